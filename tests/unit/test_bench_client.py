"""The benchmark client against a deterministic mock OpenAI-compatible server (specserve.bench.mockserver).

Consistency checks: per-request tokens sum to the total, TTFT <= E2E, per-chunk counts sum to
usage.completion_tokens, acceptance numbers equal what the server sent and its /metrics deltas.
"""
from __future__ import annotations

import json

import pytest

from specserve.bench import datasets, mockserver, runner
from specserve.cli import main


def _samples(n=10, bad=False, prompt=False):
    out = []
    for i in range(n):
        msgs = [{"role": "user", "content": f"question {i}" + (" FAIL" if bad and i == 0 else "")}]
        out.append(datasets.Sample(f"s{i}", "alpha" if i % 2 else "beta", 8 + 3 * i,
                                   prompt=f"prompt {i}" if prompt else None, messages=None if prompt else msgs))
    return out


def _run(url, samples, **kw):
    cfg = runner.BenchConfig(base_url=url, warmup=1, progress=False, **kw)
    src = [{"segment": s, "source": "test", "license": "-", "num_samples": 0} for s in ("alpha", "beta")]
    return runner.run_bench_sync(cfg, samples=samples, sources=src)


def _expected(sample, profile):
    key = json.dumps(sample.messages if sample.messages is not None else sample.prompt)
    return mockserver.plan(key, sample.max_tokens, profile != "baseline")


def _check_consistency(summary, rows):
    for run in summary["runs"]:
        mine = [r for r in rows if r["profile"] == run["profile"] and r["load"] == run["load"]
                and r["repeat"] == run["repeat"]]
        ok = [r for r in mine if not r["error"]]
        assert run["overall"]["output_tokens"] == sum(r["output_tokens"] for r in ok)
        assert sum(m["output_tokens"] for m in run["segments"].values()) == run["overall"]["output_tokens"]
        assert sum(m["num_requests"] for m in run["segments"].values()) == len(mine)
        for r in ok:
            assert sum(c[1] for c in r["chunks"]) == pytest.approx(r["output_tokens"])
            assert 0 < r["chunks"][0][0] <= r["chunks"][-1][0] <= r["stream_end_ms"]
            assert [c[0] for c in r["chunks"]] == sorted(c[0] for c in r["chunks"])
        m = run["overall"]
        assert m["ttft_ms_p50"] <= m["e2e_ms_p50"] and m["ttft_ms_p99"] <= m["e2e_ms_p99"] + 1e-9
        assert m["ttft_ms_p50"] <= m["ttft_ms_p90"] <= m["ttft_ms_p95"] <= m["ttft_ms_p99"]


def test_with_specserve_field_acceptance_equals_server():
    samples = _samples(10)
    with mockserver.MockServer(delay_s=0.002) as url:
        summary, rows = _run(url, samples, concurrency=[1, 3], profiles=["baseline", "ngram_4"], logprobs=True)
    _check_consistency(summary, rows)
    assert len(rows) == 2 * 2 * 10 and {r["served_profile"] for r in rows} == {"baseline", "ngram_4"}
    assert summary["problems"] == [] and summary["warnings"] == [] and summary["failed"] == 0
    assert [g["profile_check"] for g in summary["groups"]] == ["verified"] * 4
    ids = [r["response_id"] for r in rows]
    assert len(set(ids)) == len(ids) and all(i.startswith("mock-") for i in ids)  # warm-up took mock-1, mock-2
    for r in rows:  # exact per-chunk token counts from logprobs, equal to what the server sent
        chunks, acc = _expected(next(s for s in samples if s.id == r["sample_id"]), r["profile"])
        assert r["token_count_source"] == "logprobs" and [c[1] for c in r["chunks"]] == chunks
        assert r["specserve"]["num_accepted_tokens"] == sum(acc) and r["specserve"]["num_drafts"] == len(acc)
        assert r["text"] == "".join(f" w{i}" for i in range(sum(chunks)))  # the generated text, for equality checks
        assert r["last_chunk_ms"] == r["chunks"][-1][0]  # no EOS chunk: the last chunk carries text
    for run in summary["runs"]:
        m = run["overall"]
        if run["profile"] == "baseline":
            assert m["acceptance_rate"] is None
            continue
        exp = [_expected(s, "ngram_4")[1] for s in samples]
        assert m["acceptance_source"] == "response"
        assert m["num_drafts"] == sum(map(len, exp)) and m["num_accepted_tokens"] == sum(map(sum, exp))
        from_metrics = run["server"]["acceptance_from_metrics"]
        for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "acceptance_rate",
                  "mean_acceptance_length", "acceptance_per_pos"):
            assert m[k] == pytest.approx(from_metrics[k]), k
        seg_drafts = sum(s["num_drafts"] for s in run["segments"].values())
        assert seg_drafts == m["num_drafts"]
        assert run["server"]["memory_bytes"] == 123456789.0
    comp = summary["comparisons"]
    assert [c["load"] for c in comp] == ["c=1", "c=3"] and all(c["candidate"] == "ngram_4" for c in comp)
    assert comp[0]["overall"]["greedy_match"] == [10, 10]  # mock text does not depend on the profile
    assert comp[0]["overall"]["speedup"] > 1  # fewer chunks per token -> faster per token


