"""`specserve bench` against a real `specserve serve` (tiny random-weight qwen2, fp32, CPU).

Starts the server as a subprocess with three profiles (baseline, ngram, suffix; profile override
allowed), runs the benchmark on every real segment at two concurrencies, and checks that every metric
is present and consistent, that the acceptance numbers equal the server's /metrics deltas, and that
greedy outputs of the speculative profiles match the baseline's. About half a minute on 2 cores.
"""
from __future__ import annotations

import json

import pytest

from specserve.bench.server_process import ServerProcess, ServerStartError
from specserve.cli import main
from tests.helpers.tiny_model import make_tiny_model

PROFILES = {"profiles": {"baseline": None,
                         "ngram_4": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                                     "prompt_lookup_max": 3},
                         "suffix": {"method": "suffix", "num_speculative_tokens": 3}},
            "weights": {"baseline": 1}}
SPEC_KEYS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos",
             "acceptance_rate", "mean_acceptance_length", "acceptance_per_pos")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("bench-e2e")
    model = make_tiny_model(d / "tiny", arch="qwen2", max_position_embeddings=4096)
    (d / "profiles.json").write_text(json.dumps(PROFILES))
    srv = ServerProcess(["--model", str(model), "--profiles", str(d / "profiles.json"), "--allow-profile-override",
                         "--dtype", "float32", "--device", "cpu", "--max-num-seqs", "4", "--log-level", "warning",
                         "--tool-call-parser", "hermes"],  # the tiny model's template shows no tool format
                        d / "server.log")
    with srv:
        try:
            srv.start(timeout_s=180)
        except ServerStartError as e:
            pytest.fail(f"specserve serve did not start: {e}")
        yield srv.base_url + "/v1"


@pytest.fixture(scope="module")
def bench(server, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-out")
    rc = main(["bench", "--base-url", server, "--dataset", "all", "--num-prompts", "12", "--max-tokens", "24",
               "--max-prompt-chars", "600", "--concurrency", "1,3", "--profile", "baseline", "ngram_4", "suffix",
               "--logprobs", "--warmup", "1", "--slo", "ttft:5000,tpot:1000", "--no-progress",
               "--output-dir", str(out)])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]
    return summary, rows, out


def test_every_metric_present_and_consistent(bench):
    summary, rows, out = bench
    assert (out / "report.html").stat().st_size > 100_000
    assert len(summary["runs"]) == 6 and len(rows) == 6 * 12
    assert {s["segment"] for s in summary["datasets"]} == {"chat", "code", "tool_call", "edit", "summarize", "creative"}
    for run in summary["runs"]:
        mine = [r for r in rows if (r["profile"], r["load"]) == (run["profile"], run["load"])]
        assert all(r["error"] is None for r in mine), [r["error"] for r in mine if r["error"]][:3]
        assert all(r["served_profile"] == run["profile"] for r in mine)
        m = run["overall"]
        for k in ("ttft_ms", "tpot_ms", "itl_chunk_ms", "itl_token_ms", "e2e_ms"):
            for p in ("mean", "p50", "p90", "p95", "p99"):
                assert isinstance(m[f"{k}_{p}"], float), (k, p)
        for k in ("output_tps", "request_tps", "goodput_rps", "tpot_ms_agg", "tokens_per_chunk"):
            assert m[k] > 0, k
        assert m["error_rate"] == 0 and m["num_requests"] == 12
        assert m["output_tokens"] == sum(r["output_tokens"] for r in mine)
        assert m["output_tokens"] == sum(s["output_tokens"] for s in run["segments"].values())
        assert m["ttft_ms_p50"] <= m["e2e_ms_p50"]
        for r in mine:
            assert r["token_count_source"] == "usage"  # our server honours continuous_usage_stats (exact)
            assert sum(c[1] for c in r["chunks"]) == r["output_tokens"] >= 1
            assert 0 < r["chunks"][0][0] <= r["chunks"][-1][0] <= r["last_chunk_ms"]
            assert r["response_id"].startswith(("chatcmpl-", "cmpl-"))
            assert r["specserve"]["profile"] == run["profile"]


def test_acceptance_equals_server_metrics_deltas(bench):
    summary, rows, _ = bench
    for run in summary["runs"]:
        m, server = run["overall"], run["server"]["acceptance_from_metrics"]
        assert m["acceptance_source"] == "response" and run["server"]["metrics_available"]
        if run["profile"] == "baseline":
            assert m["num_drafts"] == 0 and (not server or server["num_drafts"] == 0)
            continue
        assert m["num_drafts"] > 0 and 0 <= m["acceptance_rate"] <= 1 and m["mean_acceptance_length"] >= 1
        for k in SPEC_KEYS:
            assert m[k] == pytest.approx(server[k]), k
        assert sum(s["num_accepted_tokens"] for s in run["segments"].values()) == m["num_accepted_tokens"]
        mine = [r for r in rows if (r["profile"], r["load"]) == (run["profile"], run["load"])]
        assert m["num_draft_tokens"] == sum(r["specserve"]["num_draft_tokens"] for r in mine)


def test_greedy_outputs_match_baseline_and_compare_cli(bench, capsys):
    summary, _, out = bench
    comps = [c for c in summary["comparisons"] if c["load"] == "c=1"]
    assert {c["candidate"] for c in comps} == {"ngram_4", "suffix"}
    for c in comps:
        same, n = c["overall"]["greedy_match"]
        assert n == 10 and same == n, c["candidate"]  # 12 requests minus the 2 creative ones (temperature 1)
        assert c["overall"]["speedup"] > 0
    assert main(["bench", "compare", str(out / "summary.json"), str(out / "summary.json")]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert all(c["overall"]["ratio"]["output_tps"] == pytest.approx(1.0) for c in last)
