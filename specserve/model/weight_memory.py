"""CPU weight memory backed by transparent huge pages.

Why: decoding streams every weight once per step, so the page size matters (one TLB entry per 4 KiB
page vs per 2 MiB). On the 2-core CI-class machine, a single-thread fp32 decode step of
qwen2.5-coder-0.5b took 1.1-1.5x as long (three runs; the more loaded the host, the larger) with the
weights left as views of the memory-mapped safetensors file (what `safe_open` returns), and 1.0-1.15x
as long from ordinary heap tensors (4 KiB pages when the kernel's THP mode is "madvise"), as from
huge-page memory. `benchmarks/verify_cost.py` measures the three side by side.

What it does: copies all parameters of a module into one anonymous memory mapping advised with
MADV_HUGEPAGE and points the parameters at views of it (same values, same dtypes and shapes). What it
does not do: anything on CUDA, or for buffers (the RoPE table is small).
"""

from __future__ import annotations

import logging
import mmap

import torch
from torch import nn

logger = logging.getLogger(__name__)

_ALIGN = 64  # bytes; every tensor starts on a cache line


class WeightArena:
    """One anonymous, huge-page-advised memory mapping holding a module's CPU parameters.

    Attributes:
        nbytes: size of the mapping in bytes.
        huge_pages: whether madvise(MADV_HUGEPAGE) was accepted (False where the OS lacks it; the
            weights then live in ordinary pages, which is correct, only slower).
    """

    def __init__(self, nbytes: int):
        self.nbytes = max(nbytes, 1)
        self._map = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.huge_pages = False
        advice = getattr(mmap, "MADV_HUGEPAGE", None)
        if advice is not None:
            try:
                self._map.madvise(advice)
                self.huge_pages = True
            except OSError as e:  # e.g. a kernel built without THP
                logger.info("madvise(MADV_HUGEPAGE) refused (%s); weights stay in ordinary pages", e)
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)

    def view(self, offset: int, like: torch.Tensor) -> torch.Tensor:
        """A tensor of like's dtype and shape at byte `offset` of the mapping (not yet filled)."""
        n = like.numel() * like.element_size()
        return self._bytes[offset : offset + n].view(like.dtype).view(like.shape)

    def contains(self, t: torch.Tensor) -> bool:
        """Whether tensor t's memory lies inside this mapping."""
        start = self._bytes.data_ptr()
        return start <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= start + self.nbytes


def move_weights_to_huge_pages(module: nn.Module) -> WeightArena:
    """Copy every parameter of `module` (all on the CPU) into one WeightArena, in place.

    Each parameter's old storage is freed as soon as it is copied (the module held the only reference),
    so peak memory grows by about one tensor, not by the whole model.

    Returns:
        The arena; keep a reference to it for as long as the module lives (the loader stores it on the
        model as `weight_arena`).

    Raises:
        ValueError: a parameter is not on the CPU.
    """
    params = list(dict.fromkeys(module.parameters()))  # tied weights appear once
    offsets, total = [], 0
    for p in params:
        if p.device.type != "cpu":
            raise ValueError(f"move_weights_to_huge_pages: parameter on {p.device}, expected cpu")
        offsets.append(total)
        total += -(-p.numel() * p.element_size() // _ALIGN) * _ALIGN
    arena = WeightArena(total)
    with torch.no_grad():
        for p, off in zip(params, offsets):
            dst = arena.view(off, p.data)
            dst.copy_(p.data)
            p.data = dst
    return arena
