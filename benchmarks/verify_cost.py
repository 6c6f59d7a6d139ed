"""Cost of one target forward as a function of the new tokens per request (1 = a decode, 1 + k = a verify).

This is the curve speculation has to beat: a verify block of k drafts pays off only if the tokens it
commits on average exceed cost(1 + k) / cost(1). Also measures where the weights live: `arena` (one
anonymous mapping advised with MADV_HUGEPAGE, what the loader does on the CPU), `heap` (every weight
in an ordinary heap tensor, i.e. 4 KiB pages when the kernel's THP mode is "madvise") and `file` (what
the loader did before: checkpoint tensors left as views of the memory-mapped safetensors file, fused
q/k/v and gate/up in the heap). All modes use the same model and KV cache (the parameters are swapped
between the copies), measured in rotating order so that machine noise hits every mode alike. Batch 1,
--context tokens already in the KV cache.

    python benchmarks/verify_cost.py --model qwen2.5-coder-0.5b-instruct --threads 1 --out docs/benchmarks
    python benchmarks/verify_cost.py --threads 1 --repeats 5 --tag run2 --out docs/benchmarks
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch


def file_backed(target, params) -> list[torch.Tensor]:
    """The parameters as the loader used to leave them (one tensor per entry of `params`, same order):
    checkpoint tensors of the same dtype and shape as views of the memory-mapped file, the rest (fused
    q/k/v and gate/up) as heap copies."""
    from safetensors import safe_open

    names = {id(p): n for n, p in target.model.named_parameters()}
    mapped = {}
    for f in sorted(target.files.path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt", device="cpu") as st:
            mapped.update({n: st.get_tensor(n) for n in st.keys()})
    out = []
    for p in params:
        t = mapped.get(names[id(p)])
        out.append(t if t is not None and t.dtype == p.dtype and t.shape == p.shape else p.data.clone())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--max-new", type=int, default=9, help="largest number of new tokens (1 + k)")
    ap.add_argument("--context", type=int, default=600, help="tokens already in the KV cache")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--weights", default="arena,heap,file", help="comma-separated: arena, heap, file")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--tag", default=None, help="suffix for the output file name (keep several runs)")
    ap.add_argument("--out", default=None, help="folder for the JSON results")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from specserve import LLM
    from specserve.engine.model_runner import SeqInput

    llm = LLM(args.model, max_model_len=args.context + args.max_new + 1, max_num_seqs=1, device="cpu")
    target = llm.engine.target
    params = list(target.model.parameters())
    modes = args.weights.split(",")
    if set(modes) - {"arena", "heap", "file"} or "arena" not in modes:
        raise SystemExit("--weights: a comma-separated subset of arena,heap,file that includes arena")
    copies = {"arena": [p.data for p in params]}
    if "heap" in modes:
        copies["heap"] = [p.data.clone() for p in params]
    if "file" in modes:
        copies["file"] = file_backed(target, params)

    def use(mode: str) -> None:
        for p, t in zip(params, copies[mode]):
            p.data = t

    slot = target.kv.allocate()
    prompt = [(1000 + 7 * i) % target.config.vocab_size for i in range(args.context)]
    target.runner.forward([SeqInput(slot, 0, prompt, 1)])
    sizes = list(range(1, args.max_new + 1))
    times: dict[tuple[str, int], list[float]] = {(m, n): [] for m in modes for n in sizes}
    for rep in range(args.repeats + 1):  # the first pass warms up and is dropped
        for n in sizes:
            for mode in modes[rep % len(modes):] + modes[: rep % len(modes)]:
                use(mode)
                target.kv.truncate(slot, args.context)
                t0 = time.perf_counter()
                target.runner.forward([SeqInput(slot, args.context, [11] * n, n)])
                if rep:
                    times[(mode, n)].append(time.perf_counter() - t0)
    use("arena")

    rows = []
    for mode in modes:
        base = statistics.median(times[(mode, 1)])
        for n in sizes:
            ms = statistics.median(times[(mode, n)])
            rows.append({"weights": mode, "new_tokens": n, "median_ms": 1000 * ms, "cost_vs_decode": ms / base,
                         "min_ms": 1000 * min(times[(mode, n)]), "max_ms": 1000 * max(times[(mode, n)])})
    print(f"{'weights':<8}" + "".join(f"{n:>9}" for n in sizes) + "   (median ms per forward; x = vs 1 token)")
    for mode in modes:
        r = [x for x in rows if x["weights"] == mode]
        print(f"{mode:<8}" + "".join(f"{x['median_ms']:>9.0f}" for x in r))
        print(f"{'':<8}" + "".join(f"{'x%.2f' % x['cost_vs_decode']:>9}" for x in r))
    res = {
        "benchmark": "verify_cost", "model": args.model, "context_tokens": args.context, "repeats": args.repeats,
        "conditions": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
                      f"{target.dtype}, cpu, batch 1",
        "rows": rows,
    }
    for mode in modes[1:]:
        res[f"{mode}_over_arena_decode"] = statistics.median(times[(mode, 1)]) / statistics.median(times[("arena", 1)])
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        name = f"verify_cost_{args.model}" + (f"_{args.tag}" if args.tag else "")
        (out / f"{name}.json").write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
