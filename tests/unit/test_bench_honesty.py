"""`specserve bench` cannot mislead: each way a run used to mislead, with its right value, through the
CLI and its three outputs (console, summary.json, report.html), against the scripted mock server.

- a run with failed requests is marked FAILED everywhere and exits 1 unless --allow-errors;
  `bench compare` shows both error rates and never calls a candidate with more errors faster
  without a warning;
- a server that names no profile (vLLM) makes `--profile baseline ngram_4` UNVERIFIED everywhere and
  fails unless --allow-unverified-profile;
- acceptance from /metrics deltas is labelled server-wide everywhere;
- warm-up is strict by default and never sends a measured prompt;
- E2E ends at an EOS chunk with no text; --ignore-eos / --output-len fix output lengths.
"""
from __future__ import annotations

import json

import pytest

from specserve.bench import mockserver
from specserve.bench.checks import SERVER_WIDE
from specserve.cli import main


def _dataset(tmp_path, n=8, prompt=False):
    p = tmp_path / "w.jsonl"
    p.write_text("".join(json.dumps({"prompt": f"question {i}"} if prompt else
                                    {"messages": [{"role": "user", "content": f"question {i}"}]})
                         + "\n" for i in range(n)))
    return p


def _bench(url, data, out, *extra):
    return main(["bench", "--base-url", url, "--dataset", str(data), "--concurrency", "2", "--no-progress",
                 "--output-dir", str(out), *extra])


def _outputs(capsys, out):
    text = capsys.readouterr()
    return (text.out, json.loads(text.out.strip().splitlines()[-1]), (out / "report.html").read_text(),
            json.loads((out / "summary.json").read_text()), text.err)


def test_failed_requests_fail_the_run_and_compare_warns(tmp_path, capsys):
    data = _dataset(tmp_path)
    with mockserver.MockServer(fail_profiles=("ngram_4",), continuous_usage=True) as url:
        assert _bench(url, data, tmp_path / "a", "--profile", "baseline") == 0
        capsys.readouterr()
        assert _bench(url, data, tmp_path / "b", "--profile", "ngram_4", "--warmup", "0") == 1
        con, js, page, saved, _ = _outputs(capsys, tmp_path / "b")
        assert _bench(url, data, tmp_path / "c", "--profile", "ngram_4", "--warmup", "0", "--allow-errors") == 0
        allowed = _outputs(capsys, tmp_path / "c")[1]
    n_bad = js["failed"]
    assert 0 < n_bad < 8 and js["failed_rate"] == n_bad / 8 and saved["failed"] == n_bad
    msg = f"FAILED: {n_bad} of 8 measured requests failed ({n_bad / 8:.1%})"
    assert js["problems"][0]["message"].startswith(msg) and f"PROBLEM: {msg}" in con and msg in page
    assert allowed["problems"] == [] and allowed["warnings"][0]["message"].startswith(msg)

    rc = main(["bench", "compare", str(tmp_path / "a" / "summary.json"), str(tmp_path / "c" / "summary.json")])
    out = capsys.readouterr().out
    comp = json.loads(out.strip().splitlines()[-1])[0]
    assert rc == 0 and comp["overall"]["speedup"] > 1  # fewer chunks per token: faster per token ...
    assert comp["comparable"] is False and comp["warnings"][0]["kind"] == "error_rate"  # ... but never silently
    assert comp["overall"]["baseline"]["error_rate"] == 0 and comp["overall"]["candidate"]["error_rate"] == n_bad / 8
    assert "base err%" in out and "cand err%" in out and f"{comp['overall']['speedup']:.2f}x (!)" in out
    assert f"WARNING: c:ngram_4 has more failed requests than a:baseline ({n_bad / 8:.1%} vs 0.0%)" in out


