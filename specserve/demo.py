"""`specserve demo`: the first command a new user runs (`bash scripts/demo.sh` sets up, then calls it).

What it does, in four steps: (1) pulls the model unless it is already in the cache (a catalog name;
a local model folder or .gguf also works); (2) starts `specserve serve` as a child process on
127.0.0.1 and a free port, with the profiles `baseline`, `ngram_4` and `suffix` (or `--profiles FILE`)
and profile override allowed, and waits for /health; (3) runs the bench runner on a small mixed sample
of the real workload segments, the same greedy requests for every profile, after a short warm-up that
is not counted; (4) prints, per segment and overall, each profile's speed against the baseline
(TPOT and tokens/s ratios), its acceptance, and whether its greedy outputs matched the baseline's
(a WARNING line when not), writes `summary.json`, `requests.jsonl`, `report.html` and `demo.json` to
`--output-dir`, and prints the demo summary as the last stdout line. The server is stopped on every
exit path: normal end, error, Ctrl-C, SIGTERM; it also dies with us if we are killed (PDEATHSIG).
What it does not do: tune anything (see `specserve bench` for the full set of knobs) or keep the server.
Only argparse is imported at module level, so `specserve --help` stays fast.
"""
from __future__ import annotations

import argparse
import sys

DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct"
DEFAULT_SEGMENTS = "code,edit,chat,summarize,tool_call"
DEFAULT_PROFILES = {
    "profiles": {
        "baseline": None,
        "ngram_4": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
        "suffix": {"method": "suffix", "num_speculative_tokens": 8},
    },
    "weights": {"baseline": 1},
}
SCHEMA = "specserve.demo/1"


class DemoError(RuntimeError):
    """The demo cannot go on (the server did not start, the benchmark failed); the message says why."""


def _csv_ints(s: str) -> list[int]:
    try:
        out = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {s!r}")
    return out


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
    p.add_argument("--concurrency", type=_csv_ints, default=[1], help="closed-loop concurrency, e.g. 1,4 (default 1)")
    p.add_argument("--profiles", metavar="FILE",
                   help='profiles file as `serve --profiles` ({"profiles": {name: config|null}}); '
                        "default: baseline, ngram_4 (ngram k=4, lookup 2-4) and suffix (SuffixDecoding k=8)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up requests per profile, not counted (default 1)")
    p.add_argument("--seed", type=int, default=0, help="sample seed (same seed, same requests)")
    p.add_argument("--output-dir", default="out/demo", help="where the report and summaries go (default out/demo)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
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


# ---- step 2: the server -------------------------------------------------------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child between fork and exec (Linux: PR_SET_PDEATHSIG)
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))
    except (OSError, AttributeError):
        pass


class ServerProcess:
    """`specserve serve` as a child process in its own session; `stop()` ends it and anything it spawned."""

    def __init__(self, model_path: str, profiles_path: str, log_path, *, dtype: str, device: str,
                 max_num_seqs: int):
        self.argv = [sys.executable, "-m", "specserve.cli", "serve", "--model", model_path, "--profiles", profiles_path,
                     "--allow-profile-override", "--host", "127.0.0.1", "--dtype", dtype, "--device", device,
                     "--max-num-seqs", str(max_num_seqs), "--log-level", "warning"]
        self.log_path = log_path
        self.proc = None
        self.port: int | None = None
        self.stopped_by: str | None = None  # "SIGTERM" (graceful), "SIGKILL", or None (it had exited)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _log_tail(self, n: int = 1500) -> str:
        try:
            return open(self.log_path, errors="replace").read()[-n:].strip()
        except OSError:
            return ""

    def start(self, timeout_s: float) -> "ServerProcess":
        """Start and wait for /health; retries on a new port if the chosen one was taken meanwhile."""
        for _attempt in range(3):
            if self._start_once(timeout_s):
                return self
        raise DemoError(f"server could not bind a free port; log tail:\n{self._log_tail()}")

    def _start_once(self, timeout_s: float) -> bool:
        import os
        import subprocess
        import time

        import httpx

        self.port = _free_port()
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen([*self.argv, "--port", str(self.port)], stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                         preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                tail = self._log_tail()
                if "address already in use" in tail.lower():
                    return False
                raise DemoError(f"the server exited with status {self.proc.returncode} while starting "
                                f"(log {self.log_path}):\n{tail}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise DemoError(f"the server did not answer /health within {timeout_s:.0f} s "
                                f"(--server-timeout); log {self.log_path}:\n{self._log_tail()}")
            time.sleep(0.25)

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM the server's process group (uvicorn shuts down gracefully), SIGKILL it if it lingers."""
        import os
        import signal
        import subprocess

        if self.proc is None:
            return
        for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
            if self.proc.returncode is not None:  # reaped: its pid may belong to someone else now
                return
            try:
                os.killpg(self.proc.pid, sig)  # start_new_session: the server leads its own group
            except ProcessLookupError:
                pass
            self.stopped_by = sig.name
            try:
                self.proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                continue


# ---- step 3: the benchmark ----------------------------------------------------------------------------------


async def _bench(cfg, samples, sources, warm, profiles: list[str]):
    import httpx

    from specserve.bench import client as bclient
    from specserve.bench import runner

    if warm:
        async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout_s, connect=30.0)) as cl:
            model = await runner.discover_model(cl, cfg.base_url)
            for p in profiles:
                _say(f"warm-up {p} ({len(warm)} request(s), not counted)")
                recs, _ = await bclient.run_load(cl, cfg.base_url, warm, model, concurrency=1, profile=p)
                bad = [r.error for r in recs if r.error]
                if bad:
                    raise DemoError(f"warm-up request to profile {p} failed: {bad[0]}")
    return await runner.run_bench(cfg, samples, sources)


