"""oneDNN-packed CPU linear layers: same results as F.linear, clear choices and errors (the panel kernel:
test_panel_linear.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specserve.model.cpu_linear import PackedLinear, onednn_available, pack_linear_weights

needs_onednn = pytest.mark.skipif(not onednn_available(torch.float32), reason="no oneDNN in this torch build")


@needs_onednn
@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_matches_f_linear_for_every_row_count(bias):
    torch.manual_seed(0)
    lin = nn.Linear(96, 200, bias=bias)
    packed = PackedLinear.from_linear(lin)
    assert packed.weight.is_mkldnn and packed.weight.numel() == lin.weight.numel()
    with torch.inference_mode():
        for rows in (1, 2, 5, 9, 17, 64):
            x = torch.randn(rows, 96)
            torch.testing.assert_close(packed(x), lin(x), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_pack_replaces_every_linear_and_respects_the_choice():
    model = nn.Sequential(nn.Linear(8, 16), nn.SiLU(), nn.Sequential(nn.Linear(16, 4, bias=False)))
    x = torch.randn(3, 8)
    with torch.no_grad():
        ref = model(x)
    assert pack_linear_weights(model, "torch") == "torch" and isinstance(model[0], nn.Linear)
    assert pack_linear_weights(model, "onednn") == "onednn"
    assert isinstance(model[0], PackedLinear) and isinstance(model[2][0], PackedLinear)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="auto, panel, onednn, torch"):
        pack_linear_weights(model, "mkl")


def test_unpackable_dtype_keeps_f_linear_or_raises_when_onednn_is_required():
    model = nn.Sequential(nn.Linear(8, 8)).to(torch.float16)
    assert pack_linear_weights(model, "auto") == "torch"
    assert isinstance(model[0], nn.Linear)
    with pytest.raises(RuntimeError, match="cannot pack torch.float16"):
        pack_linear_weights(model, "onednn")


def test_auto_packs_float32_and_keeps_f_linear_for_bfloat16():
    from specserve.model.panel_linear import PanelLinear, panel_available

    model = nn.Sequential(nn.Linear(8, 16))
    expected = ((PanelLinear, "panel") if panel_available() else (PackedLinear, "onednn")
                if onednn_available(torch.float32) else (nn.Linear, "torch"))
    assert pack_linear_weights(model, "auto") == expected[1] and isinstance(model[0], expected[0])
    bf16 = nn.Sequential(nn.Linear(8, 16)).to(torch.bfloat16)
    assert pack_linear_weights(bf16, "auto") == "torch" and isinstance(bf16[0], nn.Linear)


# (out_features, in_features) of every projection of smollm2-135m, qwen2.5-coder-0.5b and 1.5b: q/k/v, o,
# gate/up, down (the one-row kernel of down, and of the 1.5b's q/k/v and o, sums in another order)
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (1152, 896), (896, 896), (9728, 896), (896, 4864),
          (2048, 1536), (1536, 1536), (1536, 8960)]


@needs_onednn
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_a_row_is_bit_identical_alone_and_in_any_batch(shape):
    """fp32 batch invariance: row i of an M-row call equals row i of a 40-row call, M = 1..9 and 17,
    and a lone row (1-D or [1, K]) equals its row in the batch."""
    n, k = shape
    gen = torch.Generator().manual_seed(0)
    packed = PackedLinear(torch.randn(n, k, generator=gen) * 0.02, torch.randn(n, generator=gen) * 0.01)
    x = torch.randn(40, k, generator=gen)
    with torch.inference_mode():
        ref = packed(x)
        for m in (*range(1, 10), 17):
            assert torch.equal(packed(x[:m]), ref[:m]), m
        for i in (0, 5, 39):
            assert torch.equal(packed(x[i : i + 1]), ref[i : i + 1]) and torch.equal(packed(x[i]), ref[i])
