"""The engine's step outputs are deltas (O(n) per request in all) with frozen counter snapshots; the
real engine over the model-free target of tests/helpers/fake_engine.py."""

import dataclasses

import pytest

from specserve.config import SpeculativeConfig
from specserve.outputs import OutputAccumulator, RequestOutput, SpecStats
from specserve.sampling_params import SamplingParams
from tests.helpers.fake_engine import fake_engine

K = 4
NGRAM = SpeculativeConfig("ngram", K)


def _run(eng, max_tokens: int):
    """Every output of one greedy ngram request with logprobs and a stop string that never matches,
    and each output's counters as they were when it was emitted."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=2, stop=["zz"])
    eng.add_request(f"r{max_tokens}", "The quick brown fox", params, speculative_config=NGRAM)
    outs, at_emission = [], []
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs.append(o)
            at_emission.append(o.spec_stats.to_dict())
    return outs, at_emission


def _size(o: RequestOutput) -> int:
    """Items one output carries besides the prompt (which is the request's own list, not a copy)."""
    lps = o.new_logprobs or []
    return (len(o.new_token_ids) + len(o.new_text) + len(lps) + sum(len(lp.top) for lp in lps)
            + len(o.spec_stats.num_accepted_tokens_per_pos) + len(o.metrics))


def test_outputs_are_deltas_whose_size_does_not_grow():
    assert {f.name for f in dataclasses.fields(RequestOutput)} == {
        "request_id", "prompt_token_ids", "new_token_ids", "new_text", "new_logprobs", "finished",
        "finish_reason", "stop_reason", "spec_stats", "metrics"}  # no field repeats what was sent before
    eng = fake_engine(max_model_len=512)
    biggest = {}
    for n in (40, 480):
        outs, _ = _run(eng, n)
        acc = OutputAccumulator()
        for o in outs:
            acc.add(o)
        assert len(acc.token_ids) == len(acc.logprobs) == len(acc.text) == n  # one ASCII byte per token
        assert acc.spec_stats.num_accepted_tokens > 0  # multi-token steps really happened
        biggest[n] = max(_size(o) for o in outs)
        # a step commits at most k + 1 tokens (each: 1 id, 1 char, 1 logprob entry with 2 top entries), plus
        # at most 1 char held back before ("z" of the stop "zz"), k per-position counters and 4 timestamps
        assert biggest[n] <= 5 * (K + 1) + 1 + K + 4, n
    assert biggest[480] <= biggest[40] + 1  # 12x the tokens, the same largest output


def test_counter_snapshots_never_change_after_emission():
    eng = fake_engine(max_model_len=512)
    outs, at_emission = _run(eng, 120)
    assert [o.spec_stats.to_dict() for o in outs] == at_emission  # later steps did not touch them
    assert at_emission[0] != at_emission[-1]  # the counters did move while the request ran
    last = outs[-1]
    assert eng.spec_stats["ngram"] == last.spec_stats  # the engine's sum is a snapshot too
    with pytest.raises(dataclasses.FrozenInstanceError):
        last.spec_stats.num_drafts = 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        last.new_text = ""
    assert isinstance(last.spec_stats.num_accepted_tokens_per_pos, tuple)


def test_spec_stats_add_position_by_position():
    a, b = SpecStats(1, 3, 2, [1, 1, 0], 3), SpecStats(2, 5, 4, [2, 1, 1, 0, 0], 6)
    assert a + b == SpecStats(3, 8, 6, (3, 2, 1, 0, 0), 9) == b + a
    assert sum([a, b], SpecStats()) == a + b and a == SpecStats(1, 3, 2, (1, 1, 0), 3)


def test_accumulator_refuses_an_output_after_the_final_one():
    eng = fake_engine()
    eng.add_request("x", "hi", SamplingParams(temperature=0, max_tokens=3))
    acc, outs = OutputAccumulator(), []
    while eng.has_unfinished_requests():
        outs += eng.step()
    for o in outs:
        acc.add(o)
    assert acc.finished and acc.finish_reason == "length" and len(acc.token_ids) == 3 and acc.logprobs is None
    with pytest.raises(ValueError, match="after its finished one"):
        acc.add(outs[-1])
