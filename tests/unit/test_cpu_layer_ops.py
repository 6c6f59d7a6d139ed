"""The fused CPU layer kernels (specserve/model/cpu_layer_ops.py): the eager ops' results, the documented
summation order, every row bit-identical alone and in any batch, a whole model against the eager path,
and the selection with its errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from specserve.config import ConfigError
from specserve.model import cpu_layer_ops
from specserve.model.attention import AttentionMetadata, cached_attention
from specserve.model.llama import RotaryEmbedding

needs_kernels = pytest.mark.skipif(not cpu_layer_ops.EXTENSION.available(), reason="the kernels cannot be built here")
H, HKV, D, SLOTS, MAXLEN = 6, 2, 32, 4, 64


@pytest.fixture(scope="module")
def ops():
    return cpu_layer_ops.load_kernels()


def lane_sum_of_squares(row: np.ndarray) -> np.float32:
    """The order the kernels document: lane l sums x[l]^2, x[l+16]^2, ... (fused multiply-add, emulated in
    float64 and rounded once per step, which is exact for an fma of float32 values), then lanes l and
    l + w are added for w = 8, 4, 2, 1."""
    acc = np.zeros(16, np.float32)
    for i in range(0, row.size, 16):
        chunk = row[i : i + 16].astype(np.float64)
        acc = (chunk * chunk + acc.astype(np.float64)).astype(np.float32)
    w = 8
    while w >= 1:
        acc[:w] = acc[:w] + acc[w : 2 * w]
        w //= 2
    return acc[0]


@needs_kernels
def test_rms_norm_follows_the_documented_order_bit_for_bit(ops):
    gen = torch.Generator().manual_seed(0)
    x, w, eps = torch.randn(5, 96, generator=gen), torch.randn(96, generator=gen), 1e-6
    y = ops.rms_norm(x, w, eps)
    for t in range(5):
        row = x[t].numpy()
        mean = np.float32(lane_sum_of_squares(row) / np.float32(96))
        r = np.float32(1.0) / np.sqrt(np.float32(mean + np.float32(eps)), dtype=np.float32)
        expected = (row * r).astype(np.float32) * w.numpy()
        assert np.array_equal(y[t].numpy(), expected), t
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)


@needs_kernels
def test_add_rms_norm_adds_in_place_then_normalizes(ops):
    gen = torch.Generator().manual_seed(1)
    x, res, w = torch.randn(3, 64, generator=gen), torch.randn(3, 64, generator=gen), torch.randn(64, generator=gen)
    total = x + res
    y = ops.add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(x, total)  # x now holds the next residual
    assert torch.equal(y, ops.rms_norm(total, w, 1e-5))


@needs_kernels
def test_silu_mul_matches_torch(ops):
    gen = torch.Generator().manual_seed(2)
    gu = torch.randn(7, 2 * 1100, generator=gen) * 6  # beyond +-88 too: exp's clamp
    gu[0, :4] = torch.tensor([-120.0, 120.0, 0.0, -0.0])
    ref = F.silu(gu[:, :1100]) * gu[:, 1100:]
    torch.testing.assert_close(ops.silu_mul(gu), ref, rtol=3e-6, atol=1e-6)


def eager_attention(qkv, positions, slots, k_cache, v_cache, rotary, scale):
    """The eager path's RoPE + `cached_attention` for one step, from the same fused q/k/v rows."""
    T = qkv.shape[0]
    tables = rotary.tables(positions, torch.float32)
    qk = RotaryEmbedding.apply(qkv[:, : (H + HKV) * D].view(T, H + HKV, D), tables)
    v = qkv[:, (H + HKV) * D :].view(T, HKV, D)
    seqs, starts, lens = [], [], []
    t = 0
    while t < T:  # consecutive tokens of one slot form a sequence
        n = 1
        while t + n < T and slots[t + n] == slots[t] and positions[t + n] == positions[t] + n:
            n += 1
        seqs.append(int(slots[t])), starts.append(int(positions[t])), lens.append(n)
        t += n
    meta = AttentionMetadata.build(seqs, starts, lens, torch.device("cpu"))
    return cached_attention(qk[:, :H], qk[:, H:], v, k_cache, v_cache, meta, scale)


def make_step(gen, seqs):
    """Flat q/k/v rows and per-token positions/slots for [(slot, first position, new tokens)]."""
    T = sum(n for _, _, n in seqs)
    qkv = torch.randn(T, (H + 2 * HKV) * D, generator=gen)
    positions = torch.tensor([p0 + i for _, p0, n in seqs for i in range(n)])
    slots = torch.tensor([s for s, _, n in seqs for _ in range(n)])
    return qkv, positions, slots