def test_without_specserve_field_acceptance_from_metrics_deltas():
    """A vLLM-like server: no specserve block, no profile header. Acceptance comes from /metrics deltas,
    labelled server-wide; the profile is UNVERIFIED, which the run refuses unless allowed."""
    samples = _samples(6, prompt=True)  # /v1/completions path
    with mockserver.MockServer(specserve=False, continuous_usage=True) as url:
        with pytest.raises(runner.WarmupError, match="no response named the profile"):
            _run(url, samples, request_rate=[50.0], profiles=["ngram_4"])
        summary, rows = _run(url, samples, request_rate=[50.0], profiles=["ngram_4"], allow_unverified_profile=True)
    _check_consistency(summary, rows)
    assert all(r["specserve"] is None and r["served_profile"] is None for r in rows)
    assert all(r["token_count_source"] == "usage" for r in rows)
    assert summary["problems"] == [] and summary["groups"][0]["profile_check"] == "unverified"
    assert [w["kind"] for w in summary["warnings"]] == ["profile_unverified", "acceptance_server_wide"]
    assert "server-wide, includes other traffic" in summary["warnings"][1]["message"]
    for r in rows:
        assert [c[1] for c in r["chunks"]] == _expected(next(s for s in samples if s.id == r["sample_id"]), "x")[0]
    m = summary["runs"][0]["overall"]
    exp = [_expected(s, "ngram_4")[1] for s in samples]
    assert m["acceptance_source"] == "metrics_delta"  # warm-up excluded: the delta covers the run only
    assert m["num_drafts"] == sum(map(len, exp)) and m["num_accepted_tokens"] == sum(map(sum, exp))
    assert "acceptance_rate" not in summary["runs"][0]["segments"]["alpha"]  # no per-segment numbers then


def test_errors_are_recorded_not_raised():
    with mockserver.MockServer() as url:
        summary, rows = _run(url, _samples(4, bad=True), concurrency=[2])
        allowed, _ = _run(url, _samples(4, bad=True), concurrency=[2], allow_errors=True)
    bad = [r for r in rows if r["error"]]
    assert len(bad) == 1 and bad[0]["error"].startswith("HTTP 500: injected failure") and bad[0]["chunks"] == []
    assert summary["runs"][0]["overall"]["error_rate"] == 0.25
    assert (summary["failed"], summary["failed_rate"], summary["num_requests"]) == (1, 0.25, 4)
    assert [p["kind"] for p in summary["problems"]] == ["failed"]
    assert summary["problems"][0]["message"].startswith("FAILED: 1 of 4 measured requests failed (25.0%)")
    # the bad sample fails when it primes the cache too: a warning naming the run (it may have met a colder cache)
    assert allowed["problems"] == [] and [w["kind"] for w in allowed["warnings"]] == ["failed", "prime_failed", "itl_estimate"]
    assert "default c=2 #0 (1)" in allowed["warnings"][1]["message"] and allowed["runs"][0]["prime_failed"] == 1
    _check_consistency(summary, rows)


