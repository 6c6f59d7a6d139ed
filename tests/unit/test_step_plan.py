"""The step plan (docs/step-plan.md): one Scheduler.schedule() call decides the batch, each request's k
cap, the drafts, the prefill chunks and the flat layout the runner and the verifier read. No model."""

import pytest
import torch

from specserve.config import SpeculativeConfig
from specserve.engine.kv_cache import KVCache
from specserve.engine.model_runner import ModelInput
from specserve.engine.scheduler import Scheduler
from specserve.request import Request
from specserve.sampling_params import SamplingParams
from specserve.spec_decode.proposer import Proposal


def make(budget=32, slots=4, max_len=64):
    kv = KVCache(1, slots, 1, 2, max_len, torch.float32, torch.device("cpu"))
    return Scheduler(kv, budget, max_len), kv


def req(rid, n_prompt, spec=None, max_tokens=32):
    return Request(rid, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens), spec, 0)


def decode_ready(sched, kv, r, n_out=1):
    """Admit r and pretend its prompt is in the KV cache and n_out tokens were generated."""
    sched.add(r)
    sched.admit(r)
    r.all_token_ids += [100 + i for i in range(n_out)]
    r.num_computed_tokens = len(r.all_token_ids) - 1
    kv.extend(r.slot, r.num_computed_tokens)


class Recorder:
    """A propose callback that records what it was asked and drafts 50, 51, ... (n_give of them)."""

    def __init__(self, n_give=None, probs=False):
        self.asks, self.n_give, self.probs = [], n_give, probs

    def __call__(self, asks):
        self.asks.append([(r.request_id, k) for r, k in asks])
        out = []
        for r, k in asks:
            n = k if self.n_give is None else self.n_give
            q = torch.full((n, 8), 1 / 8) if self.probs else None
            out.append(Proposal([50 + i for i in range(n)], q))
        return out


def test_mixed_verify_decode_and_prefill_layout():
    sched, kv = make(budget=20)
    k4 = SpeculativeConfig("ngram", 4)
    a, b = req("a", 5, k4), req("b", 3)  # a drafts, b decodes plainly
    decode_ready(sched, kv, a, n_out=2)
    decode_ready(sched, kv, b, n_out=1)
    c, d = req("c", 30), req("d", 4)  # c prefills in chunks, d waits for budget
    sched.add(c)
    sched.add(d)
    prop = Recorder(n_give=3)  # fewer drafts than the cap: the prefill gets the unused budget
    plan = sched.schedule(prop)
    assert prop.asks == [[("a", 4)]]
    ids = [(s.request.request_id, s.is_prefill, s.start, s.num_new_tokens, s.num_rows) for s in plan.scheduled]
    # a: newest + 3 drafts (4 tokens, 4 rows); b: 1; c: 20 - 5 = 15 prompt tokens, not its last chunk (0 rows)
    assert ids == [("a", False, 6, 4, 4), ("b", False, 3, 1, 1), ("c", True, 0, 15, 0)]
    assert plan.scheduled[0].token_ids == [101, 50, 51, 52] and plan.scheduled[0].draft_token_ids == [50, 51, 52]
    assert [s.request.request_id for s in plan.sampled] == ["a", "b"]
    assert (plan.num_tokens, plan.num_rows, plan.num_draft_tokens) == (20, 5, 3)
    assert (plan.max_query_len, plan.has_prefill) == (15, True)
    assert [(s.token_offset, s.row_offset) for s in plan.scheduled] == [(0, 0), (4, 4), (5, 5)]
    mi = plan.model_input(torch.device("cpu"))
    assert mi is plan.model_input(torch.device("cpu"))  # built once per step
    assert mi.input_ids.tolist() == [101, 50, 51, 52, 100] + list(range(1, 16))
    assert mi.positions.tolist() == [6, 7, 8, 9, 3] + list(range(15))
    assert mi.slot_mapping.tolist() == [a.slot] * 4 + [b.slot] + [c.slot] * 15
    assert mi.query_start_loc.tolist() == [0, 4, 5, 20]
    assert mi.seq_lens.tolist() == [10, 4, 15]
    assert mi.logits_indices.tolist() == [0, 1, 2, 3, 4]
    assert list(sched.waiting) == [d]


