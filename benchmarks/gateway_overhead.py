"""Latency the gateway adds, at a fixed request rate, over a stub backend that answers at once.

Three processes: a stub OpenAI-compatible backend (`tests/helpers/stub_backend.py`, no delay, not
recording requests), the gateway (`specserve gateway`, one backend), and this script, the load
generator: an open loop at `--rate` requests/s (Poisson arrivals, fixed seed), each request on its own
task over one shared aiohttp session (its C HTTP parser keeps the client's own cost per request low;
the same client serves both arms). Two arms measured side by side, alternating in blocks of
`--block-s` seconds, `--repeats` times, the order reversed every other pair: `direct` (client -> stub)
and `gateway` (client -> gateway -> stub), for non-streamed requests (latency = the whole response)
and streamed ones (`--chunks` SSE events; TTFT = first chunk, E2E = last byte). Added latency =
gateway percentile - direct percentile over all requests of the arm (`added_pooled`, what the goal is
judged on), also per block pair. `--runs` repeats the whole measurement with fresh processes; the
summary is the worst run. Recorded with the figures: CPU per request of the gateway, the stub and
this client (from /proc), the machine's CPU use (/proc/stat) and load average per block, and how late
the client sent its requests against the open-loop schedule (a saturated client shows up there).

    python benchmarks/gateway_overhead.py --runs 3 --out docs/benchmarks     # ~3 minutes per run

Goal (issue 13): added p50 <= 1 ms and p99 <= 5 ms at 100 requests/s, streamed and not (E2E).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from specserve.engine.step_cost import cpu_model_name  # noqa: E402  (a light module: no torch at import)

MODES = ("non_streamed", "streamed")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_s(pid: int | str) -> float:
    """User + system CPU seconds of a process so far."""
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def _machine_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot (/proc/stat; idle + iowait count as not busy)."""
    f = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return sum(f) - f[3] - f[4], sum(f)


def _wait_up(url: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not come up")


async def _one(session: aiohttp.ClientSession, url: str, data: bytes, stream: bool) -> tuple[float, float | None]:
    """(E2E s, TTFT s or None) of one request; raises on a non-200 answer."""
    t0 = time.perf_counter()
    first = None
    async with session.post(url, data=data, headers={"content-type": "application/json"}) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}: {(await r.read())[:200]!r}")
        if not stream:
            await r.read()
            return time.perf_counter() - t0, None
        async for _ in r.content.iter_any():
            if first is None:
                first = time.perf_counter() - t0
    return time.perf_counter() - t0, first


async def _block(session: aiohttp.ClientSession, url: str, rate: float, seconds: float, stream: bool, chunks: int,
                 rng: random.Random) -> dict:
    """One open-loop block: latencies and how late each request left against its scheduled time."""
    data = json.dumps({"prompt": "hello", "max_tokens": chunks, "temperature": 0, "stream": stream}).encode()
    tasks, lag = [], []
    t_next = time.perf_counter()
    end = t_next + seconds
    while t_next < end:
        delay = t_next - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        lag.append(time.perf_counter() - t_next)
        tasks.append(asyncio.create_task(_one(session, url, data, stream)))
        t_next += rng.expovariate(rate)
    res = await asyncio.gather(*tasks)
    return {"e2e": [e for e, _ in res], "ttft": [f for _, f in res if f is not None], "lag": lag}


def _code_version() -> str:
    """The commit measured (and whether the work tree differed from it), or why it is unknown."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as e:
        return f"unknown ({type(e).__name__})"
    return head + (" + uncommitted changes" if dirty else "")



def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs) * 1000, q))


def _hist_quantile(text: str, name: str, q: float) -> float | None:
    """A quantile (ms) from a Prometheus histogram's cumulative buckets (upper bound of the bucket)."""
    buckets = []
    for line in text.splitlines():
        if line.startswith(name + "_bucket"):
            le = line.split('le="')[1].split('"')[0]
            buckets.append((float("inf") if le == "+Inf" else float(le), float(line.rsplit(" ", 1)[1])))
    if not buckets or buckets[-1][1] == 0:
        return None
    total = buckets[-1][1]
    for le, n in buckets:
        if n >= q * total:
            return le * 1000
    return None


