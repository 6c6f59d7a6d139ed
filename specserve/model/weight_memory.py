"""CPU weight memory backed by transparent huge pages.

Why: decoding streams every weight once per step, so the page size can matter (one TLB entry per 4 KiB
page vs per 2 MiB). On the 2-core CI-class machine, single-thread fp32 qwen2.5-coder-0.5b, two recorded
runs of `benchmarks/verify_cost.py` (docs/benchmarks/verify_cost_*.json) measured a decode step 1.10-1.12x
slower with the weights the old loader left in the memory-mapped safetensors file, and 1.01x slower
from ordinary heap tensors (4 KiB pages when the kernel's THP mode is "madvise"), than from huge-page
memory. transformers' default load, which leaves every tensor in the mapped file, gained 1.6x from the
same move (benchmarks/engine_vs_transformers.py).

What it does: copies all parameters of a module into one anonymous memory mapping advised with
MADV_HUGEPAGE and points the parameters at views of it (same values, same dtypes and shapes). What it
does not do: anything on CUDA, or for buffers (the RoPE table is small), or for weights already packed
into oneDNN's opaque layout (`specserve.model.cpu_linear`; oneDNN allocates those itself).
"""

from __future__ import annotations

import logging
import mmap

import torch
from torch import nn

logger = logging.getLogger(__name__)

_ALIGN = 64  # bytes; every tensor starts on a cache line


class WeightArena:
    """One anonymous memory mapping, advised with MADV_HUGEPAGE, holding a module's CPU parameters.

    The mapping lives as long as any tensor viewing it (torch.frombuffer keeps it referenced); it is
    never closed explicitly, since closing it under live views would leave dangling pointers.

    Args:
        nbytes: size in bytes (at least 1).

    Attributes:
        nbytes: size of the mapping in bytes.
        huge_pages: whether madvise(MADV_HUGEPAGE) was accepted. The kernel still decides: with THP
            disabled ("never") the advice is accepted and ignored; where the OS has no MADV_HUGEPAGE
            (macOS, Windows) this is False. Either way the weights are correct, only maybe slower.

    Raises:
        OSError: the mapping cannot be created (out of memory / address space).
    """

    def __init__(self, nbytes: int):
        self.nbytes = max(nbytes, 1)
        if hasattr(mmap, "MAP_PRIVATE"):  # POSIX
            self._map = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        else:  # Windows: an anonymous, pagefile-backed mapping
            self._map = mmap.mmap(-1, self.nbytes)
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
        """A contiguous tensor with like's dtype and shape at byte `offset` of the mapping (contents not set).

        Raises:
            ValueError: the tensor would not fit inside the mapping, or offset is not a multiple of
                like's element size.
        """
        n = like.numel() * like.element_size()
        if offset < 0 or offset + n > self.nbytes or offset % like.element_size():
            raise ValueError(f"WeightArena.view: {n} bytes at offset {offset} do not fit a {self.nbytes}-byte arena")
        return self._bytes[offset : offset + n].view(like.dtype).view(like.shape)

    def contains(self, t: torch.Tensor) -> bool:
        """Whether tensor t's memory lies inside this mapping."""
        start = self._bytes.data_ptr()
        return start <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= start + self.nbytes


def _same_tensor_key(t: torch.Tensor) -> tuple:
    """Identifies tensors that are the same memory viewed the same way (weights tied via two Parameters)."""
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def move_weights_to_huge_pages(module: nn.Module) -> WeightArena:
    """Copy every parameter of `module` (all on the CPU) into one WeightArena, in place.

    Parameters keep their dtypes, shapes and values; afterwards they are contiguous views of the arena.
    oneDNN-packed parameters (`p.is_mkldnn`) are left where they are.
    Tied weights stay tied: one Parameter object used twice, or two Parameters viewing the same memory
    the same way, get one copy. A parameter's old storage is freed when it is copied if nothing else
    references it (the loader drops its own references first), so peak memory grows by about one
    tensor rather than by the whole model.

    Returns:
        The arena (the loader stores it on the model as `weight_arena`; the parameters keep it alive).

    Raises:
        ValueError: a parameter is not on the CPU.
        OSError: the arena cannot be allocated.
    """
    params = [p for p in module.parameters() if not p.is_mkldnn]  # parameters() lists a Parameter used twice once
    slots: dict[tuple, int] = {}
    offsets, total = [], 0
    for p in params:
        if p.device.type != "cpu":
            raise ValueError(f"move_weights_to_huge_pages: parameter on {p.device}, expected cpu")
        key = _same_tensor_key(p.data)
        if key not in slots:
            slots[key] = total
            total += -(-p.numel() * p.element_size() // _ALIGN) * _ALIGN
        offsets.append(slots[key])
    arena = WeightArena(total)
    moved: dict[int, torch.Tensor] = {}
    # inference_mode(False): the views must be normal tensors even if the caller runs under inference_mode
    with torch.inference_mode(False), torch.no_grad():
        for p, off in zip(params, offsets):
            if off not in moved:
                moved[off] = arena.view(off, p.data)
                moved[off].copy_(p.data)
            p.data = moved[off]
    return arena
