"""Attention over the slot KV cache for a ragged step (prefill chunks, decodes, verify blocks) against a
plain softmax reference; each sequence's result does not depend on the rest of the batch."""

from __future__ import annotations

import pytest
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


def test_a_verify_block_attended_by_row_gives_decode_bits():
    """`by_row`: each row of a verify block (4 new tokens after 29 cached) is attended as its own
    one-query call over its own prefix, so its output is bit-identical to four one-token decodes at
    those positions, whatever this machine's SDPA does for a 4-query call; a sequence beside it keeps
    one call."""
    gen = torch.Generator().manual_seed(3)
    H, Hkv, D, ctx, n = 4, 2, 16, 29, 4
    kc = torch.zeros(2, Hkv, 64, D)
    vc = torch.zeros(2, Hkv, 64, D)
    kc[:, :, :ctx] = torch.randn(2, Hkv, ctx, D, generator=gen)
    vc[:, :, :ctx] = torch.randn(2, Hkv, ctx, D, generator=gen)
    q = torch.randn(n + 3, H, D, generator=gen)
    k = torch.randn(n + 3, Hkv, D, generator=gen)
    v = torch.randn(n + 3, Hkv, D, generator=gen)
    meta = AttentionMetadata.build([0, 1], [ctx, ctx], [n, 3], torch.device("cpu"), by_row=[True, False])
    assert len(meta.seqs) == n + 1 and all(s.mask is None and s.end - s.start == 1 for s in meta.seqs[:n])
    block = cached_attention(q, k, v, kc.clone(), vc.clone(), meta, D ** -0.5)
    k2, v2 = kc.clone(), vc.clone()
    for i in range(n):  # the same rows as one-token decodes, one step at a time
        one = AttentionMetadata.build([0], [ctx + i], [1], torch.device("cpu"))
        out = cached_attention(q[i : i + 1], k[i : i + 1], v[i : i + 1], k2, v2, one, D ** -0.5)
        assert torch.equal(out, block[i : i + 1]), i
    plain = AttentionMetadata.build([1], [ctx], [3], torch.device("cpu"))
    assert torch.equal(cached_attention(q[n:], k[n:], v[n:], kc.clone(), vc.clone(), plain, D ** -0.5), block[n:])


@pytest.mark.parametrize("layer_ops", ["torch", "auto"])
def test_the_runner_gives_a_verify_block_the_logits_of_one_token_decodes(tiny_model_dir, monkeypatch, layer_ops):
    """The guarantee the row-by-row attention exists for, on the runner the engine uses (its own probe
    decides whether it is needed on this CPU): the logits of a 5-token verify block after a 37-token
    prompt are bit-identical to five one-token decodes at the same positions. Both with the eager ops
    and with the fused CPU kernels (`auto`, where they can be built), which need no probe."""
    from specserve import LLM
    from specserve.engine.model_runner import SeqInput

    from specserve.model.cpu_layer_ops import EXTENSION

    monkeypatch.setenv("SPECSERVE_CPU_LAYER_KERNELS", layer_ops)
    llm = LLM(str(tiny_model_dir), max_model_len=128, max_num_seqs=2, device="cpu")
    fused = layer_ops == "auto" and EXTENSION.available()
    assert llm.engine.target.model.layer_backend == ("native" if fused else "torch")
    t = llm.engine.target
    s = t.kv.allocate()
    prompt, block = [(7 * i + 3) % 300 for i in range(37)], [11, 52, 77, 199, 242]
    with torch.inference_mode():
        t.runner.forward([SeqInput(s, 0, prompt, 1)])
        verify = t.runner.forward([SeqInput(s, len(prompt), block, len(block))]).clone()
        t.kv.truncate(s, len(prompt))
        decodes = torch.cat([t.runner.forward([SeqInput(s, len(prompt) + i, [tok], 1)]).clone()
                             for i, tok in enumerate(block)])
    assert torch.equal(verify, decodes)
