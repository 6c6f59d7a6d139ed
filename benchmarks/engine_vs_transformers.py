"""Greedy decoding speed: specserve's engine vs transformers' generate() on the same prompts (issue 2).

Both run the same converted weights in fp32 on the CPU, batch 1, greedy, exactly --max-tokens new
tokens (EOS ignored), rotating the order per prompt and repeat so machine noise hits all alike.
Three contenders: our engine; transformers as it loads by default; and transformers with its weights
moved to huge-page memory the way our loader does (`specserve.model.weight_memory`), which separates
the gain from memory placement from the engine's own. Prints a
table, then one JSON line; with --out, writes the JSON there.

    python benchmarks/engine_vs_transformers.py --model qwen2.5-coder-0.5b-instruct --out docs/benchmarks
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome, with a docstring and two tests.",
    "Explain in a short paragraph why the sky is blue.",
    "Rename the function `add` to `plus` and return the whole code:\n```python\ndef add(a, b):\n    return a + b\n\nprint(add(2, 3))\n```",
    "List five tips for writing readable code.",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="folder for the JSON results")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    from specserve import LLM, SamplingParams
    from specserve.model.weight_memory import move_weights_to_huge_pages

    llm = LLM(args.model, max_model_len=2048, max_num_seqs=1)
    path = str(llm.engine.target.files.path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # the same transformers model with its weights moved to huge-page memory as our loader does, so the
    # comparison also shows how much of the gap is memory placement and how much is the engine
    hf_hp = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf_hp.weight_arena = move_weights_to_huge_pages(hf_hp)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = [llm.engine.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]

    def run_hf(model, ids):
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), max_new_tokens=args.max_tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        return out[0, len(ids):].tolist()

    contenders = {
        "specserve": lambda ids: llm.generate([ids], params)[0].outputs[0].token_ids,
        "transformers": lambda ids: run_hf(hf, ids),
        "transformers_huge_pages": lambda ids: run_hf(hf_hp, ids),
    }
    names = list(contenders)
    secs = {n: [] for n in names}
    match = []
    for r in range(args.repeats):
        for i, ids in enumerate(prompts):
            rot = (r * len(prompts) + i) % len(names)
            toks = {}
            for who in names[rot:] + names[:rot]:
                t = time.perf_counter()
                toks[who] = contenders[who](ids)
                secs[who].append(time.perf_counter() - t)
            match.append(toks["specserve"] == toks["transformers"] == toks["transformers_huge_pages"])
    n = args.max_tokens
    rate = {who: n * len(secs[who]) / sum(secs[who]) for who in names}
    ratios = [h / o for o, h in zip(secs["specserve"], secs["transformers"])]
    ratios_hp = [h / o for o, h in zip(secs["specserve"], secs["transformers_huge_pages"])]
    res = {
        "benchmark": "engine_vs_transformers",
        "model": args.model,
        "max_tokens": n,
        "prompts": len(prompts),
        "repeats": args.repeats,
        "ours_tokens_per_s": rate["specserve"],
        "transformers_tokens_per_s": rate["transformers"],
        "transformers_huge_pages_tokens_per_s": rate["transformers_huge_pages"],
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "ratio_vs_huge_pages_median": statistics.median(ratios_hp),
        "ratio_vs_huge_pages_min": min(ratios_hp),
        "ratio_vs_huge_pages_max": max(ratios_hp),
        "greedy_tokens_identical": f"{sum(match)}/{len(match)}",
        "conditions": f"CPU {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
                      f"torch {torch.__version__}, fp32, batch 1, greedy, EOS ignored",
    }
    print(f"{'engine':<32}{'tokens/s':>10}")
    print(f"{'specserve':<32}{res['ours_tokens_per_s']:>10.2f}")
    print(f"{'transformers':<32}{res['transformers_tokens_per_s']:>10.2f}")
    print(f"{'transformers, huge-page weights':<32}{res['transformers_huge_pages_tokens_per_s']:>10.2f}")
    print(f"ratio specserve/transformers: median {res['ratio_median']:.2f} (min {res['ratio_min']:.2f}, "
          f"max {res['ratio_max']:.2f}) over {len(ratios)} paired runs; "
          f"identical tokens {res['greedy_tokens_identical']}")
    print(f"ratio specserve/transformers with huge-page weights: median {res['ratio_vs_huge_pages_median']:.2f} "
          f"(min {res['ratio_vs_huge_pages_min']:.2f}, max {res['ratio_vs_huge_pages_max']:.2f})")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "engine_vs_transformers.json").write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
