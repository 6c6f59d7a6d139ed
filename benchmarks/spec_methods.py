"""Speculative methods side by side on real prompts (issue 3): tokens/s and acceptance per segment.

For each prompt of each segment (code = HumanEval completions, edit = HumanEval code-edit requests,
chat = ShareGPT, all via specserve.bench.datasets), runs baseline and every method at batch 1, greedy,
in a rotating order per prompt and repeat so that machine noise hits every method alike. Reports per
segment: decode tokens/s ((output tokens - 1) / (finish - first token), so the prompt's prefill,
which is the same for every method, does not dilute the comparison), the ratio to baseline, TTFT, mean acceptance length (1 + accepted / drafts), and whether greedy outputs equal baseline.
The suffix proposer's global cache is reset at each repeat, so it only learns from earlier *other*
prompts of the same pass, never from a previous run of the same prompt.

    python benchmarks/spec_methods.py --model qwen2.5-coder-0.5b-instruct --out docs/benchmarks
    python benchmarks/spec_methods.py --model qwen2.5-coder-1.5b-instruct --methods baseline,draft_model \
        --draft qwen2.5-coder-0.5b-instruct --num-prompts 2
"""

from __future__ import annotations

import argparse
import json
import platform
from collections import defaultdict
from pathlib import Path

import torch


def method_configs(names: list[str], k: int, draft: str | None):
    from specserve.config import SpeculativeConfig

    cfgs = {}
    for m in names:
        if m == "baseline":
            cfgs[m] = None
        elif m == "ngram":
            cfgs[m] = SpeculativeConfig("ngram", k, prompt_lookup_min=2, prompt_lookup_max=4)
        elif m == "suffix":
            cfgs[m] = SpeculativeConfig("suffix", max(k, 8))
        elif m == "draft_model":
            cfgs[m] = SpeculativeConfig("draft_model", k, model=draft)
        elif m == "draft_model_adaptive":  # the adaptive schedule with a draft model, k <= --k
            cfgs[m] = SpeculativeConfig("draft_model", k, model=draft, num_speculative_tokens_schedule="adaptive")
        elif m == "ngram_adaptive":
            cfgs[m] = SpeculativeConfig("ngram", max(k, 8), prompt_lookup_min=2, prompt_lookup_max=4,
                                        num_speculative_tokens_schedule="adaptive")
        elif m == "suffix_adaptive":
            # a cache size one below the default only gives this method its own proposer (its own global
            # tree), so it never learns from the other suffix method's run of the same prompt
            cfgs[m] = SpeculativeConfig("suffix", max(k, 8), num_speculative_tokens_schedule="adaptive",
                                        suffix_decoding_max_cached_requests=9999)
        else:
            raise SystemExit(f"unknown method {m!r}")
    return cfgs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--draft", default=None, help="draft model for method draft_model")
    ap.add_argument("--methods", default="baseline,ngram,suffix")
    ap.add_argument("--segments", default="code,edit,chat")
    ap.add_argument("--num-prompts", type=int, default=3, help="prompts per segment")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--tag", default=None, help="suffix for the output file names")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from specserve import LLM, SamplingParams
    from specserve.bench.datasets import build_segment

    if args.threads:
        torch.set_num_threads(args.threads)
    names = args.methods.split(",")
    cfgs = method_configs(names, args.k, args.draft)
    llm = LLM(args.model, max_model_len=4096, max_num_seqs=1, device=args.device)
    for c in cfgs.values():
        if c is not None:
            llm.engine.prepare_speculative_config(c)
    samples = [s for seg in args.segments.split(",") for s in build_segment(seg, args.num_prompts, args.seed, args.max_tokens)]
    prompts = [llm.engine.encode_chat(s.messages) for s in samples]
    tok_s = defaultdict(float)  # (segment, method) -> seconds
    toks = defaultdict(int)
    ttft = defaultdict(float)
    drafts = defaultdict(int)
    accepted = defaultdict(int)
    same = defaultdict(lambda: [0, 0])
    for r in range(args.repeats):
        llm.engine.reset_proposers()  # a fresh suffix global tree per pass (ngram keeps no state)
        for i, (s, ids) in enumerate(zip(samples, prompts)):
            params = SamplingParams(temperature=0, max_tokens=s.max_tokens)
            rot = (i + r) % len(names)
            base_ids = None
            outs = {}
            for m in names[rot:] + names[:rot]:
                o = llm.generate([ids], params, speculative_config=cfgs[m])[0].outputs[0]
                key = (s.segment, m)
                tok_s[key] += o.metrics["finished"] - o.metrics["first_token"]
                ttft[key] += o.metrics["first_token"] - o.metrics["arrival"]
                toks[key] += len(o.token_ids) - 1
                drafts[key] += o.num_drafts
                accepted[key] += o.num_accepted_tokens
                outs[m] = o.token_ids
            base_ids = outs.get("baseline")
            for m in names:
                same[(s.segment, m)][0] += outs[m] == base_ids
                same[(s.segment, m)][1] += 1
            print(f"[repeat {r + 1}/{args.repeats}] {s.id}: " + ", ".join(
                f"{m} {len(outs[m])} tok" for m in names), flush=True)
    rows = []
    for seg in args.segments.split(","):
        base_rate = toks[(seg, "baseline")] / tok_s[(seg, "baseline")] if "baseline" in names else None
        # decode tokens = output tokens - 1 per request (the first token comes from prefill)
        for m in names:
            k = (seg, m)
            rate = toks[k] / tok_s[k]
            rows.append({
                "segment": seg, "method": m, "decode_tokens_per_s": rate,
                "mean_ttft_ms": 1000 * ttft[k] / same[k][1],
                "ratio_vs_baseline": rate / base_rate if base_rate else None,
                "mean_acceptance_length": 1 + accepted[k] / drafts[k] if drafts[k] else None,
                "output_tokens": toks[k], "greedy_equal_baseline": f"{same[k][0]}/{same[k][1]}",
            })
    print(f"\n{'segment':<9}{'method':<13}{'decode tok/s':>13}{'x base':>8}{'TTFT ms':>9}{'acc.len':>9}{'= base':>9}")
    for row in rows:
        ratio = f"{row['ratio_vs_baseline']:.2f}" if row["ratio_vs_baseline"] else "-"
        acc = f"{row['mean_acceptance_length']:.2f}" if row["mean_acceptance_length"] else "-"
        print(f"{row['segment']:<9}{row['method']:<13}{row['decode_tokens_per_s']:>13.2f}{ratio:>8}"
              f"{row['mean_ttft_ms']:>9.0f}{acc:>9}{row['greedy_equal_baseline']:>9}")
    res = {
        "benchmark": "spec_methods", "model": args.model, "draft": args.draft, "k": args.k,
        "max_tokens": args.max_tokens, "num_prompts_per_segment": args.num_prompts, "repeats": args.repeats,
        "device": str(llm.engine.device),
        "conditions": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
                      f"{llm.engine.target.dtype}, batch 1, greedy",
        "rows": rows,
    }
    stats = llm.engine.speculation_stats()  # the adaptive schedule's draft-chain scale, where a draft model ran
    if stats.get("chain_scale"):
        res["draft_chain_scale"] = {m: round(v, 3) for m, v in stats["chain_scale"].items()}
        res["chosen_k"] = {str(c["config"].method): c["chosen_k"] for c in stats["configs"]}
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        name = "spec_methods_" + args.model + (f"_{args.tag}" if args.tag else "")
        (out / f"{name}.json").write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
