"""The CPU linear kernels side by side on a model's projections: the panel kernel, oneDNN (packed) and
F.linear (MKL), for several row counts, in one process.

Each "forward" runs every projection of the model once, in layer order, each layer with its own random
fp32 weights (so, as in a real decode step, every weight comes from memory, not from a cache): q/k/v, o,
gate/up and down per layer, then the output projection. The kernels alternate (order reversed every
repeat) so a shared machine's noise hits them alike. Reports the median milliseconds per forward for
each (kernel, rows) and, per row count, the median over repeats of the paired ratio to the panel kernel
(> 1: that kernel is slower). Also checks each kernel's row independence on the first layer's shapes:
whether every row of an M-row call equals the same row of a one-row call (M = 2..8), bit for bit.

    python benchmarks/cpu_linear_kernels.py --threads 2 --rows 1,2,4,5,8,16,300 --out docs/benchmarks/cpu_linear_kernels.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (out_features, in_features) per layer, layers, vocabulary (qwen2.5-coder-0.5b-instruct's)
MODELS = {"qwen2.5-coder-0.5b-instruct": ([(1152, 896), (896, 896), (9728, 896), (896, 4864)], 24, 151936, 896),
          "smollm2-135m-instruct": ([(960, 576), (576, 576), (3072, 576), (576, 1536)], 30, 49152, 576)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", choices=sorted(MODELS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,4,5,8,16,300")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--out", default=None, help="JSON file to write")
    args = ap.parse_args()

    import torch

    from specserve.model.panel_linear import PanelLinear

    torch.set_num_threads(args.threads)
    shapes, layers, vocab, hidden = MODELS[args.model]
    rows = [int(r) for r in args.rows.split(",")]
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        weights = [torch.randn(n, k, generator=gen) * 0.02 for _ in range(layers) for n, k in shapes]
        weights.append(torch.randn(vocab, hidden, generator=gen) * 0.02)
        panel = [PanelLinear(w, None) for w in weights]
        onednn = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
        kernels = {
            "panel": lambda x, i: panel[i](x),
            "onednn": lambda x, i: torch.ops.mkldnn._linear_pointwise(x, onednn[i], None, "none", [], ""),
            "mkl": lambda x, i: torch.nn.functional.linear(x, weights[i]),
        }
        xs = {(m, k): torch.randn(m, k, generator=gen) for m in rows for k in {k for _, k in shapes} | {hidden}}

        independent = {}
        for name, f in kernels.items():
            ok = True
            for i in range(len(shapes)):
                x = xs[(8, weights[i].shape[1])] if 8 in rows else torch.randn(8, weights[i].shape[1], generator=gen)
                alone = torch.cat([f(x[j : j + 1], i) for j in range(8)])
                ok &= all(torch.equal(f(x[:m], i), alone[:m]) for m in range(2, 9))
            independent[name] = ok

        times = {(name, m): [] for name in kernels for m in rows}
        loads = []
        for rep in range(args.repeats + 1):
            loads.append(os.getloadavg()[0])
            for name in (list(kernels) if rep % 2 == 0 else list(kernels)[::-1]):
                for m in rows:
                    t0 = time.perf_counter()
                    for i, w in enumerate(weights):
                        kernels[name](xs[(m, w.shape[1])], i)
                    if rep:  # the first round warms up
                        times[(name, m)].append(time.perf_counter() - t0)
    table = []
    for m in rows:
        for name in kernels:
            xs_ = times[(name, m)]
            paired = [b / a for a, b in zip(times[("panel", m)], xs_)]
            table.append({"rows": m, "kernel": name, "median_ms": 1000 * statistics.median(xs_),
                          "min_ms": 1000 * min(xs_), "paired_ratio_to_panel": statistics.median(paired)})
            print(f"rows {m:4d} {name:7s} median {table[-1]['median_ms']:8.1f} ms  min {table[-1]['min_ms']:8.1f} ms"
                  f"  x{table[-1]['paired_ratio_to_panel']:.2f} of panel")
    print("row independent (a row alone == the same row in a batch of 2-8):", independent)
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    res = {"benchmark": "cpu_linear_kernels", "model_shapes": args.model, "threads": args.threads,
           "repeats": args.repeats, "rows": rows, "row_independent": independent, "table": table,
           "what": "one forward = every projection of the model once, each layer with its own random fp32 weights",
           "conditions": f"{cpu}, {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
                         f"loadavg 1 min {min(loads):.2f}-{max(loads):.2f} during the run"}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({k: res[k] for k in ("row_independent", "conditions")}))


if __name__ == "__main__":
    main()
