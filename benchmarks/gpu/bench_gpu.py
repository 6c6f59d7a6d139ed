"""GPU benchmark (issue 9): specserve vs transformers side by side, one process, same weights and token ids.

Two steps:
  prepare (any machine with the datasets and the tokenizer):
      python benchmarks/gpu/bench_gpu.py prepare --tokenizer-model qwen2.5-coder-0.5b-instruct --out prompts.json
    builds the benchmark's real segments (specserve.bench.datasets: code, edit, chat, tool_call, summarize;
    --num-prompts each), applies the chat template and writes the token ids.
  run (on the GPU):
      python benchmarks/gpu/bench_gpu.py run --prompts prompts.json --model qwen2.5-coder-0.5b-instruct \
          --model qwen2.5-coder-1.5b-instruct:qwen2.5-coder-0.5b-instruct --out docs/benchmarks/gpu_h200.json
    `--model TARGET[:DRAFT]` (catalog name or folder). Per model, bf16, greedy:
    - batch 1, every prompt alone, methods baseline / ngram / suffix (/ draft_model), in a rotating order,
      two passes: pass 1 = first sight (nothing seen before in this process), pass 2 = warm. Decode
      tokens/s = sum(output tokens - 1) / sum(finish - first token) per segment (prefill excluded).
    - batch-invariant mode (a second engine): baseline and the n-gram/suffix methods, one pass: greedy
      match rate (must be 1.0) and its cost.
    - 16 concurrent: 2 x 16 requests queued on a 16-slot engine (16 in flight), per profile; total output
      tokens / wall time.
    - transformers generate() on the same token ids (--hf-prompts per segment): baseline, prompt lookup,
      assisted (with the draft).
    - the weight-read floor: bytes of the weights one forward reads / the measured copy bandwidth.
    Writes the raw figures and `summary[model]` = {batch1_baseline_tok_s, batch1_speedup {segment:
    {method: ratio}}, c16_total_tok_s {profile: tok/s}, first_sight_over_warm, bf16_greedy_match_rate};
    prints a table last.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time
from collections import defaultdict
from pathlib import Path

SEGMENTS = "code,edit,chat,tool_call,summarize"


def prepare(args) -> None:
    from transformers import AutoTokenizer

    from specserve.bench.datasets import build_segment
    from specserve.hub import resolve_model

    tok = AutoTokenizer.from_pretrained(str(resolve_model(args.tokenizer_model).path))
    out = []
    for seg in args.segments.split(","):
        for s in build_segment(seg, args.num_prompts, args.seed, args.max_tokens):
            text = tok.apply_chat_template(s.messages, tools=s.tools, add_generation_prompt=True, tokenize=False)
            out.append({"id": s.id, "segment": seg, "max_tokens": s.max_tokens,
                        "token_ids": tok.encode(text, add_special_tokens=False)})
    Path(args.out).write_text(json.dumps({"segments": args.segments, "seed": args.seed, "samples": out}))
    print(f"{len(out)} prompts -> {args.out}")


# ---- measurement helpers ----------------------------------------------------------------------------


def ceilings(torch) -> dict:
    """Copy bandwidth (bytes read + written / s) and bf16 matmul rate, measured here."""
    if not torch.cuda.is_available():  # a CPU smoke run of this script: nominal numbers
        return {"copy_bytes_per_s": 1e10, "bf16_matmul_tflops": 0.0}
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ev[0].record()
    for _ in range(10):
        y.copy_(x)
    ev[1].record()
    torch.cuda.synchronize()
    bw = 2 * x.numel() * 10 / (ev[0].elapsed_time(ev[1]) / 1e3)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ a
    ev[0].record()
    for _ in range(10):
        a @ a
    ev[1].record()
    torch.cuda.synchronize()
    tflops = 2 * 8192**3 * 10 / (ev[0].elapsed_time(ev[1]) / 1e3) / 1e12
    del x, y, a
    return {"copy_bytes_per_s": bw, "bf16_matmul_tflops": tflops}


def weight_read_bytes(model) -> int:
    """Bytes of weights one forward reads: every parameter except the embedding table (rows are
    gathered), plus the lm_head (the embedding again when tied)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    emb = model.model.embed_tokens.weight
    return total - (0 if model.config.tie_word_embeddings else emb.numel() * emb.element_size())


