"""Shape buckets for CUDA-graph steps, and packing one step's sequences into a padded flat layout.

What it does: `BucketSet` lists the (tokens, sequences, longest sequence) shapes that get a captured CUDA
graph, decode buckets and prefill buckets, and picks the smallest one that holds a step; `pack_step` writes a step's token ids, positions, slots, logits rows
and per-sequence layout into one int32 array with fixed field offsets (`StepLayout`), padded to the
bucket: padding tokens get slot -1 (no KV write), padding sequences get 0 new tokens (no attention
work), padding logits rows point at row 0 and are never returned. One array means one host-to-device
copy per step. Pure numpy: no torch, no CUDA (tested on the CPU).
What it does not do: run or capture anything (`specserve.engine.cuda_graph_runner`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

# Token counts are what a step's cost follows (matmul rows), so they are fine-grained; sequence counts
# only size the attention grid (a padding sequence's programs exit at once), so they are coarse.
DEFAULT_TOKEN_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128,
                       160, 192, 224, 256, 320, 384, 448, 512)
DEFAULT_SEQ_SIZES = (1, 4, 16, 64, 256)
# Token counts of the prefill buckets (steps with a sequence of more than max_qlen new tokens: a prompt
# chunk, a draft model's catch-up). Such steps cost what their tokens cost (compute), so padding them to a
# coarse size wastes less than an eager forward's launches (~12-15 ms on the H200) would.
PREFILL_TOKEN_SIZES = (32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)


@dataclass(frozen=True, order=True)
class Bucket:
    """A captured step shape: `num_tokens` token rows (>= num_seqs) over `num_seqs` sequence entries, of
    which none has more than `max_qlen` new tokens (the attention grid is sized for it)."""

    num_tokens: int
    num_seqs: int
    max_qlen: int


class BucketSet:
    """The graph shapes of one runner.

    Two families: decode buckets, whose sequences have at most `max_qlen` new tokens each (decodes,
    verify blocks, short prompt tails), and prefill buckets, which hold one or more sequences of up to
    all their tokens (a prompt chunk, a draft model's catch-up on a prompt) beside short ones. A prefill
    bucket's attention grid is sized for its longest possible sequence; its padding tiles exit at once.

    Args:
        max_num_seqs: most sequences in one step (the KV slot count).
        max_qlen: most new tokens of one sequence in a decode bucket (1 + the largest k served by graphs).
        max_tokens: most tokens of a decode bucket.
        prefill_tokens: most tokens of a prefill bucket (0: none; longer steps run eagerly).
        token_sizes, seq_sizes, prefill_sizes: candidate sizes (each list is cut to the limits;
            max_num_seqs is added to the sequence sizes).

    Raises:
        ValueError: a limit below 1 (prefill_tokens below 0).
    """

    def __init__(self, max_num_seqs: int, max_qlen: int = 16, max_tokens: int = 512, prefill_tokens: int = 0,
                 token_sizes: Sequence[int] = DEFAULT_TOKEN_SIZES, seq_sizes: Sequence[int] = DEFAULT_SEQ_SIZES,
                 prefill_sizes: Sequence[int] = PREFILL_TOKEN_SIZES):
        if min(max_num_seqs, max_qlen, max_tokens) < 1 or prefill_tokens < 0:
            raise ValueError("max_num_seqs, max_qlen and max_tokens must be >= 1, prefill_tokens >= 0")
        seqs = sorted({s for s in seq_sizes if s < max_num_seqs} | {max_num_seqs})
        tokens = sorted({t for t in token_sizes if t <= max_tokens} | {s for s in seqs if s <= max_tokens})
        # only shapes a step can have: num_seqs <= num_tokens <= num_seqs * max_qlen
        decode = [Bucket(t, s, max_qlen) for s in seqs for t in tokens if s <= t <= s * max_qlen]
        prefill = [Bucket(t, s, t) for s in seqs for t in prefill_sizes if max_qlen < t <= prefill_tokens and s < t]
        # sorted by (tokens, sequences, longest sequence): a step takes the fewest padded tokens, and of two
        # buckets of one size the decode one (its grid has no long-sequence tiles)
        self.buckets: list[Bucket] = sorted(decode + prefill)
        self.max_qlen = max((b.max_qlen for b in self.buckets), default=0)
        self.max_tokens = max((b.num_tokens for b in self.buckets), default=0)
        self.max_seqs = max((b.num_seqs for b in self.buckets), default=0)

    @property
    def max_tokens_at_max_qlen(self) -> int:
        """The most tokens of a bucket that holds a sequence of `max_qlen` new tokens (the largest
        prefill bucket, or decode bucket where there are none); 0 without buckets."""
        return max((b.num_tokens for b in self.buckets if b.max_qlen == self.max_qlen), default=0)

    def fits(self, qlens: Sequence[int]) -> bool:
        """Whether a step whose sequences have `qlens` new tokens each (non-empty) is held by a bucket."""
        return self.pick(len(qlens), sum(qlens), max(qlens)) is not None

    def pick(self, num_seqs: int, num_tokens: int, max_qlen: int) -> Bucket | None:
        """The bucket with the fewest tokens (then fewest sequences, then the decode one) that holds the
        step, or None when the step is outside every bucket (too many tokens or sequences, or a sequence
        longer than any bucket takes): such a step runs eagerly."""
        if max_qlen > self.max_qlen or num_tokens > self.max_tokens or num_seqs > self.max_seqs:
            return None
        for b in self.buckets:
            if b.num_tokens >= num_tokens and b.num_seqs >= num_seqs and b.max_qlen >= max_qlen:
                return b
        return None


@dataclass(frozen=True)
class StepLayout:
    """Field offsets of the packed int32 step array for capacities `max_tokens` and `max_seqs`:
    ids, positions, token_slots, logits_rows (max_tokens each), then seq_qstart, seq_qlen, seq_ctx,
    seq_slot (max_seqs each)."""

    max_tokens: int
    max_seqs: int

    TOKEN_FIELDS = ("input_ids", "positions", "token_slots", "logits_rows")
    SEQ_FIELDS = ("seq_qstart", "seq_qlen", "seq_ctx", "seq_slot")

    @property
    def size(self) -> int:
        return 4 * self.max_tokens + 4 * self.max_seqs

    def field(self, buf, name: str, length: int):
        """The first `length` entries of field `name` in `buf` (numpy array or torch tensor, a view)."""
        if name in self.TOKEN_FIELDS:
            off = self.TOKEN_FIELDS.index(name) * self.max_tokens
        else:
            off = 4 * self.max_tokens + self.SEQ_FIELDS.index(name) * self.max_seqs
        return buf[off : off + length]


def pack_step(buf: np.ndarray, layout: StepLayout, slots: Sequence[int], starts: Sequence[int],
              token_ids: Sequence[Sequence[int]], num_logits: Sequence[int], num_tokens: int,
              num_seqs: int) -> int:
    """Write one step into `buf` (int32 [layout.size]), padded to `num_tokens` tokens and `num_seqs`
    sequences. Sequence b feeds token_ids[b] at positions starts[b], ... into KV slot slots[b]; its last
    num_logits[b] tokens get logits rows, in order.

    Returns:
        R, the number of logits rows (rows [0, R) of the forward's logits are the real ones).

    Raises:
        ValueError: the step does not fit (num_tokens / num_seqs below what it needs, or above the
            layout's capacity), or a sequence asks for more logits than it has tokens.
    """
    B = len(slots)
    q = np.fromiter((len(t) for t in token_ids), dtype=np.int64, count=B)
    n = np.asarray(num_logits, dtype=np.int64)
    T = int(q.sum())
    if not (T <= num_tokens <= layout.max_tokens and B <= num_seqs <= layout.max_seqs):
        raise ValueError(f"a step of {B} sequences / {T} tokens does not fit a {num_seqs} x {num_tokens} bucket "
                         f"(capacity {layout.max_seqs} x {layout.max_tokens})")
    if np.any(n > q) or np.any(n < 0) or np.any(q < 1):
        raise ValueError("each sequence needs >= 1 new token and 0 <= num_logits <= its new tokens")
    qstart = np.cumsum(q) - q
    R = int(n.sum())

    def put(name, length, values, pad):
        dst = layout.field(buf, name, length)
        k = len(values)
        dst[:k] = values
        dst[k:] = pad

    put("input_ids", num_tokens, np.fromiter((t for ids in token_ids for t in ids), dtype=np.int64, count=T), 0)
    tok_seq_start = np.repeat(np.asarray(starts, dtype=np.int64) - qstart, q)
    put("positions", num_tokens, tok_seq_start + np.arange(T), 0)
    put("token_slots", num_tokens, np.repeat(np.asarray(slots, dtype=np.int64), q), -1)
    first_row = np.repeat(qstart + q - n, n)  # a sequence's logits rows are its last n tokens
    put("logits_rows", num_tokens, first_row + np.arange(R) - np.repeat(np.cumsum(n) - n, n), 0)
    put("seq_qstart", num_seqs, qstart, T)
    put("seq_qlen", num_seqs, q, 0)
    put("seq_ctx", num_seqs, np.asarray(starts, dtype=np.int64), 0)
    put("seq_slot", num_seqs, np.asarray(slots, dtype=np.int64), 0)
    return R
