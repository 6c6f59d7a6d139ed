"""Attention over the slot KV cache for a ragged step (prefill chunks, decodes, verify blocks) against a
plain softmax reference; each sequence's result does not depend on the rest of the batch."""

from __future__ import annotations

import torch

from specserve.model.attention import AttentionMetadata, cached_attention

H, HKV, D, SLOTS, MAXLEN = 4, 2, 8, 5, 32


def reference(q, k_cache, v_cache, slot, p0, scale):
    """q [Q, H, D] at positions p0.. of `slot`: softmax over keys <= own position, GQA by repetition."""
    Q = q.shape[0]
    keys = k_cache[slot, :, : p0 + Q].repeat_interleave(H // HKV, 0)  # [H, L, D]
    vals = v_cache[slot, :, : p0 + Q].repeat_interleave(H // HKV, 0)
    s = torch.einsum("qhd,hld->hql", q.double(), keys.double()) * scale
    allowed = torch.arange(p0 + Q)[None, :] <= torch.arange(p0, p0 + Q)[:, None]
    s = s.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hql,hld->qhd", s.softmax(-1), vals.double()).reshape(Q, H * D).float()


def test_ragged_step_matches_reference_and_writes_the_cache():
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(SLOTS, HKV, MAXLEN, D, generator=gen)  # old keys, and stale ones past every length
    v_cache = torch.randn(SLOTS, HKV, MAXLEN, D, generator=gen)
    # slot, first position, new tokens: a first prompt chunk, a later chunk, a decode, a verify block
    seqs = [(3, 0, 6), (0, 5, 4), (4, 9, 1), (1, 7, 4)]
    T = sum(n for _, _, n in seqs)
    q, k, v = (torch.randn(T, h, D, generator=gen) for h in (H, HKV, HKV))
    stale = k_cache.clone()
    meta = AttentionMetadata.build([s for s, _, _ in seqs], [p for _, p, _ in seqs], [n for _, _, n in seqs], torch.device("cpu"))
    with torch.inference_mode():
        out = cached_attention(q, k, v, k_cache, v_cache, meta, D**-0.5)
    assert out.shape == (T, H * D)
    t = 0
    for slot, p0, n in seqs:
        assert torch.equal(k_cache[slot, :, p0 : p0 + n], k[t : t + n].transpose(0, 1))
        assert torch.equal(v_cache[slot, :, p0 : p0 + n], v[t : t + n].transpose(0, 1))
        assert torch.equal(k_cache[slot, :, p0 + n :], stale[slot, :, p0 + n :])  # nothing else touched
        torch.testing.assert_close(out[t : t + n], reference(q[t : t + n], k_cache, v_cache, slot, p0, D**-0.5),
                                   rtol=1e-5, atol=1e-5)
        t += n
    assert torch.equal(k_cache[2], stale[2])  # an unused slot

    # the verify block alone gives the same bits as inside the batch
    slot, p0, n = seqs[3]
    alone = AttentionMetadata.build([slot], [p0], [n], torch.device("cpu"))
    with torch.inference_mode():
        again = cached_attention(q[T - n :], k[T - n :], v[T - n :], k_cache, v_cache, alone, D**-0.5)
    assert torch.equal(again, out[T - n :])


def test_a_sequence_without_new_tokens_is_refused():
    import pytest

    with pytest.raises(ValueError, match="at least one new token"):
        AttentionMetadata.build([0, 1], [3, 4], [2, 0], torch.device("cpu"))
