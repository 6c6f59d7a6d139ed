"""The panel kernel (specserve/model/panel_linear.py): F.linear's results, every row bit-identical alone and
in any batch, and the backend choice with its errors."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from specserve.model import panel_linear
from specserve.model.cpu_linear import pack_linear_weights
from specserve.model.panel_linear import PanelLinear, panel_available

needs_panel = pytest.mark.skipif(not panel_available(), reason="the panel kernel cannot be built here")


@needs_panel
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(200, 96), (16, 7), (3, 40), (1000, 33)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_matches_f_linear_for_any_row_count_and_padded_panels(bias, shape):
    n, k = shape  # 200, 3, 1000: out_features not a multiple of 16 (zero-padded panel); 7, 33: odd in_features
    torch.manual_seed(0)
    lin = nn.Linear(k, n, bias=bias)
    p = PanelLinear.from_linear(lin)
    assert p.weight.shape == ((n + 15) // 16, k, 16) and p.weight.dtype == torch.float32
    with torch.inference_mode():
        for rows in (0, 1, 2, 3, 5, 6, 7, 13, 64):
            x = torch.randn(rows, k)
            torch.testing.assert_close(p(x), lin(x), rtol=1e-5, atol=1e-5)
        x = torch.randn(2, 3, k)  # any leading shape; a non-contiguous input too
        torch.testing.assert_close(p(x), lin(x), rtol=1e-5, atol=1e-5)
        xt = torch.randn(k, 4).t()
        torch.testing.assert_close(p(xt), lin(xt), rtol=1e-5, atol=1e-5)


# (out_features, in_features) of smollm2-135m and qwen2.5-coder-0.5b: q/k/v, o, gate/up, down
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (1152, 896), (896, 896), (9728, 896), (896, 4864)]


@needs_panel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_a_row_is_bit_identical_alone_and_in_any_batch(shape, threads):
    """fp32 batch invariance: rows of an M-row call equal the same rows of a 40-row call (M = 1..13, 17,
    every tile remainder), and a lone row equals its row in the batch, with 1 and 2 threads."""
    n, k = shape
    gen = torch.Generator().manual_seed(0)
    p = PanelLinear(torch.randn(n, k, generator=gen) * 0.02, torch.randn(n, generator=gen) * 0.01)
    x = torch.randn(40, k, generator=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            ref = p(x)
            for m in (*range(1, 14), 17):
                assert torch.equal(p(x[:m]), ref[:m]), m
            for i in (0, 5, 39):
                assert torch.equal(p(x[i : i + 1]), ref[i : i + 1]) and torch.equal(p(x[i]), ref[i])
                assert torch.equal(p(x[i : i + 7]), ref[i : i + 7][: len(x[i : i + 7])])
    finally:
        torch.set_num_threads(before)


@needs_panel
def test_auto_and_panel_replace_every_linear_and_the_tied_head():
    class Tied(nn.Module):  # the two attributes pack_linear_weights reads of a CausalLM with tied embeddings
        def __init__(self):
            super().__init__()
            self.config = type("C", (), {"tie_word_embeddings": True})()
            self.model = nn.Module()
            self.model.embed_tokens = nn.Embedding(50, 8)
            self.proj = nn.Linear(8, 8)

    m = Tied()
    x = torch.randn(3, 8)
    with torch.no_grad():
        ref_proj, ref_head = m.proj(x), x @ m.model.embed_tokens.weight.T
    assert pack_linear_weights(m, "auto") == "panel"
    assert isinstance(m.proj, PanelLinear) and isinstance(m.lm_head, PanelLinear)
    assert isinstance(m.model.embed_tokens, nn.Embedding)  # the lookup keeps the plain table
    with torch.no_grad():
        torch.testing.assert_close(m.proj(x), ref_proj, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(m.lm_head(x), ref_head, rtol=1e-5, atol=1e-5)
    bf16 = nn.Sequential(nn.Linear(8, 16)).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="float32 only"):
        pack_linear_weights(bf16, "panel")
    with pytest.raises(ValueError, match="float32"):
        PanelLinear(torch.zeros(4, 4, dtype=torch.float64), None)


def test_a_kernel_that_cannot_be_built_is_an_error_for_panel_and_a_logged_fallback_for_auto(monkeypatch, caplog):
    ext = panel_linear.EXTENSION
    monkeypatch.setattr(ext, "_module", None)
    monkeypatch.setattr(ext, "_error", "the panel linear kernel could not be built: RuntimeError: no g++")
    model = nn.Sequential(nn.Linear(8, 16))
    with pytest.raises(RuntimeError, match="could not be built: RuntimeError: no g\\+\\+"):
        pack_linear_weights(model, "panel")
    assert isinstance(model[0], nn.Linear)
    with caplog.at_level(logging.WARNING, logger="specserve.model.cpu_linear"):
        backend = pack_linear_weights(model, "auto")
    assert backend in ("onednn", "torch") and "instead of the panel kernel" in caplog.text
    assert not panel_available()
