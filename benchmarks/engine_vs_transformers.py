"""Greedy decoding speed: specserve's engine vs transformers' generate() on the same prompts (issue 2).

Both run the same converted weights in fp32 on the CPU, batch 1, greedy, exactly --max-tokens new
tokens (EOS ignored), alternating A/B per prompt and repeat so machine noise hits both alike. Prints a
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

    llm = LLM(args.model, max_model_len=2048, max_num_seqs=1)
    hf = AutoModelForCausalLM.from_pretrained(str(llm.engine.target.files.path), dtype=torch.float32).eval()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = [llm.engine.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    ours_s, hf_s, match = [], [], []
    for r in range(args.repeats):
        for i, ids in enumerate(prompts):
            order = ["ours", "hf"] if (r + i) % 2 == 0 else ["hf", "ours"]
            for who in order:
                t = time.perf_counter()
                if who == "ours":
                    toks = llm.generate([ids], params)[0].outputs[0].token_ids
                    ours_s.append(time.perf_counter() - t)
                    ours_toks = toks
                else:
                    with torch.inference_mode():
                        out = hf.generate(torch.tensor([ids]), max_new_tokens=args.max_tokens, do_sample=False,
                                          eos_token_id=None, pad_token_id=0)
                    hf_s.append(time.perf_counter() - t)
                    hf_toks = out[0, len(ids):].tolist()
            match.append(ours_toks == hf_toks)
    n = args.max_tokens
    ratios = [h / o for o, h in zip(ours_s, hf_s)]
    res = {
        "benchmark": "engine_vs_transformers",
        "model": args.model,
        "max_tokens": n,
        "prompts": len(prompts),
        "repeats": args.repeats,
        "ours_tokens_per_s": n * len(ours_s) / sum(ours_s),
        "transformers_tokens_per_s": n * len(hf_s) / sum(hf_s),
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "greedy_tokens_identical": f"{sum(match)}/{len(match)}",
        "conditions": f"CPU {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
                      f"torch {torch.__version__}, fp32, batch 1, greedy, EOS ignored",
    }
    print(f"{'engine':<14}{'tokens/s':>10}")
    print(f"{'specserve':<14}{res['ours_tokens_per_s']:>10.2f}")
    print(f"{'transformers':<14}{res['transformers_tokens_per_s']:>10.2f}")
    print(f"ratio specserve/transformers: median {res['ratio_median']:.2f} (min {res['ratio_min']:.2f}, "
          f"max {res['ratio_max']:.2f}) over {len(ratios)} paired runs; identical tokens {res['greedy_tokens_identical']}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "engine_vs_transformers.json").write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
