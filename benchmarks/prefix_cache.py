"""TTFT with and without automatic prefix caching, side by side in one run (docs/prefix_caching.md).

Starts two `specserve serve` servers on the same model and settings, one with --enable-prefix-caching
and one with --no-enable-prefix-caching (both loaded for the whole run; the idle one uses no CPU), and
in each repeat runs the same `specserve bench` against both, alternating which goes first. The bench
sends the same prompts at c=1, at c=4 and in every repeat (as it did against vLLM in
benchmarks/cpu_vs_vllm.py), so the first c=1 pass of repeat 0 is mostly first sight and everything after
it can hit the cache. Records per run TTFT / TPOT / output tokens/s (overall and per segment), the CPU
seconds of each server, the load average, the prefix cache's queried and hit prompt tokens (the
caching server's /metrics), and whether the greedy texts of the two servers are identical request by
request. `summary` holds on/off ratios, medians over the repeats (TTFT and TPOT < 1 and tokens/s > 1
mean the cache helps), and the conditions.

    /work/wt/bin/bench-lock python benchmarks/prefix_cache.py --out docs/benchmarks/prefix_cache_cpu.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_vs_vllm import figures, ratio, run_bench, texts, tree_cpu_seconds  # noqa: E402

from specserve.bench.prom import prefix_cache_tokens  # noqa: E402
from specserve.bench.server_process import ServerProcess  # noqa: E402

DIRECTION = ("ratios are with / without prefix caching (median over repeats of the per-repeat ratio, both "
             "servers measured in the same repeat): *_ttft_ratio and *_tpot_ratio < 1 and *_tps_ratio > 1 "
             "mean prefix caching is faster")
SERVERS = {"cache_on": "--enable-prefix-caching", "cache_off": "--no-enable-prefix-caching"}


def one_repeat(args, rep: int, servers: dict[str, ServerProcess], scratch: Path) -> dict:
    order = list(SERVERS) if rep % 2 == 0 else list(SERVERS)[::-1]
    result: dict = {"repeat": rep, "order": order, "servers": {}}
    all_texts = {}
    for name in order:
        srv = servers[name]
        pids = {n: s.proc.pid for n, s in servers.items()}
        cpu0 = {n: tree_cpu_seconds(p) for n, p in pids.items()}
        pc0 = prefix_cache_tokens(srv.base_url)
        load0, t0 = os.getloadavg(), time.monotonic()
        summary, rows, cmd = run_bench(srv.base_url + "/v1", None, args, scratch / f"{rep}-{name}")
        wall = time.monotonic() - t0
        pc1 = prefix_cache_tokens(srv.base_url)
        cpu1 = {n: tree_cpu_seconds(p) for n, p in pids.items()}
        cpu = {n: round(cpu1[n] - cpu0[n], 1) for n in pids}
        result["servers"][name] = {
            "command": " ".join(cmd[1:]), "wall_s": round(wall, 1), "loadavg_before": load0,
            "loadavg_after": os.getloadavg(), "cpu_seconds": cpu, "server_cores": round(cpu[name] / wall, 2),
            "figures": figures(summary)}
        if pc0 is not None and pc1 is not None:
            result["servers"][name]["prefix_cache"] = {"queried_tokens": pc1[0] - pc0[0], "hit_tokens": pc1[1] - pc0[1]}
        all_texts[name] = {(load, sid): t for (_, load, sid), t in texts(rows).items()}
    on, off = all_texts["cache_on"], all_texts["cache_off"]
    same = [t == off.get(key) for key, t in on.items()]
    result["greedy_identical"] = [sum(same), len(same)]
    return result


def summarize(reps: list[dict]) -> dict:
    out: dict = {"direction": DIRECTION}
    for load in ("c=1", "c=4"):
        per: dict[str, list] = {}
        for rep in reps:
            s = next(iter(rep["servers"]["cache_on"]["figures"].values())).get(load)
            w = next(iter(rep["servers"]["cache_off"]["figures"].values())).get(load)
            if not s or not w:
                continue
            for key, metric in (("ttft", "ttft_ms_mean"), ("tpot", "tpot_ms_mean"), ("tps", "output_tps")):
                per.setdefault(f"{key}_ratio", []).append(ratio(s["overall"][metric], w["overall"][metric]))
                for seg in s["segments"]:
                    per.setdefault(f"{seg}_{key}_ratio", []).append(
                        ratio(s["segments"][seg][metric], w["segments"].get(seg, {}).get(metric)))
            for name, fig in (("on", s), ("off", w)):
                per.setdefault(f"ttft_ms_cache_{name}", []).append(fig["overall"]["ttft_ms_mean"])
        c = load.replace("=", "")
        for k, vals in per.items():
            vals = [x for x in vals if x is not None]
            if vals:
                out[f"{c}_{k}"] = statistics.median(vals) if "ratio" in k else [round(v, 1) for v in vals]
    hits = [r["servers"]["cache_on"].get("prefix_cache") for r in reps]
    out["conditions"] = {
        "repeats": len(reps),
        "loadavg_1min": [round(r["servers"][n]["loadavg_before"][0], 2) for r in reps for n in r["order"]],
        "server_cores": {n: [r["servers"][n]["server_cores"] for r in reps] for n in SERVERS},
        "cpu_seconds_of_each_server_during_its_runs": {n: [r["servers"][n]["cpu_seconds"][n] for r in reps]
                                                       for n in SERVERS},
        "greedy_identical": [sum(r["greedy_identical"][0] for r in reps), sum(r["greedy_identical"][1] for r in reps)],
        "prefix_cache_hit_share_per_repeat": [round(h["hit_tokens"] / h["queried_tokens"], 3)
                                              if h and h["queried_tokens"] else None for h in hits],
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--serve-args", default="--dtype float32 --max-num-batched-tokens 512",
                    help="further `specserve serve` options, the same for both servers")
    ap.add_argument("--dataset", default="code,edit,chat")
    ap.add_argument("--num-prompts", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="docs/benchmarks/prefix_cache_cpu.json")
    args = ap.parse_args()

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="prefix_cache-") as tmp:
        servers = {n: ServerProcess(["--model", args.model, *args.serve_args.split(), flag, "--seed", "0"],
                                    Path(tmp) / f"{n}.log") for n, flag in SERVERS.items()}
        try:
            for srv in servers.values():  # one after the other: loading both at once only slows both
                srv.start(600)
            reps = []
            for rep in range(args.repeats):
                reps.append(one_repeat(args, rep, servers, Path(tmp)))
                r = reps[-1]
                print(f"repeat {rep}: " + ", ".join(
                    f"{n} {r['servers'][n]['wall_s']:.0f} s (load {r['servers'][n]['loadavg_before'][0]:.2f})"
                    for n in r["order"]) + f"; greedy identical {r['greedy_identical'][0]}/{r['greedy_identical'][1]}",
                    file=sys.stderr)
        finally:
            for srv in servers.values():
                srv.stop()
    data = {
        "benchmark": "prefix_cache_cpu", "direction": DIRECTION, "summary": summarize(reps),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
        "specserve": commit,
        "servers": {n: f"specserve serve --model {args.model} {args.serve_args} {flag} --seed 0"
                    for n, flag in SERVERS.items()},
        "bench": {k: getattr(args, k) for k in ("dataset", "num_prompts", "max_tokens", "concurrency", "warmup", "seed")},
        "repeats": reps,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(json.dumps(data["summary"], indent=1))


if __name__ == "__main__":
    main()
