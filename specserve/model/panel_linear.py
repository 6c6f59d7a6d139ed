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

What it does: builds the C++ extension once per machine with torch.utils.cpp_extension (gcc and ninja;
-O3 -march=native, so the build directory is named after this CPU's instruction-set flags and the source)
under ~/.cache/specserve/kernels (SPECSERVE_KERNEL_DIR overrides), and `PanelLinear` holds a packed
weight as an ordinary tensor (so it can live in the huge-page weight arena).
What it does not do: bf16/fp16, CUDA, or quantized weights.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import threading
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("panel_linear.cpp")
LANES = 16  # output features per panel (the .cpp's kLanes)
_lock = threading.Lock()
_kernel: ModuleType | None = None
_error: str | None = None


def _cflags() -> list[str]:
    flags = ["-O3", "-march=native", "-fopenmp"]
    if platform.machine() in ("x86_64", "AMD64"):
        flags.append("-mprefer-vector-width=512")  # gcc's default for some Intel -march targets is 256 bits
    return flags


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _build_name() -> str:
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(_cflags()).encode(), _cpu_flags().encode(), torch.__version__.encode()):
        digest.update(part)
    return f"specserve_panel_linear_{digest.hexdigest()[:16]}"


def _ninja_on_path() -> None:
    """torch.utils.cpp_extension runs `ninja`: use the `ninja` package's binary when none is on PATH."""
    if shutil.which("ninja"):
        return
    try:
        import ninja  # the PyPI package ships the binary
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def load_kernel() -> ModuleType:
    """The compiled extension (built on first use, ~20 s; then loaded from the cache in well under 1 s).

    Raises:
        RuntimeError: it cannot be built here (no C++ compiler, no ninja, a compile error); the message
            says why. The failure is remembered: later calls raise at once.
    """
    global _kernel, _error
    with _lock:
        if _kernel is not None:
            return _kernel
        if _error is not None:
            raise RuntimeError(_error)
        try:
            from torch.utils.cpp_extension import load

            _ninja_on_path()
            name = _build_name()
            root = Path(os.environ.get("SPECSERVE_KERNEL_DIR") or Path.home() / ".cache" / "specserve" / "kernels")
            build_dir = root / name
            build_dir.mkdir(parents=True, exist_ok=True)
            _kernel = load(name=name, sources=[str(SOURCE)], extra_cflags=_cflags(), extra_ldflags=["-fopenmp"],
                           build_directory=str(build_dir), verbose=False)
        except Exception as e:  # noqa: BLE001 - any build failure means "not available here"
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            _error = f"the panel linear kernel could not be built: {type(e).__name__}: {first}"
            raise RuntimeError(_error) from e
        return _kernel


def panel_available() -> bool:
    """Whether the panel kernel can be built (or is built) on this machine; builds it if needed."""
    try:
        load_kernel()
    except RuntimeError:
        return False
    return True


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
        y = (_kernel or load_kernel()).linear(rows, self.weight, self.bias, self.out_features)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, panels"
