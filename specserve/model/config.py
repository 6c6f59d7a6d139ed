"""Model architecture config read from a Hugging Face `config.json` (llama / qwen2 / qwen3 families).

What it does: picks out the fields our forward pass needs and refuses what it cannot run (an unknown
architecture, a RoPE scaling type we do not implement) with a clear error. What it does not do: load
weights (see `loader.py`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


class ModelConfigError(ValueError):
    """The model folder describes an architecture or option this engine does not run."""


SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a decoder-only transformer of the Llama family.

    Attributes:
        family: "llama", "qwen2" (bias on q/k/v) or "qwen3" (per-head RMSNorm on q and k, no bias).
        vocab_size, hidden_size, intermediate_size, num_layers: sizes.
        num_heads, num_kv_heads, head_dim: attention shape (grouped-query when num_kv_heads < num_heads).
        rms_norm_eps: epsilon of every RMSNorm.
        rope_theta: RoPE base (default RoPE only).
        max_position_embeddings: the model's own context limit (tokens).
        tie_word_embeddings: lm_head shares the embedding matrix.
        attention_bias: q/k/v projections have a bias (qwen2; llama when config says so).
        eos_token_ids: token ids that end generation, from config.json / generation_config.json.
    """

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ModelConfig":
        """Read `config.json` (and `generation_config.json` for EOS ids) from a model folder.

        Raises:
            ModelConfigError: unsupported architecture or RoPE scaling.
            FileNotFoundError: no config.json.
        """
        folder = Path(folder)
        cfg = json.loads((folder / "config.json").read_text())
        archs = cfg.get("architectures") or []
        family = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if family is None and not archs:
            family = SUPPORTED_MODEL_TYPES.get(cfg.get("model_type"))
        if family is None:
            raise ModelConfigError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; supported model types: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default")) if rope else "default"
        if rope_type not in (None, "default"):
            raise ModelConfigError(f"RoPE scaling type {rope_type!r} is not supported yet (only default RoPE)")
        rope_theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        eos = _eos_ids(cfg.get("eos_token_id"))
        gen_path = folder / "generation_config.json"
        if gen_path.exists():
            eos = tuple(dict.fromkeys(eos + _eos_ids(json.loads(gen_path.read_text()).get("eos_token_id"))))
        return cls(
            family=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
            eos_token_ids=eos,
        )


def _eos_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
