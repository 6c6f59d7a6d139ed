"""`specserve bench` arguments and handlers (hooked into `specserve/cli.py` by `_add_bench`).

`specserve bench [options]` runs a benchmark; `specserve bench compare A.json B.json` prints
per-segment ratios of two saved summaries; `specserve bench report summary.json` re-renders the
HTML. Only argparse is imported at module level, so `specserve --help` stays fast.
Output of a run: progress bar on stderr, console tables on stdout (then PROBLEM / WARNING lines: what
could mislead, see `checks.py`), then the JSON summary as the last stdout line; files `summary.json`,
`requests.jsonl` and `report.html` in `--output-dir`. Exit status: 0; 1 when the run has a problem
(failed requests unless --allow-errors, a profile no response confirmed unless
--allow-unverified-profile, a profile mismatch) or its warm-up failed; 2 for a usage error, an
unreachable server or a missing dataset.
"""
from __future__ import annotations

import argparse
import os
import sys


def csv_list(kind, minimum=None):
    """An argparse type: "1,4,16" -> [1, 4, 16] of `kind`; with `minimum`, a non-empty list of values >= it."""
    what = {int: "integers", float: "numbers"}.get(kind, f"{kind.__name__} values")

    def parse(s: str):
        try:
            out = [kind(x) for x in s.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {s!r}") from None
        if minimum is not None and (not out or min(out) < minimum):
            raise argparse.ArgumentTypeError(f"expected {what} >= {minimum}, got {s!r}")
        return out
    return parse


def parse_slo(s: str) -> dict:
    """'ttft:500,tpot:50' -> {'ttft': 500.0, 'tpot': 50.0} (ms); keys ttft, tpot, itl, e2e."""
    out = {}
    for part in filter(None, (p.strip() for p in s.split(","))):
        k, _, v = part.partition(":")
        if k not in ("ttft", "tpot", "itl", "e2e") or not v:
            raise argparse.ArgumentTypeError(f"bad SLO {part!r}: use ttft|tpot|itl|e2e:MS, e.g. ttft:500,tpot:50")
        out[k] = float(v)
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="OpenAI-compatible base URL (ends in /v1)")
    p.add_argument("--model", help="model name to send (default: the first of GET /v1/models)")
    p.add_argument("--dataset", default="all",
                   help="comma list of segments chat,code,tool_call,edit,summarize,creative; aliases sharegpt, "
                        "humaneval, bfcl, all; or a .jsonl path of {prompt|messages, segment, max_tokens}")
    p.add_argument("--num-prompts", type=int, default=60, help="requests per run, split evenly over the segments")
    p.add_argument("--seed", type=int, default=0, help="sample seed (same seed, same requests)")
    p.add_argument("--max-tokens", type=int, default=256,
                   help="cap on each request's max_tokens (built-in segments and .jsonl lines alike)")
    p.add_argument("--output-len", type=int, metavar="N",
                   help="fixed output length: every request's max_tokens = N (overrides the datasets' lengths and "
                        "--max-tokens; add --ignore-eos so that every request generates exactly N tokens)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="send ignore_eos (vLLM's field): generate to max_tokens, for throughput runs; requests "
                        "that still end early are reported as a WARNING")
    p.add_argument("--max-prompt-chars", type=int, default=3000,
                   help="longest chat/creative prompt taken (characters); summarize texts are 2/3 to 2x this")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=csv_list(int), help="closed loop, e.g. 1,4,16 (default 1)")
    load.add_argument("--request-rate", type=csv_list(float), help="open loop req/s, e.g. 2,8 or inf (gamma arrivals)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals (1 = Poisson)")
    p.add_argument("--max-concurrency", type=int, help="cap on requests in flight with --request-rate")
    p.add_argument("--profile", nargs="+", metavar="P",
                   help="server profiles to run, first = baseline (sent as the `profile` body field); each "
                        "response must name the profile that served it (x-specserve-profile header or "
                        "specserve.profile), see --allow-unverified-profile")
    p.add_argument("--profile-header", action="store_true", help="send the profile as x-specserve-profile instead")
    p.add_argument("--repeats", type=int, default=1, help="runs per (profile, load); the report shows the spread")
    p.add_argument("--warmup", type=int, default=2,
                   help="warm-up requests per profile, not counted; never a measured prompt (other samples of the "
                        "built-in segments, or short neutral prompts for a .jsonl dataset); a failed one stops the "
                        "run unless --allow-errors")
    p.add_argument("--no-prime", action="store_true",
                   help="do not send each run's prompts once (max_tokens 1, untimed) before the run; by default "
                        "they are, so every profile meets the prefix cache alike and TTFT is that of cached "
                        "prompts. Without priming the first run to send a prompt pays its prefill (a WARNING says so)")
    p.add_argument("--allow-errors", action="store_true",
                   help="accept failed requests (warm-up included): the run is still marked FAILED in every output "
                        "but exits 0")
    p.add_argument("--allow-unverified-profile", action="store_true",
                   help="with --profile: the server cannot report which profile served a request (e.g. vLLM, which "
                        "ignores the profile field and header): run anyway, marked UNVERIFIED in every output")
    p.add_argument("--slo", type=parse_slo, help="goodput SLOs in ms, e.g. ttft:500,tpot:50")
    p.add_argument("--logprobs", action="store_true",
                   help="ask for logprobs to count tokens per chunk exactly when the server sends no usage on "
                        "every chunk (stream_options.continuous_usage_stats); without either, per-token ITL is "
                        "an ESTIMATE")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    p.add_argument("--metrics-url", help="Prometheus URL (default: base URL's root + /metrics)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token (env OPENAI_API_KEY)")
    p.add_argument("--output-dir", help="where to write files (default bench-results/<UTC time>)")
    p.add_argument("--no-html", action="store_true", help="skip the HTML report")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    sub = p.add_subparsers(dest="bench_command", metavar="{compare,report}")
    sub.required = False
    c = sub.add_parser("compare", help="per-segment ratios of summary B vs summary A (the baseline)")
    c.add_argument("a", metavar="A.json")
    c.add_argument("b", metavar="B.json")
    c.add_argument("--json", action="store_true", help="print the comparison as JSON only")
    r = sub.add_parser("report", help="re-render report.html from a saved summary.json")
    r.add_argument("summary", metavar="summary.json")
    r.add_argument("-o", "--out", help="HTML path (default: report.html next to the summary)")