def test_server_that_names_no_profile_is_unverified_everywhere(tmp_path, capsys):
    """vLLM answers 200 to the `profile` field and the header and ignores both: two runs of one
    configuration must not be labelled "baseline" and "ngram_4" with "0 mismatches"."""
    data = _dataset(tmp_path)
    with mockserver.MockServer(specserve=False, continuous_usage=True) as url:
        assert _bench(url, data, tmp_path / "x", "--profile", "baseline", "ngram_4") == 1
        err = capsys.readouterr().err
        assert "no response named the profile that served it" in err and "--allow-unverified-profile" in err
        assert not (tmp_path / "x").exists()  # stopped at warm-up, before the measured requests
        assert _bench(url, data, tmp_path / "y", "--profile", "baseline", "ngram_4", "--warmup", "0") == 1
        con, js, page, _, _ = _outputs(capsys, tmp_path / "y")
        assert [p["kind"] for p in js["problems"]] == ["profile_unverified"]
        for flag in ([], ["--profile-header"]):
            assert _bench(url, data, tmp_path / "z", "--profile", "baseline", "ngram_4",
                          "--allow-unverified-profile", *flag) == 0
            con, js, page, _, _ = _outputs(capsys, tmp_path / "z")
            assert js["problems"] == [] and js["warnings"][0]["kind"] == "profile_unverified"
            assert [g["profile_check"] for g in js["groups"]] == ["unverified", "unverified"]
            assert "profile baseline (UNVERIFIED)" in con and "profile ngram_4 (UNVERIFIED)" in con
            assert "WARNING: UNVERIFIED: no response named the profile" in con
            assert "profile ngram_4 (UNVERIFIED)" in page and "UNVERIFIED: 8 unnamed, 0 mismatched" in page
            assert "0 mismatches" not in page
            comp = js["comparisons"][0]
            assert comp["comparable"] is False and {w["kind"] for w in comp["warnings"]} >= {"profile_unverified"}


def test_acceptance_from_metrics_delta_is_labelled_server_wide(tmp_path, capsys):
    data = _dataset(tmp_path)
    with mockserver.MockServer(specserve=False, continuous_usage=True) as url:
        assert _bench(url, data, tmp_path / "o", "--profile", "ngram_4", "--allow-unverified-profile") == 0
    con, js, page, _, _ = _outputs(capsys, tmp_path / "o")
    g = js["groups"][0]["overall"]
    assert g["acceptance_source"] == "metrics_delta" and g["acceptance_rate"] > 0
    assert f"{g['acceptance_rate']:.2f}*" in con
    assert f"acceptance from the server's /metrics delta: {SERVER_WIDE}" in con
    assert any(w["kind"] == "acceptance_server_wide" and SERVER_WIDE in w["message"] for w in js["warnings"])
    assert f"{g['acceptance_rate']:.3f}*" in page and SERVER_WIDE in page and "(server-wide)" in page


def test_per_token_itl_estimate_is_labelled_and_logprobs_make_it_exact(tmp_path, capsys):
    data = _dataset(tmp_path)
    with mockserver.MockServer() as url:  # no usage on every chunk
        assert _bench(url, data, tmp_path / "e", "--profile", "ngram_4") == 0
        con, js, page, _, _ = _outputs(capsys, tmp_path / "e")
        assert _bench(url, data, tmp_path / "l", "--profile", "ngram_4", "--logprobs") == 0
        exact = _outputs(capsys, tmp_path / "l")[1]
    assert js["groups"][0]["overall"]["itl_token_exact"] is False and js["warnings"][0]["kind"] == "itl_estimate"
    assert "ITL/token p50 (ESTIMATE)" in con and "WARNING: ESTIMATE: per-token ITL" in con
    assert "ITL/token p50 (ESTIMATE)" in page and "ESTIMATE: no per-chunk token counts" in page
    assert exact["warnings"] == [] and exact["groups"][0]["overall"]["itl_token_exact"] is True


