"""GPU development check: random-weight models of the real configs, no weights to move (docs/gpu-notes.md).

    python benchmarks/gpu/dev_check.py --config-0_5b path/to/config.json --tokenizer DIR --out OUTDIR

For the qwen2.5-coder 0.5b config (and the 1.5b's, written from its published shape) in bf16:
- one decode step: the eager `CausalLM` forward, the fused forward run eagerly, and its CUDA-graph
  replay; graph replay per token bucket (1..128 tokens) in default and batch-invariant mode;
- attention alone at several contexts; the runner's host time per step;
- the engine: batch-1 decode tok/s (baseline, ngram), 16 concurrent total tok/s, start-up capture time;
then writes everything to OUTDIR/dev_check.json and prints a short table.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

# qwen2.5-coder-1.5b-instruct as its GGUF converts (docs/design.md section 6), when no config file is given
CFG_1_5B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 1536,
            "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
            "num_key_value_heads": 2, "vocab_size": 151936, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, "tie_word_embeddings": False,
            "eos_token_id": 151645, "bos_token_id": 151643}


def cuda_time(fn, iters=50, warmup=5) -> float:
    """Median ms of fn() over iters, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]


def random_folder(cfg: dict, tokenizer: Path, dst: Path) -> Path:
    """A Hugging Face folder with random bf16 weights of `cfg` and the real tokenizer files."""
    import transformers

    dst.mkdir(parents=True, exist_ok=True)
    conf = transformers.Qwen2Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    conf.architectures = ["Qwen2ForCausalLM"]
    with torch.device("cuda"):
        m = transformers.Qwen2ForCausalLM(conf).to(torch.bfloat16)
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.copy_(1.0 + 0.05 * torch.randn_like(p) if "norm" in n else 0.02 * torch.randn_like(p))
    m.save_pretrained(dst)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer / f).exists():
            shutil.copy(tokenizer / f, dst / f)
    del m
    torch.cuda.empty_cache()
    return dst


