"""The CUDA forward's Triton kernels and fused forward against torch references.

Runs on a CUDA GPU; skips without one. With TRITON_INTERPRET=1 and Triton installed, the same tests
run on the CPU through Triton's interpreter (slow, for developing kernels without a GPU). Inputs are
fresh random draws, outputs are poisoned before each run, errors are ||out - ref|| / ||ref|| against
float64 references (docs/gpu-notes.md).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if torch.cuda.is_available():
    DEVICE = "cuda"
elif os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None:
    DEVICE = "cpu"
else:
    DEVICE = None
pytestmark = pytest.mark.skipif(DEVICE is None, reason="needs a CUDA GPU (or TRITON_INTERPRET=1 with Triton)")

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def skip_interpreted_bf16_dot(dtype):
    if DEVICE == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter computes bf16 tl.dot on raw bits (checked on the GPU only)")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all()
    return float((out - ref).norm() / ref.norm())


@pytest.fixture
def gen():
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(os.urandom(4), "little"))


def randn(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_with_residual_and_rows(gen, dtype):
    from specserve.model import triton_ops as ops

    T, N = 7, 896
    x, r, w = randn(gen, T, N, dtype=dtype), randn(gen, T, N, dtype=dtype), randn(gen, N, dtype=dtype)
    h = (x.double() + r.double())
    ref = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    out, res = ops.rms_norm(x, w, 1e-6, r)
    assert rel_err(out, ref) < TOL[dtype] and rel_err(res, h) < TOL[dtype]
    rows = torch.tensor([5, 0, 5], dtype=torch.int32, device=DEVICE)
    out_r, res_r = ops.rms_norm(x, w, 1e-6, r, rows=rows)
    assert torch.equal(out_r, out[rows.long()]) and torch.equal(res_r, res[rows.long()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_and_cache(gen, dtype, qk_norm):
    from specserve.model import triton_ops as ops
    from specserve.model.llama import RotaryEmbedding

    H, Hkv, D, T, slots, L = 14, 2, 64, 6, 3, 32
    rope = RotaryEmbedding(D, 1e6, L).to(DEVICE)
    qkv = randn(gen, T, (H + 2 * Hkv) * D, dtype=dtype)
    pos = torch.tensor([0, 1, 2, 9, 31, 4], dtype=torch.int32, device=DEVICE)
    slot = torch.tensor([0, 0, 0, 2, 1, -1], dtype=torch.int32, device=DEVICE)  # last token: padding
    kc = torch.full((slots, Hkv, L, D), 7.0, dtype=dtype, device=DEVICE)
    vc = kc.clone()
    qn = kn = None
    q_ref, k_ref, v_ref = qkv.double().split([H * D, Hkv * D, Hkv * D], -1)
    q_ref, k_ref, v_ref = q_ref.view(T, H, D), k_ref.view(T, Hkv, D), v_ref.view(T, Hkv, D)
    if qk_norm:
        qn, kn = randn(gen, D, dtype=dtype), randn(gen, D, dtype=dtype)
        norm = lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()  # noqa: E731
        q_ref, k_ref = norm(q_ref, qn), norm(k_ref, kn)
    cos, sin = rope.cos[pos.long()].double()[:, None], rope.sin[pos.long()].double()[:, None]
    rot = lambda x: torch.cat((-x[..., D // 2:], x[..., : D // 2]), -1)  # noqa: E731
    q_ref, k_ref = q_ref * cos + rot(q_ref) * sin, k_ref * cos + rot(k_ref) * sin
    q = ops.rope_and_cache(qkv, H, Hkv, D, rope.cos, rope.sin, pos, slot, kc, vc, qn, kn, 1e-6)
    tol = 2 * TOL[dtype] if qk_norm else TOL[dtype]  # the norm rounds twice to bf16, as the eager model does
    assert rel_err(q, q_ref) < tol
    for t in range(T - 1):
        s, p = int(slot[t]), int(pos[t])
        assert rel_err(kc[s, :, p], k_ref[t]) < tol and rel_err(vc[s, :, p], v_ref[t]) < TOL[dtype]
    written = torch.zeros(slots, L, dtype=torch.bool)
    written[slot[:-1].long().cpu(), pos[:-1].long().cpu()] = True
    kc, vc = kc.cpu().transpose(1, 2), vc.cpu().transpose(1, 2)  # [slots, L, Hkv, D]
    assert (kc[~written] == 7.0).all() and (vc[~written] == 7.0).all()  # padding wrote nothing


def test_silu_mul(gen):
    from specserve.model import triton_ops as ops

    x = randn(gen, 5, 2 * 1500)
    g, u = x.double().chunk(2, -1)
    assert rel_err(ops.silu_mul(x), torch.nn.functional.silu(g) * u) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(14, 2, 64), (12, 2, 128), (4, 4, 64)])
def test_cached_attention_ragged(gen, dtype, heads):
    from specserve.model import triton_ops as ops

    skip_interpreted_bf16_dot(dtype)
    H, Hkv, D = heads
    L, slots = 300, 4
    kc, vc = randn(gen, slots, Hkv, L, D, dtype=dtype), randn(gen, slots, Hkv, L, D, dtype=dtype)
    # (slot, ctx, qlen): a decode, a verify block, a prefill chunk over 2 tiles, a fresh prompt
    seqs = [(2, 130, 1), (0, 57, 6), (3, 100, 37), (1, 0, 9)]
    T = sum(q for _, _, q in seqs) + 3  # 3 padding tokens
    q = randn(gen, T, H, D, dtype=dtype)
    qstart, t = [], 0
    for _, _, n in seqs:
        qstart.append(t)
        t += n
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=DEVICE)  # noqa: E731
    # one padding sequence (qlen 0) in the batch
    meta = [i32(qstart + [t]), i32([n for *_, n in seqs] + [0]), i32([c for _, c, _ in seqs] + [0]),
            i32([s for s, _, _ in seqs] + [0])]
    out = torch.full((T, H * D), float("nan"), dtype=dtype, device=DEVICE)
    ops.cached_attention(q, kc, vc, *meta, max_qlen=37, scale=D**-0.5, out=out)
    for (slot, ctx, n), s0 in zip(seqs, qstart):
        k = kc[slot, :, : ctx + n].double().repeat_interleave(H // Hkv, 0)
        v = vc[slot, :, : ctx + n].double().repeat_interleave(H // Hkv, 0)
        qq = q[s0 : s0 + n].double().transpose(0, 1)  # [H, n, D]
        mask = torch.arange(ctx + n, device=DEVICE)[None, :] <= (ctx + torch.arange(n, device=DEVICE))[:, None]
        att = (qq @ k.transpose(1, 2)) * D**-0.5
        ref = torch.softmax(att.masked_fill(~mask, float("-inf")), -1) @ v  # [H, n, D]
        assert rel_err(out[s0 : s0 + n], ref.transpose(0, 1).reshape(n, H * D)) < TOL[dtype]
    assert torch.isnan(out[t:]).all()  # padding token rows untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_invariant_linear_is_exact_per_row_at_any_batch_size(gen, dtype):
    from specserve.model import triton_ops as ops

    skip_interpreted_bf16_dot(dtype)
    N, K = 896, 4864
    w, b = randn(gen, N, K, dtype=dtype), randn(gen, N, dtype=dtype)
    x = randn(gen, 70, K, dtype=dtype)
    y = ops.invariant_linear(x, w, b)
    assert rel_err(y, x.double() @ w.double().T + b.double()) < TOL[dtype]
    if DEVICE != "cuda":
        return  # the interpreter's numpy matmul is not row-invariant; the claim is about the GPU kernel
    for rows in ([3], [3, 4, 5, 6, 7, 8], list(range(70))[::-1]):
        idx = torch.tensor(rows, device=DEVICE)
        assert torch.equal(ops.invariant_linear(x[idx], w, b), y[idx])
