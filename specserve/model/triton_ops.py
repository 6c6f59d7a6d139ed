"""Triton kernels for the CUDA forward (`specserve.model.fused_forward`): fused elementwise work and
attention over the slot KV cache.

What it does:
- `rms_norm`: residual add + RMSNorm in one pass (fp32 math, rounded like the eager model), optionally
  gathering rows (the final norm runs on the logits rows only).
- `rope_and_cache`: splits the fused qkv projection, applies RoPE (and Qwen3's per-head q/k norm),
  writes K and V into the cache at each token's (slot, position), and returns the rotated queries.
- `silu_mul`: SwiGLU's silu(gate) * up.
- `cached_attention`: causal attention of a ragged batch of new tokens (prefill chunks, decodes, verify
  blocks) over the slot KV cache. Sequence lengths and positions come from device tensors, so the same
  compiled kernel serves every shape and can be captured in CUDA graphs (docs/gpu-attention.md).
- `invariant_linear`: y = x W^T + b with one fixed tiling and a fixed-split K reduction for every M, so
  a row's result never depends on how many other rows are in the batch (batch-invariant mode).

Every kernel uses one configuration per model shape, never one per batch shape: a row's result is then
the same whether it is computed alone (a decode) or inside a verify block.
What it does not do: choose shapes, own buffers or capture graphs (see `specserve.engine.cuda_graph_runner`).
Importing this module needs Triton (present with CUDA builds of PyTorch); the CPU path never imports it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


# ---- RMSNorm (+ residual add) --------------------------------------------------------------------


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, rows_ptr, N, eps,
                     stride_x, stride_r, stride_o, stride_ro,
                     HAS_RES: tl.constexpr, HAS_ROWS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    row = tl.load(rows_ptr + pid).to(tl.int64) if HAS_ROWS else pid.to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        h = (x + r).to(res_out_ptr.dtype.element_ty)  # the residual stream keeps the model dtype
        tl.store(res_out_ptr + pid * stride_ro + cols, h, mask=mask)
        x = h.to(tl.float32)
    var = tl.sum(x * x, axis=0) / N
    y = (x * (1.0 / tl.sqrt(var + eps))).to(out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid * stride_o + cols, (y.to(tl.float32) * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of (x + residual), Zhang & Sennrich 2019, as the eager `RMSNorm` computes it.

    Args:
        x: [T, N] activations; residual: [T, N] running residual or None (x is then the residual).
        weight: [N] norm weight.
        rows: int32 [R] rows to normalize (output row r is input row rows[r]); None = all T rows.

    Returns:
        (normalized [R, N], residual stream x + residual [R, N]) in x's dtype.
    """
    T, N = x.shape
    R = T if rows is None else rows.shape[0]
    out = torch.empty((R, N), dtype=x.dtype, device=x.device)
    if residual is None and rows is None:
        res_out = x
    else:
        res_out = torch.empty((R, N), dtype=x.dtype, device=x.device)
    has_res = residual is not None
    if not has_res and rows is not None:  # the gathered rows of x are the residual stream
        res_out.copy_(x.index_select(0, rows))
    r = residual if has_res else x
    _rms_norm_kernel[(R,)](x, r, weight, out, res_out, rows if rows is not None else x, N, eps,
                           x.stride(0), r.stride(0), out.stride(0), res_out.stride(0),
                           HAS_RES=has_res, HAS_ROWS=rows is not None, BLOCK=_pow2(N),
                           num_warps=4 if N <= 2048 else 8)
    return out, res_out


# ---- RoPE + KV cache write -----------------------------------------------------------------------