async def run_once(args, seed: int) -> dict:
    """One whole measurement (fresh stub and gateway processes): both modes, both arms."""
    stub_port, gw_port = _free_port(), _free_port()
    tmp = Path(tempfile.mkdtemp())
    fleet = tmp / "fleet.yaml"
    fleet.write_text(f'backends: [{{name: stub, url: "http://127.0.0.1:{stub_port}", profile: baseline}}]\n'
                     "health: {interval_s: 2}\n")
    # the repo first, then whatever PYTHONPATH already held (the device script's wheels in /tmp/site)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    stub = subprocess.Popen([sys.executable, "-m", "tests.helpers.stub_backend", "--port", str(stub_port),
                             "--n-chunks", str(args.chunks), "--no-record"], cwd=ROOT, env=env,
                            stderr=subprocess.DEVNULL)
    gw = subprocess.Popen([sys.executable, "-m", "specserve.cli", "gateway", "--config", str(fleet), "--port",
                           str(gw_port), "--log-level", "warning"], cwd=ROOT, env=env, stderr=subprocess.DEVNULL)
    direct, via = f"http://127.0.0.1:{stub_port}/v1/completions", f"http://127.0.0.1:{gw_port}/v1/completions"
    result: dict = {}
    try:
        _wait_up(f"http://127.0.0.1:{stub_port}/health")
        _wait_up(f"http://127.0.0.1:{gw_port}/health")
        rng = random.Random(seed)
        loads = [os.getloadavg()[0]]
        gc.collect()
        gc.freeze()  # the client's start-up heap (numpy, httpx, aiohttp) out of the collector's full passes
        # keep-alive shorter than the servers' 5 s, so an idle connection is never reused as the server closes it
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=30),
                                         cookie_jar=aiohttp.DummyCookieJar()) as session:
            for stream in (False, True):
                for url in (direct, via):  # warm-up: connections, imports
                    await _block(session, url, args.rate, 2.0, stream, args.chunks, rng)
                pairs = []
                for rep in range(args.repeats):
                    order = [("direct", direct), ("gateway", via)]
                    if rep % 2:
                        order.reverse()
                    block = {}
                    for name, url in order:
                        c0 = {"gateway": _cpu_s(gw.pid), "stub": _cpu_s(stub.pid), "client": _cpu_s("self")}
                        m0 = _machine_ticks()
                        b = await _block(session, url, args.rate, args.block_s, stream, args.chunks, rng)
                        m1 = _machine_ticks()
                        b["cpu_s"] = {"gateway": _cpu_s(gw.pid) - c0["gateway"], "stub": _cpu_s(stub.pid) - c0["stub"],
                                      "client": _cpu_s("self") - c0["client"]}
                        b["machine_busy"] = (m1[0] - m0[0]) / max(1, m1[1] - m0[1])
                        b["load_1m"] = os.getloadavg()[0]
                        loads.append(b["load_1m"])
                        block[name] = b
                    pairs.append(block)
                result["streamed" if stream else "non_streamed"] = _summarize(pairs, stream)
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{gw_port}/metrics") as r:
            metrics = await r.text()
        result["gateway_self_measured_overhead_ms"] = {
            "note": "non-streamed requests: time in the gateway minus time waiting for the backend "
                    "(bucket upper bounds)",
            "p50_le": _hist_quantile(metrics, "specserve:gateway_overhead_seconds", 0.5),
            "p99_le": _hist_quantile(metrics, "specserve:gateway_overhead_seconds", 0.99)}
        result["load_average_1m"] = {"min": min(loads), "max": max(loads), "mean": round(statistics.mean(loads), 2)}
    finally:
        for p in (gw, stub):
            p.terminate()
            p.wait(10)
    return result


def _summarize(pairs: list[dict], stream: bool) -> dict:
    out: dict = {"blocks": len(pairs), "requests_per_arm": sum(len(p["direct"]["e2e"]) for p in pairs)}
    for label in ("e2e", "ttft") if stream else ("e2e",):
        for q in (50, 99):
            added = [_pct(p["gateway"][label], q) - _pct(p["direct"][label], q) for p in pairs]
            d_all = [x for p in pairs for x in p["direct"][label]]
            g_all = [x for p in pairs for x in p["gateway"][label]]
            out[f"{label}_p{q}_ms"] = {
                "direct": round(_pct(d_all, q), 3), "gateway": round(_pct(g_all, q), 3),
                "added_pooled": round(_pct(g_all, q) - _pct(d_all, q), 3),
                "added_median_of_blocks": round(statistics.median(added), 3),
                "added_per_block": [round(a, 3) for a in added]}
    e = out["e2e_p50_ms"]["added_pooled"], out["e2e_p99_ms"]["added_pooled"]
    out["goal_met"] = {"added_p50_le_1ms": e[0] <= 1.0, "added_p99_le_5ms": e[1] <= 5.0}
    for arm in ("direct", "gateway"):
        n = sum(len(p[arm]["e2e"]) for p in pairs)
        out[arm] = {
            "cpu_ms_per_request": {who: round(1000 * sum(p[arm]["cpu_s"][who] for p in pairs) / n, 3)
                                   for who in ("gateway", "stub", "client")},
            "machine_cpu_busy": [round(p[arm]["machine_busy"], 3) for p in pairs],
            "load_1m": [round(p[arm]["load_1m"], 2) for p in pairs],
            "send_lag_ms": {"p50": round(_pct([x for p in pairs for x in p[arm]["lag"]], 50), 3),
                            "p99": round(_pct([x for p in pairs for x in p[arm]["lag"]], 99), 3)}}
    return out