def test_warmup_is_strict_and_never_sends_a_measured_prompt(tmp_path, capsys):
    data = _dataset(tmp_path, n=6, prompt=True)
    app_kw = dict(continuous_usage=True)
    with mockserver.MockServer(fail_first=1, **app_kw) as url:
        assert _bench(url, data, tmp_path / "f", "--warmup", "2") == 1
        err = capsys.readouterr().err.strip()
        assert err.startswith("specserve: error: warm-up request to profile default failed: HTTP 500")
        assert "\n" not in err
    server = mockserver.MockServer(**app_kw)
    with server as url:
        assert _bench(url, data, tmp_path / "w", "--warmup", "3", "--profile", "baseline", "ngram_4") == 0
    js = _outputs(capsys, tmp_path / "w")[1]
    bodies = server.config.app.state.bodies
    measured = {f"question {i}" for i in range(6)}
    warm = [b["prompt"] for b in bodies if b["prompt"] not in measured]
    assert len(bodies) == 2 * (3 + 6 + 6) and len(warm) == 6  # 3 per profile, not the file's 6 lines
    assert js["warmup"]["per_profile"] == 3 and js["warmup"]["source"] == "short neutral prompts"
    # before each measured run its own prompts go once with max_tokens 1 (the prefix cache primed alike
    # for every profile), and are not measured: the runs' records are the 6 measured requests
    runs = [b for b in bodies if b["prompt"] in measured]
    for i in range(2):
        primes, timed = runs[12 * i: 12 * i + 6], runs[12 * i + 6: 12 * i + 12]
        assert {b["prompt"] for b in primes} == measured and all(b["max_tokens"] == 1 for b in primes)
        assert {b["prompt"] for b in timed} == measured and all(b["max_tokens"] > 1 for b in timed)
    assert all(r["prime_failed"] == 0 for r in js["runs"]) and js["num_requests"] == 12


def test_e2e_ends_at_the_eos_chunk_with_no_text(tmp_path, capsys):
    """A stream ending on EOS sends one more chunk, with no text; E2E is stamped there (it used to be
    stamped at the last text chunk, one decode step early)."""
    data = _dataset(tmp_path, n=4)
    for cont in (True, False):
        with mockserver.MockServer(eos=True, eos_delay_s=0.15, continuous_usage=cont) as url:
            assert _bench(url, data, tmp_path / f"o{cont}", "--warmup", "0") == 0
        capsys.readouterr()
        rows = [json.loads(x) for x in (tmp_path / f"o{cont}" / "requests.jsonl").read_text().splitlines()]
        for r in rows:
            assert r["finish_reason"] == "stop" and r["last_chunk_ms"] == r["chunks"][-1][0]
            assert r["chunks"][-1][0] - r["chunks"][-2][0] >= 140  # the EOS chunk, 150 ms after the last text
            assert r["token_count_source"] == ("usage" if cont else "estimate")
            if cont:
                assert r["chunks"][-1][1] == 1  # exactly the EOS token


def test_ignore_eos_and_fixed_output_length(tmp_path, capsys):
    data = _dataset(tmp_path, n=4)
    server = mockserver.MockServer(eos=True, continuous_usage=True)
    with server as url:
        assert _bench(url, data, tmp_path / "o", "--output-len", "40", "--ignore-eos", "--max-tokens", "8") == 0
    js = _outputs(capsys, tmp_path / "o")[1]
    bodies = server.config.app.state.bodies
    primes = [b for b in bodies if b["max_tokens"] == 1]  # the prefix cache primed before the run
    assert len(primes) == 4 and all(b["ignore_eos"] is True for b in primes)
    assert all(b["max_tokens"] == 40 and b["ignore_eos"] is True for b in bodies if b not in primes)
    assert js["groups"][0]["overall"]["output_tokens"] == 4 * 40 and js["warnings"] == []
    with mockserver.MockServer(eos=True, continuous_usage=True, honour_ignore_eos=False) as url:
        assert _bench(url, data, tmp_path / "n", "--output-len", "40", "--ignore-eos") == 0
    js = _outputs(capsys, tmp_path / "n")[1]
    w = [w for w in js["warnings"] if w["kind"] == "ignore_eos_not_honoured"]
    assert w and w[0]["message"].startswith("--ignore-eos: 4 of 4 requests ended before max_tokens")