def test_cli_writes_files_prints_json_last_and_compares(tmp_path, capsys):
    data = tmp_path / "w.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"}],
                                        "segment": "edit" if i % 2 else "chat", "max_tokens": 12}) + "\n"
                            for i in range(6)))
    outs = []
    with mockserver.MockServer() as url:
        for name, profs in (("a", ["baseline"]), ("b", ["baseline", "ngram_4"])):
            out = tmp_path / name
            rc = main(["bench", "--base-url", url, "--dataset", str(data), "--concurrency", "2", "--no-progress",
                       "--profile", *profs, "--output-dir", str(out), "--slo", "ttft:1000,tpot:100"])
            assert rc == 0
            outs.append(out)
    text = capsys.readouterr().out
    last = json.loads(text.strip().splitlines()[-1])
    assert last["schema"] == runner.SCHEMA and [g["profile"] for g in last["groups"]] == ["baseline", "ngram_4"]
    assert "ngram_4 vs baseline" in text and "ITL/token p50" in text
    for out in outs:
        assert (out / "summary.json").exists() and (out / "report.html").exists()
        assert len((out / "requests.jsonl").read_text().splitlines()) == 6 * len(json.loads(
            (out / "summary.json").read_text())["groups"])
    assert last["groups"][0]["overall"]["goodput_rps"] > 0
    rc = main(["bench", "compare", str(outs[0] / "summary.json"), str(outs[1] / "summary.json")])
    assert rc == 0
    comps = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [c["candidate"].split(":")[-1] for c in comps] == ["baseline", "ngram_4"]
    assert set(comps[1]["segments"]) == {"chat", "edit"} and comps[1]["overall"]["greedy_match"] == [6, 6]