def profile_step(runner, seqs, reset, steps: int = 10) -> dict:
    """GPU time per kernel name (us per step) and kernel count per step, eager fused forward (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        runner.forward(seqs)
        reset()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            runner.forward(seqs)
            reset()
        torch.cuda.synchronize()
    by, count = {}, 0
    for e in prof.events():
        if e.device_type.name == "CUDA" and "Memcpy" not in e.name and "Memset" not in e.name:
            key = e.name[:60]
            by[key] = by.get(key, 0.0) + e.device_time / steps
            count += 1
    top = dict(sorted(by.items(), key=lambda kv: -kv[1])[:14])
    return {"kernels_per_step": count / steps, "gpu_us_per_step": sum(by.values()), "top_us": top}


def step_benchmarks(folder: Path, ctx: int = 500) -> dict:
    from specserve.engine.cuda_graph_runner import CudaGraphRunner
    from specserve.engine.kv_cache import KVCache
    from specserve.engine.model_runner import ModelRunner, SeqInput
    from specserve.model import triton_ops as ops
    from specserve.model.config import ModelConfig
    from specserve.model.loader import load_model

    cfg = ModelConfig.from_folder(folder)
    model = load_model(folder, cfg, torch.bfloat16, torch.device("cuda"), 4096)
    kv = KVCache(cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim, 4096, torch.bfloat16, torch.device("cuda"))
    slots = [kv.allocate() for _ in range(16)]
    eager = ModelRunner(model, kv, torch.device("cuda"))
    for sl in slots:
        eager.forward([SeqInput(sl, 0, list(range(2000)), 1)])  # K/V of 2000 positions in every slot

    def at(n):
        for sl in slots:
            kv.lengths[sl] = n  # positions < 2000 hold K/V written by the prefill above
    out = {}
    at(ctx)
    out["eager_model_decode_ms"] = cuda_time(lambda: (eager.forward([SeqInput(slots[0], ctx, [5], 1)]), at(ctx)),
                                             iters=10, warmup=2)

    def bench(r, shapes, key, n_ctx=ctx):
        for B, q in shapes:
            seqs = [SeqInput(sl, n_ctx, [7] * q, q) for sl in slots[:B]]
            at(n_ctx)
            out[f"{key}_B{B}_q{q}" + ("" if n_ctx == ctx else f"_L{n_ctx}") + "_ms"] = cuda_time(
                lambda: (r.forward(seqs), at(n_ctx)), iters=30)

    shapes = [(1, 1), (1, 2), (1, 4), (1, 6), (1, 8), (1, 16), (4, 8), (16, 1), (16, 2), (16, 4), (16, 6), (16, 8)]
    # attention split variants (keys per split; 0 = one pass), captured into the whole forward
    default_split = ops.ATTENTION_SPLIT
    for split in (0, 64, 128, 256):
        ops.ATTENTION_SPLIT = split
        t0 = time.perf_counter()
        r = CudaGraphRunner(model, kv, torch.device("cuda"), 16)
        out[f"capture_s_split{split}"] = time.perf_counter() - t0
        bench(r, shapes if split == default_split else [(1, 1), (1, 6), (16, 1), (16, 6)], f"split{split}")
        bench(r, [(1, 1), (16, 6)], f"split{split}", n_ctx=1900)
        r = None
    ops.ATTENTION_SPLIT = default_split
    # leave one stage out (timing only: the output is wrong), to place the in-graph time
    real = {n: getattr(ops, n) for n in ("cached_attention", "rope_and_cache", "silu_mul", "rms_norm")}
    fakes = {
        "cached_attention": lambda q, *a, **k: q.view(q.shape[0], -1),
        "rope_and_cache": lambda qkv, H, Hkv, D, *a, **k: qkv[:, : H * D].unflatten(1, (H, D)),
        "silu_mul": lambda x: x[:, : x.shape[1] // 2],
        "rms_norm": lambda x, w, eps, residual=None, rows=None: (
            (x, x) if rows is None else (x.index_select(0, rows), x.index_select(0, rows))),
    }
    for name, fake in fakes.items():
        setattr(ops, name, fake)
        r = CudaGraphRunner(model, kv, torch.device("cuda"), 16)
        bench(r, [(1, 1), (16, 6)], f"no_{name}")
        setattr(ops, name, real[name])
        r = None
    # batch-invariant mode
    t0 = time.perf_counter()
    r = CudaGraphRunner(model, kv, torch.device("cuda"), 16, batch_invariant=True)
    out["capture_s_inv"] = time.perf_counter() - t0
    bench(r, shapes, "inv")
    r = None
    # the fused forward without graphs, its profile, and the host time of one graph forward
    r = CudaGraphRunner(model, kv, torch.device("cuda"), 16, cuda_graphs=False)
    at(ctx)
    out["fused_eager_decode_ms"] = cuda_time(lambda: (r.forward([SeqInput(slots[0], ctx, [5], 1)]), at(ctx)), iters=10)
    for B, q in ((1, 1), (16, 6)):
        out[f"profile_B{B}_q{q}"] = profile_step(r, [SeqInput(sl, ctx, [7] * q, q) for sl in slots[:B]],
                                                 lambda: at(ctx))
    r = CudaGraphRunner(model, kv, torch.device("cuda"), 16)
    for B, q in ((1, 1), (1, 6), (16, 6)):
        seqs = [SeqInput(sl, ctx, [7] * q, q) for sl in slots[:B]]
        ts = []
        for _ in range(30):
            at(ctx)
            torch.cuda.synchronize()
            t = time.perf_counter()
            r.forward(seqs)
            ts.append(time.perf_counter() - t)
        out[f"host_B{B}_q{q}_ms"] = 1e3 * sorted(ts)[15]
    r = None
    model = kv = eager = None
    torch.cuda.empty_cache()
    return out


def engine_benchmarks(folder: Path, draft: Path | None = None) -> dict:
    from specserve import LLM, SamplingParams
    from specserve.config import SpeculativeConfig

    t0 = time.perf_counter()
    llm = LLM(str(folder), dtype="bfloat16", device="cuda", max_model_len=4096, max_num_seqs=16)
    out = {"engine_load_s": time.perf_counter() - t0}
    prompt = llm.engine.encode_chat([{"role": "user", "content": "Write a Python function that sorts a list. " * 20}])
    p = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
    for name, cfg in (("baseline", None), ("ngram", SpeculativeConfig("ngram", 5, prompt_lookup_min=2,
                                                                       prompt_lookup_max=4))):
        for rep in range(2):
            o = llm.generate([prompt], p, speculative_config=cfg)[0].outputs[0]
            out[f"b1_{name}_tok_s_{rep}"] = (len(o.token_ids) - 1) / (o.metrics["finished"] - o.metrics["first_token"])
            out[f"b1_{name}_acc_len"] = o.mean_acceptance_length
    for name, cfg in (("baseline", None), ("ngram", SpeculativeConfig("ngram", 3, prompt_lookup_min=2,
                                                                       prompt_lookup_max=4))):
        t = time.perf_counter()
        outs = llm.generate([prompt] * 16, SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True),
                            speculative_config=cfg)
        out[f"c16_{name}_tok_s"] = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)
    if draft is not None:  # random weights accept ~nothing: this times one step = k draft forwards + 1 verify
        for k in (1, 4):
            cfg = SpeculativeConfig("draft_model", k, model=str(draft))
            llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8), speculative_config=cfg)
            o = llm.generate([prompt], p, speculative_config=cfg)[0].outputs[0]
            out[f"draft_k{k}_ms_per_step"] = 1e3 * (o.metrics["finished"] - o.metrics["first_token"]) / max(1, o.num_drafts)
            out[f"draft_k{k}_acc_len"] = o.mean_acceptance_length
    r = llm.engine.target.runner
    out["graph_steps"], out["eager_steps"], out["capture_s"] = r.num_graph_steps, r.num_eager_steps, r.capture_seconds
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config-0_5b", required=True)
    ap.add_argument("--config-1_5b", default=None)
    ap.add_argument("--tokenizer", required=True, help="folder with tokenizer.json etc.")
    ap.add_argument("--work", default="/tmp/devcheck")
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="0.5b,1.5b")
    args = ap.parse_args()
    cfgs = {"0.5b": json.loads(Path(args.config_0_5b).read_text()),
            "1.5b": json.loads(Path(args.config_1_5b).read_text()) if args.config_1_5b else CFG_1_5B}
    res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    import triton

    res["triton"] = triton.__version__
    for name in args.models.split(","):
        t0 = time.perf_counter()
        folder = random_folder(cfgs[name], Path(args.tokenizer), Path(args.work) / name)
        r = res[name] = {"make_folder_s": time.perf_counter() - t0}
        r.update(step_benchmarks(folder))
        print(name, json.dumps(r), flush=True)
        r.update(engine_benchmarks(folder, Path(args.work) / "0.5b" if name == "1.5b" else None))
        print(name, json.dumps(r), flush=True)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "dev_check.json").write_text(json.dumps(res, indent=1))
    for name in args.models.split(","):
        r = res[name]
        print(f"\n== {name} (random weights, bf16, context 500)")
        print(f"decode step ms: eager model {r['eager_model_decode_ms']:.2f}, fused eager {r['fused_eager_decode_ms']:.2f}")
        for pre in ("split0", "split64", "split128", "split256", "inv", "no_cached_attention", "no_rope_and_cache",
                    "no_silu_mul", "no_rms_norm"):
            print(f"{pre:>20}: " + ", ".join(f"{k[len(pre) + 1:-3]} {v:.3f}" for k, v in r.items()
                                             if k.startswith(pre + "_B")))
        print("host ms/forward: " + ", ".join(f"{k[5:-3]} {v:.3f}" for k, v in r.items() if k.startswith("host_")))
        for key in ("profile_B1_q1", "profile_B16_q6"):
            pr = r[key]
            print(f"{key}: {pr['kernels_per_step']:.0f} kernels, {pr['gpu_us_per_step']:.0f} us GPU; " + "; ".join(
                f"{n} {v:.0f}" for n, v in pr["top_us"].items()))
        print(f"engine: b1 baseline {r['b1_baseline_tok_s_1']:.0f} tok/s (first {r['b1_baseline_tok_s_0']:.0f}), "
              f"b1 ngram {r['b1_ngram_tok_s_1']:.0f} (acc.len {r['b1_ngram_acc_len'] or 0:.2f}), c16 baseline "
              f"{r['c16_baseline_tok_s']:.0f}, c16 ngram {r['c16_ngram_tok_s']:.0f}; capture {r['capture_s']:.1f} s, "
              f"load {r['engine_load_s']:.1f} s; graph/eager steps {r['graph_steps']}/{r['eager_steps']}; " +
              ", ".join(f"{k} {v:.2f}" for k, v in r.items() if k.startswith("draft_")))


if __name__ == "__main__":
    main()
