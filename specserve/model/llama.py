"""Decoder-only transformer of the Llama family (Llama, SmolLM2, Qwen2/2.5, Qwen3) in plain PyTorch.

What it does: the forward pass over a flat, ragged batch of new tokens (prefill chunks and verify
blocks of several requests at once), reading and writing a slot-based KV cache, and returning logits
only for the rows the sampler needs. Parameter names follow Hugging Face, so checkpoints load as they
are; q/k/v and gate/up are fused at load time (`fuse_projections`) for fewer matmuls.
What it does not do: sampling, scheduling, or owning the cache (it is passed in).

Reference: Touvron et al. 2023 (Llama), RoPE (Su et al. 2021), GQA (Ainslie et al. 2023).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specserve.model.attention import AttentionMetadata, cached_attention
from specserve.model.config import ModelConfig
from specserve.model.cpu_layer_ops import cpu_fused_forward


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019), computed in float32 like the reference implementation."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # the lines below, bit for bit, with two temporaries fewer: on the CPU F.rms_norm runs the same
            # ops but copies its input twice (a 300-row prompt chunk: 1.0-3.8 ms against 0.2 ms, 1-2 threads)
            r = x.pow(2).mean(-1, keepdim=True).add_(self.eps).rsqrt_()
            return (x * r).mul_(self.weight)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """Default RoPE with a precomputed cos/sin table of [max_positions, head_dim].

    `tables(positions, dtype)` gathers one step's rows once (every layer reuses them); `apply` rotates.
    """

    def __init__(self, head_dim: int, theta: float, max_positions: int):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        half = head_dim // 2
        self.register_buffer("sign", torch.cat((-torch.ones(half), torch.ones(half))), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin), each [T, 1, head_dim] in `dtype`, for positions [T] (signed sin: the first
        half negated, so that `apply` needs no concatenation)."""
        cos = self.cos[positions].unsqueeze(1).to(dtype)
        sin = (self.sin[positions] * self.sign).unsqueeze(1).to(dtype)
        return cos, sin

    @staticmethod
    def apply(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x: [T, heads, head_dim] -> rotated x: x * cos + rotate_half(x) * sin, where rotate_half(x) =
        cat(-x2, x1) = roll(x, half) * sign (bit-identical to the concatenating form)."""
        cos, sin = tables
        return (x * cos).add_(x.roll(x.shape[-1] // 2, -1).mul_(sin))  # the same ops, two temporaries fewer

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_dim], positions: [T] -> rotated x (same shape and dtype)."""
        return self.apply(x, self.tables(positions, x.dtype))


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE over the slot KV cache: [T, hidden] -> [T, hidden]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)
        if cfg.family == "qwen3":
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.qkv_proj: nn.Linear | None = None
        self.scale = d**-0.5

    def fuse(self) -> None:
        """Replace q/k/v projections by one fused Linear (same math, one matmul)."""
        q, k, v = self.q_proj, self.k_proj, self.v_proj
        fused = nn.Linear(q.in_features, q.out_features + k.out_features + v.out_features, bias=q.bias is not None)
        fused = fused.to(device=q.weight.device, dtype=q.weight.dtype)
        with torch.no_grad():
            fused.weight.copy_(torch.cat([q.weight, k.weight, v.weight]))
            if q.bias is not None:
                fused.bias.copy_(torch.cat([q.bias, k.bias, v.bias]))
        self.qkv_proj = fused
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x, rope_tables, k_cache, v_cache, meta: AttentionMetadata):
        """x: [T, hidden]; rope_tables: this step's `RotaryEmbedding.tables`. Returns [T, hidden]."""
        cfg = self.cfg
        T, H, Hkv, D = x.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        if self.qkv_proj is not None and cfg.family != "qwen3":
            qkv = self.qkv_proj(x)
            # q and k are adjacent columns: rotate both heads' sets in one pass
            qk = RotaryEmbedding.apply(qkv[:, : (H + Hkv) * D].view(T, H + Hkv, D), rope_tables)
            q, k = qk[:, :H], qk[:, H:]
            v = qkv[:, (H + Hkv) * D :].view(T, Hkv, D)
        else:
            if self.qkv_proj is not None:
                q, k, v = self.qkv_proj(x).split([H * D, Hkv * D, Hkv * D], -1)
            else:
                q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            q, k, v = q.view(T, H, D), k.view(T, Hkv, D), v.view(T, Hkv, D)
            if cfg.family == "qwen3":
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = RotaryEmbedding.apply(q, rope_tables), RotaryEmbedding.apply(k, rope_tables)
        out = cached_attention(q, k, v, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out)


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)), [T, hidden] -> [T, hidden]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up_proj: nn.Linear | None = None

    def fuse(self) -> None:
        """Replace gate/up projections by one fused Linear."""
        g, u = self.gate_proj, self.up_proj
        fused = nn.Linear(g.in_features, 2 * g.out_features, bias=False).to(device=g.weight.device, dtype=g.weight.dtype)
        with torch.no_grad():
            fused.weight.copy_(torch.cat([g.weight, u.weight]))
        self.gate_up_proj = fused
        del self.gate_proj, self.up_proj

    def forward(self, x):
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate).mul_(up))  # in place: one [T, intermediate] temporary fewer


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(x)). [T, hidden] -> [T, hidden]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, rope_tables, k_cache, v_cache, meta):
        # residual adds into the fresh sublayer outputs (a + b == b + a bit for bit): no new [T, hidden] tensors
        x = self.self_attn(self.input_layernorm(x), rope_tables, k_cache, v_cache, meta).add_(x)
        return self.mlp(self.post_attention_layernorm(x)).add_(x)


class Backbone(nn.Module):
    """Hugging Face's `model.` prefix: embeddings, layers, final norm."""

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, max_positions)


class CausalLM(nn.Module):
    """The whole model: `forward(input_ids, meta, kv, logits_rows) -> logits`.

    Args (forward):
        input_ids: int64 [T], the step's new tokens of all requests, request after request.
        meta: `AttentionMetadata` for those tokens.
        kv: object with `.k[layer]`, `.v[layer]` cache tensors [num_slots, num_kv_heads, max_len, head_dim].
        logits_rows: int64 [R], which of the T rows need logits (the sampler's rows).

    Returns:
        float32 logits [R, vocab_size].
    """

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg, max_positions)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.cpu_layer_ops = None  # the fused CPU kernels when the loader selects them (`specserve.model.cpu_layer_ops`)

    def fuse_projections(self) -> None:
        """Fuse q/k/v and gate/up projections of every layer (call after loading weights)."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    @torch.inference_mode()
    def forward(self, input_ids, meta, kv, logits_rows):
        if self.cpu_layer_ops is not None:
            return cpu_fused_forward(self, input_ids, meta, kv, logits_rows)
        x = self.model.embed_tokens(input_ids)
        rope_tables = self.model.rotary.tables(meta.positions, x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, rope_tables, kv.k[i], kv.v[i], meta)
        x = self.model.norm(x[logits_rows])
        head = getattr(self, "lm_head", None)  # absent when tied, unless the CPU packed a copy
        return (head(x) if head is not None else F.linear(x, self.model.embed_tokens.weight)).float()
