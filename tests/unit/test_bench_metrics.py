"""Benchmark metric functions on hand-made timelines (docs/design.md section 5 definitions)."""
from __future__ import annotations

import numpy as np
import pytest

from specserve.bench import client, metrics, prom


def rec(chunks, out=None, send=0.0, error=None, seg="chat", spec=None):
    return {"chunks": chunks, "output_tokens": out if out is not None else sum(c[1] for c in chunks),
            "send_time_s": send, "error": error, "segment": seg, "specserve": spec, "token_count_source": "usage"}


def test_several_tokens_in_one_chunk():
    r = rec([[100.0, 1], [150.0, 3], [170.0, 1]])
    assert metrics.ttft_ms(r) == 100 and metrics.e2e_ms(r) == 170
    assert metrics.tpot_ms(r) == pytest.approx(70 / 4)
    assert metrics.itl_per_chunk(r) == [50, 20]
    assert metrics.itl_per_token(r) == [(pytest.approx(50 / 3), 3.0), (20.0, 1.0)]
    m = metrics.summarize([r], wall_s=0.5)
    assert m["output_tokens"] == 5 and m["output_tps"] == pytest.approx(10.0)
    assert m["request_tps"] == pytest.approx(2.0)
    assert m["itl_token_ms_mean"] == pytest.approx(70 / 4)  # token-weighted mean = TPOT for one request
    assert m["tpot_ms_agg"] == pytest.approx(70 / 4)
    assert m["tokens_per_chunk"] == pytest.approx(5 / 3)


def test_one_token_output_has_no_tpot_or_itl():
    r = rec([[80.0, 1]])
    assert metrics.tpot_ms(r) is None and metrics.itl_per_chunk(r) == [] and metrics.itl_per_token(r) == []
    m = metrics.summarize([r], wall_s=1.0)
    assert m["ttft_ms_p50"] == 80 and m["e2e_ms_p50"] == 80
    assert m["tpot_ms_p50"] is None and m["itl_chunk_ms_p50"] is None and m["tpot_ms_agg"] is None
    assert m["output_tps"] == 1.0


def test_zero_token_chunk_passes_its_gap_on():
    r = rec([[10.0, 1], [20.0, 0], [30.0, 2]])
    assert metrics.itl_per_token(r) == [(10.0, 2.0)]
    assert metrics.itl_per_chunk(r) == [10.0, 10.0]


def test_errors_count_in_error_rate_not_in_tokens_or_latency():
    good = rec([[10.0, 2], [30.0, 2]], send=0.0)
    bad = rec([], out=None, send=0.1, error="HTTP 500: boom")
    half = rec([[5.0, 1]], send=0.2, error="ReadTimeout: x")  # partial stream that then failed
    m = metrics.summarize([good, bad, half], wall_s=2.0, slo={"ttft": 100})
    assert m["num_requests"] == 3 and m["num_ok"] == 1 and m["error_rate"] == pytest.approx(2 / 3)
    assert m["output_tokens"] == 4 and m["ttft_ms_p50"] == 10
    assert m["goodput_rps"] == pytest.approx(0.5) and m["slo_attainment"] == pytest.approx(1 / 3)


def test_slo_and_goodput():
    fast = rec([[10.0, 1], [20.0, 1]])
    slow = rec([[900.0, 1], [910.0, 1]])
    assert metrics.meets_slo(fast, {"ttft": 500, "tpot": 50})
    assert not metrics.meets_slo(slow, {"ttft": 500})
    assert metrics.meets_slo(rec([[10.0, 1]]), {"tpot": 1})  # no TPOT for one token: not a violation
    m = metrics.summarize([fast, slow], wall_s=4.0, slo={"ttft": 500})
    assert m["goodput_rps"] == pytest.approx(0.25)


def test_percentiles_match_numpy_and_weights_match_repeats():
    vals = [5.0, 1.0, 3.0, 10.0, 7.0]
    p = metrics.percentiles(vals)
    assert p["p50"] == np.percentile(vals, 50) and p["p99"] == pytest.approx(np.percentile(vals, 99))
    w = [1, 3, 2, 1, 4]
    rep = [v for v, k in zip(vals, w) for _ in range(k)]
    pw, pr = metrics.percentiles(vals, w), metrics.percentiles(rep)
    for k in pr:
        assert pw[k] == pytest.approx(pr[k])
    assert metrics.percentiles([])["p50"] is None


def test_wall_of_segment_and_throughput():
    a = rec([[100.0, 1], [500.0, 4]], send=1.0)  # ends at 1.5 s
    b = rec([[100.0, 1], [200.0, 1]], send=2.0)  # ends at 2.2 s
    assert metrics.wall_of([a, b]) == pytest.approx(1.2)
    assert metrics.summarize([a, b])["output_tps"] == pytest.approx(7 / 1.2)


