"""CUDA path check (issue 2): the engine runs on the GPU and its greedy tokens match the CPU path.

Two modes:
  --reference OUT.json   (on the CPU) greedy tokens of every prompt, fp32, written to OUT.json.
  --check REF.json       (on the GPU) the same prompts in fp32 and in bf16 on CUDA: per-prompt match of
                         the greedy tokens against the CPU reference (the fraction of positions equal up
                         to the first difference, and exact-match count), plus decode tokens/s baseline
                         vs ngram and the speculative greedy equality on the GPU. Prints a table and a
                         JSON line; --out writes the JSON.
Use the same weights file on both sides (e.g. a bf16 copy of the model, loaded as fp32 on the CPU).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain what a hash map is in two sentences.",
    "List three colors of the rainbow.",
    "1: I will not skip any words.\n2: I will not skip any words.\n3:",
    "Translate 'good morning' to Spanish, French and German.",
    "def quicksort(arr):",
    "Give me a haiku about the sea.",
]


def prefix_match(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def run(model: str, device: str, dtype: str, max_tokens: int, spec=None):
    from specserve import LLM, SamplingParams

    llm = LLM(model, device=device, dtype=dtype, max_model_len=1024, max_num_seqs=len(PROMPTS))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = [llm.engine.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    return llm, ids, params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--max-tokens", type=int, default=64)
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--reference")
    g.add_argument("--check")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.reference:
        llm, ids, params = run(args.model, "cpu", "float32", args.max_tokens)
        outs = llm.generate(ids, params)
        Path(args.reference).write_text(json.dumps({"max_tokens": args.max_tokens, "prompts": PROMPTS,
                                                    "tokens": [o.outputs[0].token_ids for o in outs]}))
        return
    ref = json.loads(Path(args.check).read_text())["tokens"]
    from specserve.config import SpeculativeConfig

    res = {"benchmark": "gpu_check", "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "modes": {}}
    for dtype in ("float32", "bfloat16"):
        llm, ids, params = run(args.model, "cuda", dtype, args.max_tokens)
        batched = [o.outputs[0].token_ids for o in llm.generate(ids, params)]
        alone = [llm.generate([i], params)[0].outputs[0].token_ids for i in ids]
        exact = sum(a == r for a, r in zip(alone, ref))
        pos = sum(prefix_match(a, r) for a, r in zip(alone, ref)) / sum(len(r) for r in ref)
        batch_inv = sum(a == b for a, b in zip(alone, batched))
        timings = {}
        ngram = SpeculativeConfig("ngram", 4, prompt_lookup_min=2, prompt_lookup_max=4)
        spec_equal = 0
        for name, cfg in (("baseline", None), ("ngram_4", ngram)):
            llm.generate([ids[0]], params, speculative_config=cfg)  # warm-up
            torch.cuda.synchronize()
            toks, secs = 0, 0.0
            for i, p_ids in enumerate(ids):
                o = llm.generate([p_ids], params, speculative_config=cfg)[0].outputs[0]
                toks += len(o.token_ids) - 1
                secs += o.metrics["finished"] - o.metrics["first_token"]
                if name == "ngram_4":
                    spec_equal += o.token_ids == alone[i]
            timings[name] = toks / secs
        res["modes"][dtype] = {
            "exact_match_vs_cpu": f"{exact}/{len(ref)}",
            "token_match_rate_vs_cpu": pos,
            "batched_equals_alone": f"{batch_inv}/{len(ref)}",
            "ngram_greedy_equals_baseline": f"{spec_equal}/{len(ref)}",
            "decode_tokens_per_s": timings,
        }
        print(dtype, json.dumps(res["modes"][dtype]))
        del llm
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
