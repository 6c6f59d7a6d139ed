"""vLLM's `num_speculative_tokens_per_batch_size` ([bs_lo, bs_hi, k] entries, same meaning as vLLM's
dynamic speculative decoding lookup) and the schedule names; the scheduler applies the table."""

import pytest

from specserve.config import ConfigError, SpeculativeConfig
from specserve.spec_decode.proposer import Proposal
from tests.unit.test_scheduler import decode_ready, make, req


def table(entries, k=4, **kw):
    return SpeculativeConfig("ngram", k, num_speculative_tokens_per_batch_size=entries, **kw)


def test_lookup_like_vllm():
    cfg = table([[1, 2, 4], [5, 8, 2], [9, 16, 0]])
    assert [cfg.k_for_batch_size(b) for b in range(1, 20)] == (
        [4, 4]            # [1, 2]
        + [4, 4]          # 3-4: a gap carries the range before it
        + [2] * 4         # [5, 8]
        + [0] * 8         # [9, 16]: speculation off
        + [0] * 3         # past the last range: its k
    )
    # k above num_speculative_tokens is capped at it (vLLM: min(num_speculative_tokens, k))
    assert table([[1, 4, 10]], k=3).k_for_batch_size(2) == 3
    # unsorted input is sorted; JSON lists and tuples both work; to_dict gives it back
    cfg = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4,
                                       "num_speculative_tokens_per_batch_size": [[3, 4, 1], [1, 2, 3]]})
    assert cfg.num_speculative_tokens_per_batch_size == ((1, 2, 3), (3, 4, 1))
    assert cfg.to_dict()["num_speculative_tokens_per_batch_size"] == ((1, 2, 3), (3, 4, 1))
    assert SpeculativeConfig("ngram", 5).k_for_batch_size(100) == 5


@pytest.mark.parametrize("entries,match", [
    ([], "non-empty"),
    ([[4, 8]], "triples"),
    ([[1, 2, 3, 4]], "triples"),
    ([[1, 2, 4, 100, 3]], "5-item form"),
    ([[2, 4, 1]], "start at 1"),
    ([[1, 4, 2], [3, 6, 1]], "overlap"),
    ([[1, 0, 2]], "bs_lo <= bs_hi"),
    ([[1, 2, -1]], "k must be >= 0"),
    ([[1, 2, 1.5]], "integer"),
    ("1-4:2", "list"),
])
def test_table_validation(entries, match):
    with pytest.raises(ConfigError, match=match):
        table(entries)


def test_schedule_names():
    assert SpeculativeConfig("ngram", 4).num_speculative_tokens_schedule == "constant"
    assert SpeculativeConfig("ngram", 4, num_speculative_tokens_schedule="adaptive").adaptive
    for bad in ("heuristic", "sometimes"):
        with pytest.raises(ConfigError, match="'constant', 'adaptive'"):
            SpeculativeConfig("ngram", 4, num_speculative_tokens_schedule=bad)


def test_scheduler_applies_the_table_by_decoding_batch_size():
    sched, _ = make(budget=64, slots=3)
    cfg = table([[1, 1, 4], [2, 3, 1]])
    rs = [req(f"r{i}", 5, cfg) for i in range(3)]
    sched.add(rs[0])
    sched.admit(rs[0])
    decode_ready(rs[0])
    assert sched.speculation_caps([rs[0]]) == [4]
    for r in rs[1:]:
        sched.add(r)
        sched.admit(r)
        decode_ready(r)
    assert sched.speculation_caps(rs) == [1, 1, 1]
    asked = []
    plan = sched.schedule(lambda asks: asked.extend(k for _, k in asks) or [Proposal([5] * k) for _, k in asks])
    assert asked == [1, 1, 1] and [s.num_drafts for s in plan.scheduled] == [1, 1, 1]
