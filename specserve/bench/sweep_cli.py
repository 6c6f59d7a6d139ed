"""`specserve sweep` arguments and handler (hooked into `specserve/cli.py` by `_add_sweep`).

Output: a progress bar on stderr, one table per segment on stdout, the recommendation lines, then
the result summary as JSON on the last stdout line; files in --output-dir: sweep.json (every run,
the table rows, the recommendations), recommended_profiles.json (a `serve --profiles` file),
table.txt and report.html. Only argparse is imported at module level.
"""
from __future__ import annotations

import argparse
import os
import sys

EPILOG = """examples:
  # one running server: profiles are added through its admin API, no restart
  specserve serve --model qwen2.5-coder-0.5b-instruct --admin-token T --allow-profile-override &
  specserve sweep --base-url http://127.0.0.1:8000/v1 --admin-token T --methods ngram,suffix --k 2,4,6,8 \\
      --concurrency 1,4 --segments code,edit,chat --num-prompts 4 --repeats 2

  # external servers, one per config (e.g. vLLM); {speculative_config_arg} is empty for the baseline
  specserve sweep --server-cmd 'python -m vllm.entrypoints.openai.api_server --model /models/qwen \\
      --port {port} {speculative_config_arg}' --methods ngram --k 2,4 --no-adaptive

Profiles are named baseline, <method>_k<k> and <method>_adaptive (num_speculative_tokens = the largest
--k, "num_speculative_tokens_schedule": "adaptive"). Speedup = baseline TPOT / profile TPOT in the same
repeat; the best is the profile with the highest median speedup. Each profile is compared with the
best in the same repeat (its speedup over the best's there), and the noise band is the largest relative
half-range of those ratios over repeats, (max - min) / 2 / median, at least --min-noise. Every profile
whose median ratio is at least 1 - band is as good as the best (listed in each "recommended for" line);
the recommendation per (segment, concurrency) is the smallest k among those whose median ratio is at
least 1 - band / 2 (the baseline has k = 0; an adaptive profile counts with its maximum k and wins a
tie of k against a constant one): a pick at the band's edge more often falls outside a re-run's band.
With --base-url, profiles more than --prune-margin below the best after the first repeat are not run
again in that (segment, concurrency) and are not recommended (off by default)."""


