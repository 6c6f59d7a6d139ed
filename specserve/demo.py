"""`specserve demo`: the first command a new user runs (`bash scripts/demo.sh` sets up, then calls it).

The demo is a preset of the bench runner: (1) pull the model unless it is already in the cache (a
catalog name; a local model folder or .gguf also works); (2) start `specserve serve` as a child process
on 127.0.0.1 (`bench.server_process`) with the profiles `baseline`, `ngram_adaptive` and `suffix_adaptive`
(the adaptive draft length, up to 8 drafts; or `--profiles FILE`) and profile override allowed, and wait for /health; (3) run the bench runner with
fixed options: a small mixed sample of the real workload segments (`--num-prompts` per segment), every
request greedy, the same requests for every profile, a short strict warm-up that is not counted; (4)
print, per segment and overall, each profile's speed against the baseline (TPOT and tokens/s ratios),
its acceptance, and whether its greedy outputs matched the baseline's (a WARNING line when not), write
`summary.json`, `requests.jsonl`, `report.html` (as `specserve bench` does) and `demo.json` to
`--output-dir`, and print the demo summary as the last stdout line. The server is stopped on every
exit path: normal end, error, Ctrl-C, SIGTERM; it also dies with us if we are killed.
What it does not do: tune anything (see `specserve bench` for the full set of knobs) or keep the server.
Only argparse (and the bench CLI's argument types) is imported at module level, so `specserve --help`
stays fast.
"""
from __future__ import annotations

import argparse
import sys

from specserve.bench.cli import csv_list

DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct"
DEFAULT_SEGMENTS = "code,edit,chat,summarize,tool_call"
DEFAULT_PROFILES = {
    "profiles": {
        "baseline": None,
        # adaptive: k per request and step from the measured step cost and acceptance (docs/adaptive-speculation.md).
        # It replaced constant k (ngram k 4, suffix k 8), which lost on tool_call, chat and summarize text
        # (0.76-0.90x); adaptive held >= 0.97x on every segment (docs/benchmarks/adaptive_cpu.json). Its cost:
        # the server times the model's step once per model, dtype and device (15-35 s on the 2-core CPU, cached).
        "ngram_adaptive": {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2,
                           "prompt_lookup_max": 4, "num_speculative_tokens_schedule": "adaptive"},
        "suffix_adaptive": {"method": "suffix", "num_speculative_tokens": 8, "num_speculative_tokens_schedule": "adaptive"},
    },
    "weights": {"baseline": 1},
}
SCHEMA = "specserve.demo/1"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"catalog name (pulled if missing), local model folder or .gguf (default {DEFAULT_MODEL})")
    p.add_argument("--segments", default=DEFAULT_SEGMENTS,
                   help=f"comma list of workload segments, as `bench --dataset` (default {DEFAULT_SEGMENTS}); "
                        "a .jsonl file of {prompt|messages, segment, max_tokens} works too")
    p.add_argument("--num-prompts", type=int, default=2, help="prompts per segment (default 2)")
    p.add_argument("--max-tokens", type=int, default=64, help="cap on each request's output tokens (default 64)")
    p.add_argument("--max-prompt-chars", type=int, default=1500,
                   help="longest chat prompt taken; summarize texts are 2/3 to 2x this (default 1500)")
    p.add_argument("--concurrency", type=csv_list(int, minimum=1), default=[1],
                   help="closed-loop concurrency, e.g. 1,4 (default 1)")
    p.add_argument("--profiles", metavar="FILE",
                   help='profiles file as `serve --profiles` ({"profiles": {name: config|null}}); '
                        "default: baseline, ngram_adaptive (ngram, lookup 2-4) and suffix_adaptive (SuffixDecoding), "
                        "both up to k=8 with the adaptive draft length")
    p.add_argument("--warmup", type=int, default=1, help="warm-up requests per profile, not counted (default 1)")
    p.add_argument("--seed", type=int, default=0, help="sample seed (same seed, same requests)")
    p.add_argument("--output-dir", default="out/demo", help="where the report and summaries go (default out/demo)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--tool-call-parser", default="auto", choices=["auto", "none", "hermes", "llama3_json"],
                   help="passed to the server: how tool calls are read from the model's output (auto: from the "
                        "chat template; the tool_call segment needs one)")
    p.add_argument("--server-timeout", type=float, default=600.0, help="seconds to wait for the server's /health")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _say(msg: str) -> None:
    print(f"[demo] {msg}", file=sys.stderr, flush=True)