def _check_summary(path: str) -> None:
    """Raise a one-line ValueError unless `path` is a bench summary.json."""
    import json
    from pathlib import Path

    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{path}: no such file (give the summary.json a bench run wrote)")
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a JSON bench summary ({e})") from None
    if not isinstance(data, dict) or "groups" not in data:
        raise ValueError(f"{path}: not a bench summary.json (no 'groups'); give the summary.json a bench run wrote")


def run(args: argparse.Namespace) -> int:
    import json

    if args.bench_command == "compare":
        from specserve.bench import compare, console
        _check_summary(args.a)
        _check_summary(args.b)
        comps = compare.compare_files(args.a, args.b)
        if not comps:
            raise ValueError(f"{args.b} and {args.a} share no load to compare")
        if not args.json:
            console.print_comparisons(comps)
        print(json.dumps(comps))
        return 0
    if args.bench_command == "report":
        from pathlib import Path

        from specserve.bench import report
        _check_summary(args.summary)
        out = args.out or str(Path(args.summary).with_name("report.html"))
        report.load_and_write(args.summary, out)
        print(out)
        return 0
    return _run_bench(args)


def _run_bench(args: argparse.Namespace) -> int:
    import datetime as dt
    import json
    from pathlib import Path

    import httpx

    from specserve.bench import console, report, runner, wheels

    cfg = runner.BenchConfig(
        base_url=args.base_url, model=args.model, dataset=args.dataset, num_prompts=args.num_prompts, seed=args.seed,
        max_tokens=args.max_tokens, max_prompt_chars=args.max_prompt_chars,
        concurrency=args.concurrency or ([] if args.request_rate else [1]), request_rate=args.request_rate or [],
        burstiness=args.burstiness, max_concurrency=args.max_concurrency, profiles=args.profile or [None],
        profile_header=args.profile_header, repeats=args.repeats, warmup=args.warmup, slo=args.slo,
        logprobs=args.logprobs, timeout_s=args.timeout, metrics_url=args.metrics_url, api_key=args.api_key,
        progress=not args.no_progress, allow_errors=args.allow_errors,
        allow_unverified_profile=args.allow_unverified_profile, ignore_eos=args.ignore_eos, output_len=args.output_len,
        prime=not args.no_prime)
    if cfg.num_prompts < 1 or cfg.repeats < 1 or any(c < 1 for c in cfg.concurrency) or cfg.max_tokens < 1:
        raise ValueError("--num-prompts, --repeats, --concurrency and --max-tokens must be >= 1")
    if cfg.warmup < 0 or (cfg.output_len is not None and cfg.output_len < 1):
        raise ValueError("--warmup must be >= 0 and --output-len >= 1")
    out = Path(args.output_dir or f"bench-results/{dt.datetime.now(dt.timezone.utc):%Y%m%d-%H%M%S}")
    try:
        summary, rows = runner.run_bench_sync(cfg)
    except wheels.DatasetUnavailable as e:
        print(f"specserve: error: {e}", file=sys.stderr)
        return 2
    except httpx.HTTPError as e:
        print(f"specserve: error: cannot reach {cfg.base_url}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except runner.WarmupError as e:
        print(f"specserve: error: {e}", file=sys.stderr)
        return 1
    report.save_run(out, summary, rows, html=not args.no_html)
    console.print_summary(summary)
    print(f"wrote {out}/summary.json, requests.jsonl{'' if args.no_html else ', report.html'}", file=sys.stderr)
    sys.stdout.flush()
    print(json.dumps(summary))
    return 1 if summary["problems"] else 0