# batch-1 methods: name -> speculative config keys ("model" is filled in for draft_model)
METHODS = {
    "baseline": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
    "ngram_k8": {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
    "suffix": {"method": "suffix", "num_speculative_tokens": 8},
    # a cache size one below the default gives this method its own proposer, so its global tree never
    # holds the other suffix method's output for the same prompt (which it would replay at no cost)
    "suffix_k15": {"method": "suffix", "num_speculative_tokens": 15, "suffix_decoding_max_cached_requests": 9999},
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 3},
    "draft_model_k5": {"method": "draft_model", "num_speculative_tokens": 5},
}
# 16 concurrent: the same, plus k capped by batch size (vLLM's num_speculative_tokens_per_batch_size,
# [bs_lo, bs_hi, k]) and the adaptive schedule (k per request and step from the measured step cost)
C16_PROFILES = ["baseline", "ngram", "suffix", "draft_model"]
C16_EXTRA = {
    "ngram_pbs": {**METHODS["ngram"], "num_speculative_tokens_per_batch_size": [[1, 4, 5], [5, 16, 3]]},
    "suffix_pbs": {**METHODS["suffix"], "num_speculative_tokens_per_batch_size": [[1, 4, 8], [5, 16, 4]]},
    "draft_model_pbs": {**METHODS["draft_model"], "num_speculative_tokens_per_batch_size": [[1, 4, 3], [5, 16, 1]]},
    # k = 0 at 16 concurrent (the proposer does no work for a request with k = 0)
    "suffix_pbs0": {**METHODS["suffix"], "num_speculative_tokens_per_batch_size": [[1, 4, 8], [5, 8, 4], [9, 16, 0]]},
    "draft_model_pbs0": {**METHODS["draft_model"],
                         "num_speculative_tokens_per_batch_size": [[1, 4, 3], [5, 8, 1], [9, 16, 0]]},
    "ngram_adaptive": {**METHODS["ngram_k8"], "num_speculative_tokens_schedule": "adaptive"},
    # its own suffix proposer (see suffix_k15): no other profile's outputs of the same prompts in its tree
    "suffix_adaptive": {**METHODS["suffix"], "num_speculative_tokens_schedule": "adaptive",
                        "suffix_decoding_max_cached_requests": 9998},
    # k per request and step up to 5, priced with the draft model's measured forward time per position
    "draft_model_adaptive": {**METHODS["draft_model_k5"], "num_speculative_tokens_schedule": "adaptive"},
}


def method_configs(draft: str | None, specs: dict) -> dict:
    """name -> SpeculativeConfig (None for the baseline); draft_model entries only with a draft."""
    from specserve.config import SpeculativeConfig

    out = {}
    for name, spec in specs.items():
        if spec is not None and spec["method"] == "draft_model":
            if not draft:
                continue
            spec = {**spec, "model": draft}
        out[name] = SpeculativeConfig.from_dict(spec) if spec else None
    return out


def batch1(llm, samples, cfgs, passes: int, log) -> dict:
    """Rows per (pass, segment, method) and every output's token ids."""
    from specserve import SamplingParams
    from specserve.spec_decode import make_proposer

    eng = llm.engine
    names = list(cfgs)
    acc = defaultdict(lambda: [0, 0.0, 0, 0])  # tokens, seconds, drafts, accepted
    outs = {}
    for p in range(passes):
        for m, c in cfgs.items():  # a fresh suffix tree per pass: it learns only from this pass's earlier prompts
            if c is not None and c.method == "suffix":
                eng.set_proposer(c, make_proposer(c, eng.proposer_context))
        for i, s in enumerate(samples):
            rot = (i + p) % len(names)
            for m in names[rot:] + names[:rot]:
                params = SamplingParams(temperature=0.0, max_tokens=s["max_tokens"])
                o = llm.generate([s["token_ids"]], params, speculative_config=cfgs[m])[0].outputs[0]
                a = acc[(p, s["segment"], m)]
                a[0] += len(o.token_ids) - 1
                a[1] += o.metrics["finished"] - o.metrics["first_token"]
                a[2] += o.num_drafts
                a[3] += o.num_accepted_tokens
                outs[(p, s["id"], m)] = o.token_ids
        log(f"  batch-1 pass {p + 1}/{passes} done")
    return {"acc": acc, "outs": outs}


def concurrent(llm, samples, cfg, n_requests: int) -> dict:
    from specserve import SamplingParams

    eng = llm.engine
    t0 = time.perf_counter()
    for i in range(n_requests):
        s = samples[i % len(samples)]
        eng.add_request(f"c{i}-{t0}", s["token_ids"], SamplingParams(temperature=0.0, max_tokens=s["max_tokens"]),
                        speculative_config=cfg)
    tokens = 0
    while eng.has_unfinished_requests():
        for o in eng.step():  # outputs are deltas: the tokens each step committed
            tokens += len(o.new_token_ids)
    wall = time.perf_counter() - t0
    return {"requests": n_requests, "output_tokens": tokens, "seconds": wall, "total_tok_s": tokens / wall}


