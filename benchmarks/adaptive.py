"""Adaptive draft length against the baseline and the best static k (issue 10), through a real server.

Starts `specserve serve` (fp32, CPU by default) with the admin API and profile override, then runs the
sweep machinery (`specserve.bench.sweep`: every profile on the same greedy requests of one segment at a
time, closed loop, order rotated per run, fresh prompts per repeat and concurrency, TPOT speedup against
the baseline of the same repeat, medians over repeats):

- part A: baseline, adaptive ngram and adaptive suffix on the five demo segments;
- part B: on code and edit also every static k of both methods, side by side with the adaptive ones;
- with --sweep-check: `specserve sweep` over 2 methods x 4 k x 2 concurrency levels x 3 segments, twice,
  timed, and whether the second recommendation reproduces the first within its reported spread.

Summary (`docs/benchmarks/adaptive_cpu.json`, field `summary`): `min_segment_ratio` = the worst median
TPOT speedup of an adaptive profile over segments and concurrency levels; `kept_of_best_static` per
segment (code, edit) = the smallest, over methods and concurrency, of adaptive speedup / best static
speedup of the same method.

    python benchmarks/adaptive.py --out docs/benchmarks                      # parts A and B
    python benchmarks/adaptive.py --out docs/benchmarks --sweep-check        # and the sweep goal

On a shared machine, run it in parts (each alone on the machine), then combine them:

    python benchmarks/adaptive.py --out out/parts --tag A --segments chat,summarize,tool_call
    python benchmarks/adaptive.py --out out/parts --tag code --segments code
    python benchmarks/adaptive.py --out out/parts --tag edit --segments edit
    python benchmarks/adaptive.py --out docs/benchmarks --combine out/parts/adaptive_cpu_{A,code,edit}.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import secrets
import subprocess
import sys
import time
from pathlib import Path

SEGMENTS = ["code", "edit", "chat", "summarize", "tool_call"]
STATIC_SEGMENTS = ["code", "edit"]


def profiles(ks: list[int], max_k: int, static: bool) -> dict:
    out: dict = {"baseline": None}
    opts = {"ngram": {"prompt_lookup_min": 2, "prompt_lookup_max": 4}, "suffix": {}}
    for m, extra in opts.items():
        if static:
            for k in ks:
                out[f"{m}_k{k}"] = {"method": m, "num_speculative_tokens": k, **extra}
        out[f"{m}_adaptive"] = {"method": m, "num_speculative_tokens": max_k, **extra,
                                "num_speculative_tokens_schedule": "adaptive"}
    return out


def summarize(rows: list[dict]) -> dict:
    adaptive = [r for r in rows if r["profile"].endswith("_adaptive") and r["speedup"]["median"] is not None]
    worst = min(adaptive, key=lambda r: r["speedup"]["median"])
    kept, details = {}, []
    for seg in STATIC_SEGMENTS:
        ratios = []
        for r in adaptive:
            if r["segment"] != seg:
                continue
            method = r["profile"].split("_")[0]
            static = [s for s in rows if s["segment"] == seg and s["concurrency"] == r["concurrency"]
                      and s["profile"].startswith(method + "_k") and s["speedup"]["median"] is not None]
            if not static:
                continue
            best = max(static, key=lambda s: s["speedup"]["median"])
            ratio = r["speedup"]["median"] / best["speedup"]["median"]
            ratios.append(ratio)
            details.append({"segment": seg, "concurrency": r["concurrency"], "adaptive": r["profile"],
                            "adaptive_speedup": r["speedup"]["median"], "best_static": best["profile"],
                            "best_static_speedup": best["speedup"]["median"], "kept": ratio})
        if ratios:
            kept[seg] = min(ratios)
    by_profile = {}
    for r in adaptive:
        by_profile.setdefault(r["profile"], {})[f"{r['segment']} c={r['concurrency']}"] = round(r["speedup"]["median"], 3)
    return {"min_segment_ratio": worst["speedup"]["median"],
            "min_segment_ratio_at": {"profile": worst["profile"], "segment": worst["segment"],
                                     "concurrency": worst["concurrency"],
                                     "spread": [worst["speedup"]["min"], worst["speedup"]["max"]]},
            "kept_of_best_static": kept, "kept_details": details, "adaptive_speedups": by_profile}


def combine(args) -> None:
    """One result from part files written by separate invocations (each with its own server)."""
    from specserve.bench.sweep_select import recommend, summarize_runs

    parts = [json.loads(Path(f).read_text()) for f in args.combine]
    for f, part in zip(args.combine, parts):
        if part.get("partial") and not args.allow_partial:
            raise SystemExit(f"{f} is partial (its run did not finish; --allow-partial takes the segments it completed)")
    runs = [r for part in parts for r in part["runs"]]
    profiles_all = {k: v for part in parts for k, v in part["profiles"].items()}
    rows = summarize_runs(runs)
    result = {"benchmark": "adaptive", "model": parts[0]["model"], "partial": False,
              "conditions": parts[0]["conditions"] + f"; combined from {len(parts)} parts, one server each",
              "parts": [{"file": Path(f).name, "started": p["started"], "wall_s": p["wall_s"], "partial": p["partial"],
                         "segments": sorted({r["segment"] for r in p["runs"]})} for f, p in zip(args.combine, parts)],
              "segments_measured": sorted({r["segment"] for r in runs}),
              "profiles": profiles_all, "summary": summarize(rows),
              "recommendations": recommend(rows, profiles_all, 0.02), "rows": rows, "runs": runs,
              "wall_s": round(sum(p["wall_s"] for p in parts), 1)}
    if args.note:
        result["note"] = args.note
    for p in parts:
        if "sweep_check" in p:
            result["sweep_check"] = p["sweep_check"]
            result["summary"]["sweep_wall_s"] = p["summary"]["sweep_wall_s"]
            result["summary"]["sweep_reproduces"] = p["summary"]["sweep_reproduces"]
    out = Path(args.out or "docs/benchmarks")
    out.mkdir(parents=True, exist_ok=True)
    (out / f"adaptive_{args.device}{'_' + args.tag if args.tag else ''}.json").write_text(json.dumps(result, indent=1) + "\n")
    print_summary(result)


def print_summary(result: dict) -> None:
    s = result["summary"]
    print(f"\nmin_segment_ratio {s['min_segment_ratio']:.3f} ({s['min_segment_ratio_at']}); kept_of_best_static "
          + ", ".join(f"{k} {v:.3f}" for k, v in s["kept_of_best_static"].items()))
    for p, v in s["adaptive_speedups"].items():
        print(f"  {p}: " + ", ".join(f"{k} {x:.2f}x" for k, x in v.items()))
    print(json.dumps({k: v for k, v in result.items() if k not in ("runs", "rows")}))


def run_cli_sweep(base_url: str, token: str, out: Path, args) -> tuple[dict, float]:
    cmd = [sys.executable, "-m", "specserve.cli", "sweep", "--base-url", base_url, "--admin-token", token,
           "--methods", "ngram,suffix", "--k", "2,4,6,8", "--no-adaptive", "--concurrency", "1,4",
           "--segments", "code,edit,chat", "--num-prompts", str(args.num_prompts), "--max-tokens",
           str(args.max_tokens), "--repeats", "2", "--output-dir", str(out), "--no-progress"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode not in (0, 1):
        raise SystemExit(f"sweep failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    print(proc.stdout, flush=True)
    return json.loads((out / "sweep.json").read_text()), wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-prompts", type=int, default=4, help="requests per run (segment, concurrency)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--ks", default="2,4,6,8", help="static k of part B")
    ap.add_argument("--max-k", type=int, default=8, help="num_speculative_tokens of the adaptive profiles")
    ap.add_argument("--segments", default=",".join(SEGMENTS))
    ap.add_argument("--adaptive-objective", default="throughput", choices=["throughput", "fair"],
                    help="the server's --adaptive-objective")
    ap.add_argument("--torch-threads", type=int, default=None,
                    help="OMP_NUM_THREADS for the server (default: torch's own choice)")
    ap.add_argument("--sweep-check", action="store_true", help="also time the sweep goal and re-run it")
    ap.add_argument("--tag", default=None, help="suffix for the output file name")
    ap.add_argument("--out", default=None, help="folder for adaptive_<device>.json")
    ap.add_argument("--work-dir", default="out/adaptive-bench", help="server log and sweep files")
    ap.add_argument("--combine", nargs="+", default=None, metavar="PART_JSON",
                    help="measure nothing: combine the runs of part files into one result (and summary)")
    ap.add_argument("--allow-partial", action="store_true",
                    help="with --combine: take the completed segments of a part that did not finish")
    ap.add_argument("--note", default=None, help="with --combine: a note kept in the result (how the parts were run)")
    args = ap.parse_args()
    if args.combine:
        return combine(args)

    from specserve.bench import sweep
    from specserve.bench.sweep_select import recommend, summarize_runs
    from specserve.bench.server_process import ServerProcess
    from specserve.demo import prepare_model

    def write(result: dict) -> None:
        if args.out:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            name = f"adaptive_{args.device}" + (f"_{args.tag}" if args.tag else "")
            (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")

    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    files = prepare_model(args.model, progress=True)
    token = secrets.token_hex(8)
    conc = [int(c) for c in args.concurrency.split(",")]
    os.environ["SPECSERVE_ADMIN_TOKEN"] = token  # the server reads it; never on a command line
    if args.torch_threads:
        os.environ["OMP_NUM_THREADS"] = str(args.torch_threads)
    empty = work / "profiles.json"
    empty.write_text(json.dumps({"profiles": {"baseline": None}}))
    server = ServerProcess(["--model", str(files.path), "--profiles", str(empty), "--allow-profile-override",
                            "--dtype", args.dtype, "--device", args.device, "--max-num-seqs", str(max(conc)),
                            "--log-level", "warning", "--adaptive-objective", args.adaptive_objective],
                           work / "server.log")
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    t0 = time.perf_counter()
    server.start(900)
    try:
        base_url = server.base_url + "/v1"
        segs = args.segments.split(",")
        common = dict(base_url=base_url, admin_token=token, concurrency=conc, num_prompts=args.num_prompts,
                      max_tokens=args.max_tokens, repeats=args.repeats, warmup=1)
        runs = []
        parts = [([s for s in segs if s not in STATIC_SEGMENTS], profiles([], args.max_k, static=False)),
                 ([s for s in segs if s in STATIC_SEGMENTS], profiles([int(k) for k in args.ks.split(",")], args.max_k, True))]
        all_profiles = {**parts[0][1], **parts[1][1]}
        result: dict = {}

        def checkpoint(partial: bool) -> None:  # a long run keeps what it measured so far
            rows = summarize_runs(runs)
            result.update({
                "benchmark": "adaptive", "model": args.model, "started": started, "partial": partial,
                "conditions": f"{platform.machine()}, {os.cpu_count()} CPUs (shared), {args.device}, {args.dtype}, "
                              f"server threads {args.torch_threads or 'torch default'}, "
                              f"greedy, max_tokens {args.max_tokens}, {args.num_prompts} prompts per run, "
                              f"concurrency {args.concurrency}, {args.repeats} repeats, order rotated per run, "
                              "fresh prompts per repeat and concurrency, through `specserve serve`, "
                              f"adaptive objective {args.adaptive_objective}",
                "profiles": all_profiles, "summary": summarize(rows),
                "recommendations": recommend(rows, all_profiles, 0.02), "rows": rows, "runs": runs,
                "wall_s": round(time.perf_counter() - t0, 1)})
            write(result)

        for i, (part_segs, profs) in enumerate(parts):
            if not part_segs:
                continue
            # part B (11 profiles per segment) one segment at a time, the JSON written after each
            for group in ([part_segs] if i == 0 else [[s] for s in part_segs]):
                cfg = sweep.SweepConfig(segments=group, **common)
                print(f"part {'AB'[i]}: {', '.join(group)} x {', '.join(profs)}", file=sys.stderr, flush=True)
                runs += asyncio.run(sweep.sweep_server(cfg, profs, f"{i}{secrets.token_hex(2)}"))
                checkpoint(partial=True)
        checkpoint(partial=bool(args.sweep_check))
        if args.sweep_check:
            first, wall1 = run_cli_sweep(base_url, token, work / "sweep1", args)
            again, wall2 = run_cli_sweep(base_url, token, work / "sweep2", args)
            from specserve.bench.sweep_select import consistent

            result["sweep_check"] = {
                "grid": "ngram,suffix x k 2,4,6,8 x c 1,4 x code,edit,chat, 2 repeats",
                "wall_s": [round(wall1, 1), round(wall2, 1)],
                "recommendations": [first["recommendations"], again["recommendations"]],
                "consistent": consistent(first["recommendations"], again["recommendations"])}
            result["summary"]["sweep_wall_s"] = max(wall1, wall2)
            result["summary"]["sweep_reproduces"] = result["sweep_check"]["consistent"]["all"]
            result["partial"] = False
            result["wall_s"] = round(time.perf_counter() - t0, 1)
            write(result)
    finally:
        server.stop()
    print_summary(result)


if __name__ == "__main__":
    main()