def _samples(args, segments: str):
    from specserve.bench import datasets

    names = datasets.parse_dataset_arg(segments)
    n_builtin = sum(1 for n in names if n in datasets.SEGMENTS)
    samples, sources = datasets.load_samples(segments, args.num_prompts * max(n_builtin, 1), args.seed,
                                             args.max_tokens, args.max_prompt_chars)
    warm_segs = ",".join(n for n in names if n in datasets.SEGMENTS) or segments
    warm, _ = datasets.load_samples(warm_segs, args.warmup, args.seed + 1_000_003, min(args.max_tokens, 16),
                                    args.max_prompt_chars) if args.warmup > 0 else ([], [])
    for s in samples + warm:  # the demo compares greedy outputs: every request is temperature 0
        s.temperature = 0.0
        s.max_tokens = min(s.max_tokens, args.max_tokens)
    return samples, sources, warm


# ---- step 4: the comparison ---------------------------------------------------------------------------------


def _rate(rows: list[dict]) -> float | None:
    """Output tokens / summed request time (send to last token), over successful requests: the speed one
    request sees (equals throughput at concurrency 1, and is not diluted by other segments' requests)."""
    ok = [r for r in rows if not r.get("error") and r.get("chunks")]
    secs = sum(r["chunks"][-1][0] for r in ok) / 1000
    toks = sum(r.get("output_tokens") or 0 for r in ok)
    return toks / secs if secs > 0 else None


def _div(a, b):
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def _int(x):
    return int(x) if isinstance(x, float) and x.is_integer() else x


def comparison_rows(summary: dict, rows: list[dict]) -> list[dict]:
    """One row per (load, segment incl. 'all', profile): TPOT, tok/s, both ratios, acceptance, greedy match."""
    groups = summary["groups"]
    base = groups[0]["profile"]
    comps = {(c["candidate"], c["load"]): c for c in summary.get("comparisons") or []}
    out = []
    for load in dict.fromkeys(g["load"] for g in groups):
        gs = [g for g in groups if g["load"] == load]
        segs = list(dict.fromkeys(s for g in gs for s in g["segments"])) + ["all"]
        for seg in segs:
            brows = [r for r in rows if r["profile"] == base and r["load"] == load and r.get("repeat", 0) == 0
                     and (seg == "all" or r["segment"] == seg)]
            base_m = gs[0]["overall"] if seg == "all" else gs[0]["segments"].get(seg, {})
            base_rate = _rate(brows)
            for g in gs:
                m = g["overall"] if seg == "all" else g["segments"].get(seg)
                if m is None:
                    continue
                prow = [r for r in rows if r["profile"] == g["profile"] and r["load"] == load
                        and r.get("repeat", 0) == 0 and (seg == "all" or r["segment"] == seg)]
                rate = _rate(prow)
                c = comps.get((g["profile"], load))
                cm = (c["overall"] if seg == "all" else c["segments"].get(seg, {})) if c else {}
                is_base = g["profile"] == base
                out.append({
                    "load": load, "segment": seg, "profile": g["profile"], "requests": _int(m.get("num_requests")),
                    "errors": _int(m.get("num_errors")), "output_tokens": _int(m.get("output_tokens")),
                    "tpot_ms": m.get("tpot_ms_agg"), "tokens_per_s": rate,
                    "speedup_tpot": None if is_base else _div(base_m.get("tpot_ms_agg"), m.get("tpot_ms_agg")),
                    "tokens_per_s_ratio": None if is_base else _div(rate, base_rate),
                    "acceptance_rate": m.get("acceptance_rate"),
                    "mean_acceptance_length": m.get("mean_acceptance_length"),
                    "greedy_match": None if is_base else cm.get("greedy_match"),
                })
    return out