@pytest.mark.parametrize("flag", ["--output-len", "--warmup"])
def test_bad_lengths_are_one_line_errors(tmp_path, capsys, flag):
    rc = main(["bench", "--dataset", str(_dataset(tmp_path)), flag, "-1", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "--output-len" in err and "\n" not in err


def test_against_our_own_server_counts_are_exact_and_e2e_is_the_eos_chunk():
    """Our server honours continuous_usage_stats, so the bench counts every chunk's tokens exactly
    (equal to the logprob entries of the same chunks) instead of spreading them evenly, and E2E ends
    at the chunk that carries the EOS token, one engine step after the last text."""
    import httpx

    from specserve.bench import datasets, runner
    from specserve.rollout.profiles import profile_set_from_dict
    from specserve.server.api import ServerSettings, create_app
    from specserve.server.launcher import ServerThread
    from tests.helpers.fake_engine import EOS, ToyLM, fake_client, toy_logits

    marker = list(b"<assistant>")

    def eos_after_25(ctx):  # the toy LM's greedy text ("abcdefghi0abc..."), then EOS as the 26th output token
        ctx = list(ctx)
        start = max(i for i in range(len(ctx)) if ctx[i:i + len(marker)] == marker) + len(marker)
        if len(ctx) - start == 25:
            row = toy_logits(ctx)
            row[EOS] = 10.0
            return row
        return toy_logits(ctx)

    profiles = {"profiles": {"baseline": None, "ngram_4": {"method": "ngram", "num_speculative_tokens": 4}}}
    app = create_app(fake_client(lm=ToyLM(eos_after_25, step_delay_s=0.02)), profile_set_from_dict(profiles),
                     ServerSettings(allow_profile_override=True))
    samples = [datasets.Sample(f"s{i}", "chat", 40, messages=[{"role": "user", "content": f"q{i}"}]) for i in range(3)]
    with ServerThread(app) as srv:
        cfg = runner.BenchConfig(base_url=srv.base_url + "/v1", concurrency=[1], profiles=["baseline", "ngram_4"],
                                 warmup=0, progress=False)
        summary, rows = runner.run_bench_sync(cfg, samples=samples, sources=[])
        truth = {}
        for s in samples:  # the same requests, raw, with logprobs: one entry per token of each chunk
            body = {"model": summary["model"], "messages": s.messages, "max_tokens": 40, "temperature": 0,
                    "stream": True, "logprobs": True, "profile": "ngram_4"}
            with httpx.stream("POST", srv.base_url + "/v1/chat/completions", json=body, timeout=30) as r:
                evs = [json.loads(x[5:]) for x in r.iter_lines() if x.startswith("data:") and "[DONE]" not in x]
            truth[s.id] = [n for e in evs for c in e["choices"]
                           if (n := len((c["logprobs"] or {}).get("content") or []))]
    assert summary["problems"] == [] and summary["warnings"] == []
    assert all(g["overall"]["itl_token_exact"] and g["profile_check"] == "verified" for g in summary["groups"])
    for r in rows:
        assert r["token_count_source"] == "usage" and r["output_tokens"] == 26 and r["finish_reason"] == "stop"
        assert r["response_id"].startswith("chatcmpl-") and r["served_profile"] == r["profile"] and len(r["text"]) == 25
        assert r["last_chunk_ms"] == r["chunks"][-1][0]
        if r["profile"] == "ngram_4":
            assert [n for _, n in r["chunks"]] == truth[r["sample_id"]] and max(n for _, n in r["chunks"]) > 1
        else:  # one token a step; the EOS token comes alone, with no text, one 20 ms step after the last text
            assert [n for _, n in r["chunks"]] == [1] * 26 and r["chunks"][-1][0] - r["chunks"][-2][0] >= 10


def test_checks_on_hand_made_rows():
    """The same class as an ignored ignore_eos: a server that ignores max_tokens is reported; the
    profile check distinguishes confirmed, unconfirmed and contradicted profiles."""
    from specserve.bench import checks

    def row(served, out=8, mt=8, error=None):
        return {"chunks": [[1.0, out]], "output_tokens": out, "max_tokens": mt, "served_profile": served,
                "error": error, "finish_reason": "length"}
    assert checks.profile_check([row("a"), row("a"), row(None, error="x")], "a")["status"] == "verified"
    assert checks.profile_check([row("a"), row(None)], "a") == {"status": "unverified", "named": 1, "unnamed": 1,
                                                                "mismatched": 0}
    assert checks.profile_check([row("b"), row(None)], "a")["status"] == "mismatch"
    assert checks.profile_check([row(None)], None)["status"] is None
    summary = {"groups": [{"profile": "a", "load": "c=1", "profile_check": "mismatch",
                           "overall": {"itl_token_exact": True, "output_tokens_exact": True}}]}
    problems, warnings = checks.evaluate(summary, [row("b", out=20, mt=8), row("b")])
    assert [p["kind"] for p in problems] == ["profile_mismatch"] and "a c=1" in problems[0]["message"]
    assert [w["kind"] for w in warnings] == ["max_tokens_exceeded"] and "(e.g. 20 > 8)" in warnings[0]["message"]


def test_compare_warns_when_two_runs_sent_different_requests(tmp_path, capsys):
    data = _dataset(tmp_path, n=4)
    with mockserver.MockServer(continuous_usage=True) as url:
        assert _bench(url, data, tmp_path / "a", "--max-tokens", "64") == 0
        assert _bench(url, data, tmp_path / "b", "--max-tokens", "8") == 0
    capsys.readouterr()
    assert main(["bench", "compare", str(tmp_path / "a" / "summary.json"), str(tmp_path / "b" / "summary.json")]) == 0
    out = capsys.readouterr().out
    comp = json.loads(out.strip().splitlines()[-1])[0]
    assert comp["comparable"] is False and [w["kind"] for w in comp["warnings"]] == ["workload_differs"]
    assert "WARNING: the two runs differ in max_tokens (64 vs 8)" in out and "(!)" in out


def test_no_prime_sends_no_priming_requests_and_every_output_says_so(tmp_path, capsys):
    """Priming is labelled in the console and report.html; `--no-prime` sends only the measured requests
    and, with several profiles, warns that the first profile to send a prompt paid its prefill."""
    data = _dataset(tmp_path, n=4, prompt=True)
    server = mockserver.MockServer(continuous_usage=True)
    with server as url:
        assert _bench(url, data, tmp_path / "p", "--warmup", "0", "--profile", "baseline", "ngram_4") == 0
        primed = _outputs(capsys, tmp_path / "p")
        n_primed = len(server.config.app.state.bodies)
        assert _bench(url, data, tmp_path / "n", "--warmup", "0", "--profile", "baseline", "ngram_4",
                      "--no-prime") == 0
        cold = _outputs(capsys, tmp_path / "n")
        bodies = server.config.app.state.bodies[n_primed:]
    assert n_primed == 2 * (4 + 4) and len(bodies) == 2 * 4 and all(b["max_tokens"] > 1 for b in bodies)
    assert "prompts primed (TTFT of cached prompts)" in primed[0] and "TTFT is that of" in primed[2]
    assert "not_primed" not in [w["kind"] for w in primed[1]["warnings"]]
    assert "prompts not primed" in cold[0] and "were not primed" in cold[2]
    assert all(r["primed"] is False and r["prime_failed"] is None for r in cold[3]["runs"])
    assert [w["kind"] for w in cold[1]["warnings"]] == ["not_primed"]
    assert "WARNING: NOT PRIMED (--no-prime)" in cold[0] and "NOT PRIMED" in cold[2]


def test_a_speedup_above_what_the_accepted_tokens_allow_is_flagged():
    """At concurrency 1, a TPOT speedup larger than the candidate's tokens per step (every step commits 1
    + its accepted drafts and costs at least a plain decode) cannot come from speculation: the demo
    printed 10.87x with an acceptance length of 2.00 when the baseline ran beside other load. Not
    checked at concurrency > 1, against a reference that drafted, without priming, or with server-wide
    acceptance."""
    from specserve.bench import checks

    def m(out, ok, acc, drafts=None):  # output tokens, successful requests, accepted tokens
        return {"output_tokens": out, "num_ok": ok, "num_accepted_tokens": acc, "num_drafts": drafts}

    def summary(speedup, chat_speedup, concurrency=1, ref_drafts=None, primed=True, source=None, tpot=80.0):
        cand = {"profile": "ngram", "load": "c=1", "concurrency": concurrency,
                "overall": {**m(104, 4, 50, 40), "acceptance_source": source},  # 100 tokens in 50 steps: <= 2x
                "segments": {"chat": m(52, 2, 10, 20), "code": m(52, 2, 40, 20)}}  # chat <= 50/40 = 1.25x, code 5x
        if source:  # server-wide acceptance has no per-segment counts
            cand["segments"] = {"chat": m(52, 2, None), "code": m(52, 2, None)}
        ref = {"profile": "baseline", "load": "c=1", "concurrency": concurrency,  # 100 tokens at 80 ms: 8 s
               "overall": {**m(104, 4, 0, ref_drafts), "tpot_ms_agg": 80.0},
               "segments": {"chat": {**m(52, 2, 0), "tpot_ms_agg": 80.0}, "code": {**m(52, 2, 0), "tpot_ms_agg": tpot}}}
        return {"groups": [ref, cand], "runs": [{"profile": "ngram", "primed": primed}],
                "comparisons": [{"baseline": "baseline", "candidate": "ngram", "load": "c=1",
                                 "overall": {"speedup": speedup},
                                 "segments": {"chat": {"speedup": chat_speedup}, "code": {"speedup": 5.5}}}]}

    _, warnings = checks.evaluate(summary(10.87, 1.6), [])
    assert [w["kind"] for w in warnings] == ["implausible_speedup"]
    msg = warnings[0]["message"]
    assert "ngram c=1 all: 10.87x where its acceptance allows at most 2.00x" in msg
    assert "ngram c=1 chat: 1.60x where its acceptance allows at most 1.25x" in msg
    assert "c=1 code" not in msg  # 5.5x against 5x is within the margin
    # 50 tokens of a tiny model at 1 ms each: timer jitter, not checked (the demo test's 40x on one request)
    tiny = checks.evaluate(summary(10.87, 1.6, tpot=1.0), [])[1][0]["message"]
    assert "c=1 all" in tiny and "c=1 code" not in tiny
    summary_code = summary(10.87, 1.6, tpot=1.0)
    summary_code["comparisons"][0]["segments"]["code"]["speedup"] = 60.0
    assert "c=1 code" not in checks.evaluate(summary_code, [])[1][0]["message"]
    assert checks.evaluate(summary(2.3, 1.4), [])[1] == []  # within 1.2x of the bounds
    for quiet in (dict(concurrency=4), dict(ref_drafts=10), dict(primed=False), dict(source="metrics_delta")):
        kinds = [w["kind"] for w in checks.evaluate(summary(10.87, 1.6, **quiet), [])[1]]
        assert "implausible_speedup" not in kinds, quiet
