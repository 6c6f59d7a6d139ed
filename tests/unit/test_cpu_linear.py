"""oneDNN-packed CPU linear layers: same results as F.linear, clear choices and errors."""

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
    assert pack_linear_weights(model, "auto") == "torch" and isinstance(model[0], nn.Linear)  # seed-exact default
    assert pack_linear_weights(model, "onednn") == "onednn"
    assert isinstance(model[0], PackedLinear) and isinstance(model[2][0], PackedLinear)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="auto, onednn, torch"):
        pack_linear_weights(model, "mkl")


def test_unpackable_dtype_keeps_f_linear_or_raises_when_onednn_is_required():
    model = nn.Sequential(nn.Linear(8, 8)).to(torch.float16)
    assert pack_linear_weights(model, "auto") == "torch"
    assert isinstance(model[0], nn.Linear)
    with pytest.raises(RuntimeError, match="cannot pack torch.float16"):
        pack_linear_weights(model, "onednn")
