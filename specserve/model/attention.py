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


# Sequences with more new tokens than this (prefill chunks) are attended one by one; shorter ones
# (decode and verify blocks) are padded into one batched call. Padding a batch to a prefill chunk's
# length would multiply the attention work by the batch size.
MAX_PADDED_QUERY = 16


@dataclass
class AttentionPart:
    """A contiguous run of the step's tokens attended in one SDPA call.

    Attributes:
        start, end: the part's tokens are [start, end) of the step's flat tokens.
        batch_slots: int64 [Bp], cache slot of each sequence in the part.
        single_slot: the slot when the part is one sequence (its cache slice is a view), else None.
        token_batch_idx, token_query_idx: int64 [end - start], each token's sequence (0..Bp-1) and its
            index among that sequence's new tokens.
        max_query_len, max_context_len: Qmax and Lmax of the part.
        mask: bool [Bp, 1, Qmax, Lmax], True where attention is allowed.
    """

    start: int
    end: int
    batch_slots: torch.Tensor
    single_slot: int | None
    token_batch_idx: torch.Tensor
    token_query_idx: torch.Tensor
    max_query_len: int
    max_context_len: int
    mask: torch.Tensor


@dataclass
class AttentionMetadata:
    """Where the T new tokens of one step go, built once per step and shared by every layer.

    Attributes:
        slots: int64 [T], cache slot of each new token.
        positions: int64 [T], position of each new token in its sequence.
        parts: the attention calls of the step (see `AttentionPart`), covering [0, T) in order.
    """

    slots: torch.Tensor
    positions: torch.Tensor
    parts: list[AttentionPart]

    @classmethod
    def build(
        cls, slots: list[int], start_positions: list[int], query_lens: list[int], device: torch.device
    ) -> "AttentionMetadata":
        """Metadata for B sequences: sequence b writes `query_lens[b]` tokens at positions
        `start_positions[b]` ... into cache slot `slots[b]`; its tokens follow sequence b - 1's.

        Raises:
            ValueError: a sequence with zero new tokens.
        """
        if any(q <= 0 for q in query_lens):
            raise ValueError("every request in a step needs at least one new token")
        tok_slot, tok_pos = [], []
        for slot, start, q in zip(slots, start_positions, query_lens):
            tok_slot += [slot] * q
            tok_pos += range(start, start + q)
        groups: list[list[int]] = []  # consecutive short sequences share a group; a long one is alone
        for b, q in enumerate(query_lens):
            if q <= MAX_PADDED_QUERY and groups and query_lens[groups[-1][-1]] <= MAX_PADDED_QUERY:
                groups[-1].append(b)
            else:
                groups.append([b])
        offsets = [0]
        for q in query_lens:
            offsets.append(offsets[-1] + q)
        parts = [
            _part([slots[b] for b in g], [start_positions[b] for b in g], [query_lens[b] for b in g],
                  offsets[g[0]], offsets[g[-1] + 1], device)
            for g in groups
        ]

        def t(x):
            return torch.tensor(x, dtype=torch.int64, device=device)

        return cls(slots=t(tok_slot), positions=t(tok_pos), parts=parts)


def _part(slots, starts_l, qlens_l, start, end, device) -> AttentionPart:
    qmax = max(qlens_l)
    lmax = max(s + q for s, q in zip(starts_l, qlens_l))
    tok_b, tok_q = [], []
    for b, q in enumerate(qlens_l):
        tok_b += [b] * q
        tok_q += range(q)
    starts = torch.tensor(starts_l, dtype=torch.int64)
    qlens = torch.tensor(qlens_l, dtype=torch.int64)
    qi = torch.arange(qmax)
    # Padded query rows (qi >= qlen) attend to position 0 only, so no row is fully masked (NaN).
    qpos = torch.where(qi[None, :] < qlens[:, None], starts[:, None] + qi[None, :], 0)  # [Bp, Qmax]
    mask = torch.arange(lmax)[None, None, :] <= qpos[:, :, None]  # [Bp, Qmax, Lmax]

    def t(x):
        return torch.tensor(x, dtype=torch.int64, device=device)

    return AttentionPart(start, end, t(slots), slots[0] if len(slots) == 1 else None, t(tok_b), t(tok_q),
                         qmax, lmax, mask[:, None].to(device))


def cached_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write k/v into the cache, then attend, part by part.

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
    outs = [_attend_part(q[p.start : p.end], k_cache, v_cache, p, scale) for p in meta.parts]
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _attend_part(q, k_cache, v_cache, p: AttentionPart, scale: float) -> torch.Tensor:
    L = p.max_context_len
    s = p.single_slot
    if s is not None:
        kb, vb = k_cache[s : s + 1, :, :L], v_cache[s : s + 1, :, :L]
        qb = q.transpose(0, 1).unsqueeze(0)  # [1, H, T, D]
    else:
        kb, vb = k_cache[p.batch_slots, :, :L], v_cache[p.batch_slots, :, :L]  # [Bp, Hkv, L, D]
        B, H, D = p.batch_slots.shape[0], q.shape[1], q.shape[2]
        qp = q.new_zeros(B, p.max_query_len, H, D)
        qp[p.token_batch_idx, p.token_query_idx] = q
        qb = qp.transpose(1, 2)  # [Bp, H, Qmax, D]
    out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=p.mask, scale=scale, enable_gqa=True)
    out = out.transpose(1, 2)  # [Bp, Qmax, H, D]
    if s is not None:
        return out[0].reshape(q.shape[0], -1)
    return out[p.token_batch_idx, p.token_query_idx].reshape(q.shape[0], -1)