# ---- step 1: the model ------------------------------------------------------------------------------------


def prepare_model(model_ref: str, progress: bool):
    """ModelFiles of a catalog name (pulled if missing, with a progress bar), a folder or a .gguf."""
    from specserve.hub import CATALOG, pull, resolve_model

    if model_ref.strip().lower() in CATALOG:
        return pull(model_ref.strip().lower(), progress=progress)
    return resolve_model(model_ref)


# ---- step 3: the benchmark preset (step 2, the server, is `specserve.bench.server_process`) ------------


def preset_samples(args):
    """(samples, sources, warm-up samples, where those come from) of the demo: `--num-prompts` per
    built-in segment, warm-up requests of at most 16 tokens that repeat no measured prompt, every
    request greedy and capped at --max-tokens."""
    from specserve.bench import datasets

    builtin = [n for n in datasets.parse_dataset_arg(args.segments) if n in datasets.SEGMENTS]
    samples, sources = datasets.load_samples(args.segments, args.num_prompts * max(len(builtin), 1), args.seed,
                                             args.max_tokens, args.max_prompt_chars)
    warm, warm_source = datasets.warmup_samples(args.segments, args.warmup, args.seed, min(args.max_tokens, 16),
                                                args.max_prompt_chars, samples)
    for s in samples + warm:  # the demo compares greedy outputs: every request is temperature 0
        s.temperature = 0.0
        s.max_tokens = min(s.max_tokens, args.max_tokens)
    return samples, sources, warm, warm_source


def preset_config(args, base_url: str, profiles: list[str], num_samples: int):
    """The bench runner's config for the demo (the options `specserve bench` would take as flags)."""
    from specserve.bench import runner

    return runner.BenchConfig(
        base_url=base_url + "/v1", dataset=args.segments, num_prompts=num_samples, seed=args.seed,
        max_tokens=args.max_tokens, max_prompt_chars=args.max_prompt_chars, concurrency=list(args.concurrency),
        profiles=profiles, warmup=args.warmup, progress=not args.no_progress,
        timeout_s=max(600.0, args.server_timeout))


# ---- the command ------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    """The `specserve demo` command. Returns the exit status: 0 ok; 1 the server or the benchmark failed,
    a request failed, or a greedy output differed from the baseline's; 2 a usage error."""
    import httpx

    from specserve.bench.runner import WarmupError
    from specserve.bench.server_process import ServerStartError
    from specserve.bench.wheels import DatasetUnavailable

    try:
        return _run(args)
    except DatasetUnavailable as e:
        print(f"specserve: error: {e}", file=sys.stderr)
        return 2
    except (ServerStartError, WarmupError, httpx.HTTPError) as e:
        print(f"specserve: error: demo failed: {type(e).__name__ + ': ' if isinstance(e, httpx.HTTPError) else ''}{e}",
              file=sys.stderr)
        return 1


def _profiles(args, out) -> tuple[str, object, list[str]]:
    """(profiles file path, ProfileSet, profile names with baseline first); a bad file fails here, before
    anything slow happens."""
    import json
    from pathlib import Path

    from specserve.rollout.profiles import BASELINE, load_profiles

    if args.profiles:
        path = str(Path(args.profiles).resolve())
    else:
        path = str((out / "profiles.json").resolve())
        Path(path).write_text(json.dumps(DEFAULT_PROFILES, indent=1) + "\n")
    pset = load_profiles(path)
    names = [BASELINE] + [n for n in pset.profiles if n != BASELINE]
    if len(names) < 2:
        raise ValueError(f"profiles file {args.profiles} has no speculative profile to compare with baseline")
    return path, pset, names