def test_cli_unreachable_server_is_one_line(tmp_path, capsys):
    data = tmp_path / "w.jsonl"
    data.write_text('{"prompt": "x"}\n')
    rc = main(["bench", "--base-url", "http://127.0.0.1:9/v1", "--dataset", str(data), "--no-progress",
               "--output-dir", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and "cannot reach http://127.0.0.1:9/v1" in err and len(err.strip().splitlines()) == 1


def test_sse_parsing_counts_tokens_that_hold_back_text():
    """A chunk whose token has no text yet (partial UTF-8) is token-bearing when logprobs count it."""
    import asyncio

    import httpx

    from specserve.bench import client as bclient

    def ev(content, n_lp=None, finish=None, usage=None, spec=None):
        choices = [] if content is None else [{"index": 0, "delta": {"content": content}, "finish_reason": finish,
                                               "logprobs": None if n_lp is None else
                                               {"content": [{"token": "x", "logprob": 0.0}] * n_lp}}]
        d = {"choices": choices, "usage": usage}
        if spec:
            d["specserve"] = spec
        return f"data: {json.dumps(d)}\n\n"
    spec = {"profile": "p", "num_drafts": 1, "num_draft_tokens": 2, "num_accepted_tokens": 2}
    body = (ev("") + ev("", n_lp=1) + ev("ab", n_lp=2) + ev("c", n_lp=1, finish="stop")
            + ev(None, usage={"prompt_tokens": 3, "completion_tokens": 5}, spec=spec) + "data: [DONE]\n\n")
    transport = httpx.MockTransport(lambda req: httpx.Response(200, content=body.encode(),
                                                                 headers={"x-specserve-profile": "p"}))

    async def go():
        async with httpx.AsyncClient(transport=transport) as cl:
            return await bclient.send_one(cl, "http://x/v1", datasets.Sample("s", "seg", 5, messages=[]), "m", 0.0,
                                          profile="p", logprobs=True)
    r = asyncio.run(go())
    assert r.error is None and r.text == "abc" and r.finish_reason == "stop" and r.served_profile == "p"
    assert [c[1] for c in r.chunks] == [1, 2, 2]  # the last chunk also takes the token usage had beyond logprobs
    assert r.token_count_source == "logprobs" and r.output_tokens == 5 and r.specserve == spec


def test_a_suffix_profile_run_more_than_once_is_flagged():
    """A profile the server runs with a suffix tree keeps finished requests' outputs, so its second run
    of the same prompts can replay them: `suffix_replay` names it (read from /v1/models); one run per
    profile, or no suffix profile, gives no such warning."""
    configs = {"baseline": None, "ngram_4": {"method": "ngram"}, "sfx": {"method": "suffix"}}
    with mockserver.MockServer(speculative_configs=configs) as url:
        twice, _ = _run(url, _samples(2), concurrency=[1, 2], profiles=["baseline", "ngram_4", "sfx"])
        once, _ = _run(url, _samples(2), concurrency=[1], profiles=["baseline", "ngram_4", "sfx"])
        plain, _ = _run(url, _samples(2), concurrency=[1, 2], profiles=["baseline", "ngram_4"])
    kinds = [w["kind"] for w in twice["warnings"]]
    assert "suffix_replay" in kinds
    msg = next(w["message"] for w in twice["warnings"] if w["kind"] == "suffix_replay")
    assert msg.startswith("SUFFIX REPLAY: sfx ") and "ngram_4" not in msg.split("(")[0]
    assert twice["server_speculative_configs"] == configs
    assert "suffix_replay" not in [w["kind"] for w in once["warnings"] + plain["warnings"]]


def test_repeats_run_the_profiles_in_a_rotated_order():
    """Every profile is warmed up before any measured run; then each repeat runs each load's profiles in
    an order rotated by one per repeat, so the baseline is not always first."""
    from specserve.bench.runner import run_order

    assert run_order(["a", "b", "c"], 0) == ["a", "b", "c"] and run_order(["a", "b", "c"], 4) == ["b", "c", "a"]
    assert run_order([], 3) == []
    with mockserver.MockServer(delay_s=0.0) as url:
        summary, _ = _run(url, _samples(2), concurrency=[1, 2], profiles=["baseline", "ngram_4"], repeats=2)
    order = [(r["repeat"], r["load"], r["profile"]) for r in summary["runs"]]
    assert order == [(0, "c=1", "baseline"), (0, "c=1", "ngram_4"), (0, "c=2", "baseline"), (0, "c=2", "ngram_4"),
                     (1, "c=1", "ngram_4"), (1, "c=1", "baseline"), (1, "c=2", "ngram_4"), (1, "c=2", "baseline")]
    assert [g["profile"] for g in summary["groups"]] == ["baseline", "baseline", "ngram_4", "ngram_4"]


def test_sse_lines_end_only_where_the_sse_spec_ends_them():
    """A generated U+2028 (or U+2029, U+0085) raw inside an event's JSON string: httpx's
    aiter_lines (str.splitlines) cut the event in two and the bench counted a JSONDecodeError as a failed
    request (a flaky e2e failure, creative text at temperature 1 on the tiny model). Lines end at CRLF,
    LF or CR only, also when a chunk boundary falls inside a CRLF or an event."""
    import asyncio

    from specserve.bench.client import sse_lines

    event = 'data: {"text":"a\u2028b\u2029c\x85d"}'
    stream = f"{event}\r\n\r\n{event}\n\n{event}\r\rdata: [DONE]\n\n"

    async def chunks(size):
        for i in range(0, len(stream), size):
            yield stream[i:i + size]

    async def collect(size):
        return [line async for line in sse_lines(chunks(size))]

    for size in (1, 2, 3, 7, len(stream)):
        lines = [x for x in asyncio.run(collect(size)) if x]
        assert lines == [event, event, event, "data: [DONE]"], size
        assert json.loads(lines[0][6:])["text"] == "a\u2028b\u2029c\x85d"
    assert "".join(stream.splitlines()).count("data:") == 4 and len([x for x in stream.splitlines() if x]) > 4