@needs_kernels
def test_rope_cache_attention_matches_the_eager_path(ops):
    gen = torch.Generator().manual_seed(3)
    rotary = RotaryEmbedding(D, 10000.0, MAXLEN)
    sin_signed = (rotary.sin * rotary.sign).contiguous()
    kc = torch.randn(SLOTS, HKV, MAXLEN, D, generator=gen)  # old keys, and stale ones past every length
    vc = torch.randn(SLOTS, HKV, MAXLEN, D, generator=gen)
    # a first prompt chunk, a later chunk, a decode, a verify block
    qkv, positions, slots = make_step(gen, [(3, 0, 6), (0, 5, 4), (2, 9, 1), (1, 7, 5)])
    kc2, vc2 = kc.clone(), vc.clone()
    out = ops.rope_cache_attention(qkv, rotary.cos, sin_signed, positions, slots, kc, vc, H, HKV, D ** -0.5)
    ref = eager_attention(qkv, positions, slots, kc2, vc2, rotary, D ** -0.5)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)  # RoPE'd keys: the eager bits; nothing else touched
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def row_identity_outputs(ops, head_dim: int) -> dict[str, torch.Tensor]:
    """Outputs of every kernel on one random step (a verify block, a prefill chunk, a decode) and the same
    rows computed alone; checks the row identities and returns the batch outputs."""
    gen = torch.Generator().manual_seed(4)
    rotary = RotaryEmbedding(head_dim, 10000.0, MAXLEN)
    sin_signed = (rotary.sin * rotary.sign).contiguous()
    kc = torch.randn(SLOTS, HKV, MAXLEN, head_dim, generator=gen)
    vc = torch.randn(SLOTS, HKV, MAXLEN, head_dim, generator=gen)
    T = 5 + 33 + 1
    qkv = torch.randn(T, (H + 2 * HKV) * head_dim, generator=gen)
    positions = torch.tensor(list(range(20, 25)) + list(range(33)) + [40])
    slots = torch.tensor([0] * 5 + [1] * 33 + [2])
    scale = head_dim ** -0.5
    batch = ops.rope_cache_attention(qkv, rotary.cos, sin_signed, positions, slots, kc.clone(), vc.clone(), H, HKV, scale)
    kd, vd = kc.clone(), vc.clone()  # the verify block (slot 0, positions 20..24) as five decodes in turn
    for i in range(5):
        one = ops.rope_cache_attention(qkv[i : i + 1], rotary.cos, sin_signed, positions[i : i + 1], slots[i : i + 1],
                                       kd, vd, H, HKV, scale)
        assert torch.equal(one, batch[i : i + 1]), i
    alone = ops.rope_cache_attention(qkv[-1:], rotary.cos, sin_signed, positions[-1:], slots[-1:], kc.clone(), vc.clone(),
                                     H, HKV, scale)
    assert torch.equal(alone, batch[-1:])
    chunk = ops.rope_cache_attention(qkv[5:38], rotary.cos, sin_signed, positions[5:38], slots[5:38], kc.clone(),
                                     vc.clone(), H, HKV, scale)
    assert torch.equal(chunk, batch[5:38])  # a prompt chunk's rows do not depend on the rest of the step
    x, w = torch.randn(39, 64, generator=gen), torch.randn(64, generator=gen)
    gu = torch.randn(39, 2 * 2100, generator=gen)
    norm, swiglu = ops.rms_norm(x, w, 1e-6), ops.silu_mul(gu)
    assert torch.equal(norm[17:18], ops.rms_norm(x[17:18], w, 1e-6))
    assert torch.equal(swiglu[17:18], ops.silu_mul(gu[17:18]))
    return {"attention": batch, "norm": norm, "silu_mul": swiglu}


@needs_kernels
@pytest.mark.parametrize("head_dim", [32, 64, 128])  # 64 and 128: the kernels' compile-time head sizes
def test_every_row_is_bit_identical_alone_in_any_batch_and_with_any_thread_count(ops, head_dim):
    """A verify block's rows = one-token decodes at the same positions; a sequence's rows do not depend on
    the other sequences of the step; norms and SwiGLU rows likewise; and 1 and 2 threads give the same bits."""
    old = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(row_identity_outputs(ops, head_dim))
    finally:
        torch.set_num_threads(old)
    for name in outs[0]:
        assert torch.equal(outs[0][name], outs[1][name]), name


@needs_kernels
@pytest.mark.parametrize("variant", ["portable", "avx2"])
def test_the_other_instruction_set_paths_give_the_same_bits(ops, variant, tmp_path, monkeypatch):
    """The AVX-512, AVX2 and portable forms of the lane sums do the same operations in the same order:
    builds of this source for the other paths give this build's bits (~25 s per build)."""
    from specserve.model.cpu_layer_ops import EXTENSION, NativeExtension

    flags = list(EXTENSION.cflags)
    if variant == "portable":
        flags.append("-DSPECSERVE_PORTABLE")
    else:
        cpu = open("/proc/cpuinfo").read() if Path("/proc/cpuinfo").exists() else ""
        if " avx512f" not in cpu or " avx2" not in cpu:
            pytest.skip("the AVX2 path differs from this build's only on an AVX-512 host")
        flags += ["-mno-avx512f"]
    other = NativeExtension(f"specserve_cpu_layer_ops_{variant}", EXTENSION.source, flags, f"the {variant} build").load()
    for head_dim in (64, 32):
        mine, theirs = row_identity_outputs(ops, head_dim), row_identity_outputs(other, head_dim)
        for name in mine:
            assert torch.equal(mine[name], theirs[name]), (variant, head_dim, name)