def _run(args: argparse.Namespace) -> int:
    import json
    import os
    import signal
    import time
    from pathlib import Path

    from specserve.bench import compare, report, runner
    from specserve.bench.server_process import ServerProcess

    if args.num_prompts < 1 or args.max_tokens < 1 or args.warmup < 0:
        raise ValueError("--num-prompts and --max-tokens must be >= 1, --warmup >= 0")
    t_start = time.perf_counter()
    load_before = os.getloadavg()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    profiles_path, pset, names = _profiles(args, out)
    samples, sources, warm, warm_source = preset_samples(args)

    _say(f"1/4 model {args.model}")
    t = time.perf_counter()
    files = prepare_model(args.model, not args.no_progress)
    timings["model_s"] = time.perf_counter() - t

    server = ServerProcess(["--model", str(files.path), "--profiles", profiles_path, "--allow-profile-override",
                            "--dtype", args.dtype, "--device", args.device, "--tool-call-parser", args.tool_call_parser,
                            "--max-num-seqs", str(max(2, max(args.concurrency))), "--log-level", "warning"],
                           out / "server.log")
    # Ctrl-C too: asyncio.run's own SIGINT handling only cancels the benchmark's task, and a cancellation
    # that lands inside httpx's read timeout (anyio) can come back as a timeout, recorded as one failed
    # request while the benchmark goes on (seen once in CI: the demo ran to its end after Ctrl-C).
    prev = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}

    def _interrupt(signum, frame):
        raise KeyboardInterrupt

    for s in prev:
        signal.signal(s, _interrupt)
    try:
        adaptive = any(p.spec_config is not None and p.spec_config.adaptive for p in pset.profiles.values())
        _say(f"2/4 starting the server with profiles {', '.join(names)} (log {out / 'server.log'})"
             + ("; the adaptive profiles' step cost is measured on the first start (15-35 s on 2 CPU cores, "
                "then cached)" if adaptive else "")
             + ("; on a CPU the first start also builds two C++ kernels (45-80 s on 2 cores, then cached)"
                if not args.device.startswith("cuda") else ""))
        t = time.perf_counter()
        server.start(args.server_timeout, "--server-timeout")
        timings["server_start_s"] = time.perf_counter() - t
        _say(f"server ready at {server.base_url} (pid {server.proc.pid}) in {timings['server_start_s']:.1f} s")

        n_req = len(samples) * len(names) * len(args.concurrency)
        _say(f"3/4 benchmark: {len(samples)} requests x {len(names)} profiles x concurrency "
             f"{','.join(map(str, args.concurrency))} = {n_req} requests (greedy, max_tokens {args.max_tokens}), "
             f"each profile after {len(warm)} warm-up request(s), not counted")
        t = time.perf_counter()
        cfg = preset_config(args, server.base_url, names, len(samples))
        summary, rows = runner.run_bench_sync(cfg, samples=samples, sources=sources, warm=warm, warm_source=warm_source)
        timings["bench_s"] = time.perf_counter() - t
    finally:
        t = time.perf_counter()
        server.stop()
        timings["server_stop_s"] = time.perf_counter() - t
        for s, h in prev.items():
            signal.signal(s, h)
        if server.proc is not None:
            how = {"SIGTERM": "graceful shutdown on SIGTERM", "SIGKILL": "killed: it ignored SIGTERM"}.get(
                server.stopped_by or "", f"it had exited with status {server.proc.returncode}")
            _say(f"server stopped (pid {server.proc.pid}, {how})")

    _say("4/4 results")
    report.save_run(out, summary, rows)
    timings["total_s"] = time.perf_counter() - t_start
    demo = {"schema": SCHEMA, "model": summary["model"], "model_path": str(files.path),
            "profiles": {n: (pset.profiles[n].spec_config.to_dict() if pset.profiles[n].spec_config else None) for n in names},
            "segments": [d["segment"] for d in sources], "num_prompts_per_segment": args.num_prompts,
            "num_requests_per_profile": len(samples), "max_tokens": args.max_tokens,
            "concurrency": list(args.concurrency), "seed": args.seed, "warmup_per_profile": len(warm),
            "rows": compare.profile_rows(summary, rows), "errors": sum(1 for r in rows if r.get("error")),
            "problems": summary["problems"], "warnings": summary["warnings"],
            "profile_mismatches": sum(r.get("profile_mismatches", 0) for r in summary["runs"]),
            "timings_s": {k: round(v, 2) for k, v in timings.items()},
            "load_avg": {"before": round(load_before[0], 2), "after": round(os.getloadavg()[0], 2),
                         "cpus": os.cpu_count()},
            "server": {"pid": server.proc.pid, "exit_status": server.proc.returncode, "base_url": server.base_url},
            "files": {"report": str(out / "report.html"), "summary": str(out / "summary.json"),
                      "requests": str(out / "requests.jsonl"), "demo": str(out / "demo.json"),
                      "server_log": str(out / "server.log"), "profiles": profiles_path}}
    status = print_results(demo)
    (out / "demo.json").write_text(json.dumps(demo, indent=1))
    sys.stdout.flush()
    print(json.dumps(demo))
    return status