def transformers_runs(torch, folder, draft_folder, samples, k, max_tokens, device, dtype) -> list[dict]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).to(device).eval()
    assistant = (AutoModelForCausalLM.from_pretrained(str(draft_folder), dtype=dtype).to(device).eval()
                 if draft_folder else None)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    methods = {"baseline": {}, "prompt_lookup": {"prompt_lookup_num_tokens": k}}
    if assistant is not None:
        methods["assisted"] = {"assistant_model": assistant}
    rows = []
    for s in samples:
        ids = torch.tensor([s["token_ids"]], device=device)
        mask = torch.ones_like(ids)
        n = min(s["max_tokens"], max_tokens)
        for m, kw in methods.items():
            with torch.inference_mode():
                sync()
                t0 = time.perf_counter()
                hf.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False)
                sync()
                t1 = time.perf_counter()
                out = hf.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, **kw)
                sync()
                t2 = time.perf_counter()
            new = out[0, ids.shape[1]:].tolist()
            # decode time: the whole generate less a 1-token generate (prefill + first token)
            rows.append({"id": s["id"], "segment": s["segment"], "method": m, "tokens": new,
                         "decode_tokens": len(new) - 1, "decode_seconds": (t2 - t1) - (t1 - t0)})
    del hf, assistant
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def hf_rates(rows) -> dict:
    """Decode tokens/s per transformers method: sum(tokens - 1) / sum(decode seconds)."""
    out = {}
    for m in dict.fromkeys(x["method"] for x in rows):
        sel = [x for x in rows if x["method"] == m]
        sec = sum(x["decode_seconds"] for x in sel)
        out[m] = sum(x["decode_tokens"] for x in sel) / sec if sec > 0 else float("nan")
    return out


def match_rate(outs, passes_methods, base_key) -> tuple[float, int]:
    """Fraction of runs whose greedy tokens equal the baseline's, and the number of runs compared."""
    same = n = 0
    for (p, sid, m), toks in outs.items():
        if (p, m) in passes_methods:
            n += 1
            same += toks == outs[(p, sid, base_key)]
    return (same / n if n else float("nan")), n


