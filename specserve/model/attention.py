"""Batched causal attention over a slot-based KV cache, for ragged batches of new tokens.

What it does: writes each new token's key/value into its request's cache slot at its position, then
lets every new token attend to all cached positions <= its own position in its own slot. One step may
hold prefill chunks (many tokens per request) and verify blocks (last token + k drafts) side by side.
What it does not do: own the cache memory (see `specserve.engine.kv_cache`) or decide positions.

Stale entries past a request's length (left by rejected drafts) are never read: a query at position p
only sees keys at positions <= p, and every such key was written in this or an earlier step. This is
why rolling back a request is just lowering its length (`KVCache.truncate`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Where the T new tokens of one step go, built once per step and shared by every layer.

    Attributes:
        slots: int64 [T], cache slot of each new token.
        positions: int64 [T], position of each new token in its sequence.
        batch_slots: int64 [B], cache slot of each request in the step.
        token_batch_idx: int64 [T], which request (0..B-1) each token belongs to.
        token_query_idx: int64 [T], index of the token among its request's new tokens.
        max_query_len: Qmax, most new tokens of any request in the step.
        max_context_len: Lmax, longest context (cached + new) of any request in the step.
        mask: bool [B, 1, Qmax, Lmax], True where attention is allowed.
        single_slot: the slot when B == 1 (the cache slice is then a view, not a copy), else None.
    """

    slots: torch.Tensor
    positions: torch.Tensor
    batch_slots: torch.Tensor
    token_batch_idx: torch.Tensor
    token_query_idx: torch.Tensor
    max_query_len: int
    max_context_len: int
    mask: torch.Tensor
    single_slot: int | None

    @classmethod
    def build(
        cls, slots: list[int], start_positions: list[int], query_lens: list[int], device: torch.device
    ) -> "AttentionMetadata":
        """Metadata for B requests: request b writes `query_lens[b]` tokens at positions
        `start_positions[b]` ... into cache slot `slots[b]`.

        Raises:
            ValueError: a request with zero new tokens.
        """
        if any(q <= 0 for q in query_lens):
            raise ValueError("every request in a step needs at least one new token")
        B = len(slots)
        qmax = max(query_lens)
        lmax = max(s + q for s, q in zip(start_positions, query_lens))
        tok_b, tok_q, tok_slot, tok_pos = [], [], [], []
        for b, (slot, start, q) in enumerate(zip(slots, start_positions, query_lens)):
            tok_b += [b] * q
            tok_q += range(q)
            tok_slot += [slot] * q
            tok_pos += range(start, start + q)
        starts = torch.tensor(start_positions, dtype=torch.int64)
        qlens = torch.tensor(query_lens, dtype=torch.int64)
        qi = torch.arange(qmax)
        # Padded query rows (qi >= qlen) attend to position 0 only, so no row is fully masked (NaN).
        qpos = torch.where(qi[None, :] < qlens[:, None], starts[:, None] + qi[None, :], 0)  # [B, Qmax]
        mask = torch.arange(lmax)[None, None, :] <= qpos[:, :, None]  # [B, Qmax, Lmax]

        def t(x):
            return torch.tensor(x, dtype=torch.int64, device=device)

        return cls(
            slots=t(tok_slot),
            positions=t(tok_pos),
            batch_slots=t(slots),
            token_batch_idx=t(tok_b),
            token_query_idx=t(tok_q),
            max_query_len=qmax,
            max_context_len=lmax,
            mask=mask[:, None].to(device),
            single_slot=slots[0] if B == 1 else None,
        )


def cached_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write k/v into the cache, then attend.

    Args:
        q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] (after RoPE).
        k_cache, v_cache: [num_slots, num_kv_heads, max_len, head_dim], updated in place.
        meta: this step's `AttentionMetadata`.
        scale: softmax scale, usually head_dim ** -0.5.

    Returns:
        [T, num_heads * head_dim] attention output, in token order.
    """
    k_cache[meta.slots, :, meta.positions] = k
    v_cache[meta.slots, :, meta.positions] = v
    L = meta.max_context_len
    s = meta.single_slot
    if s is not None:
        kb, vb = k_cache[s : s + 1, :, :L], v_cache[s : s + 1, :, :L]
        qb = q.transpose(0, 1).unsqueeze(0)  # [1, H, T, D]
    else:
        kb, vb = k_cache[meta.batch_slots, :, :L], v_cache[meta.batch_slots, :, :L]  # [B, Hkv, L, D]
        B, T, H, D = meta.batch_slots.shape[0], q.shape[0], q.shape[1], q.shape[2]
        qp = q.new_zeros(B, meta.max_query_len, H, D)
        qp[meta.token_batch_idx, meta.token_query_idx] = q
        qb = qp.transpose(1, 2)  # [B, H, Qmax, D]
    out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=meta.mask, scale=scale, enable_gqa=True)
    out = out.transpose(1, 2)  # [B, Qmax, H, D]
    if s is not None:
        return out[0].reshape(q.shape[0], -1)
    return out[meta.token_batch_idx, meta.token_query_idx].reshape(q.shape[0], -1)