def print_results(demo: dict) -> int:
    """Print the comparison table, the verdict lines, PROBLEM / WARNING lines and file paths; fills
    demo['greedy_match']. Returns 0, or 1 when a greedy output differed from baseline, a request failed
    or the run has another problem (`bench/checks.py`)."""
    from specserve.bench.console import cell, print_profile_table

    table, files, t = demo["rows"], demo["files"], demo["timings_s"]
    print_profile_table(table, f"specserve demo | {demo['model']} | {demo['num_requests_per_profile']} requests "
                               f"per profile, greedy, max_tokens {demo['max_tokens']}, prompts primed "
                               "(TTFT of cached prompts)")
    greedy = [r["greedy_match"] for r in table if r["segment"] == "all" and r["greedy_match"]]
    same, total = sum(g[0] for g in greedy), sum(g[1] for g in greedy)
    demo["greedy_match"] = {"identical": same, "compared": total, "ok": same == total and total > 0}
    for r in table:
        if r["segment"] == "all" and r["greedy_match"]:
            sp = r["speedup_tpot"]
            verdict = ("not comparable: see the WARNING lines" if r.get("comparable") is False else
                       f"{'faster' if (sp or 0) > 1 else 'not faster'} than baseline per output token")
            print(f"{r['load']} overall: {r['profile']} speedup {cell(sp, '{:.2f}x')} ({verdict}), tokens/s "
                  f"{cell(r['tokens_per_s_ratio'], '{:.2f}x')} baseline, mean acceptance length "
                  f"{cell(r['mean_acceptance_length'], '{:.2f}')}")
    print(f"greedy outputs identical to baseline: {same}/{total}")
    status = 0
    if not demo["greedy_match"]["ok"]:
        status = 1
        bad = [f"{r['profile']} {r['segment']} {r['greedy_match'][0]}/{r['greedy_match'][1]}" for r in table
               if r["segment"] != "all" and r["greedy_match"] and r["greedy_match"][0] != r["greedy_match"][1]]
        print(f"WARNING: greedy outputs differ from baseline on {total - same} of {total} requests "
              f"({'; '.join(bad) or 'nothing compared'}): speculation must be lossless; see {files['requests']}")
    for p in demo["problems"]:
        print(f"PROBLEM: {p['message']}")
    for w in demo["warnings"]:
        print(f"WARNING: {w['message']}")
    if demo["errors"] or demo["profile_mismatches"] or demo["problems"]:
        status = 1
        print(f"WARNING: {demo['errors']} request(s) failed and {demo['profile_mismatches']} were served by "
              f"another profile; see {files['requests']} and {files['server_log']}")
    la = demo["load_avg"]
    print(f"demo took {t['total_s']:.0f} s (model {t['model_s']:.0f} s, server start {t['server_start_s']:.0f} s, "
          f"benchmark {t['bench_s']:.0f} s); load average {la['before']:.1f} -> {la['after']:.1f} on {la['cpus']} CPUs")
    print(f"HTML report:  {files['report']}")
    print(f"JSON summary: {files['summary']} (per request: {files['requests']}; this demo: {files['demo']})")
    return status