@triton.jit
def _rope_rows(base, rows, rmask, norm_ptr, dt_ptr, d, d_rot, sign, cos, sin, eps, D: tl.constexpr,
               HAS_NORM: tl.constexpr):
    # heads `rows` ([R, 1]) of one token at `base` (head r at base + r * D) -> float32 [R, D]: optionally
    # RMS-normed per head (Qwen3, rounded to dt_ptr's dtype like the eager model), then rotated by RoPE
    x = tl.load(base + rows * D + d[None, :], mask=rmask, other=0.0).to(tl.float32)
    x_r = tl.load(base + rows * D + d_rot[None, :], mask=rmask, other=0.0).to(tl.float32)
    if HAS_NORM:
        dt = dt_ptr.dtype.element_ty
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
        x = ((x * rstd).to(dt).to(tl.float32) * tl.load(norm_ptr + d)[None, :].to(tl.float32)).to(dt).to(tl.float32)
        x_r = (x_r * rstd).to(dt).to(tl.float32) * tl.load(norm_ptr + d_rot)[None, :].to(tl.float32)
        x_r = x_r.to(dt).to(tl.float32)
    return x * cos + sign[None, :] * x_r * sin


@triton.jit
def _rope_cache_kernel(qkv_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr,
                       qn_ptr, kn_ptr, eps, stride_t, stride_qo, stride_cos,
                       stride_cs, stride_ch, stride_cl,
                       H: tl.constexpr, HKV: tl.constexpr, H_P2: tl.constexpr, HKV_P2: tl.constexpr,
                       D: tl.constexpr, HAS_QK_NORM: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    d = tl.arange(0, D)
    half: tl.constexpr = D // 2
    d_rot = (d + half) % D  # rotate_half: x_rot[d] = -x[d + D/2] (first half), x[d - D/2] (second half)
    sign = tl.where(d < half, -1.0, 1.0)
    cos = tl.load(cos_ptr + pos * stride_cos + d)[None, :]
    sin = tl.load(sin_ptr + pos * stride_cos + d)[None, :]
    base = qkv_ptr + t * stride_t
    h = tl.arange(0, H_P2)[:, None]
    hm = h < H
    q = _rope_rows(base, h, hm, qn_ptr, q_out_ptr, d, d_rot, sign, cos, sin, eps, D, HAS_QK_NORM)
    tl.store(q_out_ptr + t * stride_qo + h * D + d[None, :], q.to(q_out_ptr.dtype.element_ty), mask=hm)
    if slot >= 0:  # padding tokens (slot -1) write nothing
        g = tl.arange(0, HKV_P2)[:, None]
        gm = g < HKV
        k = _rope_rows(base + H * D, g, gm, kn_ptr, q_out_ptr, d, d_rot, sign, cos, sin, eps, D, HAS_QK_NORM)
        v = tl.load(base + (H + HKV) * D + g * D + d[None, :], mask=gm, other=0.0)
        dst = slot * stride_cs + g * stride_ch + pos * stride_cl + d[None, :]
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=gm)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=gm)


