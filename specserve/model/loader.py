"""Load a Hugging Face model folder (config.json + *.safetensors) into our `CausalLM`.

What it does: builds the module on the meta device (no throwaway random init), assigns the checkpoint
tensors in the requested dtype/device, handles tied embeddings, fuses projections, and on the CPU
moves the weights into huge-page memory (`specserve.model.weight_memory`). What it does not do:
download or convert models (see `specserve.hub`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from specserve.model.config import ModelConfig
from specserve.model.cpu_layer_ops import select_layer_kernels
from specserve.model.cpu_linear import pack_linear_weights
from specserve.model.llama import CausalLM, RotaryEmbedding
from specserve.model.weight_memory import move_weights_to_huge_pages


class WeightLoadError(RuntimeError):
    """The checkpoint does not match the architecture (missing or unexpected tensors, wrong shapes)."""


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _safetensor_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"no *.safetensors files in {folder}")
    return files


def load_model(
    folder: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_positions: int,
    cpu_linear: str = "auto",
) -> CausalLM:
    """Build the model described by `cfg` from the checkpoint in `folder`, in `dtype` on `device`.

    Args:
        cfg: the folder's ModelConfig (`ModelConfig.from_folder`).
        max_positions: size of the RoPE table (the engine's max_model_len).
        cpu_linear: on the CPU, how linear layers run (`specserve.model.cpu_linear.pack_linear_weights`):
            "auto" (float32: the panel kernel, else oneDNN with prepacked weights), "panel", "onednn" or
            "torch" (F.linear).

    Returns:
        the model in eval mode, with fused projections; on the CPU with its linear weights packed
        (`model.linear_backend` says which backend) and the other weights in `model.weight_arena`.

    Raises:
        WeightLoadError: checkpoint mismatch (missing or unexpected tensors, wrong shapes).
    """
    folder = Path(folder)
    with torch.device("meta"):
        model = CausalLM(cfg, max_positions)
    expected = {k: v for k, v in model.state_dict().items()}
    state: dict[str, torch.Tensor] = {}
    for f in _safetensor_files(folder):
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for name in st.keys():
                if name == "lm_head.weight" and cfg.tie_word_embeddings:
                    continue
                if name not in expected:
                    if "rotary_emb" in name:
                        continue
                    raise WeightLoadError(f"unexpected tensor {name!r} in {f.name}")
                t = st.get_tensor(name)
                if tuple(t.shape) != tuple(expected[name].shape):
                    raise WeightLoadError(f"{name}: checkpoint shape {tuple(t.shape)} != model {tuple(expected[name].shape)}")
                state[name] = t.to(device=device, dtype=dtype)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise WeightLoadError(f"checkpoint in {folder} lacks {len(missing)} tensors, e.g. {missing[:3]}")
    model.load_state_dict(state, assign=True, strict=True)
    del state, expected  # the model now holds the only references (so the move below frees as it goes)
    model.model.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, max_positions).to(device)
    model.fuse_projections()
    model.linear_backend = "torch"
    if torch.device(device).type == "cpu":
        model.linear_backend = pack_linear_weights(model, cpu_linear)
        model.layer_backend = select_layer_kernels(model)
        # Also copies the tensors still backed by the memory-mapped checkpoint (when no dtype conversion
        # was needed) into private memory: each loading process then holds its own copy of the weights
        # instead of sharing the file's page cache, in exchange for huge pages.
        model.weight_arena = move_weights_to_huge_pages(model)
    model.eval()
    return model
