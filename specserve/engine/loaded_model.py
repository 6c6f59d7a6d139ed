"""Loading one model for the engine: weights, tokenizer, KV cache and runner on one device.

What it does: resolves the model (catalog name, folder or .gguf), picks device and dtype, reads the
architecture once, loads the weights, and sizes the KV cache. The target and every draft model are a
`LoadedModel`. What it does not do: scheduling or sampling.
"""

from __future__ import annotations

import torch
from transformers import AutoTokenizer

from specserve.engine.kv_cache import KVCache
from specserve.engine.model_runner import ModelRunner
from specserve.model.config import ModelConfig
from specserve.model.loader import DTYPES, load_model
from specserve.hub import resolve_model


def resolve_device(device: str) -> torch.device:
    """ "auto" -> cuda when available, else cpu. Raises RuntimeError when cuda is asked but absent."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' was asked for but torch sees no CUDA device")
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """ "auto" -> float32 on CPU, bfloat16 on CUDA."""
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return DTYPES[dtype]


class LoadedModel:
    """A model, its tokenizer, its KV cache and its runner on one device (the target, or a draft model).

    Args:
        model_ref: catalog name, Hugging Face folder or .gguf path (`specserve.hub.resolve_model`).
        dtype, device: as EngineConfig ("auto" = float32 on CPU, bfloat16 on CUDA).
        max_model_len: context length; None = the model's own limit capped at 4096; never above the
            model's own limit.
        num_slots: KV cache slots (most sequences at once).

    Raises:
        ModelError, ModelConfigError, WeightLoadError: the model cannot be found or loaded.
    """

    def __init__(self, model_ref: str, dtype: str, device: str, max_model_len: int | None, num_slots: int):
        self.files = resolve_model(model_ref)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        cfg = ModelConfig.from_folder(self.files.path)
        self.max_model_len = min(max_model_len or min(cfg.max_position_embeddings, 4096), cfg.max_position_embeddings)
        self.model = load_model(self.files.path, cfg, self.dtype, self.device, self.max_model_len)
        self.config = cfg
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.files.path))
        self.kv = KVCache(
            cfg.num_layers, num_slots, cfg.num_kv_heads, cfg.head_dim, self.max_model_len, self.dtype, self.device
        )
        self.runner = ModelRunner(self.model, self.kv, self.device)