def _f(v, fmt: str) -> str:
    return "-" if not isinstance(v, (int, float)) else fmt.format(v)


def print_table(rows: list[dict], title: str, file=None) -> None:
    from rich.console import Console
    from rich.table import Table

    file = file or sys.stdout
    con = Console(file=file, width=None if file.isatty() else 140, highlight=False)
    loads = list(dict.fromkeys(r["load"] for r in rows))
    for load in loads:
        t = Table(title=f"{title} | {load}", title_justify="left")
        for col in ("segment", "profile", "req", "TPOT ms", "speedup", "tok/s", "tok/s ratio", "acc.len",
                    "accept", "greedy same"):
            t.add_column(col, justify="left" if col in ("segment", "profile") else "right")
        lrows = [r for r in rows if r["load"] == load]
        for i, r in enumerate(lrows):
            gm = r["greedy_match"]
            last = i + 1 == len(lrows) or lrows[i + 1]["segment"] != r["segment"]
            t.add_row(r["segment"], r["profile"], _f(r["requests"], "{:.0f}"), _f(r["tpot_ms"], "{:.1f}"),
                      _f(r["speedup_tpot"], "{:.2f}x"), _f(r["tokens_per_s"], "{:.2f}"),
                      _f(r["tokens_per_s_ratio"], "{:.2f}x"), _f(r["mean_acceptance_length"], "{:.2f}"),
                      _f(r["acceptance_rate"], "{:.2f}"), f"{gm[0]}/{gm[1]}" if gm else "-",
                      style="bold" if r["segment"] == "all" else None, end_section=last)
        con.print(t)
    con.print("speedup = baseline TPOT / profile TPOT (decode time per output token, token-weighted; > 1 = faster); "
              "tok/s = output tokens / summed request time (incl. TTFT), ratio vs baseline; acc.len = mean "
              "acceptance length = 1 + accepted / drafts; accept = accepted / drafted tokens; greedy same = "
              "outputs identical to baseline / compared.", soft_wrap=False)


