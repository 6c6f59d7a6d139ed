"""Cost of structured output per token: decode ms/token with and without a json_schema grammar, with and
without n-gram speculation, batch 1 and 4, on the CPU (docs/structured-output.md).

Every condition runs the same chat prompts greedily through the engine (`LLMEngine.step` timed per
step); decode ms/token = time of the steps without prefill / tokens they committed. The grammar's own
host work is timed inside the same steps: the row masks (`GrammarState.fill_rows`, drafts walked and
rolled back), applying them to the logits (`apply_grammar`) and advancing by committed tokens
(`GrammarState.accept`), reported per committed token. Conditions run in rotating order, `--repeats`
times; medians. With and without a grammar the model writes different text (JSON vs prose), so the
ms/token columns compare the step cost, and the grammar column is the part that is the grammar's.

    python benchmarks/grammar_cost.py --threads 1 --out docs/benchmarks
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from contextlib import contextmanager
from pathlib import Path

import torch

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city", "tags"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "city": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"},
                                                              "maxItems": 4}}}
PROMPTS = ["Describe a fictional person as JSON with name, age, city and tags.",
           "Give me a JSON record for a customer: name, age, city, tags.",
           "Make up a user profile in JSON (name, age, city, tags).",
           "Return JSON describing a chess player: name, age, city, tags."]


class _Timers:
    """Wall time (s) spent in the grammar's host functions, patched in for the run."""

    def __init__(self):
        self.fill = self.apply = self.accept = 0.0

    @contextmanager
    def installed(self):
        from specserve.grammar import matcher
        from specserve.sample import verifier

        orig = (matcher.GrammarState.fill_rows, matcher.GrammarState.accept, verifier.apply_grammar)

        def timed(name, fn):
            def wrapper(*a, **kw):
                t0 = time.perf_counter()
                try:
                    return fn(*a, **kw)
                finally:
                    setattr(self, name, getattr(self, name) + time.perf_counter() - t0)
            return wrapper

        matcher.GrammarState.fill_rows = timed("fill", orig[0])
        matcher.GrammarState.accept = timed("accept", orig[1])
        verifier.apply_grammar = timed("apply", orig[2])
        try:
            yield self
        finally:
            matcher.GrammarState.fill_rows, matcher.GrammarState.accept, verifier.apply_grammar = orig


def run_once(llm, batch: int, grammar: bool, spec, max_tokens: int) -> dict:
    from specserve.inputs import ChatPrompt
    from specserve.sampling_params import SamplingParams, StructuredOutputsParams

    eng = llm.engine
    so = StructuredOutputsParams(json=SCHEMA) if grammar else None
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=so)
    for i in range(batch):
        eng.add_request(f"b{time.monotonic_ns()}-{i}", ChatPrompt(({"role": "user", "content": PROMPTS[i % 4]},)), sp,
                        speculative_config=spec)
    timers = _Timers()
    decode_s, decode_tokens, drafts, accepted = 0.0, 0, 0, 0
    with timers.installed():
        while eng.has_unfinished_requests():
            decoding = not eng.scheduler.waiting and all(not r.in_prefill for r in eng.scheduler.running)
            before = (timers.fill, timers.apply, timers.accept)
            t0 = time.perf_counter()
            outs = eng.step()
            dt = time.perf_counter() - t0
            if decoding:
                decode_s += dt
                decode_tokens += sum(len(o.new_token_ids) for o in outs)
            else:  # the grammar's share of prefill steps is not a decode cost
                timers.fill, timers.apply, timers.accept = before
            for o in outs:
                if o.finished:
                    drafts += o.spec_stats.num_draft_tokens
                    accepted += o.spec_stats.num_accepted_tokens
    g = timers.fill + timers.apply + timers.accept
    return {"decode_ms_per_token": 1e3 * decode_s / max(decode_tokens, 1), "decode_tokens": decode_tokens,
            "grammar_ms_per_token": 1e3 * g / max(decode_tokens, 1),
            "grammar_fill_ms_per_token": 1e3 * timers.fill / max(decode_tokens, 1),
            "grammar_apply_ms_per_token": 1e3 * timers.apply / max(decode_tokens, 1),
            "grammar_accept_ms_per_token": 1e3 * timers.accept / max(decode_tokens, 1),
            "acceptance_rate": accepted / drafts if drafts else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--out", default=None, help="folder for grammar_cost.json and grammar_cost.md")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from specserve import LLM
    from specserve.config import SpeculativeConfig
    from specserve.sampling_params import StructuredOutputsParams

    llm = LLM(args.model, dtype="float32", device="cpu", max_model_len=1024, max_num_seqs=4)
    t0 = time.perf_counter()
    llm.engine.grammar_compiler.compile(StructuredOutputsParams(json=SCHEMA))
    setup_s = time.perf_counter() - t0
    ngram = SpeculativeConfig("ngram", 4, prompt_lookup_min=2, prompt_lookup_max=4)
    conds = [(b, g, name, spec) for b in (1, 4) for name, spec in (("none", None), ("ngram_k4", ngram))
             for g in (False, True)]
    run_once(llm, 1, True, None, 8)  # warm-up
    results: dict[str, list[dict]] = {}
    for rep in range(args.repeats):
        order = conds[rep % len(conds):] + conds[: rep % len(conds)]
        for b, g, name, spec in order:
            key = f"batch{b}/{name}/{'json_schema' if g else 'free'}"
            results.setdefault(key, []).append(run_once(llm, b, g, spec, args.max_tokens))
            print(key, {k: round(v, 3) if isinstance(v, float) else v for k, v in results[key][-1].items()}, flush=True)
    summary = {}
    for key, runs in results.items():
        summary[key] = {k: (statistics.median(r[k] for r in runs) if runs[0][k] is not None else None)
                        for k in runs[0]}
    out = {"model": args.model, "device": "cpu", "dtype": "float32", "threads": torch.get_num_threads(),
           "max_tokens": args.max_tokens, "repeats": args.repeats, "machine": platform.processor() or platform.machine(),
           "grammar_compiler_setup_and_first_compile_s": setup_s, "schema": SCHEMA, "results": summary}
    lines = ["# Structured output: cost per token (benchmarks/grammar_cost.py)", "",
             f"{args.model}, CPU fp32, {out['threads']} thread(s), greedy, max_tokens {args.max_tokens}, median of "
             f"{args.repeats} rotating runs; run alone on the machine. Tokenizer description + first schema compile: "
             f"{setup_s:.2f} s (once per server; later compiles of the same schema are cache hits).", "",
             "| batch | speculation | output | decode ms/token | grammar ms/token (fill + apply + accept) | acceptance |",
             "|---|---|---|---|---|---|"]
    for key, r in summary.items():
        b, name, kind = key.split("/")
        acc = f"{r['acceptance_rate']:.2f}" if r["acceptance_rate"] is not None else "-"
        lines.append(f"| {b[5:]} | {name} | {kind} | {r['decode_ms_per_token']:.1f} | {r['grammar_ms_per_token']:.3f} "
                     f"({r['grammar_fill_ms_per_token']:.3f} + {r['grammar_apply_ms_per_token']:.3f} + "
                     f"{r['grammar_accept_ms_per_token']:.3f}) | {acc} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "grammar_cost.json").write_text(json.dumps(out, indent=2) + "\n")
        (Path(args.out) / "grammar_cost.md").write_text(text)


if __name__ == "__main__":
    main()
