"""CPU weights are copied into one huge-page-advised arena: same values, nothing left file-backed."""

from __future__ import annotations

import sys

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from specserve.model.config import ModelConfig
from specserve.model.cpu_linear import onednn_available
from specserve.model.panel_linear import panel_available
from specserve.model.loader import load_model
from specserve.model.weight_memory import move_weights_to_huge_pages


@pytest.mark.parametrize("which", ["tiny_model_dir", "tiny_llama_dir"])  # tied and untied lm_head
@pytest.mark.parametrize("cpu_linear", ["torch", "onednn", "panel"])
def test_loaded_weights_live_in_the_arena_with_checkpoint_values(request, which, cpu_linear):
    if cpu_linear == "onednn" and not onednn_available(torch.float32):
        pytest.skip("no oneDNN in this torch build")
    if cpu_linear == "panel" and not panel_available():
        pytest.skip("the panel kernel cannot be built here")
    folder = request.getfixturevalue(which)
    cfg = ModelConfig.from_folder(folder)
    model = load_model(folder, cfg, torch.float32, torch.device("cpu"), 64, cpu_linear=cpu_linear)
    arena = model.weight_arena
    params = [p for p in model.parameters() if not p.is_mkldnn]  # oneDNN-packed weights live elsewhere
    assert params and all(arena.contains(p) for p in params)
    if sys.platform == "linux":
        assert arena.huge_pages  # the advice was accepted (the kernel may still ignore it if THP is off)
    # tensors do not overlap: the arena holds each parameter once (a tied lm_head is the embedding)
    spans = sorted((p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()) for p in params)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    ckpt = load_file(str(folder / "model.safetensors"))
    assert torch.equal(model.model.embed_tokens.weight, ckpt["model.embed_tokens.weight"])
    gate_up = torch.cat([ckpt["model.layers.1.mlp.gate_proj.weight"], ckpt["model.layers.1.mlp.up_proj.weight"]])
    lm_head = ckpt["model.embed_tokens.weight"] if cfg.tie_word_embeddings else ckpt["lm_head.weight"]
    layers = model.model.layers
    if model.linear_backend == "torch":
        assert cpu_linear == "torch"
        assert torch.equal(layers[0].mlp.down_proj.weight, ckpt["model.layers.0.mlp.down_proj.weight"])
        assert torch.equal(layers[1].mlp.gate_up_proj.weight, gate_up)
        if cfg.tie_word_embeddings:
            assert not hasattr(model, "lm_head")
        else:
            assert torch.equal(model.lm_head.weight, lm_head)
        return
    # packed: each projection computes x W^T with the checkpoint's W (to fp32 rounding)
    x = torch.randn(3, cfg.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(layers[1].mlp.gate_up_proj(x), x @ gate_up.T, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model.lm_head(x), x @ lm_head.T, rtol=1e-5, atol=1e-5)
        h = torch.randn(3, cfg.intermediate_size)
        down = ckpt["model.layers.0.mlp.down_proj.weight"]
        torch.testing.assert_close(layers[0].mlp.down_proj(h), h @ down.T, rtol=1e-5, atol=1e-5)


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