# ---- the command ------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    """The `specserve demo` command. Returns the exit status: 0 ok; 1 the server or the benchmark failed,
    a request failed, or a greedy output differed from the baseline's; 2 a usage error."""
    import httpx

    from specserve.bench.wheels import DatasetUnavailable

    try:
        return _run(args)
    except DatasetUnavailable as e:
        print(f"specserve: error: {e}", file=sys.stderr)
        return 2
    except (DemoError, httpx.HTTPError) as e:
        print(f"specserve: error: demo failed: {type(e).__name__ + ': ' if isinstance(e, httpx.HTTPError) else ''}{e}",
              file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    import json
    import os
    import signal
    import time
    from pathlib import Path

    from specserve.bench import report, runner
    from specserve.rollout.profiles import BASELINE, load_profiles

    if args.num_prompts < 1 or args.max_tokens < 1 or args.warmup < 0:
        raise ValueError("--num-prompts and --max-tokens must be >= 1, --warmup >= 0")
    t_start = time.perf_counter()
    load_before = os.getloadavg()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    progress = not args.no_progress
    timings: dict[str, float] = {}

    # profiles first: a bad file fails before anything slow happens
    if args.profiles:
        pset = load_profiles(args.profiles)
        profiles_path = str(Path(args.profiles).resolve())
    else:
        profiles_path = str((out / "profiles.json").resolve())
        Path(profiles_path).write_text(json.dumps(DEFAULT_PROFILES, indent=1) + "\n")
        pset = load_profiles(profiles_path)
    names = [BASELINE] + [n for n in pset.profiles if n != BASELINE]
    if len(names) < 2:
        raise ValueError(f"profiles file {args.profiles} has no speculative profile to compare with baseline")
    samples, sources, warm = _samples(args, args.segments)

    _say(f"1/4 model {args.model}")
    t = time.perf_counter()
    files = prepare_model(args.model, progress)
    timings["model_s"] = time.perf_counter() - t

    server = ServerProcess(str(files.path), profiles_path, out / "server.log", dtype=args.dtype, device=args.device,
                           max_num_seqs=max(2, max(args.concurrency)))
    prev = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}

    def _interrupt(signum, frame):
        raise KeyboardInterrupt

    for s in prev:
        signal.signal(s, _interrupt)
    try:
        _say(f"2/4 starting the server with profiles {', '.join(names)} (log {out / 'server.log'})")
        t = time.perf_counter()
        server.start(args.server_timeout)
        timings["server_start_s"] = time.perf_counter() - t
        _say(f"server ready at {server.base_url} (pid {server.proc.pid}) in {timings['server_start_s']:.1f} s")

        n_req = len(samples) * len(names) * len(args.concurrency)
        _say(f"3/4 benchmark: {len(samples)} requests x {len(names)} profiles x concurrency "
             f"{','.join(map(str, args.concurrency))} = {n_req} requests (greedy, max_tokens {args.max_tokens})")
        cfg = runner.BenchConfig(
            base_url=server.base_url + "/v1", dataset=args.segments, num_prompts=len(samples), seed=args.seed,
            max_tokens=args.max_tokens, max_prompt_chars=args.max_prompt_chars, concurrency=list(args.concurrency),
            profiles=names, warmup=0, progress=progress, timeout_s=max(600.0, args.server_timeout))
        import asyncio
        t = time.perf_counter()
        summary, rows = asyncio.run(_bench(cfg, samples, sources, warm, names))
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
    summary["config"]["warmup"] = args.warmup
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    with open(out / "requests.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    report.write(out / "report.html", summary, rows)
    timings["total_s"] = time.perf_counter() - t_start
    demo = {"schema": SCHEMA, "model": summary["model"], "model_path": str(files.path),
            "profiles": {n: (pset.profiles[n].spec_config.to_dict() if pset.profiles[n].spec_config else None) for n in names},
            "segments": [d["segment"] for d in sources], "num_prompts_per_segment": args.num_prompts,
            "num_requests_per_profile": len(samples), "max_tokens": args.max_tokens,
            "concurrency": list(args.concurrency), "seed": args.seed, "warmup_per_profile": len(warm),
            "rows": comparison_rows(summary, rows), "errors": sum(1 for r in rows if r.get("error")),
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
    """Print the comparison table, the verdict lines, WARNINGs and file paths; fills demo['greedy_match'].
    Returns 0, or 1 when a greedy output differed from baseline or a request failed."""
    table, files, t = demo["rows"], demo["files"], demo["timings_s"]
    print_table(table, f"specserve demo | {demo['model']} | {demo['num_requests_per_profile']} requests per "
                       f"profile, greedy, max_tokens {demo['max_tokens']}")
    greedy = [r["greedy_match"] for r in table if r["segment"] == "all" and r["greedy_match"]]
    same, total = sum(g[0] for g in greedy), sum(g[1] for g in greedy)
    demo["greedy_match"] = {"identical": same, "compared": total, "ok": same == total and total > 0}
    for r in table:
        if r["segment"] == "all" and r["greedy_match"]:
            sp = r["speedup_tpot"]
            print(f"{r['load']} overall: {r['profile']} speedup {_f(sp, '{:.2f}x')} "
                  f"({'faster' if (sp or 0) > 1 else 'not faster'} than baseline per output token), tokens/s "
                  f"{_f(r['tokens_per_s_ratio'], '{:.2f}x')} baseline, mean acceptance length "
                  f"{_f(r['mean_acceptance_length'], '{:.2f}')}")
    print(f"greedy outputs identical to baseline: {same}/{total}")
    status = 0
    if not demo["greedy_match"]["ok"]:
        status = 1
        bad = [f"{r['profile']} {r['segment']} {r['greedy_match'][0]}/{r['greedy_match'][1]}" for r in table
               if r["segment"] != "all" and r["greedy_match"] and r["greedy_match"][0] != r["greedy_match"][1]]
        print(f"WARNING: greedy outputs differ from baseline on {total - same} of {total} requests "
              f"({'; '.join(bad) or 'nothing compared'}): speculation must be lossless; see {files['requests']}")
    if demo["errors"] or demo["profile_mismatches"]:
        status = 1
        print(f"WARNING: {demo['errors']} request(s) failed and {demo['profile_mismatches']} were served by "
              f"another profile; see {files['requests']} and {files['server_log']}")
    la = demo["load_avg"]
    print(f"demo took {t['total_s']:.0f} s (model {t['model_s']:.0f} s, server start {t['server_start_s']:.0f} s, "
          f"benchmark {t['bench_s']:.0f} s); load average {la['before']:.1f} -> {la['after']:.1f} on {la['cpus']} CPUs")
    print(f"HTML report:  {files['report']}")
    print(f"JSON summary: {files['summary']} (per request: {files['requests']}; this demo: {files['demo']})")
    return status
