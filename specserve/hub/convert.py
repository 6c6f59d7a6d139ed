"""Convert a GGUF file into a Hugging Face folder: config.json, model.safetensors (float32), tokenizer.

Uses transformers' own GGUF reader (`load_gguf_checkpoint`, the loader `from_pretrained(gguf_file=...)`
runs for llama/qwen2), called directly so that `accelerate` is not needed and the weights go straight
from the dequantizer into a dict (the model skeleton lives on the meta device: no second copy).
Weights are written under Hugging Face tensor names; a tied lm_head is not written (the config says
`tie_word_embeddings` and loaders tie it). config.json names the model class in `architectures` (vLLM
resolves a model by it; without it vLLM takes the folder for an embedding model) and drops the GGUF's
`general.name`, which transformers' reader keeps as `_model_name_or_path` (for the catalog's qwen
models it names an AWQ model the weights are not). `fix_config_json` repairs folders converted before.
Does not check checksums or manage the cache: see pull.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

SUPPORTED_GGUF_ARCHS = ("llama", "qwen2", "qwen3")
# model_type -> the transformers (and vLLM) class of a causal LM of that type
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
CONFIG_FORMAT = 2
"""What a converted config.json holds, recorded in the folder's marker as `config_format`: 2 = it has
`architectures` and no `_model_name_or_path`; folders without the field (1) were converted before."""


@contextlib.contextmanager
def _quiet_transformers(progress: bool):
    """Silence transformers' own progress bars and info logs unless `progress`."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    verbosity = hf_logging.get_verbosity()
    if not progress:
        hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if was_enabled:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _shared_gguf_reader():
    """Parse each GGUF file once: transformers builds a fresh `gguf.GGUFReader` for the config, the
    tensors and the tokenizer, and parsing the metadata of a 151k-token vocabulary takes ~10 s each time.
    Inside this context `gguf.GGUFReader(path)` returns one shared (read-only) reader per path."""
    import gguf

    original, cache = gguf.GGUFReader, {}

    def shared(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in cache:
            cache[key] = original(path, mode)
        return cache[key]

    gguf.GGUFReader = shared
    try:
        yield
    finally:
        gguf.GGUFReader = original


def gguf_architecture(gguf_path: str | os.PathLike) -> str:
    """The `general.architecture` of a GGUF file (reads the header only).

    Raises:
        ValueError: the file is not a readable GGUF file.
    """
    import gguf

    try:
        reader = gguf.GGUFReader(str(gguf_path))
        field = reader.fields["general.architecture"]
        return bytes(field.parts[field.data[0]]).decode()
    except Exception as e:  # noqa: BLE001 - any parse failure means "not a GGUF we can read"
        raise ValueError(f"{gguf_path} is not a readable GGUF file ({type(e).__name__}: {e})") from e


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, progress: bool = True) -> dict:
    """Dequantize `gguf_path` into the (existing, empty) folder `out_dir`.

    Writes config.json, generation_config.json, model.safetensors (float32), tokenizer.json,
    tokenizer_config.json (with the GGUF's chat template) and chat_template.jinja.

    Returns:
        {"arch": model_type, "tie_word_embeddings": bool, "num_parameters": int, "timings": {phase: seconds}}
    Raises:
        ValueError: unsupported architecture, or tensors that do not match the model's parameters.
    """
    gguf_path, out_dir = Path(gguf_path).resolve(), Path(out_dir)
    with _shared_gguf_reader():
        return _convert(gguf_path, out_dir, progress)