def run(args) -> None:
    import torch

    from specserve import LLM
    from specserve.hub import resolve_model

    t_start = time.perf_counter()
    log = lambda msg: print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    data = json.loads(Path(args.prompts).read_text())
    samples = data["samples"]
    segments = list(dict.fromkeys(s["segment"] for s in samples))
    dev, dtype = args.device, args.dtype
    tdtype = getattr(torch, dtype)
    res = {"benchmark": "gpu", "device": torch.cuda.get_device_name(0) if dev == "cuda" else platform.processor(),
           "torch": torch.__version__,
           "conditions": {"dtype": dtype, "greedy": True, "methods": METHODS, "c16_extra_profiles": C16_EXTRA,
                          "transformers_prompt_lookup_k": args.k, "prompts_per_segment": {
               seg: sum(s["segment"] == seg for s in samples) for seg in segments},
               "python": platform.python_version(), "c16_requests": args.c16_requests},
           "ceilings": ceilings(torch), "models": {}, "summary": {}}
    log(f"ceilings {res['ceilings']}")
    for spec in args.model:
        target, _, draft = spec.partition(":")
        name = resolve_model(target).name
        cfgs = method_configs(draft or None, METHODS)
        r = res["models"][name] = {"draft": draft or None}
        t0 = time.perf_counter()
        llm = LLM(target, dtype=dtype, device=dev, max_model_len=args.max_model_len, max_num_seqs=16)
        runner = llm.engine.target.runner
        r["load_seconds"] = time.perf_counter() - t0
        r["capture_seconds"] = getattr(runner, "capture_seconds", 0.0)
        r["num_graphs"] = len(getattr(runner, "_graphs", {}))
        wb = weight_read_bytes(llm.engine.target.model)
        r["weight_read_bytes"] = wb
        r["weight_read_floor_ms"] = 1e3 * wb / res["ceilings"]["copy_bytes_per_s"]
        log(f"{name}: loaded in {r['load_seconds']:.1f} s ({r['num_graphs']} graphs in {r['capture_seconds']:.1f} s)")
        b1 = batch1(llm, samples, cfgs, 2, log)
        rows = []
        for (p, seg, m), (tok, sec, dr, ac) in sorted(b1["acc"].items()):
            rows.append({"pass": "first_sight" if p == 0 else "warm", "segment": seg, "method": m,
                         "decode_tok_s": tok / sec, "output_tokens": tok, "drafts": dr,
                         "mean_acceptance_length": 1 + ac / dr if dr else None})
        r["batch1"] = rows

        def rate(p, m, seg=None):
            keys = [kk for kk in b1["acc"] if kk[0] == p and kk[2] == m and (seg is None or kk[1] == seg)]
            return sum(b1["acc"][kk][0] for kk in keys) / sum(b1["acc"][kk][1] for kk in keys)

        spec_methods = [m for m in cfgs if m != "baseline"]
        mr, n_cmp = match_rate(b1["outs"], {(1, m) for m in spec_methods}, "baseline")
        r["bf16_greedy_match"] = {"rate": mr, "runs": n_cmp}
        log(f"  batch-1 baseline {rate(1, 'baseline'):.0f} tok/s warm, {rate(0, 'baseline'):.0f} first sight; match {mr:.3f}")
        # 16 concurrent
        profiles = {m: cfgs[m] for m in C16_PROFILES if m in cfgs}
        profiles.update(method_configs(draft or None, C16_EXTRA))
        r["c16"] = {pn: concurrent(llm, samples, pc, args.c16_requests) for pn, pc in profiles.items()}
        log("  c16 " + ", ".join(f"{pn} {v['total_tok_s']:.0f}" for pn, v in r["c16"].items()))
        base_w = rate(1, "baseline")
        r["weight_read_floor_fraction"] = r["weight_read_floor_ms"] / (1e3 / base_w)
        res["summary"][name] = {
            "batch1_baseline_tok_s": base_w,
            "batch1_speedup": {seg: {m: rate(1, m, seg) / rate(1, "baseline", seg) for m in spec_methods}
                               for seg in segments},
            "c16_total_tok_s": {pn: v["total_tok_s"] for pn, v in r["c16"].items()},
            "first_sight_over_warm": rate(0, "baseline") / base_w,
            "bf16_greedy_match_rate": mr,
        }
        save(res, args.out)
        hf_folder = llm.engine.target.files.path
        draft_folder = resolve_model(draft).path if draft else None
        del llm, runner
        gc.collect()
        if dev != "cuda":  # batch-invariant mode is CUDA only
            inv = None
        else:
            torch.cuda.empty_cache()
            inv = LLM(target, dtype=dtype, device=dev, max_model_len=args.max_model_len, max_num_seqs=16,
                      batch_invariant=True)
        inv_cfgs = {m: c for m, c in cfgs.items() if m in ("baseline", "ngram", "suffix", "draft_model")}
        if inv is not None:
            b1i = batch1(inv, samples, inv_cfgs, 1, log)
            mri, n_i = match_rate(b1i["outs"], {(0, m) for m in inv_cfgs if m != "baseline"}, "baseline")
            inv_base = sum(v[0] for kk, v in b1i["acc"].items() if kk[2] == "baseline") / sum(
                v[1] for kk, v in b1i["acc"].items() if kk[2] == "baseline")
            r["batch_invariant"] = {"greedy_match_rate": mri, "runs": n_i, "batch1_baseline_tok_s": inv_base,
                                    "cost_vs_default": inv_base / rate(1, "baseline"),
                                    "rows": [{"segment": seg, "method": m, "decode_tok_s": v[0] / v[1]}
                                             for (p, seg, m), v in sorted(b1i["acc"].items())]}
            log(f"  batch-invariant: match {mri:.3f}, baseline {inv_base:.0f} tok/s")
            del inv
            gc.collect()
            torch.cuda.empty_cache()
            save(res, args.out)
        if name in args.fp32_check and dev == "cuda":  # fp32: greedy speculation must equal the baseline
            from specserve.model import triton_ops

            if args.fp32_attention_precision:
                triton_ops.FP32_ATTENTION_PRECISION = args.fp32_attention_precision
            f32 = LLM(target, dtype="float32", device=dev, max_model_len=args.max_model_len, max_num_seqs=16)
            f_cfgs = {m: c for m, c in cfgs.items() if m in ("baseline", "ngram", "suffix")}
            b1f = batch1(f32, samples, f_cfgs, 1, log)
            mrf, n_f = match_rate(b1f["outs"], {(0, m) for m in f_cfgs if m != "baseline"}, "baseline")
            r["fp32"] = {"attention_precision": triton_ops.FP32_ATTENTION_PRECISION,
                         "greedy_match_rate": mrf, "runs": n_f, "batch1_baseline_tok_s": sum(
                v[0] for kk, v in b1f["acc"].items() if kk[2] == "baseline") / sum(
                v[1] for kk, v in b1f["acc"].items() if kk[2] == "baseline")}
            log(f"  fp32: match {mrf:.3f}, baseline {r['fp32']['batch1_baseline_tok_s']:.0f} tok/s")
            del f32
            gc.collect()
            torch.cuda.empty_cache()
            save(res, args.out)
        # transformers generate() on the same token ids
        hf_samples = [s for seg in segments for s in [x for x in samples if x["segment"] == seg][: args.hf_prompts]]
        if args.hf_prompts > 0:
            hf_rows = transformers_runs(torch, hf_folder, draft_folder, hf_samples, args.k, args.hf_max_tokens, dev,
                                        tdtype)
            r["transformers"] = [{kk: v for kk, v in row.items() if kk != "tokens"} for row in hf_rows]
            hf_base = {row["id"]: row["tokens"] for row in hf_rows if row["method"] == "baseline"}
            ours = {sid: toks for (p, sid, m), toks in b1["outs"].items() if p == 1 and m == "baseline"}
            r["transformers_same_tokens_as_specserve"] = sum(
                ours[i][: len(t)] == t for i, t in hf_base.items()) / max(1, len(hf_base))
            r["transformers_decode_tok_s"] = hf_rates(r["transformers"])
            log("  transformers " + ", ".join(f"{m} {v:.0f}" for m, v in r["transformers_decode_tok_s"].items()))
        save(res, args.out)
    res["wall_seconds"] = time.perf_counter() - t_start
    save(res, args.out)
    print_table(res)


