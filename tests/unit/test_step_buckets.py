"""CUDA-graph shape buckets and step packing (pure numpy: runs on the CPU)."""

from __future__ import annotations

import numpy as np
import pytest

from specserve.engine.step_buckets import Bucket, BucketSet, StepLayout, pack_step


def test_bucket_set_covers_every_step_shape_up_to_its_limits():
    bs = BucketSet(max_num_seqs=16, max_qlen=8)
    assert bs.max_seqs == 16 and bs.max_tokens == 128
    for B in range(1, 17):
        for q in range(1, 9):
            for T in (B, (B * q + B) // 2, B * q):
                b = bs.pick(B, T, q)
                assert b is not None and b.num_seqs >= B and b.num_tokens >= T
                # the smallest token count that holds it
                assert not any(B <= o.num_seqs and T <= o.num_tokens < b.num_tokens for o in bs.buckets)


def test_bucket_set_sends_outsized_steps_to_eager():
    bs = BucketSet(max_num_seqs=4, max_qlen=8, max_tokens=16)
    assert bs.pick(1, 9, 9) is None  # one sequence longer than max_qlen (a prefill chunk)
    assert bs.pick(4, 17, 5) is None  # more tokens than any bucket
    assert bs.pick(5, 5, 1) is None  # more sequences than slots
    assert bs.pick(3, 3, 1) == Bucket(4, 4, 8)  # 4 sequence entries is the smallest count >= 3 here


def test_bucket_shapes_are_possible_steps_only():
    bs = BucketSet(max_num_seqs=16, max_qlen=4)
    assert all(b.num_seqs <= b.num_tokens <= 4 * b.num_seqs and b.max_qlen == 4 for b in bs.buckets)
    with pytest.raises(ValueError):
        BucketSet(max_num_seqs=0)
    with pytest.raises(ValueError):
        BucketSet(max_num_seqs=4, prefill_tokens=-1)


def test_prefill_buckets_take_long_sequences_beside_short_ones():
    """Prefill buckets hold a prompt chunk (or a draft's catch-up) of up to `prefill_tokens` with short
    sequences beside it; a step of short sequences still takes a decode bucket of the same size, and a
    step past every prefill bucket runs eagerly (None)."""
    bs = BucketSet(max_num_seqs=16, max_qlen=16, max_tokens=256, prefill_tokens=512)
    assert bs.max_qlen == 512 and bs.max_tokens == 512
    b = bs.pick(1, 300, 300)  # one prompt chunk of 300 tokens
    assert b == Bucket(384, 1, 384)
    b = bs.pick(16, 15 + 200, 200)  # 15 decodes and a 200-token chunk
    assert b == Bucket(256, 16, 256)
    assert bs.pick(16, 32, 2) == Bucket(32, 16, 16)  # verify blocks: the decode bucket, not the prefill one
    assert bs.pick(16, 32, 17) == Bucket(32, 16, 32)  # one sequence of 17: the prefill one
    assert bs.pick(1, 513, 513) is None and bs.pick(2, 520, 500) is None
    for b in bs.buckets:
        assert b.num_seqs <= b.num_tokens and (b.max_qlen == 16 or b.max_qlen == b.num_tokens)
    assert BucketSet(max_num_seqs=16, max_qlen=16, max_tokens=256).max_qlen == 16  # prefill_tokens 0: none
    # fits: the same rule by per-sequence lengths; max_tokens_at_max_qlen: the largest bucket that takes a
    # sequence of max_qlen (what a draft may feed in one graph forward)
    assert bs.fits([300]) and bs.fits([1] * 15 + [200]) and not bs.fits([513]) and not bs.fits([500, 20])
    assert bs.max_tokens_at_max_qlen == 512
    decode_only = BucketSet(max_num_seqs=4, max_qlen=4, max_tokens=8)
    assert decode_only.max_qlen == 4 and decode_only.max_tokens_at_max_qlen == 8 and not decode_only.fits([5])
    assert BucketSet(max_num_seqs=2, max_qlen=2, max_tokens=8, prefill_tokens=12,
                     prefill_sizes=(6, 12)).max_tokens_at_max_qlen == 12
    wide = BucketSet(max_num_seqs=64, max_qlen=16, max_tokens=512, prefill_tokens=256)  # decode buckets larger
    assert wide.max_tokens == 512 and wide.max_qlen == 256 and wide.max_tokens_at_max_qlen == 256


def test_pack_step_pads_tokens_and_sequences():
    layout = StepLayout(max_tokens=16, max_seqs=4)
    buf = np.full(layout.size, 777, dtype=np.int32)
    # seq 0: a decode (1 token at position 10, slot 3); seq 1: a verify block of 3 tokens at 5..7 in
    # slot 0; seq 2: a prefill chunk of 4 tokens at 0..3 in slot 2 that samples its last token.
    R = pack_step(buf, layout, slots=[3, 0, 2], starts=[10, 5, 0], token_ids=[[11], [21, 22, 23], [31, 32, 33, 34]],
                  num_logits=[1, 3, 1], num_tokens=10, num_seqs=4)
    f = lambda name, n: layout.field(buf, name, n).tolist()  # noqa: E731
    assert R == 5
    assert f("input_ids", 10) == [11, 21, 22, 23, 31, 32, 33, 34, 0, 0]
    assert f("positions", 10) == [10, 5, 6, 7, 0, 1, 2, 3, 0, 0]
    assert f("token_slots", 10) == [3, 0, 0, 0, 2, 2, 2, 2, -1, -1]  # padding tokens write no KV
    assert f("logits_rows", 10) == [0, 1, 2, 3, 7, 0, 0, 0, 0, 0]  # real rows first, then padding -> row 0
    assert f("seq_qstart", 4) == [0, 1, 4, 8]
    assert f("seq_qlen", 4) == [1, 3, 4, 0]  # the padding sequence has no work
    assert f("seq_ctx", 4) == [10, 5, 0, 0]
    assert f("seq_slot", 4) == [3, 0, 2, 0]
    # nothing written past the bucket's share of each field
    assert layout.field(buf, "input_ids", 16).tolist()[10:] == [777] * 6
    assert layout.field(buf, "seq_slot", 4).tolist() == [3, 0, 2, 0]


def test_pack_step_non_final_prefill_chunk_has_no_logits_rows():
    layout = StepLayout(max_tokens=8, max_seqs=2)
    buf = np.zeros(layout.size, dtype=np.int32)
    R = pack_step(buf, layout, [1], [0], [[5, 6, 7]], [0], num_tokens=3, num_seqs=1)
    assert R == 0 and layout.field(buf, "positions", 3).tolist() == [0, 1, 2]


def test_pack_step_rejects_what_does_not_fit():
    layout = StepLayout(max_tokens=4, max_seqs=2)
    buf = np.zeros(layout.size, dtype=np.int32)
    with pytest.raises(ValueError, match="does not fit"):
        pack_step(buf, layout, [0], [0], [[1, 2, 3]], [1], num_tokens=2, num_seqs=1)
    with pytest.raises(ValueError, match="does not fit"):
        pack_step(buf, layout, [0, 1, 2], [0, 0, 0], [[1], [2], [3]], [1, 1, 1], num_tokens=3, num_seqs=3)
    with pytest.raises(ValueError, match="num_logits"):
        pack_step(buf, layout, [0], [0], [[1, 2]], [3], num_tokens=2, num_seqs=1)
