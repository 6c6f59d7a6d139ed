"""KV cache slot and rollback invariants."""

import pytest
import torch

from specserve.engine.kv_cache import KVCache, KVCacheFullError


def make(slots=3, max_len=16):
    return KVCache(num_layers=2, num_slots=slots, num_kv_heads=2, head_dim=4, max_len=max_len,
                   dtype=torch.float32, device=torch.device("cpu"))


def test_allocate_extend_truncate_free():
    kv = make()
    a, b = kv.allocate(), kv.allocate()
    assert a != b and kv.num_free_slots == 1
    kv.extend(a, 10)
    kv.extend(b, 4)
    assert kv.num_used_tokens == 14
    kv.truncate(a, 7)  # roll back three rejected drafts
    assert kv.lengths[a] == 7 and kv.num_used_tokens == 11
    kv.free(a)
    assert kv.lengths[a] == 0 and kv.num_free_slots == 2 and kv.num_used_tokens == 4


def test_first_use_zeroes_slot():
    kv = make()
    for t in kv.k + kv.v:
        t.fill_(float("nan"))
    s = kv.allocate()
    assert all(torch.isfinite(t[s]).all() for t in kv.k + kv.v)


def test_errors():
    kv = make(slots=1, max_len=8)
    s = kv.allocate()
    with pytest.raises(KVCacheFullError):
        kv.allocate()
    with pytest.raises(ValueError):
        kv.extend(s, 9)  # beyond max_len
    kv.extend(s, 5)
    with pytest.raises(ValueError):
        kv.truncate(s, 6)  # truncate cannot grow
    with pytest.raises(ValueError):
        kv.extend(s, 4)  # extend cannot shrink
    kv.free(s)
    with pytest.raises(ValueError):
        kv.free(s)
