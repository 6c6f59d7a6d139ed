"""The panel kernel: fp32 linear layers on the CPU, fast for the few rows of a decode or verify step and
bit-identical for a row alone and in any batch.

Why: a decode step reads every weight once, so on the CPU it is bound by memory bandwidth, and oneDNN's
packed kernel (`specserve.model.cpu_linear.PackedLinear`) streams the weights of one row ~20% slower
than the memory allows, while MKL's faster one-row sgemv rounds a lone row differently from the same row
in a batch (which would break greedy speculation's exactness and seeded sampling's batch invariance).
This kernel packs W [N, K] into panels of 16 output features ([ceil(N/16), K, 16]) and sums every
output over k in one fixed order (`panel_linear.cpp` says why that makes rows independent of their
batch). Measured on the shared 2-core Intel Xeon (AVX-512), qwen2.5-coder-0.5b's 97 projections in
a row, 2 threads (docs/benchmarks/cpu_linear_kernels_intel.json): 1 row 62 ms against oneDNN's 74 and
MKL's 66; 4 rows 67 against 73 (MKL 151); 16 rows 104 against 108; a 300-row prompt chunk 844 against
849 (docs/cpu_performance.md, "Linear layers: the panel kernel").

What it does: `PanelLinear` holds a packed weight as an ordinary tensor (so it can live in the huge-page
weight arena); the C++ source is compiled once per machine on first use (`specserve.native`).
What it does not do: bf16/fp16, CUDA, or quantized weights.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import torch
from torch import nn

from specserve.native import NativeExtension, native_cflags

SOURCE = Path(__file__).with_name("panel_linear.cpp")
LANES = 16  # output features per panel (the .cpp's kLanes)
EXTENSION = NativeExtension("specserve_panel_linear", SOURCE, native_cflags(openmp=True), "the panel linear kernel")


def load_kernel() -> ModuleType:
    """The compiled extension (`specserve.native.NativeExtension.load`: built on first use, ~20 s).

    Raises:
        RuntimeError: it cannot be built here; the message says why (remembered: later calls raise at once).
    """
    return EXTENSION.load()


def panel_available() -> bool:
    """Whether the panel kernel can be built (or is built) on this machine; builds it if needed."""
    return EXTENSION.available()


class PanelLinear(nn.Module):
    """y = x W^T + b for fp32 on the CPU with W packed in panels: [..., in_features] -> [..., out_features].

    Every row's result is bit-identical whatever rows are computed beside it (module docstring).

    Args:
        weight: [out_features, in_features] float32 CPU tensor; it is copied into the packed layout.
        bias: [out_features] float32 or None.

    Attributes:
        weight: the packed weight, [ceil(out_features / 16), in_features, 16] float32 (zero rows pad
            out_features to a multiple of 16).

    Raises:
        RuntimeError: the kernel cannot be built here (`load_kernel`).
        ValueError: weight or bias is not float32 on the CPU.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
            raise ValueError(f"PanelLinear needs a 2-D float32 CPU weight, got {weight.dtype} {tuple(weight.shape)} "
                             f"on {weight.device}")
        kernel = load_kernel()
        self.out_features, self.in_features = weight.shape
        with torch.inference_mode(False), torch.no_grad():
            packed = kernel.pack(weight.detach())
        self.weight = nn.Parameter(packed, requires_grad=False)
        if bias is not None:
            if bias.dtype != torch.float32 or bias.shape != (self.out_features,):
                raise ValueError(f"PanelLinear bias must be float32 [{self.out_features}], got {bias.dtype} "
                                 f"{tuple(bias.shape)}")
            self.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
        else:
            self.bias = None

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "PanelLinear":
        return cls(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in_features] float32 -> [..., out_features]."""
        rows = x.reshape(-1, self.in_features)
        if not rows.is_contiguous():
            rows = rows.contiguous()
        y = load_kernel().linear(rows, self.weight, self.bias, self.out_features)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, panels"
