"""CPU weights are copied into one huge-page-advised arena: same values, nothing left file-backed."""

from __future__ import annotations

import sys

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from specserve.model.config import ModelConfig
from specserve.model.loader import load_model
from specserve.model.weight_memory import move_weights_to_huge_pages


@pytest.mark.parametrize("which", ["tiny_model_dir", "tiny_llama_dir"])  # tied and untied lm_head
def test_loaded_weights_live_in_the_arena_with_checkpoint_values(request, which):
    folder = request.getfixturevalue(which)
    cfg = ModelConfig.from_folder(folder)
    model = load_model(folder, cfg, torch.float32, torch.device("cpu"), 64)
    arena = model.weight_arena
    params = list(model.parameters())
    assert params and all(arena.contains(p) for p in params)
    if sys.platform == "linux":
        assert arena.huge_pages  # the advice was accepted (the kernel may still ignore it if THP is off)
    # tensors do not overlap: the arena holds each parameter once (a tied lm_head is the embedding)
    spans = sorted((p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()) for p in params)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    ckpt = load_file(str(folder / "model.safetensors"))
    assert torch.equal(model.model.embed_tokens.weight, ckpt["model.embed_tokens.weight"])
    assert torch.equal(model.model.layers[0].mlp.down_proj.weight, ckpt["model.layers.0.mlp.down_proj.weight"])
    gate_up = torch.cat([ckpt["model.layers.1.mlp.gate_proj.weight"], ckpt["model.layers.1.mlp.up_proj.weight"]])
    assert torch.equal(model.model.layers[1].mlp.gate_up_proj.weight, gate_up)
    if cfg.tie_word_embeddings:
        assert not hasattr(model, "lm_head")
    else:
        assert torch.equal(model.lm_head.weight, ckpt["lm_head.weight"])


def test_moving_keeps_outputs_and_refuses_non_cpu_parameters():
    torch.manual_seed(0)
    lin = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3, bias=False)).to(torch.bfloat16)
    x = torch.randn(5, 8, dtype=torch.bfloat16)
    before = lin(x)
    arena = move_weights_to_huge_pages(lin)
    assert all(arena.contains(p) for p in lin.parameters())
    assert torch.equal(lin(x), before)
    with torch.inference_mode():  # the views stay normal tensors, usable outside inference_mode
        arena2 = move_weights_to_huge_pages(lin)
    assert all(arena2.contains(p) and not p.is_inference() for p in lin.parameters())
    assert torch.equal(lin(x), before)
    with torch.device("meta"):
        meta = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="expected cpu"):
        move_weights_to_huge_pages(meta)


def test_weights_tied_through_two_parameters_stay_tied():
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = nn.Parameter(emb.weight.data)  # another Parameter over the same memory
    mod = nn.ModuleDict({"emb": emb, "head": head})
    move_weights_to_huge_pages(mod)
    assert emb.weight.data_ptr() == head.weight.data_ptr()
    with torch.no_grad():
        emb.weight[0, 0] = 123.0
    assert head.weight[0, 0].item() == 123.0