def test_acceptance_from_responses_sums_counts():
    s1 = {"num_drafts": 4, "num_draft_tokens": 12, "num_accepted_tokens": 6, "num_accepted_tokens_per_pos": [3, 2, 1]}
    s2 = {"num_drafts": 2, "num_draft_tokens": 6, "num_accepted_tokens": 6, "num_accepted_tokens_per_pos": [2, 2, 2]}
    err = {**s1}
    a = metrics.acceptance_from_responses([rec([[1.0, 1]], spec=s1), rec([[1.0, 1]], spec=s2),
                                           rec([], error="x", spec=err)])
    assert a["num_drafts"] == 6 and a["num_draft_tokens"] == 18 and a["num_accepted_tokens"] == 12
    assert a["acceptance_rate"] == pytest.approx(12 / 18)
    assert a["mean_acceptance_length"] == pytest.approx(1 + 12 / 6)
    assert a["acceptance_per_pos"] == pytest.approx([5 / 6, 4 / 6, 3 / 6])
    assert metrics.acceptance_from_responses([rec([[1.0, 1]])]) == {}


def test_prometheus_delta_acceptance_and_memory():
    before = prom.parse('# HELP x\nspecserve:spec_decode_num_drafts_total{profile="ngram_4"} 10\n'
                        'specserve:spec_decode_num_draft_tokens_total{profile="ngram_4"} 40\n'
                        'specserve:spec_decode_num_accepted_tokens_total{profile="ngram_4"} 20\n'
                        'specserve:spec_decode_num_accepted_tokens_per_pos_total{position="0",profile="ngram_4"} 9\n'
                        'specserve:spec_decode_num_drafts_total{profile="other"} 5\n')
    after = prom.parse('specserve:spec_decode_num_drafts_total{profile="ngram_4"} 14\n'
                       'specserve:spec_decode_num_draft_tokens_total{profile="ngram_4"} 56\n'
                       'specserve:spec_decode_num_accepted_tokens_total{profile="ngram_4"} 26\n'
                       'specserve:spec_decode_num_accepted_tokens_per_pos_total{position="0",profile="ngram_4"} 12\n'
                       'specserve:spec_decode_num_accepted_tokens_per_pos_total{position="1",profile="ngram_4"} 3\n'
                       'specserve:spec_decode_num_drafts_total{profile="other"} 9\n'
                       'process_resident_memory_bytes 1.5e9\n')
    d = prom.delta(before, after)
    a = prom.acceptance_from_delta(d, "ngram_4")
    assert a["num_drafts"] == 4 and a["num_draft_tokens"] == 16 and a["num_accepted_tokens"] == 6
    assert a["acceptance_rate"] == pytest.approx(6 / 16) and a["mean_acceptance_length"] == pytest.approx(2.5)
    assert a["num_accepted_tokens_per_pos"] == [3, 3] and a["acceptance_source"] == "metrics_delta"
    assert prom.acceptance_from_delta(d, None)["num_drafts"] == 8  # all profiles
    assert prom.memory_bytes(after) == 1.5e9 and prom.acceptance_from_delta(None) == {}
    wider = prom.parse('specserve:spec_decode_num_drafts_total{profile="k2"} 1\n'
                       'specserve:spec_decode_num_accepted_tokens_per_pos_total{position="1",profile="k2"} 1\n'
                       'specserve:spec_decode_num_accepted_tokens_per_pos_total{position="3",profile="k4"} 1\n')
    assert prom.acceptance_from_delta(wider, "k2")["num_accepted_tokens_per_pos"] == [0, 1]  # k4's positions not k2's
    assert prom.metrics_url("http://h:8000/v1/") == "http://h:8000/metrics"


def test_aggregate_repeats():
    a = {"output_tps": 10.0, "ttft_ms_p50": 5.0, "acceptance_per_pos": [0.5, 0.25], "token_count_sources": ["usage"]}
    b = {"output_tps": 14.0, "ttft_ms_p50": 7.0, "acceptance_per_pos": [0.7, 0.35], "token_count_sources": ["usage"]}
    g = metrics.aggregate([a, b])
    assert g["num_repeats"] == 2 and g["output_tps"] == 12.0 and g["acceptance_per_pos"] == pytest.approx([0.6, 0.3])
    assert g["spread"]["output_tps"][:2] == [10.0, 14.0] and g["token_count_sources"] == ["usage"]
    assert metrics.aggregate([{"itl_token_exact": True}, {"itl_token_exact": False}])["itl_token_exact"] is False


def test_gamma_arrivals_mean_rate():
    offs = client.arrival_offsets(2001, request_rate=4.0, burstiness=1.0, seed=1)
    assert offs[0] == 0 and offs == sorted(offs)
    assert offs[-1] / 2000 == pytest.approx(0.25, rel=0.1)
    assert client.arrival_offsets(3, float("inf")) == [0.0, 0.0, 0.0]


def test_busy_time_is_union_of_in_flight_intervals():
    """A segment's rate divides by the time it had requests in flight, not the span that other
    segments' interleaved requests fill."""
    from types import SimpleNamespace as NS

    from specserve.bench.metrics import busy_time_of

    def rec(send, e2e_s):
        return NS(send_time_s=send, chunks=[(e2e_s, 1)], e2e=e2e_s)

    import specserve.bench.metrics as m

    orig = m.e2e_ms
    m.e2e_ms = lambda r: r.e2e * 1000
    try:
        assert busy_time_of([rec(0, 2), rec(10, 3)]) == 5  # two separate requests: 2 s + 3 s, not 13 s
        assert busy_time_of([rec(0, 4), rec(1, 2), rec(3, 3)]) == 6  # overlapping: [0, 6]
        assert busy_time_of([]) == 0
    finally:
        m.e2e_ms = orig