def rope_and_cache(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, cos: torch.Tensor,
                   sin: torch.Tensor, positions: torch.Tensor, token_slots: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                   eps: float = 1e-6) -> torch.Tensor:
    """RoPE (Su et al. 2021, the rotate-half form) on q and k, and the KV cache write.

    Args:
        qkv: [T, (H + 2 Hkv) * D] output of the fused q/k/v projection.
        cos, sin: float32 [max_positions, D] tables; positions, token_slots: int32 [T] (slot -1: padding
            token, nothing is written).
        k_cache, v_cache: [num_slots, Hkv, max_len, D], written at [slot, :, position].
        q_norm, k_norm: [D] per-head RMSNorm weights (Qwen3) or None.

    Returns:
        rotated queries [T, H, D].
    """
    T = qkv.shape[0]
    q = torch.empty((T, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    has_norm = q_norm is not None
    _rope_cache_kernel[(T,)](qkv, q, k_cache, v_cache, cos, sin, positions, token_slots,
                             q_norm if has_norm else cos, k_norm if has_norm else cos, eps,
                             qkv.stride(0), q.stride(0), cos.stride(0),
                             k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                             H=num_heads, HKV=num_kv_heads, H_P2=_pow2(num_heads), HKV_P2=_pow2(num_kv_heads),
                             D=head_dim, HAS_QK_NORM=has_norm, num_warps=4)
    return q


# ---- SwiGLU --------------------------------------------------------------------------------------


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, N, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + N + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (g / (1.0 + tl.exp(-g)) * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for the fused gate/up output [T, 2I] -> [T, I] (Shazeer 2020, SwiGLU)."""
    T, N2 = gate_up.shape
    N = N2 // 2
    out = torch.empty((T, N), dtype=gate_up.dtype, device=gate_up.device)
    BLOCK = 1024
    _silu_mul_kernel[(T, triton.cdiv(N, BLOCK))](gate_up, out, N, gate_up.stride(0), out.stride(0),
                                                 BLOCK=BLOCK, num_warps=4)
    return out


# ---- attention over the slot KV cache ------------------------------------------------------------


@triton.jit
def _tile_rows(qb, qlen, kvh, G: tl.constexpr, G_P2: tl.constexpr, BQ: tl.constexpr):
    # the rows of a query tile: BQ query tokens x the G_P2 (padded) query heads of KV head kvh
    r = tl.arange(0, BQ * G_P2)
    tok = qb * BQ + r // G_P2
    g = r % G_P2
    return tok, (tok < qlen) & (g < G), kvh * G + g


@triton.jit
def _attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, o_ptr, po_ptr, pml_ptr,
                      seq_qstart_ptr, seq_qlen_ptr, seq_ctx_ptr, seq_slot_ptr, scale_log2,
                      stride_qt, stride_qh, stride_ot, stride_oh, stride_cs, stride_ch, stride_cl,
                      stride_ps, stride_pt, stride_ms, stride_mt,
                      G: tl.constexpr, G_P2: tl.constexpr, BQ: tl.constexpr, D: tl.constexpr,
                      BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, NSPLIT: tl.constexpr, QLIMIT: tl.constexpr,
                      F32: tl.constexpr):
    # SPLIT == 0: one program per (sequence, KV head, query tile) covers every key and writes the output;
    # only sequences with more than QLIMIT new tokens (prefill chunks). SPLIT > 0: program (.., qb * NSPLIT
    # + sp) covers keys [sp * SPLIT, (sp + 1) * SPLIT) and writes an unnormalized partial (flash-decoding,
    # Dao et al. 2023); only sequences with at most QLIMIT new tokens. Split boundaries are fixed key
    # positions, so a row's reduction order does not depend on the other rows of its step.
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    if SPLIT > 0:
        qb = tl.program_id(2) // NSPLIT
        sp = tl.program_id(2) % NSPLIT
    else:
        qb = tl.program_id(2)
        sp = 0
    qlen = tl.load(seq_qlen_ptr + b)
    ctx = tl.load(seq_ctx_ptr + b)
    kv_end = ctx + tl.minimum(qb * BQ + BQ, qlen)  # keys [0, kv_end) are needed by this tile
    if SPLIT > 0:
        go = (qlen <= QLIMIT) & (sp * SPLIT < kv_end)
        k_lo = sp * SPLIT
        k_hi = tl.minimum(k_lo + SPLIT, kv_end)
    else:
        go = qlen > QLIMIT
        k_lo = 0
        k_hi = kv_end
    if go & (qb * BQ < qlen):
        qstart = tl.load(seq_qstart_ptr + b).to(tl.int64)
        slot = tl.load(seq_slot_ptr + b).to(tl.int64)
        tok, valid, head = _tile_rows(qb, qlen, kvh, G, G_P2, BQ)
        d = tl.arange(0, D)
        q = tl.load(q_ptr + (qstart + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=valid[:, None], other=0.0)
        qpos = ctx + tok
        base = slot * stride_cs + kvh * stride_ch
        m_i = tl.full([BQ * G_P2], float("-inf"), tl.float32)
        l_i = tl.zeros([BQ * G_P2], tl.float32)
        acc = tl.zeros([BQ * G_P2, D], tl.float32)
        for start in range(k_lo, k_hi, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            nm = n < k_hi
            k = tl.load(k_cache_ptr + base + n[:, None] * stride_cl + d[None, :], mask=nm[:, None], other=0.0)
            if F32 == 1:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            elif F32 == 2:
                s = tl.dot(q, tl.trans(k), input_precision="tf32x3")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where((n[None, :] <= qpos[:, None]) & nm[None, :], s * scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            if SPLIT > 0:  # a row can have no key in this split yet: keep its partial at m=-inf, l=0
                m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_cache_ptr + base + n[:, None] * stride_cl + d[None, :], mask=nm[:, None], other=0.0)
            if F32 == 1:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            elif F32 == 2:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="tf32x3")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        rows = (qstart + tok)[:, None]
        if SPLIT > 0:
            tl.store(po_ptr + sp * stride_ps + rows * stride_pt + head[:, None] * D + d[None, :], acc,
                     mask=valid[:, None])
            ml = pml_ptr + sp * stride_ms + (qstart + tok) * stride_mt + head * 2
            tl.store(ml, m_i, mask=valid)
            tl.store(ml + 1, l_i, mask=valid)
        else:
            out = acc / l_i[:, None]
            tl.store(o_ptr + rows * stride_ot + head[:, None] * stride_oh + d[None, :],
                     out.to(o_ptr.dtype.element_ty), mask=valid[:, None])


@triton.jit
def _combine_kernel(o_ptr, po_ptr, pml_ptr, seq_qstart_ptr, seq_qlen_ptr, seq_ctx_ptr,
                    stride_ot, stride_ps, stride_pt, stride_ms, stride_mt,
                    G: tl.constexpr, G_P2: tl.constexpr, BQ: tl.constexpr, D: tl.constexpr,
                    SPLIT: tl.constexpr, QLIMIT: tl.constexpr):
    # out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s over the row's splits, in ascending s.
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    qb = tl.program_id(2)
    qlen = tl.load(seq_qlen_ptr + b)
    if (qlen <= QLIMIT) & (qb * BQ < qlen):
        qstart = tl.load(seq_qstart_ptr + b).to(tl.int64)
        ctx = tl.load(seq_ctx_ptr + b)
        tok, valid, head = _tile_rows(qb, qlen, kvh, G, G_P2, BQ)
        d = tl.arange(0, D)
        n_row = (ctx + tok) // SPLIT + 1  # splits holding keys <= the row's position
        n_max = (ctx + tl.minimum(qb * BQ + BQ, qlen) - 1) // SPLIT + 1
        ml = pml_ptr + (qstart + tok) * stride_mt + head * 2
        m = tl.full([BQ * G_P2], float("-inf"), tl.float32)
        for sp in range(0, n_max):
            m = tl.maximum(m, tl.load(ml + sp * stride_ms, mask=valid & (sp < n_row), other=float("-inf")))
        m = tl.where(valid, m, 0.0)
        acc = tl.zeros([BQ * G_P2, D], tl.float32)
        l = tl.zeros([BQ * G_P2], tl.float32)
        rows = (qstart + tok)[:, None]
        for sp in range(0, n_max):
            use = valid & (sp < n_row)
            w = tl.exp2(tl.load(ml + sp * stride_ms, mask=use, other=float("-inf")) - m)
            l += w * tl.load(ml + sp * stride_ms + 1, mask=use, other=0.0)
            acc += w[:, None] * tl.load(po_ptr + sp * stride_ps + rows * stride_pt + head[:, None] * D + d[None, :],
                                        mask=use[:, None], other=0.0)
        out = acc / tl.where(valid, l, 1.0)[:, None]
        tl.store(o_ptr + rows * stride_ot + head[:, None] * D + d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=valid[:, None])


ATTENTION_SPLIT = 128  # keys per split for decode / verify rows (flash-decoding); fixed, see _attention_kernel
SPLIT_MAX_QLEN = 16  # sequences with at most this many new tokens take the split path
# fp32 attention's tl.dot: "ieee" (fp32 FMA) or "tf32x3" (tensor cores, three tf32 passes: close to fp32);
# docs/gpu-notes.md has what each costs on the H200
FP32_ATTENTION_PRECISION = "tf32x3"


def attention_tile(num_heads: int, num_kv_heads: int) -> tuple[int, int]:
    """(G_P2, BQ): heads of one KV group padded to a power of two, and query tokens per 64-row tile."""
    g_p2 = _pow2(num_heads // num_kv_heads)
    return g_p2, max(1, 64 // g_p2)


def cached_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_qstart: torch.Tensor,
                     seq_qlen: torch.Tensor, seq_ctx: torch.Tensor, seq_slot: torch.Tensor, max_qlen: int,
                     scale: float, out: torch.Tensor | None = None, has_short: bool = True,
                     split: int | None = None) -> torch.Tensor:
    """Causal attention of new tokens over the slot KV cache (their own K/V already written).

    Sequence b's new tokens are q rows [seq_qstart[b], seq_qstart[b] + seq_qlen[b]) at positions
    seq_ctx[b], seq_ctx[b] + 1, ...; each attends to its slot's keys at positions <= its own. A sequence
    with seq_qlen 0 (padding) is skipped, and so are its output rows. Sequences with at most
    SPLIT_MAX_QLEN new tokens (decodes, verify blocks) are split over fixed key ranges of `split` keys
    and combined in a second kernel; longer ones (prefill chunks) run one pass per query tile.

    Args:
        q: [T, H, D]; k_cache, v_cache: [num_slots, Hkv, max_len, D].
        seq_*: int32 [B] device tensors (the shape of the work lives on the device, not in the kernel).
        max_qlen: an upper bound on seq_qlen (sets the grid only).
        scale: softmax scale (head_dim ** -0.5).
        out: optional [T, H * D] output buffer.
        has_short: some sequence may have <= SPLIT_MAX_QLEN new tokens (False skips the split kernels).
        split: keys per split (default ATTENTION_SPLIT; 0 = one pass for every sequence).

    Returns:
        [T, H * D] attention output (rows of padding tokens are left unwritten).
    """
    T, H, D = q.shape
    Hkv, L = k_cache.shape[1], k_cache.shape[2]
    g_p2, bq = attention_tile(H, Hkv)
    split = ATTENTION_SPLIT if split is None else split
    qlimit = SPLIT_MAX_QLEN if split else -1
    if out is None:
        out = torch.empty((T, H * D), dtype=q.dtype, device=q.device)
    B = seq_qlen.shape[0]
    f32 = {"ieee": 1, "tf32x3": 2}[FP32_ATTENTION_PRECISION] if q.dtype == torch.float32 else 0
    common = dict(G=H // Hkv, G_P2=g_p2, BQ=bq, D=D, BLOCK_N=64, QLIMIT=qlimit, F32=f32, num_warps=4, num_stages=2)
    meta = (seq_qstart, seq_qlen, seq_ctx, seq_slot, scale * LOG2E, q.stride(0), q.stride(1), out.stride(0), D,
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
    if max_qlen > qlimit:  # prefill chunks: one pass
        _attention_kernel[(B, Hkv, triton.cdiv(max(1, max_qlen), bq))](
            q, k_cache, v_cache, out, out, out, *meta, 0, 0, 0, 0, SPLIT=0, NSPLIT=1, **common)
    if split and has_short:
        nsplit = triton.cdiv(L, split)
        nqb = triton.cdiv(max(1, min(max_qlen, qlimit)), bq)
        po = torch.empty((nsplit, T, H * D), dtype=torch.float32, device=q.device)
        pml = torch.empty((nsplit, T, H * 2), dtype=torch.float32, device=q.device)
        _attention_kernel[(B, Hkv, nqb * nsplit)](
            q, k_cache, v_cache, out, po, pml, *meta, po.stride(0), po.stride(1), pml.stride(0), pml.stride(1),
            SPLIT=split, NSPLIT=nsplit, **common)
        _combine_kernel[(B, Hkv, nqb)](out, po, pml, seq_qstart, seq_qlen, seq_ctx, out.stride(0), po.stride(0),
                                       po.stride(1), pml.stride(0), pml.stride(1), G=H // Hkv, G_P2=g_p2, BQ=bq,
                                       D=D, SPLIT=split, QLIMIT=qlimit, num_warps=4)
    return out


# ---- batch-invariant linear ----------------------------------------------------------------------


@triton.jit(do_not_specialize=["M"])
def _invariant_mm_kernel(x_ptr, w_ptr, y_ptr, M, N, K, K_SPLIT, stride_xm, stride_wn, stride_ys, stride_ym,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    sid = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k0 = sid * K_SPLIT
    k_end = tl.minimum(k0 + K_SPLIT, K)
    for k in range(k0, k_end, BLOCK_K):
        kk = k + rk
        a = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + kk[None, :],
                    mask=(rm[:, None] < M) & (kk[None, :] < k_end), other=0.0)
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_wn + kk[None, :],
                    mask=(rn[:, None] < N) & (kk[None, :] < k_end), other=0.0)
        if IEEE:
            acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(w), acc)
    tl.store(y_ptr + sid * stride_ys + rm[:, None].to(tl.int64) * stride_ym + rn[None, :], acc,
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit(do_not_specialize=["M"])
def _split_sum_kernel(p_ptr, b_ptr, y_ptr, M, N, S, stride_ps, stride_pm, stride_ym,
                      HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(0, S):  # fixed order over the K splits
        acc += tl.load(p_ptr + s * stride_ps + row * stride_pm + cols, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_ym + cols, acc.to(y_ptr.dtype.element_ty), mask=mask)


INVARIANT_BLOCK_M, INVARIANT_BLOCK_N, INVARIANT_BLOCK_K = 64, 64, 64


def invariant_k_split(N: int, K: int) -> int:
    """Keys per K split of the batch-invariant linear, a function of the weight shape only: enough
    (N tile, K split) programs to keep the GPU busy even for one row, never a function of M."""
    tiles = triton.cdiv(N, INVARIANT_BLOCK_N)
    splits = max(1, min(triton.cdiv(K, 4 * INVARIANT_BLOCK_K), triton.cdiv(264, tiles)))
    return triton.cdiv(triton.cdiv(K, splits), INVARIANT_BLOCK_K) * INVARIANT_BLOCK_K


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ weight.T + bias with a reduction order that depends on the weight shape only.

    Each output element sums its K products in fixed K splits (fp32, ascending k within a split), then
    the splits in ascending order, then adds the bias: the same operations whatever M is, so a row's
    result is bit-identical alone or in a batch (cf. He et al. 2025, "Defeating Nondeterminism in LLM
    Inference"). Slower than cuBLAS; used only in batch-invariant mode.

    Args:
        x: [M, K]; weight: [N, K]; bias: [N] or None.

    Returns:
        [M, N] in x's dtype.
    """
    M, K = x.shape
    N = weight.shape[0]
    ks = invariant_k_split(N, K)
    S = triton.cdiv(K, ks)
    ieee = x.dtype == torch.float32
    part = torch.empty((S, M, N), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(M, INVARIANT_BLOCK_M), triton.cdiv(N, INVARIANT_BLOCK_N), S)
    _invariant_mm_kernel[grid](x, weight, part, M, N, K, ks, x.stride(0), weight.stride(0), part.stride(0),
                               part.stride(1), BLOCK_M=INVARIANT_BLOCK_M, BLOCK_N=INVARIANT_BLOCK_N,
                               BLOCK_K=INVARIANT_BLOCK_K, IEEE=ieee, num_warps=4, num_stages=3)
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    BLOCK = 1024
    _split_sum_kernel[(M, triton.cdiv(N, BLOCK))](part, bias if bias is not None else part, y, M, N, S,
                                                  part.stride(0), part.stride(1), y.stride(0),
                                                  HAS_BIAS=bias is not None, BLOCK=BLOCK, num_warps=4)
    return y
