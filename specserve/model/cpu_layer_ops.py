"""Fused layer kernels for fp32 on the CPU: a decoder layer's work between its linear layers in four C++
calls instead of ~25 eager ops (`cpu_layer_ops.cpp` holds the kernels and their summation orders).

Why: with the linear layers in the panel kernel (`specserve.model.panel_linear`), what was left of a
decode step on the 2-core host was the small ops: views, RMSNorm's pow/mean/rsqrt, RoPE's roll/mul/add,
the KV-cache index_put, one SDPA call per sequence per layer, silu and mul: 9.6 ms of a 72 ms one-row
step and 12.9 ms of an 85 ms four-row step (qwen2.5-coder-0.5b, 2 threads; docs/cpu_performance.md, "Fused
layer kernels", has the before and after).

What it does: `cpu_fused_forward` runs a `CausalLM` over one step with, per layer, `add_rms_norm`
(the residual add and the norm), the fused q/k/v projection, `rope_cache_attention` (RoPE on q and k,
k and v into the cache, causal attention of every new token over its slot's cache up to its own
position), the output projection, `add_rms_norm`, the fused gate/up projection, `silu_mul`, and the down
projection. Every row is computed with a fixed order of operations whatever the rows beside it, so a
verify block's rows get a one-token decode's bits (no row-by-row attention needed) and seeded sampling
is batch invariant, as with the panel kernel.
What it does not do: bf16/fp16, CUDA, Qwen3's per-head q/k norms, or head sizes that are not a multiple
of 16 (`supports` says no and the model keeps the eager path).

Selection: `SPECSERVE_CPU_LAYER_KERNELS=auto|native|torch` (default auto: the fused kernels for an fp32
CPU model they support, built on first use, ~25 s, and cached by `specserve.native`; if they cannot be
built, a warning and the eager path). `native` makes a build failure an error; `torch` keeps the eager
path.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from types import ModuleType

import torch

from specserve.native import NativeExtension, NativeUnavailableError, native_cflags

logger = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("cpu_layer_ops.cpp")
EXTENSION = NativeExtension("specserve_cpu_layer_ops", SOURCE, native_cflags(openmp=True) + ["-ffp-contract=off", "-fno-trapping-math"],
                            "the fused CPU layer kernels")
CHOICES = ("auto", "native", "torch")
ENV = "SPECSERVE_CPU_LAYER_KERNELS"


def load_kernels() -> ModuleType:
    """The compiled extension (built on first use; `specserve.native.NativeExtension.load`).

    Raises:
        RuntimeError: it cannot be built here; the message says why.
    """
    return EXTENSION.load()


def supports(model: torch.nn.Module) -> str | None:
    """None when `cpu_fused_forward` can run `model`, else why not (a short reason)."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return "not a CausalLM"
    if cfg.family == "qwen3":
        return "Qwen3's per-head q/k norms are not fused"
    if cfg.head_dim % 16 or cfg.hidden_size % 16 or cfg.head_dim > 1024:
        return f"head_dim {cfg.head_dim} or hidden_size {cfg.hidden_size} is not a multiple of 16 (or head_dim > 1024)"
    params = list(model.parameters())
    if any(p.device.type != "cpu" for p in params):
        return "not on the CPU"
    if any(p.dtype != torch.float32 for p in params):
        return "not float32"
    if any(layer.self_attn.qkv_proj is None or layer.mlp.gate_up_proj is None for layer in model.model.layers):
        return "projections not fused"
    return None


def select_layer_kernels(model: torch.nn.Module, choice: str | None = None) -> str:
    """Decide whether `model` (a loaded, projection-fused `CausalLM`) runs through the fused kernels, and
    mark it (`model.cpu_layer_ops`, the module or None).

    Args:
        choice: "auto", "native" or "torch"; None reads `SPECSERVE_CPU_LAYER_KERNELS` (default "auto").

    Returns:
        "native" (fused kernels) or "torch" (the eager ops).

    Raises:
        ValueError: an unknown choice.
        NativeUnavailableError: "native" was asked for and the model is not supported or the kernels cannot be
            built (a ConfigError and a RuntimeError).
    """
    choice = (choice if choice is not None else os.environ.get(ENV, "auto")).strip().lower() or "auto"
    if choice not in CHOICES:
        raise ValueError(f"{ENV} must be one of {', '.join(CHOICES)}, got {choice!r}")
    model.cpu_layer_ops = None
    if choice == "torch":
        return "torch"
    reason = supports(model)
    if reason is not None:
        if choice == "native":
            raise NativeUnavailableError(f"the fused CPU layer kernels cannot run this model: {reason} "
                                         f"({ENV}=native; auto would use the eager ops)")
        logger.debug("eager layer ops: %s", reason)
        return "torch"
    try:
        ops = load_kernels()
    except RuntimeError as e:
        if choice == "native":
            raise NativeUnavailableError(f"{e} ({ENV}=native; auto would use the eager ops)") from e
        logger.warning("CPU layers use the eager ops instead of the fused kernels: %s", e)
        return "torch"
    rotary = model.model.rotary
    rotary.sin_signed = (rotary.sin * rotary.sign).contiguous()  # the rows `RotaryEmbedding.tables` gathers
    model.cpu_layer_ops = ops
    return "native"


def cpu_fused_forward(model: torch.nn.Module, input_ids: torch.Tensor, meta, kv, logits_rows: torch.Tensor) -> torch.Tensor:
    """`CausalLM.forward` through the fused kernels (same arguments and result: float32 logits [R, vocab]).

    Args:
        input_ids: int64 [T]; meta: the step's `AttentionMetadata` (only `slots` and `positions` are read:
            each token attends to its slot's positions <= its own); kv: `.k[i]`, `.v[i]` caches
            [S, Hkv, L, D]; logits_rows: int64 [R].
    """
    ops = model.cpu_layer_ops
    cfg, backbone = model.config, model.model
    H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    cos, sin = backbone.rotary.cos, backbone.rotary.sin_signed
    positions, slots = meta.positions.contiguous(), meta.slots.contiguous()
    x = backbone.embed_tokens(input_ids)
    residual = None
    for i, layer in enumerate(backbone.layers):
        attn, mlp = layer.self_attn, layer.mlp
        if residual is None:
            h, residual = ops.rms_norm(x, layer.input_layernorm.weight, layer.input_layernorm.eps), x
        else:  # x is the last layer's MLP output: x + residual is this layer's input
            h, residual = ops.add_rms_norm(x, residual, layer.input_layernorm.weight, layer.input_layernorm.eps), x
        a = ops.rope_cache_attention(attn.qkv_proj(h), cos, sin, positions, slots, kv.k[i], kv.v[i], H, Hkv, attn.scale)
        x = attn.o_proj(a)
        norm = layer.post_attention_layernorm
        h, residual = ops.add_rms_norm(x, residual, norm.weight, norm.eps), x
        x = mlp.down_proj(ops.silu_mul(mlp.gate_up_proj(h)))
    x = x[logits_rows].add_(residual[logits_rows])
    x = ops.rms_norm(x, backbone.norm.weight, backbone.norm.eps)
    head = getattr(model, "lm_head", None)
    return (head(x) if head is not None else torch.nn.functional.linear(x, backbone.embed_tokens.weight)).float()
