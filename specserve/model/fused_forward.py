"""The Llama-family forward on CUDA with fused kernels: what CUDA graphs capture.

What it does: runs a `CausalLM`'s weights (no copy) over a flat, ragged batch of new tokens whose
layout lives in device tensors (`StepTensors`), with a fixed number of kernels per layer: fused
residual-add + RMSNorm, the q/k/v projection, RoPE + KV-cache write, attention over the slot cache,
the output projection, fused add + RMSNorm, the gate/up projection, SwiGLU, the down projection
(`specserve.model.triton_ops`). No host synchronisation and no shape-dependent host logic inside, so
one forward per (tokens, sequences) bucket can be captured once and replayed.
In batch-invariant mode every matmul goes through `invariant_linear` (fixed reduction order) and every
row's attention takes the one-pass kernel (keys in 64-key blocks from position 0, whatever the chunk:
the split kernel that decode and verify rows take otherwise reduces in another order than a prefill
chunk does), so a row's logits are bit-identical whether it is decoded alone, verified in a block, or
prefilled in a chunk of any size over a cached prefix (prefix caching, chunked prefill).
What it does not do: bucketing, padding, graph capture (`specserve.engine.cuda_graph_runner`) or
sampling. The CPU path keeps the eager `CausalLM.forward`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specserve.model import triton_ops as ops
from specserve.model.llama import CausalLM


@dataclass
class StepTensors:
    """One forward's layout on the device (int32 tensors).

    Attributes:
        input_ids, positions, token_slots: [T] per new token (token_slots -1 = padding token: no KV write).
        logits_rows: [R] which token rows get logits.
        seq_qstart, seq_qlen, seq_ctx, seq_slot: [B] per sequence: first token row, number of new tokens
            (0 = padding sequence), KV length before the step (= position of its first new token), slot.
        max_qlen: host-side upper bound on seq_qlen (sets the attention grid).
        has_short: some sequence may have <= triton_ops.SPLIT_MAX_QLEN new tokens (decode / verify rows).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    token_slots: torch.Tensor
    logits_rows: torch.Tensor
    seq_qstart: torch.Tensor
    seq_qlen: torch.Tensor
    seq_ctx: torch.Tensor
    seq_slot: torch.Tensor
    max_qlen: int
    has_short: bool = True


class FusedForward:
    """`forward(step, kv) -> float32 logits [R, vocab]` over the weights of `model`.

    Args:
        model: a loaded `CausalLM` on a CUDA device (projections fused by the loader).
        batch_invariant: use `invariant_linear` for every matmul (bit-identical rows at any batch shape).

    Raises:
        ValueError: the model's head_dim is not a power of two (the RoPE/attention kernels need one).
    """

    def __init__(self, model: CausalLM, batch_invariant: bool = False):
        cfg = model.config
        if cfg.head_dim & (cfg.head_dim - 1):
            raise ValueError(f"the CUDA kernels need a power-of-two head_dim, got {cfg.head_dim}")
        self.cfg = cfg
        self.batch_invariant = batch_invariant
        bb = model.model
        self.embed = bb.embed_tokens.weight
        self.final_norm = bb.norm.weight
        self.lm_head = self.embed if cfg.tie_word_embeddings else model.lm_head.weight
        self.cos, self.sin = bb.rotary.cos, bb.rotary.sin
        self.scale = cfg.head_dim ** -0.5
        self.layers = []
        for layer in bb.layers:
            at, mlp = layer.self_attn, layer.mlp
            self.layers.append((
                layer.input_layernorm.weight, at.qkv_proj.weight, at.qkv_proj.bias, at.o_proj.weight,
                layer.post_attention_layernorm.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight,
                at.q_norm.weight if cfg.family == "qwen3" else None,
                at.k_norm.weight if cfg.family == "qwen3" else None,
            ))

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] @ w[N, K].T (+ b): cuBLAS, or the fixed-order Triton kernel in batch-invariant mode."""
        if self.batch_invariant:
            return ops.invariant_linear(x, w, b)
        return F.linear(x, w, b)

    @torch.inference_mode()
    def __call__(self, step: StepTensors, kv, out: torch.Tensor | None = None) -> torch.Tensor:
        """Run every layer over the step's tokens (writing their K/V into `kv`) and return the logits.

        Args:
            step: the step's layout on the device.
            kv: object with `.k[layer]`, `.v[layer]` cache tensors [num_slots, num_kv_heads, max_len, head_dim].
            out: optional float32 [R, vocab] buffer for the logits (CUDA graphs write into a static one).

        Returns:
            float32 logits [R, vocab] for the rows `step.logits_rows` (`out` when given).
        """
        cfg = self.cfg
        eps = cfg.rms_norm_eps
        h = self.embed.index_select(0, step.input_ids)
        res = None
        for i, (ln1, w_qkv, b_qkv, w_o, ln2, w_gu, w_down, qn, kn) in enumerate(self.layers):
            x, res = ops.rms_norm(h, ln1, eps, res)
            qkv = self.linear(x, w_qkv, b_qkv)
            q = ops.rope_and_cache(qkv, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, self.cos, self.sin,
                                   step.positions, step.token_slots, kv.k[i], kv.v[i], qn, kn, eps)
            a = ops.cached_attention(q, kv.k[i], kv.v[i], step.seq_qstart, step.seq_qlen, step.seq_ctx,
                                     step.seq_slot, step.max_qlen, self.scale, has_short=step.has_short,
                                     split=0 if self.batch_invariant else None)
            h = self.linear(a, w_o)
            x, res = ops.rms_norm(h, ln2, eps, res)
            h = self.linear(ops.silu_mul(self.linear(x, w_gu)), w_down)
        if step.logits_rows.shape[0] == 0:  # a prefill chunk that samples nothing
            return torch.empty((0, cfg.vocab_size), dtype=torch.float32, device=h.device)
        x, _ = ops.rms_norm(h, self.final_norm, eps, res, rows=step.logits_rows)
        logits = self.linear(x, self.lm_head)
        if out is None:
            return logits.float()
        return out.copy_(logits)
