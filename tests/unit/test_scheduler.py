"""Scheduler budget, draft caps (docs/speculation-cases.md B07/B08) and chunked prefill, without a model."""

import torch

from specserve.config import SpeculativeConfig
from specserve.engine.kv_cache import KVCache
from specserve.engine.scheduler import Scheduler
from specserve.request import Request
from specserve.sampling_params import SamplingParams


def make(budget=16, slots=2, max_len=64):
    kv = KVCache(1, slots, 1, 2, max_len, torch.float32, torch.device("cpu"))
    return Scheduler(kv, budget, max_len), kv


def req(rid, n_prompt, spec=None, max_tokens=32):
    return Request(rid, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens), spec, 0)


def decode_ready(r, n_out=1):
    """Pretend the prompt is prefilled and n_out tokens were generated."""
    r.all_token_ids += [7] * n_out
    r.num_computed_tokens = len(r.all_token_ids) - 1


def test_chunked_prefill_under_budget_and_slots():
    sched, kv = make(budget=16, slots=2)
    a, b, c = req("a", 40), req("b", 5), req("c", 3)
    for r in (a, b, c):
        sched.add(r)
    out = sched.schedule_prefills(sched.budget)
    assert [(s.request.request_id, s.num_new_tokens, s.num_rows) for s in out] == [("a", 16, 0)]
    a.num_computed_tokens += 16
    out = sched.schedule_prefills(sched.budget)
    assert [(s.request.request_id, s.num_new_tokens) for s in out] == [("a", 16)]
    a.num_computed_tokens += 16
    out = sched.schedule_prefills(sched.budget)  # a's last chunk (8, samples) + b admitted (5); c waits: 2 slots
    assert [(s.request.request_id, s.num_new_tokens, s.num_rows) for s in out] == [("a", 8, 1), ("b", 5, 1)]
    assert kv.num_free_slots == 0 and list(sched.waiting) == [c]


def test_draft_caps_budget_max_tokens_and_context():
    sched, _ = make(budget=16, slots=2, max_len=64)
    k8 = SpeculativeConfig("ngram", 8)
    a, b = req("a", 10, k8, max_tokens=5), req("b", 55, k8, max_tokens=50)
    for r in (a, b):
        sched.add(r)
        sched.admit(r)
    decode_ready(a, n_out=2)  # 3 tokens left: at most 2 drafts (k + 1 <= tokens left)
    decode_ready(b, n_out=3)  # 58 of 64 positions used: k + 1 <= 64 - 58
    decoding = [a, b]
    assert sched.speculation_caps(decoding) == [2, 5]
    # the budget caps drafts too: 2 decodes take 2 tokens, 4 remain for drafts
    sched.budget = 6
    assert sched.speculation_caps(decoding) == [2, 2]
    # no speculation: never drafts
    a.spec_config = None
    assert sched.speculation_caps(decoding)[0] == 0
