"""The `specserve` command line: one `_add_<cmd>(subparsers)` + `_cmd_<cmd>(args) -> int` pair per subcommand.

To add a subcommand, write its pair (importing heavy modules inside the handler, so `specserve models`
stays fast) and append the `_add_` function to `_COMMANDS`. Errors that are the user's to fix
(ModelError, ConfigError, SamplingParamsError, ValueError) print one line, `specserve: error: ...`,
and exit with status 2; there is no traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable


def _human_size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


# ---- models ---------------------------------------------------------------------------------------------


def _add_models(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="list the catalog models, whether each is pulled, and where")
    p.set_defaults(func=_cmd_models)


def _cmd_models(args: argparse.Namespace) -> int:
    from specserve.hub import CATALOG, home, is_ready, model_dir

    rows = [("NAME", "ARCH", "QUANT", "GGUF SIZE", "PULLED", "PATH")]
    for e in CATALOG.values():
        ready = is_ready(model_dir(e.name))
        rows.append((e.name, e.arch, e.quant, _human_size(e.size), "yes" if ready else "no",
                     str(model_dir(e.name)) if ready else "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    print(f"\ncache: {home()} (set SPECSERVE_HOME to move it); pull one with `specserve pull NAME`")
    return 0


# ---- pull -----------------------------------------------------------------------------------------------


def _add_pull(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pull", help="download, verify and convert catalog models into the cache")
    p.add_argument("names", nargs="+", metavar="NAME", help="catalog model name(s); see `specserve models`")
    p.add_argument("--keep-gguf", action="store_true", help="keep the assembled .gguf in the cache's downloads/")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_pull)


def _cmd_pull(args: argparse.Namespace) -> int:
    from specserve.hub import pull
    from specserve.hub.pull import catalog_entry

    for name in args.names:  # check every name before fetching anything
        catalog_entry(name)
    for name in args.names:
        files = pull(name, progress=not args.quiet, keep_gguf=args.keep_gguf)
        print(f"{files.name}\t{files.path}")
    return 0


def add_cuda_arguments(p: argparse.ArgumentParser) -> None:
    """--enforce-eager and --batch-invariant (EngineConfig fields; CUDA only)."""
    p.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: run every step eagerly instead of replaying CUDA graphs captured at start-up")
    p.add_argument("--batch-invariant", action="store_true",
                   help="CUDA: fixed-order kernels, so greedy speculation is token-identical to the baseline in "
                        "bf16 too (slower; refused on the CPU)")


def _add_cpu_threads(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cpu-threads", type=int, default=None, metavar="N",
                   help="threads of the CPU forward, sampler and verifier (default: OMP_NUM_THREADS if set, "
                        "else every CPU this process may run on)")
    p.add_argument("--cpu-linear", default="auto", choices=["auto", "panel", "onednn", "torch"],
                   help="CPU linear layers: auto = for float32 the panel kernel (built once per machine with gcc; "
                        "fastest for decode and verify steps, a row's result the same alone and in a batch), "
                        "else oneDNN, else F.linear; panel = the panel kernel or an error; "
                        "onednn = prepacked oneDNN weights (also row independent) or an error; "
                        "torch = F.linear (MKL; faster for one row on some Intel CPUs, but there a row's result "
                        "depends on the batch, so speculation is not bit-exact)")


# ---- generate -------------------------------------------------------------------------------------------


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text offline for one prompt, streaming it to stdout")
    p.add_argument("--model", required=True, help="catalog name, Hugging Face folder or .gguf path")
    p.add_argument("--prompt", required=True, help="the prompt text (a user message with --chat)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--speculative-config", metavar="JSON", default=None,
                   help='vLLM keys, e.g. \'{"method":"ngram","num_speculative_tokens":4}\'')
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    add_cuda_arguments(p)
    _add_cpu_threads(p)
    p.set_defaults(func=_cmd_generate)


def _cmd_generate(args: argparse.Namespace) -> int:
    import time

    from specserve.config import EngineConfig, SpeculativeConfig
    from specserve.engine.llm_engine import LLMEngine
    from specserve.inputs import ChatPrompt, TextPrompt
    from specserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=args.stop)
    spec_config = SpeculativeConfig.from_json(args.speculative_config) if args.speculative_config else None
    engine = LLMEngine(EngineConfig(model=args.model, speculative_config=spec_config, max_model_len=args.max_model_len,
                                    dtype=args.dtype, device=args.device, enforce_eager=args.enforce_eager,
                                    batch_invariant=args.batch_invariant, cpu_threads=args.cpu_threads,
                                    cpu_linear=args.cpu_linear))
    if args.chat:
        msgs = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}]
        prompt = engine.encode(ChatPrompt(tuple(msgs)))
    else:
        prompt = engine.encode(TextPrompt(args.prompt))
    engine.add_request("cli", prompt, params)
    start = time.perf_counter()
    first = last = None
    n = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.new_token_ids and first is None:
                first = time.perf_counter()
            n += len(out.new_token_ids)
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
            last = out
    end = time.perf_counter()
    decode_s = end - (first or end)
    rate = (n - 1) / decode_s if n > 1 and decode_s > 0 else float("nan")
    line = (f"\n[{engine.model_name} on {engine.device}: {len(prompt)} prompt tokens, {n} output tokens, "
            f"finish={last.finish_reason}, TTFT {1000 * ((first or end) - start):.0f} ms, decode {rate:.1f} tokens/s")
    if spec_config is not None:
        acc = last.spec_stats.mean_acceptance_length
        k = f"k<={spec_config.num_speculative_tokens} adaptive" if spec_config.adaptive else f"k={spec_config.num_speculative_tokens}"
        line += f", {spec_config.method} {k}: mean acceptance length {acc:.2f}" if acc else f", {spec_config.method} {k}: no drafts"
        if spec_config.adaptive:
            counts = engine.adaptive.chosen_k.get(spec_config, [])
            steps = sum(counts)
            line += f", mean k {sum(k * n for k, n in enumerate(counts)) / steps:.2f} over {steps} steps" if steps else ""
    print(line + "]", file=sys.stderr)
    return 0


# ---- serve ----------------------------------------------------------------------------------------------


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the OpenAI-compatible server (speculation profiles, /metrics, admin API)")
    p.add_argument("--model", required=True, help="catalog name, Hugging Face folder or .gguf path")
    p.add_argument("--speculative-config", metavar="JSON",
                   help='default speculation, vLLM keys, e.g. \'{"method":"ngram","num_speculative_tokens":4}\' '
                        '(served as profile "default" with weight 1, next to "baseline")')
    p.add_argument("--profiles", metavar="FILE",
                   help='profiles file (JSON, or .toml): {"profiles": {name: config|null}, "weights": {name: w}}')
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-model-len", type=int, default=None, help="context length (prompt + output tokens)")
    p.add_argument("--max-num-seqs", type=int, default=16, help="most requests running at once")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one engine step")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="automatic prefix caching (vLLM's flag; on by default): a finished request's KV slot "
                        "keeps its tokens' keys/values and a new prompt sharing a prefix with them prefills "
                        "only the rest; --no-enable-prefix-caching prefills every prompt whole")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--seed", type=int, default=None,
                   help="seed for requests that give none (default: drawn at random at start-up and printed)")
    p.add_argument("--tool-call-parser", default="auto", choices=["auto", "none", "hermes", "llama3_json"],
                   help="how tool calls are read from the model's output (auto: from the chat template)")
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="per-request prompt limit in tokens (default: the context minus one output token)")
    p.add_argument("--watchdog-s", type=float, default=60.0,
                   help="/health turns 503 when requests are pending and no engine step finished for this "
                        "long (0 = off)")
    add_cuda_arguments(p)
    _add_cpu_threads(p)
    p.add_argument("--allow-profile-override", action="store_true",
                   help="let a request pick its profile (`profile` field or x-specserve-profile header); "
                        "without it such requests get 403")
    p.add_argument("--admin-token", default=None,
                   help="bearer token of the /admin API (or env SPECSERVE_ADMIN_TOKEN); without one it is off")
    p.add_argument("--request-log", metavar="PATH", help="append one JSON line per request to PATH")
    p.add_argument("--log-prompts", action="store_true", help="include prompt and output text in the request log")
    p.add_argument("--rollout-state", metavar="PATH",
                   help="staged-rollout state file, written atomically on every change and resumed at start-up "
                        "(without it a rollout lives in memory only)")
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests that may wait beyond --max-num-seqs before new ones get 503 + Retry-After")
    p.add_argument("--graceful-shutdown-s", type=float, default=30.0,
                   help="on SIGTERM / SIGINT: new requests get 503 at once; running ones get this long to finish, "
                        "then end with an error event (streams) or a 503 body")
    p.add_argument("--refresh-step-cost", action="store_true",
                   help="measure the target's step cost again instead of reading the cached measurement "
                        "(used by the adaptive schedule; see `specserve step-cost`)")
    p.add_argument("--adaptive-objective", default="throughput", choices=["throughput", "fair"],
                   help="what the adaptive schedule maximises each step: throughput (expected committed tokens "
                        "per ms of the step, default) or fair (the sum of log per-request token rates: one "
                        "request's drafts may not slow the others more than they gain)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=_cmd_serve)


def _cmd_serve(args: argparse.Namespace) -> int:
    from specserve.server.launcher import serve

    return serve(args)


# ---- step-cost ------------------------------------------------------------------------------------------


def _add_step_cost(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("step-cost", help="show (or measure) a model's step cost on this device: forward ms by "
                                         "tokens in the step, the numbers the adaptive schedule uses",
                       description="Print the measured forward time of one step by new tokens (one sequence) and "
                                   "by sequences, relative to a decode, as cached under $SPECSERVE_HOME/step_cost "
                                   "(measured now when absent or with --refresh). The last stdout line is JSON.")
    p.add_argument("--model", required=True, help="catalog name, Hugging Face folder or .gguf path")
    p.add_argument("--refresh", action="store_true", help="measure again even when a cached measurement exists")
    p.add_argument("--max-num-seqs", type=int, default=16, help="as `serve` (the grid of sequences measured)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="as `serve`")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    p.set_defaults(func=_cmd_step_cost)


def _cmd_step_cost(args: argparse.Namespace) -> int:
    import json

    from specserve.config import EngineConfig
    from specserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                                    max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                                    max_num_batched_tokens=args.max_num_batched_tokens))
    cm = engine.step_cost(refresh=args.refresh)
    base = cm.forward_ms(1)
    print(f"{engine.model_name} on {engine.device} ({cm.meta.get('dtype')}, {cm.meta.get('threads')} threads), "
          f"context {cm.meta.get('context')} tokens, {cm.meta.get('repeats')} rounds; cache {cm.meta.get('cache')}"
          + (f" (not cached: measured while the machine was busy, {cm.meta['busy']})" if cm.meta.get("busy") else ""))
    print(f"{'new tokens':>10} {'ms':>9} {'x decode':>9}")
    for t, ms in zip(cm.tokens, cm.token_ms):
        print(f"{t:>10} {ms:>9.1f} {ms / base:>9.2f}")
    print(f"{'sequences':>10} {'extra ms':>9}")
    for b, ms in zip(cm.seqs, cm.seq_extra_ms):
        print(f"{b:>10} {ms:>9.1f}")
    sys.stdout.flush()
    print(json.dumps(cm.to_dict()))
    return 0


# ---- bench ----------------------------------------------------------------------------------------------


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from specserve.bench.cli import add_arguments  # argparse only; the heavy imports happen in the handler

    p = sub.add_parser("bench", help="benchmark an OpenAI-compatible server on real workload segments "
                                     "(`bench compare A.json B.json`, `bench report summary.json`)")
    add_arguments(p)
    p.set_defaults(func=_cmd_bench)


def _cmd_bench(args: argparse.Namespace) -> int:
    from specserve.bench.cli import run

    return run(args)


# ---- sweep ----------------------------------------------------------------------------------------------


def _add_sweep(sub: argparse._SubParsersAction) -> None:
    from specserve.bench.sweep_cli import EPILOG, add_arguments  # argparse only

    p = sub.add_parser("sweep", help="benchmark methods x k (and adaptive) x concurrency x segments and recommend "
                                     "a profile per segment and concurrency",
                       description="Run the benchmark over speculative methods x num_speculative_tokens (and the "
                                   "adaptive schedule) x concurrency x workload segments against one running "
                                   "specserve server (profiles added through its admin API) or against external "
                                   "servers started from a command template; repeat with rotated order; report "
                                   "median and spread of the TPOT speedup; recommend per (segment, concurrency) the "
                                   "profile with the smallest k within half the noise band of the best. Writes sweep.json, "
                                   "recommended_profiles.json, table.txt and report.html; the last stdout line is JSON.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=_cmd_sweep)


def _cmd_sweep(args: argparse.Namespace) -> int:
    from specserve.bench.sweep_cli import run

    return run(args)


# ---- demo -----------------------------------------------------------------------------------------------


def _add_demo(sub: argparse._SubParsersAction) -> None:
    from specserve.demo import add_arguments  # argparse only; the heavy imports happen in the handler

    p = sub.add_parser("demo", help="the one-command tour: pull a model, serve baseline + speculative profiles, "
                                    "benchmark them on real workload segments, print the comparison, write a report",
                       description="Pull the model (if needed), start `specserve serve` with profiles baseline, "
                                   "ngram_adaptive and suffix_adaptive (adaptive draft length, up to 8) on 127.0.0.1, benchmark them on a small mixed sample of real "
                                   "segments (the same greedy requests for each), print speedup, acceptance and "
                                   "whether greedy outputs matched baseline, write report.html and summary.json, and "
                                   "stop the server. The last stdout line is the demo summary as JSON.")
    add_arguments(p)
    p.set_defaults(func=_cmd_demo)


def _cmd_demo(args: argparse.Namespace) -> int:
    from specserve.demo import run

    return run(args)


# ---- rollout --------------------------------------------------------------------------------------------


def _add_rollout(sub: argparse._SubParsersAction) -> None:
    from specserve.rollout.cli import add_arguments  # argparse only

    p = sub.add_parser("rollout", help="staged rollout of a profile on a server or gateway: "
                                       "start|status|pause|resume|promote|rollback (token: SPECSERVE_ADMIN_TOKEN)")
    add_arguments(p)
    p.set_defaults(func=_cmd_rollout)


def _cmd_rollout(args: argparse.Namespace) -> int:
    from specserve.rollout.cli import run

    return run(args)


# ---- gateway --------------------------------------------------------------------------------------------


def _add_gateway(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("gateway", help="OpenAI-compatible gateway over a fleet of specserve / vLLM / OpenAI-compatible "
                                       "servers: weights, sticky users, health checks, retries, staged rollouts")
    p.add_argument("--config", required=True, metavar="FILE", help="fleet file (YAML or JSON), see docs/gateway.md")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=_cmd_gateway)


def _cmd_gateway(args: argparse.Namespace) -> int:
    from specserve.gateway.app import serve

    return serve(args)


# ---- main -----------------------------------------------------------------------------------------------

_COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _add_models, _add_pull, _add_generate, _add_serve, _add_step_cost, _add_bench, _add_sweep, _add_demo,
    _add_rollout, _add_gateway,
]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every registered subcommand."""
    from specserve import __version__

    parser = argparse.ArgumentParser(prog="specserve", description="LLM inference server with speculative decoding")
    parser.add_argument("--version", action="version", version=f"specserve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in _COMMANDS:
        add(sub)
    return parser


def _user_errors() -> tuple[type[BaseException], ...]:
    from specserve.config import ConfigError
    from specserve.hub import ModelError
    from specserve.sampling_params import SamplingParamsError

    return (ModelError, ConfigError, SamplingParamsError, ValueError)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI. Returns the exit status: 0 ok, 2 usage or user error (one line on stderr), 130 interrupted."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("specserve: interrupted", file=sys.stderr)
        return 130
    except _user_errors() as e:
        msg = " ".join(str(e).split()) or type(e).__name__
        print(f"specserve: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