def save(res: dict, out: str | None) -> None:
    """Write the results so far (after every stage, so a run cut short keeps what it measured)."""
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(res, indent=1) + "\n")


def print_table(res) -> None:
    for name, s in res["summary"].items():
        r = res["models"][name]
        print(f"\n== {name}: batch-1 baseline {s['batch1_baseline_tok_s']:.0f} tok/s "
              f"(floor {r['weight_read_floor_ms']:.3f} ms/token, {100 * r['weight_read_floor_fraction']:.0f}% of it), "
              f"first sight / warm {s['first_sight_over_warm']:.2f}, bf16 greedy match {s['bf16_greedy_match_rate']:.2f}")
        if "fp32" in r:
            print(f"fp32: greedy match {r['fp32']['greedy_match_rate']:.2f} over {r['fp32']['runs']} runs, "
                  f"baseline {r['fp32']['batch1_baseline_tok_s']:.0f} tok/s")
        if "batch_invariant" in r:
            bi = r["batch_invariant"]
            print(f"batch-invariant mode: greedy match {bi['greedy_match_rate']:.2f}, baseline "
                  f"{bi['batch1_baseline_tok_s']:.0f} tok/s = {bi['cost_vs_default']:.2f}x the default")
        methods = list(next(iter(s["batch1_speedup"].values())))
        print(f"{'segment':<11}" + "".join(f"{m:>13}" for m in methods))
        for seg, v in s["batch1_speedup"].items():
            print(f"{seg:<11}" + "".join(f"{v[m]:>12.2f}x" for m in methods))
        print("c16 total tok/s: " + ", ".join(f"{p} {v:.0f}" for p, v in s["c16_total_tok_s"].items()))
        if "transformers_decode_tok_s" in r:
            print("transformers generate() decode tok/s: " + ", ".join(
                f"{m} {v:.0f}" for m, v in r["transformers_decode_tok_s"].items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--tokenizer-model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--segments", default=SEGMENTS)
    p.add_argument("--num-prompts", type=int, default=5, help="per segment")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    r = sub.add_parser("run")
    r.add_argument("--prompts", required=True)
    r.add_argument("--model", action="append", required=True, help="TARGET[:DRAFT] (repeatable)")
    r.add_argument("--k", type=int, default=5, help="k of transformers' prompt lookup")
    r.add_argument("--max-model-len", type=int, default=4096)
    r.add_argument("--c16-requests", type=int, default=32)
    r.add_argument("--fp32-check", action="append", default=[],
                   help="model name (repeatable) whose greedy speculation is also compared in fp32")
    r.add_argument("--fp32-attention-precision", choices=["ieee", "tf32x3"], default=None,
                   help="tl.dot precision of the fp32 attention in the --fp32-check run (default: the module's)")
    r.add_argument("--hf-prompts", type=int, default=1, help="transformers prompts per segment (0: skip)")
    r.add_argument("--hf-max-tokens", type=int, default=128)
    r.add_argument("--device", default="cuda", help="cuda (cpu only for a smoke run of this script)")
    r.add_argument("--dtype", default="bfloat16")
    r.add_argument("--out", default=None)
    args = ap.parse_args()
    prepare(args) if args.cmd == "prepare" else run(args)


if __name__ == "__main__":
    main()