def _convert(gguf_path: Path, out_dir: Path, progress: bool) -> dict:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    arch = gguf_architecture(gguf_path)
    if arch not in SUPPORTED_GGUF_ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_GGUF_ARCHS)}")
    src = dict(pretrained_model_name_or_path=str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True)
    timings, t0 = {}, time.perf_counter()

    def lap(label: str) -> None:
        nonlocal t0
        timings[label] = round(time.perf_counter() - t0, 2)
        t0 = time.perf_counter()

    with _quiet_transformers(progress):
        config = AutoConfig.from_pretrained(**src)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        lap("read_metadata")
        parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton, torch_dtype=torch.float32)
        tensors = parsed["tensors"]
        lap("dequantize")
        _check_tensors(tensors, skeleton.state_dict(), config.tie_word_embeddings, type(skeleton).__name__)
        num_parameters = sum(t.numel() for t in tensors.values())
        config.architectures = [type(skeleton).__name__]
        save_file({k: t.contiguous() for k, t in tensors.items()}, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        del tensors, parsed, skeleton
        config.dtype = torch.float32
        config.save_pretrained(out_dir)
        fix_config_json(out_dir)
        lap("write_safetensors")
        tokenizer = AutoTokenizer.from_pretrained(**src)
        tokenizer.save_pretrained(out_dir)
        gen = GenerationConfig.from_model_config(config)
        gen.eos_token_id = _end_of_generation_ids(tokenizer, config.eos_token_id)
        gen.save_pretrained(out_dir)
    _embed_chat_template(out_dir, tokenizer.chat_template)
    lap("tokenizer")
    return {"arch": config.model_type, "tie_word_embeddings": bool(config.tie_word_embeddings),
            "num_parameters": num_parameters, "timings": timings}


def fix_config_json(folder: str | os.PathLike) -> bool:
    """Make `folder`/config.json a config that transformers and vLLM load unchanged: add `architectures`
    (from `model_type`, when it is one of HF_ARCHITECTURES) if it is missing, and drop the GGUF-derived
    `_model_name_or_path`. The file is replaced atomically, so a concurrent reader sees the old or the
    new file, never half of one; running it twice changes nothing.

    Returns:
        whether the file changed.
    Raises:
        OSError: the file cannot be read or replaced (e.g. a read-only folder).
        ValueError: config.json is not a JSON object.
    """
    path = Path(folder) / "config.json"
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object")
    before = dict(data)
    data.pop("_model_name_or_path", None)
    arch = HF_ARCHITECTURES.get(data.get("model_type"))
    if arch and not data.get("architectures"):
        data = {"architectures": [arch], **data}
    if data == before:
        return False
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)
    return True


def _end_of_generation_ids(tokenizer, eos_token_id) -> int | list[int]:
    """The GGUF's eos plus the ChatML end tokens the vocabulary has (llama.cpp stops on all of them too)."""
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])
    vocab = tokenizer.get_vocab()
    for token in ("<|im_end|>", "<|endoftext|>"):
        if token in vocab and vocab[token] not in ids:
            ids.append(vocab[token])
    return ids[0] if len(ids) == 1 else ids


def _check_tensors(tensors: dict, expected: dict, tied: bool, cls_name: str) -> None:
    """Raise ValueError unless `tensors` has exactly the model's parameters (less a tied lm_head), same shapes."""
    names = set(expected) - ({"lm_head.weight"} if tied else set())
    missing, extra = names - set(tensors), set(tensors) - names
    if missing or extra:
        raise ValueError(
            f"GGUF tensors do not match the {cls_name} parameters: missing {sorted(missing)[:5]}, unexpected {sorted(extra)[:5]}"
        )
    for k, t in tensors.items():
        if tuple(t.shape) != tuple(expected[k].shape):
            raise ValueError(f"tensor {k}: shape {tuple(t.shape)} in the GGUF, {tuple(expected[k].shape)} expected")


def _embed_chat_template(out_dir: Path, template) -> None:
    """Also put the chat template into tokenizer_config.json (transformers 5 writes chat_template.jinja;
    older readers and other tools look in tokenizer_config.json)."""
    if not template:
        return
    path = out_dir / "tokenizer_config.json"
    data = json.loads(path.read_text())
    data["chat_template"] = template
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
