"""Where the gateway overhead benchmark's p99 tail comes from: one traced run, every request followed.

The same three processes and open loop as `gateway_overhead.py` (stub, gateway, this client; direct
and gateway arms in alternating blocks, non-streamed then streamed), but the stub and the gateway run
under `gateway_trace_agent.py` and every request carries an `x-request-id`, so that each request can
be followed through the processes on one clock (CLOCK_MONOTONIC): client send -> gateway receive ->
upstream send -> stub receive -> stub last byte -> upstream head / body end -> gateway last byte ->
client end. Per process: GC collections (gc.callbacks), event-loop lag, and the thread's run-queue
delay (/proc/thread-self/schedstat) at each event. The report (`--out`, JSON) gives, for the slowest
1% of each arm: the segment that grew, the GC pauses and run-queue delay that overlap it, and when
the slow requests came (position in the block, spacing); plus the same shares for all requests.

    python benchmarks/gateway_trace.py --block-s 10 --repeats 2 --out /tmp/trace.json

What it does not do: judge the goal (gateway_overhead.py does); the tracing itself costs a few µs
per event in each process.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gateway_overhead as GO  # noqa: E402
import gateway_trace_agent as AG  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
C: dict = {"requests": {}, "gc": [], "lag": []}


async def _one(session, url: str, data: bytes, stream: bool, rid: str) -> None:
    t0, d0 = time.perf_counter(), AG.run_delay_ns()
    first = None
    async with session.post(url, data=data, headers={"content-type": "application/json", "x-request-id": rid}) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}")
        if not stream:
            await r.read()
        else:
            async for _ in r.content.iter_any():
                if first is None:
                    first = time.perf_counter()
    C["requests"][rid] = [t0, d0, first, time.perf_counter(), AG.run_delay_ns()]


async def _block(session, url, rate, seconds, stream, chunks, rng, tag):
    data = json.dumps({"prompt": "hello", "max_tokens": chunks, "temperature": 0, "stream": stream}).encode()
    tasks = []
    t_next = time.perf_counter()
    end = t_next + seconds
    i = 0
    while t_next < end:
        delay = t_next - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(_one(session, url, data, stream, f"{tag}-{i}")))
        i += 1
        t_next += rng.expovariate(rate)
    await asyncio.gather(*tasks)


async def run(args) -> dict:
    stub_port, gw_port = GO._free_port(), GO._free_port()
    tmp = Path(tempfile.mkdtemp())
    fleet = tmp / "fleet.yaml"
    fleet.write_text(f'backends: [{{name: stub, url: "http://127.0.0.1:{stub_port}", profile: baseline}}]\n'
                     "health: {interval_s: 2}\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    agent = str(Path(__file__).resolve().parent / "gateway_trace_agent.py")
    stub = subprocess.Popen([sys.executable, agent, "stub", "--port", str(stub_port), "--n-chunks", str(args.chunks),
                             "--no-record", *args.stub_args], cwd=ROOT, env={**env, "TRACE_OUT": str(tmp / "stub.json")},
                            stderr=subprocess.DEVNULL)
    gw = subprocess.Popen([sys.executable, agent, "gateway", "--config", str(fleet), "--port", str(gw_port),
                           "--log-level", "warning"], cwd=ROOT, env={**env, "TRACE_OUT": str(tmp / "gw.json")},
                          stderr=subprocess.DEVNULL)
    direct, via = f"http://127.0.0.1:{stub_port}/v1/completions", f"http://127.0.0.1:{gw_port}/v1/completions"
    blocks = []
    try:
        GO._wait_up(f"http://127.0.0.1:{stub_port}/health")
        GO._wait_up(f"http://127.0.0.1:{gw_port}/health")
        rng = random.Random(args.seed)
        AG.install_gc_trace(C["gc"])
        if not args.no_client_freeze:  # as gateway_overhead.py does
            gc.collect()
            gc.freeze()
        lag = asyncio.get_running_loop().create_task(AG.lag_monitor(C["lag"]))
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=30),
                                         cookie_jar=aiohttp.DummyCookieJar()) as session:
            for stream in (False, True):
                mode = "streamed" if stream else "non_streamed"
                for arm, url in (("direct", direct), ("gateway", via)):
                    await _block(session, url, args.rate, 2.0, stream, args.chunks, rng, f"warm-{mode}-{arm}")
                for rep in range(args.repeats):
                    order = [("direct", direct), ("gateway", via)]
                    if rep % 2:
                        order.reverse()
                    for arm, url in order:
                        tag = f"{mode}-{arm}-{rep}"
                        t0 = time.perf_counter()
                        await _block(session, url, args.rate, args.block_s, stream, args.chunks, rng, tag)
                        blocks.append({"tag": tag, "mode": mode, "arm": arm, "t0": t0, "t1": time.perf_counter(),
                                       "load_1m": os.getloadavg()[0]})
        lag.cancel()
    finally:
        for p in (gw, stub):
            p.terminate()
            p.wait(10)
    procs = {"client": C}
    for name in ("gw", "stub"):
        f = tmp / f"{name}.json"
        procs["gateway" if name == "gw" else "stub"] = json.loads(f.read_text()) if f.exists() else None
    return {"blocks": blocks, "procs": procs}


def _overlap(intervals, a: float, b: float) -> float:
    """Seconds of [a, b] covered by the (start, end, ...) intervals."""
    return sum(max(0.0, min(b, iv[1]) - max(a, iv[0])) for iv in intervals)


def _delay_in(events: list[tuple[float, int]], a: float, b: float) -> float:
    """Run-queue delay (s) a process accumulated by samples taken in (a, b]: waits that ended there."""
    total = 0.0
    prev = None
    for t, d in events:
        if prev is not None and a < t <= b:
            total += (d - prev) / 1e9
        prev = d
    return total


def analyze(raw: dict, tail_q: float = 99.0) -> dict:
    P = raw["procs"]
    cl, gwp, st = P["client"], P["gateway"] or {}, P["stub"] or {}
    # per-process (time, cumulative run delay) samples, sorted
    def samples(reqs: dict, idx_pairs) -> list[tuple[float, int]]:
        s = [(r[i], r[j]) for r in reqs.values() for i, j in idx_pairs if r[i] is not None and r[j] is not None]
        return sorted(s)

    s_client = samples(cl["requests"], [(0, 1), (3, 4)])
    s_gw = samples(gwp.get("requests", {}), [(0, 1), (3, 4), (5, 6)])
    s_stub = samples(st.get("requests", {}), [(0, 1), (3, 4), (5, 6)])
    gcs = {"client": cl["gc"], "gateway": gwp.get("gc", []), "stub": st.get("gc", [])}
    lags = {"client": cl["lag"], "gateway": gwp.get("lag", []), "stub": st.get("lag", [])}
    out: dict = {"gc": {}, "lag": {}}
    w0, w1 = min(b["t0"] for b in raw["blocks"]), max(b["t1"] for b in raw["blocks"])
    out["measured_s"] = round(w1 - w0, 1)
    for p, g in gcs.items():  # collections while the measured blocks ran (not start-up's)
        by_gen: dict = {}
        for t0, t1, cpu, gen, _ in g:
            if w0 <= t0 <= w1:
                by_gen.setdefault(gen, []).append(((t1 - t0) * 1000, cpu * 1000))
        out["gc"][p] = {f"gen{k}": {"n": len(v), "max_ms": round(max(x for x, _ in v), 3),
                                    "p50_ms": round(statistics.median(x for x, _ in v), 3),
                                    "max_cpu_ms": round(max(c for _, c in v), 3),
                                    "total_ms": round(sum(x for x, _ in v), 1)} for k, v in sorted(by_gen.items())}
    for p, lg in lags.items():
        v = [x[1] * 1000 for x in lg if w0 <= x[0] <= w1]
        out["lag"][p] = {"n_over_0.5ms": len(v), "n_over_2ms": sum(x > 2 for x in v),
                         "max_ms": round(max(v), 3) if v else 0.0}
    for mode in ("non_streamed", "streamed"):
        for arm in ("direct", "gateway"):
            rows = []
            for b in raw["blocks"]:
                if b["mode"] != mode or b["arm"] != arm:
                    continue
                for rid, r in cl["requests"].items():
                    if not rid.startswith(b["tag"] + "-"):
                        continue
                    t0, t1 = r[0], r[3]
                    row = {"rid": rid, "i": int(rid.rsplit("-", 1)[1]), "t": t0 - b["t0"], "e2e_ms": (t1 - t0) * 1000,
                           "_t0": t0, "_t1": t1}
                    g = gwp.get("requests", {}).get(rid)
                    s = st.get("requests", {}).get(rid)
                    u = gwp.get("upstream", {}).get(rid, {})
                    if g:
                        row["client_to_gw_ms"] = (g[0] - t0) * 1000
                        row["gw_last_to_client_ms"] = (t1 - g[3]) * 1000 if g[3] else None
                        if u.get("send"):
                            row["gw_pre_ms"] = (u["send"] - g[0]) * 1000
                        if s and u.get("send"):
                            row["up_to_stub_ms"] = (s[0] - u["send"]) * 1000
                            if s[3] and u.get("done"):  # non-streamed: stub's last byte -> gateway has the body
                                row["stub_to_gw_ms"] = (u["done"] - s[3]) * 1000
                            if s[3] and g[3]:  # stub's last byte -> gateway's last byte
                                row["stub_end_to_gw_end_ms"] = (g[3] - s[3]) * 1000
                        if u.get("done") and g[3]:
                            row["gw_post_ms"] = (g[3] - u["done"]) * 1000
                    elif s:
                        row["client_to_stub_ms"] = (s[0] - t0) * 1000
                        row["stub_last_to_client_ms"] = (t1 - s[3]) * 1000 if s[3] else None
                    if s:
                        row["stub_in_ms"] = ((s[3] or s[5]) - s[0]) * 1000
                    for p, smp in (("client", s_client), ("gateway", s_gw), ("stub", s_stub)):
                        row[f"runq_{p}_ms"] = _delay_in(smp, t0, t1) * 1000
                        row[f"gc_{p}_ms"] = _overlap(gcs[p], t0, t1) * 1000
                        row[f"lag_{p}_ms"] = max((x[1] * 1000 for x in lags[p] if t0 <= x[0] <= t1), default=0.0)
                    rows.append(row)
            if not rows:
                continue
            e2e = sorted(r["e2e_ms"] for r in rows)
            cut = e2e[min(len(e2e) - 1, int(len(e2e) * tail_q / 100))]
            tail = [r for r in rows if r["e2e_ms"] >= cut]
            keys = [k for k in rows[0] if k.endswith("_ms")]
            def med(rs, k):
                v = [r[k] for r in rs if r.get(k) is not None]
                return round(statistics.median(v), 3) if v else None
            health = gwp.get("health", [])
            for r in rows:  # (after the fact: a health-check round overlapping the request)
                r["health_overlap"] = _overlap(health, r["_t0"], r["_t1"]) > 0
            first_s = sum(r["t"] < 0.5 for r in tail)
            explained = {
                "gc_any_ge_1ms": sum(any(r[f"gc_{p}_ms"] >= 1 for p in ("client", "gateway", "stub")) for r in tail),
                "runq_any_ge_1ms": sum(any(r[f"runq_{p}_ms"] >= 1 for p in ("client", "gateway", "stub")) for r in tail),
                "either": sum(any(r[f"gc_{p}_ms"] >= 1 or r[f"runq_{p}_ms"] >= 1 for p in ("client", "gateway", "stub"))
                              for r in tail)}
            base = {
                "gc_any_ge_1ms": sum(any(r[f"gc_{p}_ms"] >= 1 for p in ("client", "gateway", "stub")) for r in rows),
                "runq_any_ge_1ms": sum(any(r[f"runq_{p}_ms"] >= 1 for p in ("client", "gateway", "stub")) for r in rows)}
            # requests during which no process waited >= 0.5 ms for a core nor paused >= 0.5 ms in GC: what is
            # left of the tail there is not the machine's (a filter biased to short requests: a long one has
            # more time to meet a wait)
            clean = sorted(r["e2e_ms"] for r in rows
                           if all(r[f"runq_{p}_ms"] < 0.5 and r[f"gc_{p}_ms"] < 0.5 for p in ("client", "gateway", "stub")))
            out[f"{mode}/{arm}"] = {
                "clean": {"n": len(clean), "p50_ms": round(statistics.median(clean), 3) if clean else None,
                          "p99_ms": round(clean[min(len(clean) - 1, int(len(clean) * 0.99))], 3) if clean else None},
                "n": len(rows), "p50_ms": round(statistics.median(e2e), 3), f"p{tail_q:g}_ms": round(cut, 3),
                "median_all": {k: med(rows, k) for k in keys}, "median_tail": {k: med(tail, k) for k in keys},
                "tail_n": len(tail), "tail_explained": explained, "all_with": base,
                "tail_in_first_0.5s_of_block": first_s,
                "health_check_overlap": {"tail": sum(r["health_overlap"] for r in tail),
                                         "all": sum(r["health_overlap"] for r in rows)},
                "tail_position_in_block_s": sorted(round(r["t"], 2) for r in tail),
                "tail": sorted(({k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()
                                 if not k.startswith("_")} for r in tail),
                               key=lambda r: -r["e2e_ms"])[:12]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=100.0)
    ap.add_argument("--block-s", type=float, default=10.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-client-freeze", action="store_true", help="no gc.freeze() in the client after start-up")
    ap.add_argument("--stub-args", nargs="*", default=[], help="extra stub_backend arguments")
    ap.add_argument("--raw", help="also write the raw trace here")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import uvloop

    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    load0 = os.getloadavg()
    raw = asyncio.run(run(args))
    if args.raw:
        Path(args.raw).write_text(json.dumps(raw))
    rep = analyze(raw)
    rep["conditions"] = {"rate_rps": args.rate, "block_s": args.block_s, "repeats": args.repeats,
                         "chunks": args.chunks, "load_avg_at_start": load0, "load_avg_at_end": os.getloadavg(),
                         "cpus": os.cpu_count(), "affinity": sorted(os.sched_getaffinity(0)),
                         "client_freeze": not args.no_client_freeze, "stub_args": args.stub_args,
                         "code": GO._code_version(), "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    Path(args.out).write_text(json.dumps(rep, indent=1) + "\n")
    for mode in ("non_streamed", "streamed"):
        d, g = rep.get(f"{mode}/direct", {}).get("clean"), rep.get(f"{mode}/gateway", {}).get("clean")
        if d and g and d["n"] and g["n"]:
            rep[f"{mode}_clean_added_ms"] = {"p50": round(g["p50_ms"] - d["p50_ms"], 3),
                                             "p99": round(g["p99_ms"] - d["p99_ms"], 3)}
    for k, v in rep.items():
        if k.endswith("_clean_added_ms"):
            print(k, v)
        if "/" in k:
            print(k, "n", v["n"], "p50", v["p50_ms"], "p99", v["p99_ms"], "tail explained", v["tail_explained"],
                  "of", v["tail_n"], "| all with", v["all_with"])
            print("   median tail", {a: b for a, b in v["median_tail"].items() if b})
    print("gc", json.dumps(rep["gc"]))
    print("lag", json.dumps(rep["lag"]))


if __name__ == "__main__":
    main()
