"""The HTML report is self-contained and renders its plots in headless Chromium with the network off.

Skips cleanly when no Chromium is installed. The browser runs inside a new network namespace
(`unshare -n`, no interfaces but a down loopback) when that is allowed, otherwise behind a dead proxy.
"""
from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from specserve.bench import mockserver, report, runner
from specserve.bench.datasets import Sample

CHROME = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome", "chrome")
               if shutil.which(n)), None)


@pytest.fixture(scope="module")
def bench_html(tmp_path_factory):
    samples = [Sample(f"s{i}", ("code", "chat", "edit")[i % 3], 6 + i,
                      messages=[{"role": "user", "content": f"q{i}"}]) for i in range(9)]
    cfg = runner.BenchConfig(concurrency=[1, 3], profiles=["baseline", "ngram_4"], warmup=0, progress=False,
                             slo={"ttft": 100.0})
    src = [{"segment": s, "source": "unit test", "license": "n/a", "num_samples": 3} for s in ("code", "chat", "edit")]
    with mockserver.MockServer(delay_s=0.001) as url:
        cfg.base_url = url
        summary, rows = runner.run_bench_sync(cfg, samples=samples, sources=src)
    path = tmp_path_factory.mktemp("report") / "report.html"
    report.write(path, summary, rows)
    return path


def test_report_is_self_contained(bench_html):
    text = bench_html.read_text()
    assert not re.search(r"<script[^>]*\bsrc=", text) and not re.search(r"<link[^>]*href=\"?https?:", text)
    assert text.count("Plotly.newPlot") >= 8  # comparisons x2, latency x4, throughput, acceptance x3
    for needle in ("ngram_4 vs baseline", "unit test", "ITL per token", "greedy outputs same", "goodput"):
        assert needle in text


def _chrome(args: list[str], timeout=120) -> subprocess.CompletedProcess:
    base = [CHROME, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-dev-shm-usage", "--proxy-server=http://127.0.0.1:9", "--virtual-time-budget=20000"]
    cmd = base + args
    unshare = shutil.which("unshare")
    if unshare and subprocess.run([unshare, "-n", "true"], capture_output=True).returncode == 0:
        cmd = [unshare, "-n"] + cmd
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(CHROME is None, reason="chromium not installed (apt-get install chromium)")
def test_report_renders_in_headless_chromium_offline(bench_html, tmp_path):
    dom = _chrome(["--dump-dom", bench_html.as_uri()])
    body = re.search(r"<body[^>]*>", dom.stdout)
    assert body, dom.stderr[-2000:]
    assert 'data-js-errors="0"' in body.group(0)
    plots = int(re.search(r'data-plots="(\d+)"', body.group(0)).group(1))
    assert plots >= 8, body.group(0)
    assert dom.stdout.count('class="main-svg"') >= 2 * plots  # plotly drew every figure
    shot = tmp_path / "report.png"
    _chrome([f"--screenshot={shot}", "--window-size=1400,2600", bench_html.as_uri()])
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 100_000  # a page full of tables and plots, not blank