def test_last_prefill_chunk_samples_and_budget_after_drafts():
    sched, kv = make(budget=12)
    a = req("a", 4, SpeculativeConfig("ngram", 8))
    decode_ready(sched, kv, a)
    c = req("c", 5)
    sched.add(c)
    plan = sched.schedule(Recorder())  # a gets 1 + 8 (budget 12 - 1 = 11 >= 8); c gets the 3 left
    assert [(s.request.request_id, s.num_new_tokens, s.num_rows) for s in plan.scheduled] == [("a", 9, 9), ("c", 3, 0)]
    c.num_computed_tokens = 3
    a.spec_config = None
    plan = sched.schedule(Recorder())
    assert [(s.request.request_id, s.num_new_tokens, s.num_rows) for s in plan.scheduled] == [("a", 1, 1), ("c", 2, 1)]
    assert plan.model_input(torch.device("cpu")).logits_indices.tolist() == [0, 2]


def test_caps_in_one_place_and_k_policy_hook():
    sched, kv = make(budget=32, max_len=64)
    k8 = SpeculativeConfig("ngram", 8)
    a, b, c = req("a", 10, k8, max_tokens=5), req("b", 55, k8, max_tokens=50), req("c", 5, k8)
    for r, n in ((a, 2), (b, 3), (c, 1)):
        decode_ready(sched, kv, r, n_out=n)
    prop = Recorder()
    sched.schedule(prop)
    # a: 3 tokens left under max_tokens -> k + 1 <= 3; b: 58 of 64 positions used -> k + 1 <= 6
    assert prop.asks == [[("a", 2), ("b", 5), ("c", 8)]]

    class Policy:
        def __init__(self):
            self.seen = None

        def choose(self, requests, max_draft_tokens):
            self.seen = ([r.request_id for r in requests], max_draft_tokens)
            return [0, 20, 3]

        def observe(self, request, num_draft_tokens, num_accepted):
            pass

    sched.k_policy = Policy()
    prop = Recorder()
    plan = sched.schedule(prop)
    assert sched.k_policy.seen == (["a", "b", "c"], 29)
    assert prop.asks == [[("b", 5), ("c", 3)]]  # 0 means no drafts; the hard caps still hold
    assert [s.num_drafts for s in plan.scheduled] == [0, 5, 3]


def test_budget_caps_drafts_fcfs_and_proposals_are_trimmed():
    sched, kv = make(budget=6)
    k8 = SpeculativeConfig("ngram", 8)
    a, b = req("a", 4, k8), req("b", 4, k8)
    decode_ready(sched, kv, a)
    decode_ready(sched, kv, b)
    prop = Recorder(n_give=7, probs=True)  # a proposer that ignores k: the plan keeps k drafts and k q rows
    plan = sched.schedule(prop)
    assert prop.asks == [[("a", 4)]]  # 6 - 2 decodes = 4 draft tokens, all to the first request
    s = plan.scheduled[0]
    assert s.num_drafts == 4 and s.draft_probs.shape == (4, 8) and plan.scheduled[1].num_drafts == 0


def test_no_drafts_when_propose_gives_none_and_bad_proposer():
    sched, kv = make()
    a = req("a", 4, SpeculativeConfig("ngram", 3))
    decode_ready(sched, kv, a)
    plan = sched.schedule(Recorder(n_give=0))
    assert plan.scheduled[0].num_rows == 1 and plan.scheduled[0].draft_probs is None
    with pytest.raises(RuntimeError, match="proposals"):
        sched.schedule(lambda asks: [])
    sched.remove(a)  # an idle scheduler plans nothing
    assert not sched.schedule(Recorder())


def test_model_input_rejects_bad_sequences():
    with pytest.raises(ValueError):
        ModelInput.build([0], [0], [[]], [0], torch.device("cpu"))
    with pytest.raises(ValueError):
        ModelInput.build([0], [0], [[1, 2]], [3], torch.device("cpu"))
