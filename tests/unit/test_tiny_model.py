"""The tiny random-weight model fixture: loads offline, tokenizer + chat template work, logits are not degenerate."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.helpers.tiny_model import make_tiny_model


@pytest.mark.parametrize("arch,tied", [("qwen2", True), ("llama", False), ("qwen3", True)])
def test_tiny_model_loads_and_is_usable(tmp_path, arch, tied):
    path = make_tiny_model(tmp_path / arch, arch=arch, tie_word_embeddings=tied)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == arch and cfg["vocab_size"] == len(tok) and 300 <= len(tok) <= 500
    assert model.config.tie_word_embeddings == tied and model.dtype == torch.float32
    assert (model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()) == tied
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == model.config.eos_token_id
    text = tok.apply_chat_template([{"role": "user", "content": "def add(a, b):"}], add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\ndef add(a, b):<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text).input_ids
    assert tok.convert_tokens_to_ids("<|im_start|>") in ids and tok.decode(ids) == text
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    top2 = logits.topk(2, dim=-1).values
    assert logits.std() > 0.3 and (top2[:, 0] - top2[:, 1] > 1e-3).all()


def test_tiny_model_is_deterministic(tmp_path):
    a = make_tiny_model(tmp_path / "a", seed=3)
    b = make_tiny_model(tmp_path / "b", seed=3)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_text() == (b / "tokenizer.json").read_text()