def _csv(kind):
    def parse(s: str):
        try:
            out = [kind(x) for x in s.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {kind.__name__}s, got {s!r}") from None
        if not out:
            raise argparse.ArgumentTypeError(f"expected at least one value, got {s!r}")
        return out
    return parse


def _json_obj(s: str) -> dict:
    import json

    try:
        d = json.loads(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(d, dict) or not all(isinstance(v, dict) for v in d.values()):
        raise argparse.ArgumentTypeError('expected {"method": {config key: value}}, e.g. {"ngram": {"prompt_lookup_min": 1}}')
    return d


def add_arguments(p: argparse.ArgumentParser) -> None:
    where = p.add_argument_group("servers (one of)")
    where.add_argument("--base-url", help="a running specserve server (ends in /v1); needs --admin-token and "
                                          "--allow-profile-override on the server")
    where.add_argument("--server-cmd", metavar="TEMPLATE",
                       help="shell command starting one server per profile, with {port}, {speculative_config} "
                            "and {speculative_config_arg} filled in (both empty for the baseline)")
    p.add_argument("--admin-token", default=os.environ.get("SPECSERVE_ADMIN_TOKEN"),
                   help="admin token of the --base-url server (env SPECSERVE_ADMIN_TOKEN)")
    p.add_argument("--server-timeout", type=float, default=600.0, help="seconds a --server-cmd server gets to start")
    p.add_argument("--model", help="model name to send (default: the first of GET /v1/models)")
    p.add_argument("--methods", type=_csv(str), default=["ngram", "suffix"], help="speculative methods (default ngram,suffix)")
    p.add_argument("--k", type=_csv(int), default=[2, 4, 6, 8], help="num_speculative_tokens values (default 2,4,6,8)")
    p.add_argument("--no-adaptive", action="store_true", help="leave out the <method>_adaptive profiles")
    p.add_argument("--method-options", type=_json_obj, default={},
                   help='extra config keys per method, JSON, e.g. \'{"ngram": {"prompt_lookup_min": 1}}\' '
                        "(default: ngram uses prompt_lookup_min 2, max 4, as the demo)")
    p.add_argument("--concurrency", type=_csv(int), default=[1, 4], help="closed-loop concurrency levels (default 1,4)")
    p.add_argument("--segments", default="code,edit,chat",
                   help="workload segments, as `bench --dataset` (default code,edit,chat); each runs on its own")
    p.add_argument("--num-prompts", type=int, default=4,
                   help="requests per run (one profile, segment, concurrency and repeat; default 4), raised to "
                        "--min-waves x the run's concurrency")
    p.add_argument("--min-waves", type=int, default=1,
                   help="each run sends at least this many requests per concurrent stream (default 1: a run at "
                        "concurrency 8 sends 8 requests, not 4; 2 steadies the runs at concurrency > 1)")
    p.add_argument("--max-tokens", type=int, default=64, help="cap on each request's max_tokens (default 64)")
    p.add_argument("--max-prompt-chars", type=int, default=1500, help="longest chat prompt taken (default 1500)")
    p.add_argument("--repeats", type=int, default=2, help="repeats; each draws fresh prompts (default 2)")
    p.add_argument("--seed", type=int, default=0, help="sample seed (same seed, same requests)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up requests per profile, not counted (default 1)")
    p.add_argument("--min-noise", type=float, default=0.02,
                   help="smallest noise band, a fraction of the best, in [0, 1) (default 0.02 = 2%%)")
    p.add_argument("--prune-margin", type=float, default=0.0,
                   help="with --base-url: after the first repeat of a (segment, concurrency), stop running the "
                        "profiles whose speedup is more than this fraction below the best there (default 0: off, "
                        "every profile runs in every repeat; one noisy repeat can cut the profile a re-run would "
                        "recommend; not with --server-cmd)")
    p.add_argument("--no-interleave", action="store_true",
                   help="with --base-url: at concurrency 1 run each profile's requests back to back instead of "
                        "taking turns request by request (the default, which spreads machine noise over all "
                        "profiles alike)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    p.add_argument("--output-dir", help="where to write files (default sweep-results/<UTC time>)")
    p.add_argument("--no-html", action="store_true", help="skip the HTML report")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    import datetime as dt
    import json
    from pathlib import Path

    import httpx

    from specserve.bench import sweep, sweep_report, wheels

    from specserve.bench.datasets import parse_dataset_arg

    cfg = sweep.SweepConfig(
        base_url=args.base_url, admin_token=args.admin_token, server_cmd=args.server_cmd,
        server_timeout_s=args.server_timeout, model=args.model, methods=args.methods, ks=args.k,
        adaptive=not args.no_adaptive, method_options=args.method_options, concurrency=args.concurrency,
        segments=parse_dataset_arg(args.segments), num_prompts=args.num_prompts, min_waves=args.min_waves,
        max_tokens=args.max_tokens,
        max_prompt_chars=args.max_prompt_chars, repeats=args.repeats, seed=args.seed, warmup=args.warmup,
        min_noise=args.min_noise, prune_margin=args.prune_margin, timeout_s=args.timeout, progress=not args.no_progress,
        interleave=not args.no_interleave)
    out = Path(args.output_dir or f"sweep-results/{dt.datetime.now(dt.timezone.utc):%Y%m%d-%H%M%S}")
    out.mkdir(parents=True, exist_ok=True)
    try:
        result = sweep.run_sweep(cfg, out)
    except (sweep.SweepError, wheels.DatasetUnavailable) as e:
        print(f"specserve: error: {e}", file=sys.stderr)
        return 2
    except httpx.HTTPError as e:
        print(f"specserve: error: cannot reach the server: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    files = {"result": str(out / "sweep.json"), "profiles": str(out / "recommended_profiles.json"),
             "table": str(out / "table.txt")}
    (out / "sweep.json").write_text(json.dumps(result, indent=1))
    (out / "recommended_profiles.json").write_text(json.dumps(result["recommended_profiles"], indent=1) + "\n")
    (out / "table.txt").write_text(sweep_report.table_text(result))
    if not args.no_html:
        files["report"] = str(out / "report.html")
        sweep_report.write_html(out / "report.html", result)
    sweep_report.print_table(result)
    print(f"wrote {', '.join(files.values())}", file=sys.stderr)
    sys.stdout.flush()
    print(json.dumps({"schema": result["schema"], "wall_s": result["wall_s"], "errors": result["errors"],
                      "recommendations": [{k: r[k] for k in ("segment", "concurrency", "profile", "speedup", "spread")}
                                          for r in result["recommendations"]],
                      "recommended_profiles": result["recommended_profiles"], "files": files}))
    return 1 if result["errors"] else 0
