"""Linear layers on the CPU: the choice of kernel, and oneDNN with weights prepacked once at load time.

The default for float32 ("auto") is the panel kernel (`specserve.model.panel_linear`): faster than
oneDNN for the 1-16 rows of decode and verify steps and bit-identical for a row alone and in any batch by
construction. oneDNN (`PackedLinear`, below) is the fallback where that kernel cannot be built (no C++
compiler) and an explicit choice ("onednn"); F.linear / MKL is "torch".

Why: torch's `F.linear` on the CPU calls MKL's sgemm. On the AMD EPYC machines this project runs on, MKL
takes a slow code path, and for one row (a batch-1 decode step) it runs on one thread. oneDNN, which
torch also ships (`torch.ops.mkldnn`, the kernels torch.compile's CPU backend and vLLM's CPU backend
use), with the weight reordered once into its blocked layout, uses every thread and was 2-6x faster on
every projection of qwen2.5-coder-0.5b for 1-20 rows (docs/cpu_performance.md has the figures).

What it does: `pack_linear_weights(model)` replaces every `nn.Linear` of a loaded model (and the
output projection, `CausalLM.lm_head`, also when it is tied to the embeddings) by a `PanelLinear` or,
for oneDNN, a `PackedLinear` that holds the oneDNN-packed weight, after checking on the first layer that
the packed kernel agrees with `F.linear`. Where oneDNN is missing or disagrees, the model keeps
`F.linear` (logged once).

Row independence (batch invariance): a row's result must not depend on the rows beside it, or a seeded
sampled request draws different tokens alone and in a batch. oneDNN computes a call of 2 or more rows
with one kernel whose per-row summation order does not depend on the row count (checked for 2-64 rows
and 1-8 threads on every projection shape of smollm2-135m, qwen2.5-coder-0.5b and 1.5b), but a one-row
call of some shapes (the down projection of all three; q/k/v and o of the 1.5b) takes another kernel
that sums in another order (about 1e-6 apart). So a `PackedLinear` whose one-row kernel differs from
its two-row kernel (tested once, on random rows, when it is packed) computes a lone row as the first of
two identical rows: the same kernel and summation order as in any batch (docs/cpu_performance.md).
What it does not do: anything on CUDA, quantized weights, or float16 (oneDNN packs fp32 and bf16).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from specserve.native import NativeUnavailableError

logger = logging.getLogger(__name__)


PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
CPU_LINEAR_CHOICES = ("auto", "panel", "onednn", "torch")


class PackedLinear(nn.Module):
    """y = x W^T + b with W in oneDNN's blocked layout: [T, in_features] -> [T, out_features].

    Args:
        weight: [out_features, in_features] CPU tensor (fp32 or bf16); it is copied, not kept.
        bias: [out_features] or None.

    Attributes:
        weight: the packed weight, an `nn.Parameter` holding an opaque oneDNN (`torch._mkldnn`) tensor:
            it counts in `parameters()` (numel, dtype) but has no strided storage to view or index.
        pad_one_row: a one-row input is computed as two identical rows (row 0 returned), because this
            shape's one-row kernel rounds differently from its batched one (module docstring).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        with torch.inference_mode(False), torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.bias = nn.Parameter(bias.detach().clone(), requires_grad=False) if bias is not None else None
        self.pad_one_row = False
        self.pad_one_row = not self._one_row_matches_batched()

    def _one_row_matches_batched(self, trials: int = 3) -> bool:
        """Whether a one-row call gives bit for bit the first row of a two-row call, on random rows."""
        gen = torch.Generator().manual_seed(1234)
        with torch.inference_mode():
            for _ in range(trials):
                x = torch.randn(2, self.in_features, generator=gen).to(self.weight.dtype)
                if not torch.equal(self._linear(x[:1]), self._linear(x)[:1]):
                    return False
        return True

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "PackedLinear":
        return cls(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in_features] -> [..., out_features]; a lone row is computed as in a batch."""
        if self.pad_one_row and x.numel() == self.in_features:
            return self._linear(x.reshape(1, -1).expand(2, -1).contiguous())[:1].reshape(*x.shape[:-1], -1)
        return self._linear(x)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"oneDNN{', one row padded to two' if self.pad_one_row else ''}")


def onednn_available(dtype: torch.dtype) -> bool:
    """Whether this torch build can pack linear weights of `dtype` for oneDNN on this CPU."""
    if dtype not in PACKABLE_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    return hasattr(torch.ops.mkldnn, "_linear_pointwise") and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def _agrees(linear: nn.Linear, packed: PackedLinear) -> bool:
    """The packed kernel gives F.linear's result (to rounding) on a few random rows."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, linear.in_features, generator=gen).to(linear.weight.dtype)
    with torch.no_grad():
        ref, got = linear(x).float(), packed(x).float()
    tol = 1e-4 if linear.weight.dtype == torch.float32 else 3e-2
    return bool(torch.allclose(got, ref, rtol=tol, atol=tol * float(ref.abs().max().clamp_min(1.0))))


