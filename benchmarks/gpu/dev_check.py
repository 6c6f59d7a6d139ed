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

# qwen2.5-coder-1.5b-instruct as its GGUF converts (DESIGN.md section 6), when no config file is given
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


def step_benchmarks(folder: Path, ctx: int = 500) -> dict:
    from specserve.engine.cuda_graph_runner import CudaGraphRunner
    from specserve.engine.kv_cache import KVCache
    from specserve.engine.model_runner import ModelRunner, SeqInput
    from specserve.model import triton_ops as ops
    from specserve.model.config import ModelConfig
    from specserve.model.loader import load_model

    cfg = ModelConfig.from_folder(folder)
    model = load_model(folder, cfg, torch.bfloat16, torch.device("cuda"), 4096)
    mk = lambda: KVCache(cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim, 4096, torch.bfloat16, torch.device("cuda"))  # noqa: E731
    out = {}
    kv = mk()
    eager = ModelRunner(model, kv, torch.device("cuda"))
    s = kv.allocate()
    eager.forward([SeqInput(s, 0, list(range(ctx)), 1)])

    def eager_step():
        eager.forward([SeqInput(s, ctx, [5], 1)])
        kv.truncate(s, ctx)
    out["eager_model_decode_ms"] = cuda_time(eager_step, iters=10, warmup=2)
    res = {}
    for inv in (False, True):
        t0 = time.perf_counter()
        r = CudaGraphRunner(model, mk(), torch.device("cuda"), 16, batch_invariant=inv)
        res[f"capture_s_{'inv' if inv else 'default'}"] = time.perf_counter() - t0
        slots = [r.kv.allocate() for _ in range(16)]
        for sl in slots:
            r.forward([SeqInput(sl, 0, list(range(ctx)), 1)])
        for B, q in [(1, 1), (1, 2), (1, 4), (1, 6), (1, 8), (1, 16), (4, 8), (16, 1), (16, 2), (16, 4), (16, 6),
                     (16, 8)]:
            seqs = [SeqInput(sl, ctx, [7] * q, q) for sl in slots[:B]]

            def step():
                r.forward(seqs)
                for sl in slots[:B]:
                    r.kv.truncate(sl, ctx)
            res[f"{'inv' if inv else 'graph'}_B{B}_q{q}_ms"] = cuda_time(step, iters=30)
            if not inv and B in (1, 16) and q in (1, 6):  # host time of one forward call, no sync
                t = time.perf_counter()
                for _ in range(50):
                    step()
                res[f"host_B{B}_q{q}_ms"] = (time.perf_counter() - t) / 50 * 1e3
                torch.cuda.synchronize()
        if not inv:  # the fused forward without graphs
            r2 = CudaGraphRunner(model, r.kv, torch.device("cuda"), 16, cuda_graphs=False)

            def fused_eager():
                r2.forward([SeqInput(slots[0], ctx, [5], 1)])
                r2.kv.truncate(slots[0], ctx)
            res["fused_eager_decode_ms"] = cuda_time(fused_eager, iters=10)
            # attention alone
            H, D = cfg.num_heads, cfg.head_dim
            for B, q, L in [(1, 1, 256), (1, 1, 1024), (1, 1, 4000), (1, 6, 1024), (16, 1, 1024), (16, 6, 1024)]:
                qq = torch.randn(B * q, H, D, device="cuda", dtype=torch.bfloat16)
                i32 = lambda v: torch.tensor(v, dtype=torch.int32, device="cuda")  # noqa: E731
                meta = (i32([b * q for b in range(B)]), i32([q] * B), i32([L - q] * B), i32(slots[:B]))
                res[f"attn_B{B}_q{q}_L{L}_us"] = 1e3 * cuda_time(
                    lambda: ops.cached_attention(qq, r.kv.k[0], r.kv.v[0], *meta, max_qlen=16, scale=D**-0.5), iters=50)
        r = None  # free the graphs before the next runner
        torch.cuda.empty_cache()
    out.update(res)
    del model
    torch.cuda.empty_cache()
    return out


def engine_benchmarks(folder: Path) -> dict:
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
        r.update(engine_benchmarks(folder))
        print(name, json.dumps(r), flush=True)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "dev_check.json").write_text(json.dumps(res, indent=1))
    for name in args.models.split(","):
        r = res[name]
        print(f"\n== {name} (random weights, bf16, context 500)")
        print(f"decode step ms: eager model {r['eager_model_decode_ms']:.2f}, fused eager {r['fused_eager_decode_ms']:.2f}, "
              f"graph {r['graph_B1_q1_ms']:.3f}, batch-invariant graph {r['inv_B1_q1_ms']:.3f}")
        print("graph ms by B x q: " + ", ".join(f"{k[6:-3]} {v:.3f}" for k, v in r.items() if k.startswith("graph_B")))
        print("invariant ms:      " + ", ".join(f"{k[4:-3]} {v:.3f}" for k, v in r.items() if k.startswith("inv_B")))
        print("attention us: " + ", ".join(f"{k[5:-3]} {v:.1f}" for k, v in r.items() if k.startswith("attn_")))
        print("host ms/forward: " + ", ".join(f"{k[5:-3]} {v:.3f}" for k, v in r.items() if k.startswith("host_")))
        print(f"engine: b1 baseline {r['b1_baseline_tok_s_1']:.0f} tok/s (first {r['b1_baseline_tok_s_0']:.0f}), "
              f"b1 ngram {r['b1_ngram_tok_s_1']:.0f} (acc.len {r['b1_ngram_acc_len'] or 0:.2f}), c16 baseline "
              f"{r['c16_baseline_tok_s']:.0f}, c16 ngram {r['c16_ngram_tok_s']:.0f}; capture {r['capture_s']:.1f} s, "
              f"load {r['engine_load_s']:.1f} s; graph/eager steps {r['graph_steps']}/{r['eager_steps']}")


if __name__ == "__main__":
    main()
