"""Loading one model for the engine: weights, tokenizer, KV cache and runner on one device.

What it does: resolves the model (catalog name, folder or .gguf), picks device and dtype, reads the
architecture once, loads the weights, and sizes the KV cache. The target and every draft model are a
`LoadedModel`. What it does not do: scheduling or sampling.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoTokenizer

from specserve.config import ConfigError
from specserve.engine.cpu_threads import release_openmp_pool
from specserve.engine.kv_cache import KVCache
from specserve.engine.model_runner import ModelRunner
from specserve.hub import ModelFiles, resolve_model
from specserve.model.config import ModelConfig
from specserve.model.llama import CausalLM
from specserve.model.loader import DTYPES, load_model


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
        enforce_eager, batch_invariant: CUDA runner options (`EngineConfig`); on the CPU the eager
            `ModelRunner` runs and batch_invariant is refused.
        cpu_linear: how linear layers run on the CPU ("auto", "panel", "onednn", "torch"; see `specserve.model.cpu_linear`).

    Raises:
        ModelError, ModelConfigError, WeightLoadError: the model cannot be found or loaded.
        ConfigError: batch_invariant on a device other than CUDA.
    """

    def __init__(self, model_ref: str, dtype: str, device: str, max_model_len: int | None, num_slots: int,
                 enforce_eager: bool = False, batch_invariant: bool = False, cpu_linear: str = "auto"):
        files = resolve_model(model_ref)
        dev = resolve_device(device)
        if batch_invariant and dev.type != "cuda":
            raise ConfigError("batch-invariant mode runs on CUDA only (its fixed-order kernels are Triton kernels)")
        dt = resolve_dtype(dtype, dev)
        cfg = ModelConfig.from_folder(files.path)
        max_len = min(max_model_len or min(cfg.max_position_embeddings, 4096), cfg.max_position_embeddings)
        model = load_model(files.path, cfg, dt, dev, max_len, cpu_linear)
        self._assemble(files, cfg, model, AutoTokenizer.from_pretrained(str(files.path)), dt, dev, max_len, num_slots,
                       enforce_eager, batch_invariant)
        if dev.type == "cpu":
            release_openmp_pool()  # loading ran parallel work here; steps may run on another thread

    @classmethod
    def from_parts(cls, files: ModelFiles, config: ModelConfig, model: torch.nn.Module, tokenizer: Any, *,
                   dtype: torch.dtype, device: torch.device, max_model_len: int, num_slots: int) -> "LoadedModel":
        """A LoadedModel around a model already in memory (any module with `CausalLM.forward`'s signature),
        with its own KV cache and runner; the tests' model-free stand-in uses it (tests/helpers/fake_engine.py)."""
        self = cls.__new__(cls)
        self._assemble(files, config, model, tokenizer, dtype, device, max_model_len, num_slots)
        return self

    def _assemble(self, files: ModelFiles, cfg: ModelConfig, model: torch.nn.Module, tokenizer: Any, dtype: torch.dtype,
                  device: torch.device, max_model_len: int, num_slots: int, enforce_eager: bool = False,
                  batch_invariant: bool = False) -> None:
        self.files, self.config, self.model, self.tokenizer = files, cfg, model, tokenizer
        self.dtype, self.device, self.max_model_len = dtype, device, max_model_len
        self.kv = KVCache(cfg.num_layers, num_slots, cfg.num_kv_heads, cfg.head_dim, max_model_len, dtype, device)
        if device.type == "cuda" and isinstance(model, CausalLM):
            from specserve.engine.cuda_graph_runner import CudaGraphRunner  # imports Triton: CUDA only

            self.runner = CudaGraphRunner(model, self.kv, device, num_slots, batch_invariant=batch_invariant,
                                          cuda_graphs=not enforce_eager)
        else:
            self.runner = ModelRunner(model, self.kv, device)
