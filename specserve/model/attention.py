"""Causal attention over a slot-based KV cache, for ragged batches of new tokens (the eager path the CPU
runs; CUDA has its own kernels in `specserve.model.fused_forward`).

What it does: writes each new token's key/value into its request's cache slot at its position, then
lets every new token attend to all cached positions <= its own position in its own slot. One step may
hold prefill chunks (many tokens per request) and verify blocks (last token + k drafts) side by side.
Each sequence is attended in its own SDPA call over a view of its slot (no gather, no padding, no copy
of the cache): on the CPU this was 1.6-1.9x faster than padding a batch of decode/verify rows and
gathering their slots (docs/cpu_performance.md), and a sequence's result does not depend on what else
is in the batch. The masks are built once per step (`AttentionMetadata.build`) and shared by every layer.
Verify blocks row by row where the kernel needs it: a verify block (the last token and k drafts, every
row sampled) must give each row the bits a one-token decode at that position would, or a seeded
request draws other tokens with speculation than without (and greedy can leave the baseline at a
near-tie). torch's CPU SDPA does not promise that: on a Zen 5 host (AVX-512, torch 2.13) a row of a
5-query masked call differed from the same row as a 1-query call over its prefix (~1e-5 in the logits;
the math and flash backends alike), while the linear layers are row independent
(`specserve.model.cpu_linear`). `sdpa_rows_match_decodes` checks this once per model shape on random
data; where rows differ, the runner asks `AttentionMetadata.build` to attend each row of a verify block
as its own one-query call over its own prefix: exactly a decode's call, and k + 1 calls instead of one
per layer (docs/cpu_performance.md has the cost). Prefill chunks keep one call.
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
class SeqAttention:
    """One sequence's attention call.

    Attributes:
        start, end: its tokens are [start, end) of the step's flat tokens.
        slot: its KV cache slot.
        context_len: L, positions it attends (its first new token's position + its new tokens).
        mask: None (one new token: it sees all L keys; or a first prompt chunk: plain causal, `is_causal`)
            or bool [1, 1, Q, L], True where attention is allowed (Q new tokens after L - Q cached ones).
        is_causal: the chunk starts at position 0, so SDPA's own causal mask is the right one.
    """

    start: int
    end: int
    slot: int
    context_len: int
    mask: torch.Tensor | None
    is_causal: bool


@dataclass
class AttentionMetadata:
    """Where the T new tokens of one step go, built once per step and shared by every layer.

    Attributes:
        slots: int64 [T], cache slot of each new token.
        positions: int64 [T], position of each new token in its sequence.
        seqs: one `SeqAttention` per sequence, covering [0, T) in order.
    """

    slots: torch.Tensor
    positions: torch.Tensor
    seqs: list[SeqAttention]

    @classmethod
    def build(
        cls, slots: list[int], start_positions: list[int], query_lens: list[int], device: torch.device,
        by_row: list[bool] | None = None, masks: bool = True,
    ) -> "AttentionMetadata":
        """Metadata for B sequences: sequence b writes `query_lens[b]` tokens at positions
        `start_positions[b]` ... into cache slot `slots[b]`; its tokens follow sequence b - 1's.
        Where `by_row[b]` is true, sequence b is attended one query row at a time (each row a
        one-token call over its own prefix, as a decode at that position; see the module docstring).
        `masks=False` leaves every mask None, for attention that reads only `slots` and `positions` (the
        fused CPU kernels, `specserve.model.cpu_layer_ops`).

        Raises:
            ValueError: a sequence with zero new tokens.
        """
        if any(q <= 0 for q in query_lens):
            raise ValueError("every request in a step needs at least one new token")
        tok_slot, tok_pos, seqs, t = [], [], [], 0
        for b, (slot, p0, q) in enumerate(zip(slots, start_positions, query_lens)):
            tok_slot += [slot] * q
            tok_pos += range(p0, p0 + q)
            if q > 1 and by_row is not None and by_row[b]:
                seqs += [SeqAttention(t + i, t + i + 1, slot, p0 + i + 1, None, False) for i in range(q)]
                t += q
                continue
            mask = None
            if masks and q > 1 and p0 > 0:  # bottom-right causal: new token i sees positions <= p0 + i
                mask = (torch.arange(p0 + q, device=device)[None, :]
                        <= torch.arange(p0, p0 + q, device=device)[:, None])[None, None]
            seqs.append(SeqAttention(t, t + q, slot, p0 + q, mask, q > 1 and p0 == 0))
            t += q
        flat = torch.tensor(tok_slot + tok_pos, dtype=torch.int64).to(device)
        return cls(slots=flat[:t], positions=flat[t:], seqs=seqs)


def sdpa_rows_match_decodes(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                            device: torch.device, max_query: int = 16, contexts: tuple[int, ...] = (61, 1100)) -> bool:
    """Whether SDPA gives each row of a Q-query block with the bottom-right causal mask (as
    `cached_attention` calls it for a verify block) the same bits as a one-query call over that row's
    prefix (a decode), for Q = 2..max_query, on random data of this head shape after each of `contexts`
    cached positions (CPU kernels block the keys by length). Deterministic (its own generator); a few
    ms on a CPU."""
    gen = torch.Generator().manual_seed(0)
    scale = head_dim ** -0.5
    for context in contexts:
        L = context + max_query
        k = torch.randn(1, num_kv_heads, L, head_dim, generator=gen).to(device, dtype)
        v = torch.randn(1, num_kv_heads, L, head_dim, generator=gen).to(device, dtype)
        q = torch.randn(1, num_heads, max_query, head_dim, generator=gen).to(device, dtype)
        with torch.inference_mode():
            one = [F.scaled_dot_product_attention(q[:, :, i : i + 1], k[:, :, : context + i + 1],
                                                  v[:, :, : context + i + 1], scale=scale, enable_gqa=True)
                   for i in range(max_query)]
            for n in range(2, max_query + 1):
                meta = AttentionMetadata.build([0], [context], [n], device)
                block = F.scaled_dot_product_attention(q[:, :, :n], k[:, :, : context + n], v[:, :, : context + n],
                                                       attn_mask=meta.seqs[0].mask, scale=scale, enable_gqa=True)
                if not all(torch.equal(block[:, :, i : i + 1], one[i]) for i in range(n)):
                    return False
    return True


def cached_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write k/v into the cache, then attend, sequence by sequence over views of the cache.

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
    outs = []
    for s in meta.seqs:
        L = s.context_len
        qs = q[s.start : s.end].transpose(0, 1).unsqueeze(0)  # [1, H, Q, D] (a view)
        o = F.scaled_dot_product_attention(
            qs, k_cache[s.slot : s.slot + 1, :, :L], v_cache[s.slot : s.slot + 1, :, :L],
            attn_mask=s.mask, is_causal=s.is_causal, scale=scale, enable_gqa=True,
        )  # [1, H, Q, D]
        outs.append(o[0].transpose(0, 1).reshape(s.end - s.start, -1))
    return outs[0] if len(outs) == 1 else torch.cat(outs)
