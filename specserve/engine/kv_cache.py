"""Slot-based KV cache with one rollback primitive and automatic prefix caching.

What it does: owns, per layer, key and value tensors of [num_slots, num_kv_heads, max_len, head_dim];
hands out a slot per running request; tracks how many positions of each slot hold valid keys/values
(`length`). `truncate(slot, n)` drops everything past position n: it is the only rollback primitive,
used both for rejected drafts and for freeing. Memory is reserved with `torch.empty`, so on the CPU
untouched pages cost nothing until written; a slot is zeroed on its first use.

Prefix caching (docs/prefix_caching.md): a slot given back with `free(slot, token_ids)` keeps its
keys/values for those tokens as a *cached entry* instead of becoming empty. A slot is then in one of
three states: in use (a running request's), cached (a finished request's tokens, evictable, kept in
least-recently-used order, no entry a prefix of another) or empty. `allocate_for_prefix(token_ids)`
gives a new request the slot whose cached tokens share the longest prefix with its prompt (taking that
slot when the entry is a prefix of the prompt or no empty slot is left, else copying the shared prefix
into an empty slot with `copy_prefix` so the entry stays), and says how many positions are already
computed; cached entries are evicted, least recently used first, only when no empty slot is left.
The caller decides which tokens are cached: the engine passes only committed tokens (positions below
the request's committed length), never the positions a rejected draft wrote.

What it does not do: paging (a slot is one contiguous sequence; two requests never share memory), or
the attention math (see `specserve.model.attention`).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import torch


class KVCacheFullError(RuntimeError):
    """No free slot: the scheduler admitted more requests than `num_slots`."""


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token id sequences: a binary search over slice
    comparisons (done in C), O(n log n) element compares in C instead of a Python loop over n."""
    if type(a) is not type(b) or not isinstance(a, (list, tuple)):
        a, b = tuple(a), tuple(b)
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class KVCache:
    """Per-layer K/V tensors, per-slot valid lengths, and the cached entries of finished sequences.

    Attributes:
        k, v: lists (one per layer) of [num_slots, num_kv_heads, max_len, head_dim] tensors.
        lengths: list[int], valid positions per slot (0 for an empty slot; a cached entry's token count
            for a cached slot).
        cached: OrderedDict slot -> tuple of token ids whose K/V positions [0, len) the slot holds, for
            the cached (finished, evictable) slots, least recently used first.
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        shape = (num_slots, num_kv_heads, max_len, head_dim)
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_slots = num_slots
        self.max_len = max_len
        self.lengths = [0] * num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # empty slots
        self.cached: OrderedDict[int, tuple[int, ...]] = OrderedDict()
        self._zeroed = [False] * num_slots
        self.bytes_per_token = 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def num_free_slots(self) -> int:
        """Slots a new sequence can get: the empty ones and the cached (evictable) ones."""
        return len(self._free) + len(self.cached)

    @property
    def num_cached_slots(self) -> int:
        return len(self.cached)

    @property
    def num_cached_tokens(self) -> int:
        """Token positions held by cached entries (not counted in `num_used_tokens`)."""
        return sum(len(t) for t in self.cached.values())

    def _take(self, slot: int) -> int:
        """Mark `slot` (already out of the empty list / cached entries) in use, zeroing it on first use."""
        if not self._zeroed[slot]:
            # Masked-out positions are still multiplied by 0 in attention; uninitialized memory may hold
            # NaN/inf, and 0 * NaN = NaN. Zero a slot once, on first use (stale finite values are harmless).
            for t in self.k + self.v:
                t[slot].zero_()
            self._zeroed[slot] = True
        return slot

    def allocate(self) -> int:
        """Take a slot of length 0: an empty one, else the least recently used cached entry's (evicted).

        Raises:
            KVCacheFullError: no empty slot and no cached entry to evict.
        """
        if self._free:
            slot = self._free.pop()
        else:
            if not self.cached:
                raise KVCacheFullError(f"all {self.num_slots} KV cache slots are in use")
            slot, _ = self.cached.popitem(last=False)
        self.lengths[slot] = 0
        return self._take(slot)

    def longest_prefix(self, token_ids: Sequence[int], min_tail: int = 1) -> tuple[int | None, int]:
        """(slot, n): the cached entry sharing the longest prefix with `token_ids` and that prefix's
        length, capped at len(token_ids) - min_tail (the last `min_tail` tokens are always fed again:
        at least the last one, to produce its logits); (None, 0) when no entry shares a token or the cap
        leaves nothing. Ties go to the most recently used entry. Read-only."""
        best, best_n = None, 0
        cap = len(token_ids) - max(min_tail, 1)
        if cap <= 0:
            return None, 0
        token_ids = tuple(token_ids)  # the entries are tuples: compare like with like
        for slot, toks in reversed(self.cached.items()):
            n = min(common_prefix_len(toks, token_ids), cap)
            if n > best_n:
                best, best_n = slot, n
        return best, best_n

    def allocate_for_prefix(self, token_ids: Sequence[int], min_tokens: int, min_tail: int = 1) -> tuple[int, int]:
        """A slot for a new sequence whose first tokens are `token_ids`, reusing a cached prefix.

        Finds the cached entry with the longest common prefix n (<= len(token_ids) - min_tail, see
        `longest_prefix`); when n >= min_tokens the new sequence starts with positions [0, n) already
        computed. It takes the entry's own slot when the entry holds nothing beyond those n tokens, or
        when no empty slot is left (the entry's positions past n are dropped: evicting another entry
        instead would lose a whole prefix); otherwise it copies the n positions into an empty slot
        (`copy_prefix`), so the entry stays cached for later requests. On a miss it gets a plain
        `allocate()` slot.

        Returns:
            (slot, n): the slot, now in use, and how many positions of `token_ids` it already holds (0
            on a miss).

        Raises:
            ValueError: min_tokens < 1.
            KVCacheFullError: no empty slot and no cached entry.
        """
        if min_tokens < 1:
            raise ValueError(f"min_tokens must be >= 1, got {min_tokens}")
        src, n = self.longest_prefix(token_ids, min_tail)
        if src is None or n < min_tokens:
            return self.allocate(), 0
        if len(self.cached[src]) == n or not self._free:
            del self.cached[src]  # take the entry's slot; its positions past n are dropped
            self.truncate(src, n)
            return src, n
        dst = self._take(self._free.pop())
        self.copy_prefix(src, dst, n)
        self.cached.move_to_end(src)  # it was just used
        return dst, n

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Copy positions [0, n) of slot `src` into slot `dst` (every layer, K and V); dst's length
        becomes n. `src` keeps its contents.

        Raises:
            ValueError: n is beyond src's valid length, or src == dst.
        """
        if src == dst or not 0 <= n <= self.lengths[src]:
            raise ValueError(f"cannot copy {n} positions of slot {src} (length {self.lengths[src]}) into slot {dst}")
        for t in self.k + self.v:
            t[dst, :, :n].copy_(t[src, :, :n])
        self.lengths[dst] = n

    def free(self, slot: int, token_ids: Sequence[int] | None = None) -> None:
        """Give a slot back. Without `token_ids` (or with none) it becomes empty (length 0); with them it
        becomes the most recently used cached entry holding those tokens' K/V at positions
        [0, len(token_ids)) (its length is cut to that). Only pass tokens whose K/V were written for
        exactly these ids, i.e. committed tokens. Entries are kept free of duplicates: a cached entry
        whose tokens are a prefix of the new one's is dropped (its slot becomes empty), and when an
        entry already holds the new tokens as its prefix the slot becomes empty instead (and that entry
        the most recently used).

        Raises:
            ValueError: the slot is not in use, or more tokens than the slot's valid length.
        """
        if slot in self._free or slot in self.cached:
            raise ValueError(f"KV slot {slot} is already free")
        if token_ids:
            toks = tuple(token_ids)
            self.truncate(slot, len(toks))
            covering = None
            for other, t in list(self.cached.items()):
                n = common_prefix_len(t, toks)
                if n == len(t):  # `other` holds nothing the new entry lacks
                    del self.cached[other]
                    self.lengths[other] = 0
                    self._free.append(other)
                elif n == len(toks):
                    covering = other
            if covering is None:
                self.cached[slot] = toks
                return
            self.cached.move_to_end(covering)
        self.truncate(slot, 0)
        self._free.append(slot)

    def clear_cached(self) -> None:
        """Evict every cached entry (their slots become empty)."""
        for slot in list(self.cached):
            del self.cached[slot]
            self.lengths[slot] = 0
            self._free.append(slot)

    def extend(self, slot: int, new_length: int) -> None:
        """Record that positions [length, new_length) were written this step."""
        if not self.lengths[slot] <= new_length <= self.max_len:
            raise ValueError(f"slot {slot}: cannot extend length {self.lengths[slot]} to {new_length} (max {self.max_len})")
        self.lengths[slot] = new_length

    def truncate(self, slot: int, new_length: int) -> None:
        """The rollback primitive: keep positions [0, new_length), drop the rest.

        Raises:
            ValueError: new_length is negative or beyond the slot's current length.
        """
        if not 0 <= new_length <= self.lengths[slot]:
            raise ValueError(f"slot {slot}: cannot truncate length {self.lengths[slot]} to {new_length}")
        self.lengths[slot] = new_length

    @property
    def num_used_tokens(self) -> int:
        """Valid positions of the slots in use (cached entries are not counted)."""
        return sum(self.lengths) - self.num_cached_tokens

    @property
    def usage(self) -> float:
        """Fraction of all slot positions holding valid entries of slots in use (0..1); cached entries
        count as free, as vLLM counts its cached free blocks."""
        return self.num_used_tokens / (self.num_slots * self.max_len)
