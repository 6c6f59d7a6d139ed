"""Where a CPU decode step's time goes, with the fused layer kernels and with the eager ops: the engine's
step, the model forward, the linear layers (the panel kernel's calls) and the rest of the forward, timed
inside a real engine (a wall-clock timer around `LLMEngine.step`, `CausalLM.forward` and
`PanelLinear.forward`), for 1 and 4 greedy sequences.

Each backend (`SPECSERVE_CPU_LAYER_KERNELS=native` / `torch`) runs in its own child process, children
alternating A B B A ...; each child loads the model once, decodes 10 warm-up steps and then `--steps`
steps per repeat. Reports medians over the children of each backend.

    python benchmarks/cpu_layer_time.py --children 4 --out docs/benchmarks --tag intel
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

PROMPTS = ["def quicksort(arr):", "Write a story about a cat.", "class LinkedList:\n    def __init__(self):",
           "Explain TCP vs UDP."]


def child(model: str, batch: int, steps: int, threads: int) -> dict:
    """Run in a child process: per-step milliseconds of step / forward / linear / forward outside linear."""
    from specserve.engine import llm_engine
    from specserve.llm import LLM
    from specserve.model import llama, panel_linear
    from specserve.sampling_params import SamplingParams

    acc = {"linear": 0.0, "forward": 0.0}

    def timed(fn, key):
        def wrapper(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            acc[key] += time.perf_counter() - t
            return out
        return wrapper

    panel_linear.PanelLinear.forward = timed(panel_linear.PanelLinear.forward, "linear")
    llama.CausalLM.forward = timed(llama.CausalLM.forward, "forward")
    llm = LLM(model, dtype="float32", cpu_threads=threads)
    eng: llm_engine.LLMEngine = llm.engine
    for i, p in enumerate(PROMPTS[:batch]):
        eng.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=10 + steps + 2, ignore_eos=True))
    for _ in range(10):
        eng.step()
    acc.update(linear=0.0, forward=0.0)
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    step = (time.perf_counter() - t0) / steps
    return {"backend": eng.target.model.layer_backend, "step_ms": 1e3 * step, "forward_ms": 1e3 * acc["forward"] / steps,
            "linear_ms": 1e3 * acc["linear"] / steps, "forward_outside_linear_ms": 1e3 * (acc["forward"] - acc["linear"]) / steps,
            "outside_forward_ms": 1e3 * (step - acc["forward"] / steps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--children", type=int, default=4, help="child processes per backend")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--tag", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        batch = int(args.child)
        print(json.dumps(child(args.model, batch, args.steps, args.threads)))
        return
    backends = ["native", "torch"]
    results: dict = {(b, n): [] for b in backends for n in (1, 4)}
    loads = []
    for c in range(args.children):
        for b in backends[:: 1 if c % 2 == 0 else -1]:
            for n in (1, 4):
                loads.append(os.getloadavg()[0])
                env = {**os.environ, "SPECSERVE_CPU_LAYER_KERNELS": b}
                out = subprocess.run([sys.executable, __file__, "--child", str(n), "--model", args.model, "--steps",
                                      str(args.steps), "--threads", str(args.threads)],
                                     capture_output=True, text=True, env=env)
                if out.returncode:
                    raise SystemExit(f"child {b} b{n} failed:\n{out.stderr[-2000:]}")
                r = json.loads(out.stdout.strip().splitlines()[-1])
                if r["backend"] != b:
                    raise SystemExit(f"asked for {b}, the model ran {r['backend']}")
                results[(b, n)].append(r)
    rows = []
    for (b, n), rs in results.items():
        row = {"layer_backend": b, "sequences": n}
        for key in ("step_ms", "forward_ms", "linear_ms", "forward_outside_linear_ms", "outside_forward_ms"):
            row[key] = statistics.median(r[key] for r in rs)
        rows.append(row)
        print(f"{b:6s} b{n}: step {row['step_ms']:.1f} ms, forward {row['forward_ms']:.1f}, linear {row['linear_ms']:.1f}, "
              f"forward outside linear {row['forward_outside_linear_ms']:.1f}, outside forward {row['outside_forward_ms']:.1f}")
    res = {"benchmark": "cpu_layer_time", "model": args.model, "threads": args.threads, "children": args.children,
           "steps": args.steps, "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                                          text=True).stdout.strip(),
           "conditions": f"{platform.machine()}, {os.cpu_count()} CPUs, fp32, greedy, contexts of ~10-60 tokens, "
                         f"loadavg 1 min {min(loads):.2f}-{max(loads):.2f}",
           "rows": rows, "raw": {f"{b}_b{n}": rs for (b, n), rs in results.items()}}
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"cpu_layer_time{'_' + args.tag if args.tag else ''}.json").write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
