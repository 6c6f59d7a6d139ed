"""fp32 attention on the GPU (docs/gpu-notes.md, issue 9's 81 tok/s fp32 decode): time and error of
`cached_attention` in fp32 per `FP32_ATTENTION_PRECISION`, against a float64 reference, at the
qwen2.5-coder-0.5b shape (14 query heads, 2 KV heads, head_dim 64), context 500; bf16 for scale.

    python benchmarks/gpu/dev_fp32.py OUT.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dev_check import cuda_time  # noqa: E402


def reference(q, kc, vc, qstart, qlen, ctx, slot, scale):
    """float64 causal attention of each sequence's new rows over its slot's keys."""
    H, Hkv = q.shape[1], kc.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    for b in range(len(qlen)):
        for i in range(qlen[b]):
            t, p = qstart[b] + i, ctx[b] + i
            k = kc[slot[b], :, : p + 1].double().repeat_interleave(H // Hkv, 0)  # [H, p+1, D]
            v = vc[slot[b], :, : p + 1].double().repeat_interleave(H // Hkv, 0)
            w = torch.softmax((k @ q[t].double()[:, :, None]).squeeze(-1) * scale, -1)
            out[t] = (w[:, None, :] @ v).squeeze(1)
    return out.flatten(1)


def main() -> None:
    from specserve.model import triton_ops as ops

    res = {}
    default = ops.FP32_ATTENTION_PRECISION
    H, Hkv, D, L, S = 14, 2, 64, 4096, 16
    g = torch.Generator(device="cuda").manual_seed(0)
    for B, qn in ((1, 1), (16, 4)):
        for dtype in (torch.float32, torch.bfloat16):
            kc = torch.randn((S, Hkv, L, D), device="cuda", generator=g).to(dtype)
            vc = torch.randn((S, Hkv, L, D), device="cuda", generator=g).to(dtype)
            T = B * qn
            q = torch.randn((T, H, D), device="cuda", generator=g).to(dtype)
            qstart = [b * qn for b in range(B)]
            ctx = [500 + 7 * b for b in range(B)]
            i32 = lambda x: torch.tensor(x, dtype=torch.int32, device="cuda")  # noqa: E731
            args = (q, kc, vc, i32(qstart), i32([qn] * B), i32(ctx), i32(list(range(B))), qn, D ** -0.5)
            ref = reference(q, kc, vc, qstart, [qn] * B, ctx, list(range(B)), D ** -0.5)
            for prec in (("ieee", "tf32x3") if dtype == torch.float32 else ("-",)):
                if prec != "-":
                    ops.FP32_ATTENTION_PRECISION = prec
                out = ops.cached_attention(*args)
                err = ((out.double() - ref).norm() / ref.norm()).item()
                us = 1e3 * cuda_time(lambda: ops.cached_attention(*args), iters=30)
                key = f"B{B}_q{qn}_{str(dtype)[6:]}_{prec}"
                res[key] = {"us": us, "rel_err": err}
                print(key, res[key], flush=True)
    ops.FP32_ATTENTION_PRECISION = default
    Path(sys.argv[1]).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
