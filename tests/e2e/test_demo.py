"""`specserve demo` end to end on the tiny random-weight qwen2 (fp32, CPU): a real server child process,
the real workload segments, one prompt per segment, 8 tokens. Checks the exit status, the printed
comparison, the files, that every greedy output matched baseline, and that no server process is left,
also when the demo is interrupted (Ctrl-C / SIGTERM) while the server runs. About 20 s on 2 cores.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.waiting import wait_until

SEGMENTS = ("code", "edit", "chat", "summarize", "tool_call")
ENV = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}


def _demo_argv(model: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "specserve.cli", "demo", "--model", str(model), "--output-dir", str(out),
            "--max-prompt-chars", "300", "--no-progress", "--device", "cpu",
            "--tool-call-parser", "hermes",  # the tiny model's template shows no tool format
            *extra]


def _processes_mentioning(text: str) -> list[int]:
    """Pids of live processes whose command line contains `text` (the demo's unique output folder)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = next((ln for ln in (d / "status").read_text().splitlines() if ln.startswith("State:")), "")
        except OSError:
            continue
        if text in cmd and "zombie" not in state:
            pids.append(int(d.name))
    return pids


def _port_closed(base_url: str) -> bool:
    host, port = base_url.rsplit("/", 1)[-1].rsplit(":", 1)
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((host, int(port))) != 0


@pytest.fixture(scope="module")
def demo_run(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("demo-out") / "out"
    t0 = time.monotonic()
    proc = subprocess.run(_demo_argv(tiny_model_dir, out, "--num-prompts", "1", "--max-tokens", "8"),
                          capture_output=True, text=True, timeout=600, env=ENV)
    return proc, out, time.monotonic() - t0


def test_demo_exits_zero_and_prints_the_comparison(demo_run):
    proc, out, wall = demo_run
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    text = proc.stdout
    for col in ("segment", "profile", "TPOT ms", "speedup", "tok/s ratio", "acc.len", "accept", "greedy same"):
        assert col in text
    table_lines = [ln for ln in text.splitlines() if "│" in ln]
    for seg in SEGMENTS + ("all",):
        for prof in ("baseline", "ngram_adaptive", "suffix_adaptive"):
            assert any(f" {seg} " in ln and f" {prof} " in ln for ln in table_lines), (seg, prof)
    assert "greedy outputs identical to baseline: 10/10" in text
    assert "WARNING" not in text
    assert f"HTML report:  {out / 'report.html'}" in text
    assert str(out / "summary.json") in text
    for step in ("1/4 model", "2/4 starting the server", "3/4 benchmark", "4/4 results", "server stopped"):
        assert step in proc.stderr
    assert "graceful shutdown on SIGTERM" in proc.stderr


def test_demo_last_line_is_the_json_summary(demo_run):
    proc, out, _ = demo_run
    demo = json.loads(proc.stdout.strip().splitlines()[-1])
    assert demo["schema"] == "specserve.demo/1"
    assert demo == json.loads((out / "demo.json").read_text())
    assert list(demo["profiles"]) == ["baseline", "ngram_adaptive", "suffix_adaptive"]
    assert demo["profiles"]["suffix_adaptive"]["num_speculative_tokens"] == 8
    assert demo["profiles"]["suffix_adaptive"]["num_speculative_tokens_schedule"] == "adaptive"
    assert demo["profiles"]["ngram_adaptive"]["num_speculative_tokens"] == 8
    assert demo["profiles"]["ngram_adaptive"]["num_speculative_tokens_schedule"] == "adaptive"
    assert demo["segments"] == list(SEGMENTS)
    assert demo["num_requests_per_profile"] == 5 and demo["errors"] == 0 and demo["profile_mismatches"] == 0
    gm = demo["greedy_match"]
    assert gm["identical"] == gm["compared"] == 10 and gm["ok"]
    rows = {(r["segment"], r["profile"]): r for r in demo["rows"]}
    assert set(rows) == {(s, p) for s in SEGMENTS + ("all",) for p in ("baseline", "ngram_adaptive", "suffix_adaptive")}
    for (seg, prof), r in rows.items():
        assert r["tokens_per_s"] > 0 and r["output_tokens"] > 0
        if prof == "baseline":
            assert r["greedy_match"] is None and r["tokens_per_s_ratio"] is None
        else:
            assert r["greedy_match"] == ([5, 5] if seg == "all" else [1, 1])
            assert r["tokens_per_s_ratio"] > 0
            assert r["mean_acceptance_length"] is None or r["mean_acceptance_length"] >= 1
    for prof in ("ngram_adaptive", "suffix_adaptive"):  # speedup = baseline TPOT / profile TPOT, as the table says
        b, c = rows[("all", "baseline")], rows[("all", prof)]
        assert c["speedup_tpot"] == pytest.approx(b["tpot_ms"] / c["tpot_ms"])


def test_demo_writes_report_and_summaries(demo_run):
    proc, out, _ = demo_run
    summary = json.loads((out / "summary.json").read_text())
    assert summary["schema"] == "specserve.bench/1"
    assert [g["profile"] for g in summary["groups"]] == ["baseline", "ngram_adaptive", "suffix_adaptive"]
    assert all(r["overall"]["num_requests"] == 5 for r in summary["runs"])  # warm-up not counted
    assert {d["segment"] for d in summary["datasets"]} == set(SEGMENTS)
    rows = [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]
    assert len(rows) == 15 and all(r["temperature"] == 0 for r in rows)
    html = (out / "report.html").read_text()
    assert html.startswith("<!doctype html>") and "Baseline vs candidates" in html
    assert "<script src=" not in html  # self-contained: plotly.js is inlined


def test_demo_leaves_no_server_behind(demo_run):
    proc, out, _ = demo_run
    demo = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not _processes_mentioning(str(out / "profiles.json")), "a server process of the demo is still running"
    assert _port_closed(demo["server"]["base_url"])
    assert demo["server"]["exit_status"] is not None


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_interrupted_demo_stops_its_server(tiny_model_dir, tmp_path, sig):
    out = tmp_path / "out"
    proc = subprocess.Popen(_demo_argv(tiny_model_dir, out, "--num-prompts", "40", "--max-tokens", "64"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        seen = []
        for line in proc.stderr:  # wait until the server answers /health and the benchmark starts
            seen.append(line)
            if "3/4 benchmark" in line:
                break
        else:
            pytest.fail("demo ended before its benchmark started:\n" + "".join(seen))
        assert _processes_mentioning(str(out / "profiles.json")), "the server child should be running now"
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = "".join(seen) + err
    assert proc.returncode == 130, err[-2000:]
    assert "server stopped" in err and "interrupted" in err
    wait_until(lambda: not _processes_mentioning(str(out / "profiles.json")), timeout_s=10, interval_s=0.2)
    assert not _processes_mentioning(str(out / "profiles.json")), "the server outlived the interrupted demo"