def summary(runs: list[dict]) -> dict:
    """The worst run's added E2E p50/p99 per mode, and whether the goal holds in every run."""
    out: dict = {}
    for mode in MODES:
        p50 = [r[mode]["e2e_p50_ms"]["added_pooled"] for r in runs]
        p99 = [r[mode]["e2e_p99_ms"]["added_pooled"] for r in runs]
        out[mode] = {"added_e2e_p50_ms": max(p50), "added_e2e_p99_ms": max(p99),
                     "added_e2e_p50_ms_per_run": p50, "added_e2e_p99_ms_per_run": p99}
    out["goal_met"] = all(r[m]["goal_met"]["added_p50_le_1ms"] and r[m]["goal_met"]["added_p99_le_5ms"]
                          for r in runs for m in MODES)
    out["load_average_1m"] = {"min": min(r["load_average_1m"]["min"] for r in runs),
                              "max": max(r["load_average_1m"]["max"] for r in runs)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=100.0, help="requests per second (open loop, Poisson)")
    ap.add_argument("--block-s", type=float, default=10.0, help="seconds per measured block")
    ap.add_argument("--repeats", type=int, default=4, help="block pairs (direct, gateway) per mode")
    ap.add_argument("--runs", type=int, default=1, help="whole measurements, each with fresh processes")
    ap.add_argument("--chunks", type=int, default=16, help="SSE events per streamed response (and max_tokens)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default="", help="suffix for the output file name")
    ap.add_argument("--out", default="docs/benchmarks")
    args = ap.parse_args()
    import importlib.util

    loop_impl = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    if loop_impl == "uvloop":  # the client too: less CPU per request, finer timers for the open loop
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    load_at_start = round(os.getloadavg()[0], 2)
    runs = []
    for i in range(args.runs):
        res = asyncio.run(run_once(args, args.seed + i))
        runs.append(res)
        for mode in MODES:
            r = res[mode]
            print(f"run {i + 1} {mode}: added E2E p50 {r['e2e_p50_ms']['added_pooled']:.3f} ms, "
                  f"p99 {r['e2e_p99_ms']['added_pooled']:.3f} ms (direct p50 {r['e2e_p50_ms']['direct']:.3f}, "
                  f"gateway p50 {r['e2e_p50_ms']['gateway']:.3f}); CPU ms/request {r['gateway']['cpu_ms_per_request']};"
                  f" goal {r['goal_met']}")
        print(f"run {i + 1}: load average {res['load_average_1m']}")
    doc = {"benchmark": "gateway_overhead", "issue": 13,
           "goal": "added E2E latency p50 <= 1 ms and p99 <= 5 ms at 100 requests/s, streamed and not",
           "conditions": {"rate_rps": args.rate, "block_s": args.block_s, "repeats": args.repeats, "runs": args.runs,
                          "chunks_per_stream": args.chunks, "cpus": os.cpu_count(),
                          "cpus_usable": sorted(os.sched_getaffinity(0)), "cpu_model": cpu_model_name(),
                          "machine": platform.machine(),
                          "python": platform.python_version(), "event_loop": loop_impl,
                          "backend": "stub that answers at once (tests/helpers/stub_backend.py --no-record)",
                          "client": "aiohttp.ClientSession, one task per request, in a third process",
                          "time": time.strftime("%Y-%m-%d %H:%M:%S"), "code": _code_version(),
                          "load_average_1m_at_start": load_at_start, "nice": os.nice(0)},
           "summary": summary(runs), "runs": runs}
    out = Path(args.out) / f"gateway_overhead{'_' + args.tag if args.tag else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"summary {json.dumps(doc['summary'])}; wrote {out}")


if __name__ == "__main__":
    main()
