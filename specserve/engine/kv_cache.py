"""Slot-based KV cache with one rollback primitive.

What it does: owns, per layer, key and value tensors of [num_slots, num_kv_heads, max_len, head_dim];
hands out a slot per running request; tracks how many positions of each slot hold valid keys/values
(`length`). `truncate(slot, n)` drops everything past position n: it is the only rollback primitive,
used both for rejected drafts and for freeing. Memory is reserved with `torch.empty`, so on the CPU
untouched pages cost nothing until written; a slot is zeroed on its first use.

What it does not do: paging/prefix sharing (a slot is one contiguous sequence), or the attention math
(see `specserve.model.attention`).
"""

from __future__ import annotations

import torch


class KVCacheFullError(RuntimeError):
    """No free slot: the scheduler admitted more requests than `num_slots`."""


class KVCache:
    """Per-layer K/V tensors and per-slot valid lengths.

    Attributes:
        k, v: lists (one per layer) of [num_slots, num_kv_heads, max_len, head_dim] tensors.
        lengths: list[int], valid positions per slot (0 for a free slot).
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
        self._free = list(range(num_slots - 1, -1, -1))
        self._zeroed = [False] * num_slots
        self.bytes_per_token = 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """Take a free slot (length 0). Raises KVCacheFullError when none is free."""
        if not self._free:
            raise KVCacheFullError(f"all {self.num_slots} KV cache slots are in use")
        slot = self._free.pop()
        self.lengths[slot] = 0
        if not self._zeroed[slot]:
            # Masked-out positions are still multiplied by 0 in attention; uninitialized memory may hold
            # NaN/inf, and 0 * NaN = NaN. Zero a slot once, on first use (stale finite values are harmless).
            for t in self.k + self.v:
                t[slot].zero_()
            self._zeroed[slot] = True
        return slot

    def free(self, slot: int) -> None:
        """Return a slot (its length drops to 0). Freeing a free slot is a bug and raises ValueError."""
        if slot in self._free:
            raise ValueError(f"KV slot {slot} is already free")
        self.truncate(slot, 0)
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
        return sum(self.lengths)

    @property
    def usage(self) -> float:
        """Fraction of all slot positions holding valid entries (0..1)."""
        return self.num_used_tokens / (self.num_slots * self.max_len)
