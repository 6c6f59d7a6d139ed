"""Engine step cost, side by side for two source trees (e.g. main and a branch): decode tokens/s and the
engine's own time per step (step time minus the target forward), greedy / sampled / ngram, batch 1
and 4, on one real model. Both in wall time and in the engine thread's CPU time (`time.thread_time`,
which a loaded machine's preemption does not inflate; with 1 torch thread all the work is on that thread).

Each tree runs in its own child process (PYTHONPATH=tree), children alternate A B B A ..., each child
loads the model once and runs every configuration; the figures are medians over the children of each
tree, and the ratios are tree B over tree A. Only the public engine API is used, so any two versions
of specserve can be compared.

    flock /tmp/bench.lock python benchmarks/engine_step.py --trees /path/to/base,. --threads 1 \
        --out docs/benchmarks --tag step_plan
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

CONFIGS = [  # name, batch size, sampling params, speculative config
    ("greedy_b1", 1, {"temperature": 0.0}, None),
    ("sampled_b1", 1, {"temperature": 0.8, "top_p": 0.9, "top_k": 50, "seed": 1}, None),
    ("ngram_b1", 1, {"temperature": 0.0}, {"method": "ngram", "num_speculative_tokens": 4}),
    ("greedy_b4", 4, {"temperature": 0.0}, None),
    ("sampled_b4", 4, {"temperature": 0.8, "top_p": 0.9, "top_k": 50, "seed": 1}, None),
    ("ngram_b4", 4, {"temperature": 0.0}, {"method": "ngram", "num_speculative_tokens": 4}),
]
PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    "def fibonacci_iter(n):",
    "Write a haiku about a server that never sleeps.",
    "class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, x):\n        self.items.append(x)\n",
    "List the planets of the solar system, one per line, with their order from the sun:",
]


def child(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    from specserve import LLM, SamplingParams
    from specserve.config import SpeculativeConfig

    llm = LLM(args.model, max_model_len=512, max_num_seqs=4, device="cpu", dtype="float32")
    eng = llm.engine
    runner = eng.target.runner
    fwd = [0.0, 0.0]  # wall, cpu seconds in the target forward during one step
    name = "execute" if hasattr(runner, "execute") else "forward"
    orig = getattr(runner, name)

    def timed(*a, **k):
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return orig(*a, **k)
        finally:
            fwd[0] += time.perf_counter() - t0
            fwd[1] += time.thread_time() - c0

    setattr(runner, name, timed)
    out = {}
    llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    for cname, bs, sp, spec in CONFIGS:
        cfg = SpeculativeConfig.from_dict(spec) if spec else None
        for i in range(bs):
            eng.add_request(f"{cname}-{i}", PROMPTS[i], SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, **sp),
                            speculative_config=cfg)
        steps, tokens, tot = 0, 0, [0.0, 0.0, 0.0, 0.0]  # step wall, step cpu, forward wall, forward cpu
        while eng.has_unfinished_requests():
            decoding = all(r.num_computed_tokens >= r.num_prompt_tokens for r in eng.scheduler.running) and not eng.scheduler.waiting
            fwd[0] = fwd[1] = 0.0
            t0, c0 = time.perf_counter(), time.thread_time()
            outs = eng.step()
            dt, dc = time.perf_counter() - t0, time.thread_time() - c0
            if decoding:  # decode steps only: prefill excluded
                steps += 1
                tokens += sum(len(o.new_token_ids) for o in outs)
                for i, v in enumerate((dt, dc, fwd[0], fwd[1])):
                    tot[i] += v
        out[cname] = {"decode_tok_s": tokens / tot[0], "decode_tok_per_cpu_s": tokens / tot[1],
                      "overhead_ms_per_step": 1000 * (tot[0] - tot[2]) / steps,
                      "overhead_cpu_ms_per_step": 1000 * (tot[1] - tot[3]) / steps,
                      "step_ms": 1000 * tot[0] / steps, "steps": steps, "tokens": tokens}
    print("RESULT " + json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trees", default=None, help="two source trees A,B (B is compared to A)")
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2, help="A B B A pairs")
    ap.add_argument("--tag", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    trees = [str(Path(t).resolve()) for t in args.trees.split(",")]
    if len(trees) != 2:
        raise SystemExit("--trees: give exactly two source trees, A,B")
    runs: dict[str, list[dict]] = {t: [] for t in trees}
    order = []
    for r in range(args.rounds):
        order += trees if r % 2 == 0 else trees[::-1]
    for tree in order:
        cmd = [sys.executable, __file__, "--child", "--model", args.model, "--max-tokens", str(args.max_tokens),
               "--threads", str(args.threads)]
        env = dict(os.environ, PYTHONPATH=tree)
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tree)
        line = [x for x in res.stdout.splitlines() if x.startswith("RESULT ")]
        if res.returncode or not line:
            raise SystemExit(f"child for {tree} failed:\n{res.stderr[-3000:]}")
        runs[tree].append(json.loads(line[0][7:]))
        print(f"{tree}: {line[0][7:]}", flush=True)
    a, b = trees
    keys = ("decode_tok_s", "decode_tok_per_cpu_s", "overhead_ms_per_step", "overhead_cpu_ms_per_step")
    rows = {}
    for cname, *_ in CONFIGS:
        med = {t: {k: statistics.median(run[cname][k] for run in runs[t]) for k in keys} for t in trees}
        rows[cname] = {"a": med[a], "b": med[b], "tok_s_ratio_b_over_a": med[b]["decode_tok_s"] / med[a]["decode_tok_s"],
                       "tok_per_cpu_s_ratio_b_over_a": med[b]["decode_tok_per_cpu_s"] / med[a]["decode_tok_per_cpu_s"],
                       "overhead_cpu_ms_b_minus_a": med[b]["overhead_cpu_ms_per_step"] - med[a]["overhead_cpu_ms_per_step"]}
    print(f"{'config':<12}{'A tok/s':>9}{'B tok/s':>9}{'B/A':>7}{'A tok/cpu-s':>12}{'B tok/cpu-s':>12}{'B/A':>7}"
          f"{'A ovh cpu ms':>13}{'B ovh cpu ms':>13}")
    for cname, r in rows.items():
        A, B = r["a"], r["b"]
        print(f"{cname:<12}{A['decode_tok_s']:>9.2f}{B['decode_tok_s']:>9.2f}{r['tok_s_ratio_b_over_a']:>7.3f}"
              f"{A['decode_tok_per_cpu_s']:>12.2f}{B['decode_tok_per_cpu_s']:>12.2f}{r['tok_per_cpu_s_ratio_b_over_a']:>7.3f}"
              f"{A['overhead_cpu_ms_per_step']:>13.2f}{B['overhead_cpu_ms_per_step']:>13.2f}")
    res = {"benchmark": "engine_step", "model": args.model, "tree_a": a, "tree_b": b, "max_tokens": args.max_tokens,
           "rounds": args.rounds, "conditions": f"{platform.machine()}, {args.threads} threads, fp32, cpu; load "
           f"average {os.getloadavg()[0]:.2f} at the end", "rows": rows, "runs": runs}
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / (f"engine_step_{Path(args.model).name}" + (f"_{args.tag}" if args.tag else "") + ".json")).write_text(
            json.dumps(res, indent=2) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k != "runs"}))


if __name__ == "__main__":
    main()