@needs_kernels
def test_the_kernels_refuse_what_they_cannot_compute(ops):
    with pytest.raises(RuntimeError, match="multiple of 16"):
        ops.rms_norm(torch.randn(2, 40), torch.randn(40), 1e-6)
    with pytest.raises(RuntimeError, match="float32"):
        ops.silu_mul(torch.randn(2, 8, dtype=torch.float64))
    rotary = RotaryEmbedding(D, 10000.0, MAXLEN)
    kc, vc = torch.zeros(SLOTS, HKV, MAXLEN, D), torch.zeros(SLOTS, HKV, MAXLEN, D)
    qkv = torch.randn(1, (H + 2 * HKV) * D)
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.rope_cache_attention(qkv, rotary.cos, rotary.sin, torch.tensor([MAXLEN]), torch.tensor([0]), kc, vc,
                                 H, HKV, 1.0)
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.rope_cache_attention(qkv, rotary.cos, rotary.sin, torch.tensor([0]), torch.tensor([SLOTS]), kc, vc,
                                 H, HKV, 1.0)


def load_tiny(folder, monkeypatch, choice):
    from specserve import LLM

    monkeypatch.setenv(cpu_layer_ops.ENV, choice)
    return LLM(str(folder), max_model_len=128, max_num_seqs=2, device="cpu")


@needs_kernels
@pytest.mark.parametrize("folder", ["tiny_model_dir", "tiny_llama_dir"])  # tied head + q/k/v biases; untied
def test_a_model_through_the_kernels_matches_the_eager_model(folder, request, monkeypatch):
    from specserve.engine.model_runner import SeqInput

    logits = {}
    for choice in ("torch", "native"):
        llm = load_tiny(request.getfixturevalue(folder), monkeypatch, choice)
        t = llm.engine.target
        assert t.model.layer_backend == choice and (t.model.cpu_layer_ops is not None) == (choice == "native")
        if choice == "native":
            assert t.runner.verify_by_row is False  # rows are independent by construction: no SDPA probe
        s = t.kv.allocate()
        prompt = [(5 * i + 1) % 300 for i in range(29)]
        with torch.inference_mode():
            first = t.runner.forward([SeqInput(s, 0, prompt, 3)]).clone()
            block = t.runner.forward([SeqInput(s, len(prompt), [4, 8, 15, 16], 4)]).clone()
        logits[choice] = torch.cat([first, block])
    torch.testing.assert_close(logits["native"], logits["torch"], rtol=1e-4, atol=1e-4)


def test_the_choice_is_checked(tiny_model_dir, monkeypatch):
    with pytest.raises(ValueError, match="SPECSERVE_CPU_LAYER_KERNELS must be one of"):
        load_tiny(tiny_model_dir, monkeypatch, "fast")
    llm = load_tiny(tiny_model_dir, monkeypatch, "torch")
    model = llm.engine.target.model
    assert model.cpu_layer_ops is None
    model.to(torch.float64)
    assert cpu_layer_ops.supports(model) == "not float32"
    with pytest.raises(ConfigError, match="cannot run this model: not float32"):  # the CLI prints it as one line
        cpu_layer_ops.select_layer_kernels(model, "native")
    assert cpu_layer_ops.select_layer_kernels(model, "auto") == "torch" and model.cpu_layer_ops is None


def test_auto_falls_back_to_the_eager_ops_when_the_kernels_cannot_be_built(tiny_model_dir, monkeypatch, caplog):
    broken = cpu_layer_ops.NativeExtension("specserve_cpu_layer_ops_broken", cpu_layer_ops.SOURCE, ["--no-such-flag"],
                                           "the fused CPU layer kernels")
    monkeypatch.setattr(cpu_layer_ops, "EXTENSION", broken)
    monkeypatch.setenv("SPECSERVE_KERNEL_DIR", str(tiny_model_dir.parent / "kernels-broken"))
    llm = load_tiny(tiny_model_dir, monkeypatch, "auto")
    assert llm.engine.target.model.cpu_layer_ops is None and llm.engine.target.model.layer_backend == "torch"
    assert "eager ops instead of the fused kernels" in caplog.text
    with pytest.raises(ConfigError, match="could not be built"):
        cpu_layer_ops.select_layer_kernels(llm.engine.target.model, "native")