def _replace_linears(model: nn.Module, make) -> None:
    """Every `nn.Linear` of `model` -> make(linear), and a tied output projection -> a packed copy."""
    linears = [(parent, name) for parent in model.modules() for name, mod in parent.named_children()
               if isinstance(mod, nn.Linear)]
    for parent, name in linears:  # one at a time, so that each old weight is freed as its copy is made
        setattr(parent, name, make(getattr(parent, name)))
    if getattr(model, "config", None) is not None and model.config.tie_word_embeddings:
        # the lookup needs the plain embedding table, the output projection a packed copy of it
        model.lm_head = make(_TiedHead(model.model.embed_tokens.weight))


class _TiedHead:
    """The embedding table seen as a bias-free linear layer (what `from_linear` reads)."""

    def __init__(self, weight: torch.Tensor):
        self.weight, self.bias = weight, None


def pack_linear_weights(model: nn.Module, choice: str = "auto") -> str:
    """Replace the CPU `nn.Linear` layers of `model` (and its output projection) by packed ones.

    Args:
        model: a loaded `CausalLM` on the CPU (projections already fused).
        choice: "auto" (float32: the panel kernel, else oneDNN where the kernel cannot be built, logged,
            else F.linear; other dtypes: F.linear), "panel" (the panel kernel or an error), "onednn"
            (oneDNN or an error), "torch" (leave F.linear / MKL). "auto" keeps F.linear for bfloat16:
            oneDNN's bf16 kernels round a row differently depending on the rows beside it, so seeded
            sampling would not be batch invariant there, and the panel kernel is float32 only.

    Returns:
        the backend in use: "panel", "onednn" or "torch".

    Raises:
        ValueError: unknown choice.
        NativeUnavailableError: "panel" or "onednn" was asked for but cannot be used here (a ConfigError, so
            the CLI prints one line, and a RuntimeError).
    """
    if choice not in CPU_LINEAR_CHOICES:
        raise ValueError(f"cpu linear backend must be one of {', '.join(CPU_LINEAR_CHOICES)}, got {choice!r}")
    if choice == "torch":
        return "torch"
    dtype = next(model.parameters()).dtype
    if choice == "auto" and dtype != torch.float32:
        return "torch"
    if choice in ("auto", "panel"):
        from specserve.model.panel_linear import PanelLinear, load_kernel

        try:
            if dtype != torch.float32:
                raise RuntimeError(f"the panel linear kernel computes float32 only, the model is {dtype}")
            load_kernel()
        except RuntimeError as e:
            if choice == "panel":
                raise NativeUnavailableError(f"{e} (--cpu-linear panel)") from e
            logger.warning("CPU linear layers use oneDNN instead of the panel kernel: %s", e)
        else:
            _replace_linears(model, PanelLinear.from_linear)
            return "panel"
    linears = [(parent, name) for parent in model.modules() for name, mod in parent.named_children()
               if isinstance(mod, nn.Linear)]
    reason = None
    if not onednn_available(dtype):
        reason = f"oneDNN cannot pack {dtype} linear weights in this torch build / on this CPU"
    elif linears:
        first = getattr(*linears[0])
        if not _agrees(first, PackedLinear.from_linear(first)):
            reason = "oneDNN's packed linear disagrees with F.linear on a test input"
        del first
    if reason is not None:
        if choice == "auto":
            logger.warning("CPU linear layers stay on F.linear (MKL): %s", reason)
            return "torch"
        raise NativeUnavailableError(f"{reason} (--cpu-linear onednn)")
    _replace_linears(model, PackedLinear.from_linear)
    return "onednn"
