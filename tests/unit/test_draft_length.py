"""The adaptive k policy's drafting step (`AdaptiveK.draft`, called by the scheduler) without a model: cut proposals, free vs costly proposers, the
draft model's k chosen before it drafts, and skipping the proposer for hopeless requests when drafting
itself costs time that matters (with a probe every PROBE_EVERY-th step)."""

import pytest

from specserve.config import SpeculativeConfig
from specserve.engine.draft_length import PROBE_EVERY, AdaptiveK
from specserve.engine.step_cost import StepCostModel
from specserve.request import Request
from specserve.sampling_params import SamplingParams
from specserve.spec_decode import proposer_key
from specserve.spec_decode.proposer import Proposal, ProposalInput

FLAT = StepCostModel(list(range(1, 17)), [100.0 + t for t in range(16)])  # drafts nearly free


class Scripted:
    """Proposes `tokens` (cut to k) for every request; counts calls; optionally slow."""

    def __init__(self, tokens, costly=False, delay_ms=0.0, clock=None):
        self.tokens, self.calls, self.delay_ms, self.clock = tokens, [], delay_ms, clock
        if costly:
            self.draft_step_cost = lambda: StepCostModel([1, 2], [50.0, 50.0])

    def propose(self, inputs):
        import time

        self.calls.append([(i.request_id, i.num_speculative_tokens) for i in inputs])
        if self.delay_ms and self.clock is not None:
            self.clock.now += self.delay_ms / 1000 * len(inputs)
        elif self.delay_ms:
            time.sleep(self.delay_ms / 1000 * len(inputs))
        return [Proposal(self.tokens[: i.num_speculative_tokens], match_len=3) for i in inputs]

    def finish_request(self, request_id, token_ids):
        pass


class FakeClock:
    """`time.perf_counter` for the policy under test: advances only when a Scripted proposer "works"."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


def fake_time(monkeypatch):
    """Make the adaptive policy's timings deterministic: proposing takes exactly its delay, nothing else
    takes time. Returns the clock to give Scripted proposers."""
    import types

    clock = FakeClock()
    monkeypatch.setattr("specserve.engine.draft_length.time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    return clock


def via(prop):
    """The engine's propose callback over one proposer: (request, k) pairs -> proposals."""
    return lambda asks: prop.propose([ProposalInput(r.request_id, r.all_token_ids, r.num_prompt_tokens, k, r.params,
                                                    r.seed) for r, k in asks])


def req(rid, cfg):
    r = Request(rid, [1, 2, 3], SamplingParams(temperature=0, max_tokens=100), cfg, 0)
    r.num_computed_tokens = 3
    return r


def commit(ad, r, tokens):
    r.all_token_ids += tokens
    ad.observe(r, 0, 0)


def test_free_proposals_are_cut_and_learned_beyond_k():
    cfg = SpeculativeConfig("ngram", 8, num_speculative_tokens_schedule="adaptive")
    prop = Scripted([7] * 8)
    ad = AdaptiveK(FLAT, lambda c: prop)
    r = req("a", cfg)
    ad.add_request(r)
    for _ in range(6):  # the target always continues with 7s: every draft token would be accepted
        (p,) = ad.draft([(r, 8)], via(prop), num_other_tokens=0, num_other_seqs=0)
        assert prop.calls[-1] == [("a", 8)]  # free drafts: proposed at the cap
        commit(ad, r, [7] * (len(p.token_ids) + 1))
    assert len(p.token_ids) == 8 and ad.chosen_k[cfg][8] >= 1
    assert ad.tracker.estimates("a", 8)[7] > 0.7  # learned the deep positions too


def test_draft_model_k_is_chosen_before_it_drafts():
    cfg = SpeculativeConfig("draft_model", 6, model="m", num_speculative_tokens_schedule="adaptive")
    prop = Scripted([5] * 6, costly=True)
    ad = AdaptiveK(FLAT, lambda c: prop)
    r = req("d", cfg)
    ad.add_request(r)
    (p,) = ad.draft([(r, 6)], via(prop), num_other_tokens=0, num_other_seqs=0)
    # 50 ms per draft forward against a 100 ms step, acceptance 0.5 before any evidence: k < 6, and
    # the proposer was asked for exactly k
    k = len(p.token_ids)
    assert 0 <= k < 6 and (prop.calls == [[("d", k)]] if k else prop.calls == [])


def test_hopeless_requests_skip_a_costly_proposer_but_probe(monkeypatch):
    # rest steps follow the decision's wall time (5 ms here, more on a loaded machine): off, so that
    # this test sees only the probing
    monkeypatch.setattr("specserve.engine.draft_length.REST_SHARE", 1e9)
    monkeypatch.setattr("specserve.engine.draft_length.HOLD_SHARE", 1e9)  # and no holds
    cfg = SpeculativeConfig("suffix", 8, num_speculative_tokens_schedule="adaptive")
    clock = fake_time(monkeypatch)  # timings exact: no flake under load
    prop = Scripted([9] * 8, delay_ms=5.0, clock=clock)  # 5 ms per request against a ~100 ms step: matters (>= 1%)
    ad = AdaptiveK(FLAT, lambda c: prop)
    r = req("s", cfg)
    ad.add_request(r)
    drafted = []
    for _ in range(40):  # the target never continues with 9: every draft is rejected
        n = len(prop.calls)
        ad.draft([(r, 8)], via(prop), num_other_tokens=0, num_other_seqs=0)
        drafted.append(len(prop.calls) > n)
        commit(ad, r, [4])
    tail = drafted[-4 * PROBE_EVERY:]
    assert sum(tail) == 4  # once hopeless: one probe every PROBE_EVERY steps
    # drafting that costs nothing (as on a CPU step of 100 ms) is never skipped
    fast = Scripted([9] * 8, clock=clock)
    ad2 = AdaptiveK(FLAT, lambda c: fast)
    r2 = req("t", cfg)
    ad2.add_request(r2)
    for _ in range(20):
        ad2.draft([(r2, 8)], via(fast), num_other_tokens=0, num_other_seqs=0)
        commit(ad2, r2, [4])
    assert len(fast.calls) == 20
    ad.finish_request(r)
    assert "s" not in ad._skipped


def test_a_prior_from_long_drafts_does_not_keep_a_rejecting_request_speculating():
    """The CPU's verify-cost shape (1-3 tokens 1.0-1.08x a decode, 4-6 ~1.8x, 7-9 ~2.5x). A first
    request of the profile accepts every draft (the prior learns ~1.0 at every position); a second one
    never accepts (tool-call text): after its first step it drafts no deeper than the cheap block of 2,
    although its deep positions were never tested (the request-level shift), and from its 4th step on
    it verifies nothing (the margin); drafts keep being recorded, so its estimates keep learning."""
    from specserve.engine.draft_length import MIN_GAIN

    cpu = StepCostModel(list(range(1, 17)), [100.0 * (1 + 0.75 * ((t - 1) // 3)) + 4.0 * (t - 1) for t in range(1, 17)])
    cfg = SpeculativeConfig("ngram", 8, num_speculative_tokens_schedule="adaptive")
    prop = Scripted([7] * 8)
    ad = AdaptiveK(cpu, lambda c: prop)
    assert ad.min_gain == MIN_GAIN
    first = req("a", cfg)
    ad.add_request(first)
    for _ in range(10):
        (p,) = ad.draft([(first, 8)], via(prop), num_other_tokens=0, num_other_seqs=0)
        commit(ad, first, [7] * (len(p.token_ids) + 1))
    assert len(p.token_ids) == 8
    ad.finish_request(first)
    second = req("b", cfg)
    ad.add_request(second)
    ks = []
    for _ in range(6):
        (p,) = ad.draft([(second, 8)], via(prop), num_other_tokens=0, num_other_seqs=0)
        ks.append(len(p.token_ids))
        commit(ad, second, [4] * (len(p.token_ids) + 1) if p.token_ids else [4])
    assert ks[0] == 8 and max(ks[1:]) <= 2 and ks[3:] == [0, 0, 0]
    est = ad.tracker.estimates("b", 8)
    assert est[0] < 0.1 and all(b <= a for a, b in zip(est, est[1:]))
    assert len(prop.calls) == 16  # drafted every step (CPU: drafting is free), verified only when it paid


def test_no_drafts_decided_at_a_noticeable_cost_rests_until_a_request_joins(monkeypatch):
    """A GPU-like step (1 ms) where drafting costs 0.5 ms per request and nothing is ever accepted: once
    the choice is k = 0 for everyone, the next steps are plain decodes without proposing or choosing
    (their number keeps the decision's cost near REST_SHARE of the time, at most MAX_REST_STEPS); a
    request that joins is decided for when the rest ends (and retired: drafting never pays here). The decisions' time is handed to the engine
    once. On a 1 s step the same decision never rests."""
    from specserve.engine.draft_length import MAX_REST_STEPS

    gpu = StepCostModel(list(range(1, 17)), [1.0 + 0.001 * t for t in range(16)])
    cfg = SpeculativeConfig("ngram", 8, num_speculative_tokens_schedule="adaptive")
    prop = Scripted([9] * 8, delay_ms=0.5, clock=fake_time(monkeypatch))  # timings exact: no flake under load
    ad = AdaptiveK(gpu, lambda c: prop)
    r = req("a", cfg)
    ad.add_request(r)
    for _ in range(60):  # the target never continues with 9
        ad.draft([(r, 8)], via(prop), num_other_tokens=0, num_other_seqs=0)
        commit(ad, r, [4])
    assert len(prop.calls) < 30 and 0 < ad.rest_steps <= MAX_REST_STEPS
    assert sum(ad.chosen_k[cfg]) == 60  # every step counted, the plain ones as k = 0
    assert ad.take_drafting_ms() >= 0.5 * len(prop.calls) and ad.take_drafting_ms() == 0.0
    joined = req("b", cfg)
    ad.add_request(joined)
    n = len(prop.calls)
    for _ in range(ad.rest_steps):
        ad.draft([(r, 8), (joined, 8)], via(prop), num_other_tokens=0, num_other_seqs=0)
    assert len(prop.calls) == n
    ad.draft([(r, 8), (joined, 8)], via(prop), num_other_tokens=0, num_other_seqs=0)
    # decided for when the rest ends: with its share of a drafting decision's time (~0.5 ms) charged, a
    # draft that the prior says is rejected never pays, so the newcomer is retired without a proposer call
    assert "b" in ad._checked and ad.num_retired == 1 and all(rid != "b" for c in prop.calls for rid, _ in c)
    # a CPU-like step (1 s at 16 concurrent on 2 cores): the same decision costs < 1% of it, so every step decides
    slow = StepCostModel(list(range(1, 17)), [1000.0 + t for t in range(16)])
    cpu_ad = AdaptiveK(slow, lambda c: prop)
    r2 = req("c", cfg)
    cpu_ad.add_request(r2)
    for _ in range(30):
        cpu_ad.draft([(r2, 8)], via(prop), num_other_tokens=0, num_other_seqs=0)
        commit(cpu_ad, r2, [4])
        assert cpu_ad.rest_steps == 0


def test_a_decision_dearer_than_its_gain_stops_drafting(monkeypatch):
    """A GPU-like step (1 ms) where the first draft token is always accepted and the second never, and
    proposing costs 2 ms per request: the first decision drafts (its price is not known yet), then the
    measured price of deciding to draft is charged to every choice with drafts (2 expected tokens for
    ~3 ms lose to 1 token for 1 ms) and the schedule stops drafting. With free proposing the same
    acceptance keeps drafting (2 tokens for ~1 ms)."""
    monkeypatch.setattr("specserve.engine.draft_length.REST_SHARE", 1e9)  # no rest steps: every step decides
    monkeypatch.setattr("specserve.engine.draft_length.HOLD_SHARE", 1e9)  # and no holds
    gpu = StepCostModel(list(range(1, 17)), [1.0 + 0.001 * t for t in range(16)])
    cfg = SpeculativeConfig("ngram", 8, num_speculative_tokens_schedule="adaptive")
    clock = fake_time(monkeypatch)  # timings exact: no flake under load
    for delay, drafts_later in ((2.0, False), (0.0, True)):
        prop = Scripted([7] + [9] * 7, delay_ms=delay, clock=clock)
        ad = AdaptiveK(gpu, lambda c: prop)
        r = req("a", cfg)
        ad.add_request(r)
        ks = []
        for _ in range(16):  # the target continues with 7, then 4
            (p,) = ad.draft([(r, 8)], via(prop), num_other_tokens=0, num_other_seqs=0)
            ks.append(len(p.token_ids))
            commit(ad, r, [7, 4] if p.token_ids else [7])
        assert ks[0] > 0 and (ks[-1] > 0) == drafts_later, (delay, ks)
        assert (ad.draft_decide_ms >= 2.0) == (not drafts_later)


def retired_batch(monkeypatch):
    """EXPLORE_EVERY + 1 requests of one adaptive suffix config on a GPU-like step (1 ms) with a proposer
    costing 0.1 ms per request, every step deciding; after 5 steps of rejected drafts all but the two
    explorers (the first and the last) are retired. Returns (config, proposer, policy, requests)."""
    from specserve.engine.draft_length import EXPLORE_EVERY

    monkeypatch.setattr("specserve.engine.draft_length.REST_SHARE", 1e9)  # every step decides
    monkeypatch.setattr("specserve.engine.draft_length.HOLD_SHARE", 1e9)  # and no holds
    gpu = StepCostModel(list(range(1, 64)), [1.0 + 0.001 * t for t in range(63)])
    cfg = SpeculativeConfig("suffix", 8, num_speculative_tokens_schedule="adaptive")
    prop = Scripted([9] * 8, delay_ms=0.1, clock=fake_time(monkeypatch))
    ad = AdaptiveK(gpu, lambda c: prop)
    rs = [req(f"r{i}", cfg) for i in range(EXPLORE_EVERY + 1)]
    for r in rs:
        ad.add_request(r)
    for _ in range(5):  # the target never continues with 9: every draft is rejected
        ad.draft([(r, 8) for r in rs], via(prop), num_other_tokens=0, num_other_seqs=0)
        for r in rs:
            commit(ad, r, [4])
    assert ad.num_retired == len(rs) - 2
    return cfg, prop, ad, rs


def test_retired_requests_get_no_proposer_work_until_drafting_pays(monkeypatch):
    """Where drafting is costly (a 1 ms step, 0.1 ms per proposer call and request), a request whose
    optimistic choice is k = 0 is retired: no proposer call in decisions and no `prepare` between steps,
    not even for a request that joins then. Explorers (the first request of a proposer and every
    EXPLORE_EVERY-th after it) are never retired and keep probing every PROBE_EVERY steps; when their
    outcomes lift the profile's prior (and the retired requests' own rejections age away at every
    re-check), the retired requests are drafted for again. A step cost where
    drafting is cheap retires nobody."""
    from specserve.engine.draft_length import EXPLORE_EVERY

    cfg, prop, ad, rs = retired_batch(monkeypatch)
    explorers = {rs[0].request_id, rs[EXPLORE_EVERY].request_id}
    asks = [(r, 8) for r in rs]
    assert all(ad.wants_prepare(r, len(rs)) == (r.request_id in explorers) for r in rs)
    n = len(prop.calls)
    for _ in range(4 * PROBE_EVERY):
        ad.draft(asks, via(prop), num_other_tokens=0, num_other_seqs=0)
        for r in rs:
            commit(ad, r, [4])
    asked = [rid for call in prop.calls[n:] for rid, _ in call]
    assert set(asked) == explorers and len(asked) == 4 * len(explorers)  # explorers probe, nobody else drafts
    joined = req("late", cfg)
    ad.add_request(joined)  # the (EXPLORE_EVERY + 2)-th request: not an explorer, checked before its prompt
    assert not ad.wants_prepare(joined, len(rs) + 1) and ad.num_retired == len(rs) - 1
    # the explorers' drafts now pass: the prior rises and the retired requests draft again
    for _ in range(60 * PROBE_EVERY):  # the retired requests' own rejections age away as the prior rises
        props = ad.draft(asks, via(prop), num_other_tokens=0, num_other_seqs=0)
        for r, p in zip(rs, props):
            commit(ad, r, [9] * (len(p.token_ids) + 1) if r.request_id in explorers else [4])
        if ad.num_retired < len(rs) - 1:
            break
    assert ad.num_retired < len(rs) - 1
    back = [r for r in rs if r.request_id not in explorers and ad.wants_prepare(r, len(rs))]
    assert back  # un-retired: no draft in that step, `prepare` (overlapped on CUDA) catches its tree up first
    ad.draft(asks, via(prop), num_other_tokens=0, num_other_seqs=0)
    assert {r.request_id for r in back} <= {rid for rid, _ in prop.calls[-1]}  # then it drafts
    # a CPU-like step: drafting costs < 1% of it, nobody stays retired
    ad.step_cost = StepCostModel(list(range(1, 64)), [1000.0 + t for t in range(63)])
    ad.draft(asks + [(joined, 8)], via(prop), num_other_tokens=0, num_other_seqs=0)
    assert ad.num_retired == 0 and len(prop.calls[-1]) == len(rs) + 1
    for r in rs + [joined]:
        ad.finish_request(r)
    assert not (ad._retired or ad._explorers or ad._checked)


def test_one_slow_proposer_call_does_not_make_drafting_costly(monkeypatch):
    """A first call that ingests a long prompt (20 ms here) is a one-off: the drafting time is the median
    of recent calls (from the third on), so after two fast ones drafting is cheap against a 100 ms step
    and nothing is skipped or retired."""
    monkeypatch.setattr("specserve.engine.draft_length.REST_SHARE", 1e9)  # every step decides
    monkeypatch.setattr("specserve.engine.draft_length.HOLD_SHARE", 1e9)  # and no holds
    cfg = SpeculativeConfig("suffix", 8, num_speculative_tokens_schedule="adaptive")
    prop = Scripted([9] * 8, delay_ms=20.0, clock=fake_time(monkeypatch))  # timings exact
    ad = AdaptiveK(FLAT, lambda c: prop)
    rs = [req(f"q{i}", cfg) for i in range(3)]
    for r in rs:
        ad.add_request(r)
    asks = [(r, 8) for r in rs]
    for step in range(6):
        ad.draft(asks, via(prop), num_other_tokens=0, num_other_seqs=0)
        prop.delay_ms = 0.0
        for r in rs:
            commit(ad, r, [4])
    key = next(iter(ad.propose_ms))
    assert ad.propose_ms[key] < 1.0 and ad.num_retired == 0 and len(prop.calls[-1]) == len(rs)


def test_a_finished_explorer_hands_probing_to_a_running_request(monkeypatch):
    """When the explorers finish, the config's oldest running non-explorer becomes one (and is
    un-retired), so retired requests are not left without anyone probing: once drafts would pass, the
    prior rises and everyone drafts again. Explorers are counted per config."""
    from specserve.engine.draft_length import EXPLORE_EVERY

    cfg, prop, ad, rs = retired_batch(monkeypatch)
    other = req("o", SpeculativeConfig("suffix", 6, num_speculative_tokens_schedule="adaptive"))
    ad.add_request(other)
    assert "o" in ad._explorers  # the first request of its own config
    for r in (rs[0], rs[EXPLORE_EVERY]):  # the explorers finish
        ad.finish_request(r)
    left = rs[1:EXPLORE_EVERY]
    assert {"r1", "r2"} <= ad._explorers and ad.num_retired == len(left) - 2
    drafted = 0
    for _ in range(60 * PROBE_EVERY):  # now every draft would pass
        n = len(prop.calls)
        props = ad.draft([(r, 8) for r in left], via(prop), num_other_tokens=0, num_other_seqs=0)
        drafted += len(prop.calls) > n
        for r, p in zip(left, props):
            commit(ad, r, [9] * (len(p.token_ids) + 1))
    assert drafted and ad.num_retired == 0 and len(prop.calls[-1]) == len(left)


def test_the_retiring_check_charges_each_request_its_share_of_a_drafting_decision():
    """Where proposing is costly (0.5 ms per request against a 1 ms step), a new request with no history
    (acceptance 0.5 at every position) would draft when only the verify's cost is counted, so its prompt
    is ingested; once a drafting decision is known to cost 3 ms per request it was proposed for, the
    same request is retired before its prompt is ingested (as the decision itself would not draft)."""
    from specserve.spec_decode import proposer_key

    gpu = StepCostModel(list(range(1, 64)), [1.0 + 0.001 * t for t in range(63)])
    cfg = SpeculativeConfig("suffix", 8, num_speculative_tokens_schedule="adaptive")
    prop = Scripted([9] * 8)
    for share_ms, kept in ((0.0, True), (3.0, False)):
        ad = AdaptiveK(gpu, lambda c: prop)
        ad.propose_ms[proposer_key(cfg)] = 0.5
        ad.decide_ms_per_request = share_ms
        explorer, r = req("e", cfg), req("r", cfg)
        ad.add_request(explorer)  # the config's first request explores: never retired
        ad.add_request(r)
        assert ad.wants_prepare(explorer, 2) and ad.wants_prepare(r, 2) == kept
        assert ad.num_retired == (0 if kept else 1)


def test_a_drafting_decision_measures_its_time_per_request_proposed_for(monkeypatch):
    """`decide_ms_per_request` is the decision's time over the requests it proposed for: four requests
    with a proposer taking 2 ms each (a fake clock: nothing else takes time) give 2 ms per request of
    the whole decision's 8 ms."""
    monkeypatch.setattr("specserve.engine.draft_length.REST_SHARE", 1e9)
    monkeypatch.setattr("specserve.engine.draft_length.HOLD_SHARE", 1e9)  # and no holds
    cfg = SpeculativeConfig("ngram", 8, num_speculative_tokens_schedule="adaptive")
    prop = Scripted([7] * 8, delay_ms=2.0, clock=fake_time(monkeypatch))
    ad = AdaptiveK(FLAT, lambda c: prop)
    rs = [req(f"m{i}", cfg) for i in range(4)]
    for r in rs:
        ad.add_request(r)
    ad.draft([(r, 8) for r in rs], via(prop), num_other_tokens=0, num_other_seqs=0)
    assert ad.decide_ms_per_request == pytest.approx(2.0) and ad.draft_decide_ms == pytest.approx(8.0)


def test_a_request_whose_proposer_offers_nothing_is_retired_despite_a_high_prior(monkeypatch):
    """Where drafting is costly (0.1 ms per request against a 1 ms step): the explorer's drafts are all
    accepted (the profile's prior goes high), while the other request's proposer offers no draft at all
    (a suffix tree without a match). The retiring checks assume the draft length each request's
    proposer has offered lately, so the second one is retired (no proposer work) instead of being
    kept, and ingested, on the prior's promise of drafts it never gets; it is tried again after
    RETRY_EVERY re-checks."""
    monkeypatch.setattr("specserve.engine.draft_length.REST_SHARE", 1e9)  # every step decides
    monkeypatch.setattr("specserve.engine.draft_length.HOLD_SHARE", 1e9)  # and no holds
    gpu = StepCostModel(list(range(1, 64)), [1.0 + 0.001 * t for t in range(63)])
    cfg = SpeculativeConfig("suffix", 8, num_speculative_tokens_schedule="adaptive")

    class Offers(Scripted):
        def propose(self, inputs):
            out = super().propose(inputs)
            return [p if i.request_id == "e" else Proposal([]) for i, p in zip(inputs, out)]

    prop = Offers([9] * 8, delay_ms=0.1, clock=fake_time(monkeypatch))
    ad = AdaptiveK(gpu, lambda c: prop)
    e, r = req("e", cfg), req("r", cfg)
    ad.add_request(e)
    ad.add_request(r)
    for _ in range(40):
        props = ad.draft([(e, 8), (r, 8)], via(prop), num_other_tokens=0, num_other_seqs=0)
        commit(ad, e, [9] * (len(props[0].token_ids) + 1))
        commit(ad, r, [4])
    assert min(ad.tracker.monotone_prior(cfg, next(iter(ad.propose_ms)), 8)) > 0.6
    assert all(("e", 8) in c for c in prop.calls)  # the explorer drafts every step
    retried = sum(("r", 8) in c for c in prop.calls[4:])  # from the first costly decision on
    assert 1 <= retried <= 3  # tried again every RETRY_EVERY re-checks, not every step


def test_a_decision_that_drafts_holds_its_k(monkeypatch):
    """A GPU-like step (1 ms) where a decision costs 0.4 ms (the fake clock: proposing takes 0.1 ms per
    request, nothing else takes time): a decision that drafts holds its k for int(0.4 / (HOLD_SHARE x
    ~1 ms)) = 3 steps. Those steps make no choice, propose only for the requests held with k > 0, cut
    their drafts to the held k and record them (the estimates keep learning); a request that joins
    during the hold decodes plainly until the next decision, which comes when the hold ends. The price
    of drafting is then the average host time over the decision and its hold."""
    import specserve.engine.draft_length as dl

    monkeypatch.setattr(dl, "REST_SHARE", 1e9)
    gpu = StepCostModel(list(range(1, 64)), [1.0 + 0.001 * t for t in range(63)])
    cfg = SpeculativeConfig("ngram", 4, num_speculative_tokens_schedule="adaptive")
    prop = Scripted([7] * 4, delay_ms=0.1, clock=fake_time(monkeypatch))
    ad = AdaptiveK(gpu, lambda c: prop)
    choices = []
    real_choose = dl.choose_draft_lengths
    monkeypatch.setattr(dl, "choose_draft_lengths", lambda *a, **k: choices.append(1) or real_choose(*a, **k))
    rs = [req(f"r{i}", cfg) for i in range(4)]
    for r in rs:
        ad.add_request(r)
    first = ad.draft([(r, 4) for r in rs], via(prop), num_other_tokens=0, num_other_seqs=0)
    held = [len(p.token_ids) for p in first]
    assert any(held) and ad.hold_steps == 3 and len(choices) == 1
    for r in rs:
        commit(ad, r, [7] * 5)
    late = req("late", cfg)
    ad.add_request(late)
    recorded = []
    real_add = ad.tracker.add_draft
    monkeypatch.setattr(ad.tracker, "add_draft", lambda rid, *a, **k: recorded.append(rid) or real_add(rid, *a, **k))
    for _ in range(3):
        calls = len(prop.calls)
        props = ad.draft([(r, 3) for r in rs] + [(late, 3)], via(prop), num_other_tokens=0, num_other_seqs=0)
        assert [len(p.token_ids) for p in props] == [min(k, 3) for k in held] + [0]
        assert [rid for rid, _ in prop.calls[calls]] == [r.request_id for r, k in zip(rs, held) if k]
        for r in rs:
            commit(ad, r, [7] * 4)
    assert len(choices) == 1 and ad.hold_steps == 0
    assert recorded == 3 * [r.request_id for r, k in zip(rs, held) if k]  # hold drafts recorded, the newcomer's not
    assert ad.drafting_step_ms == pytest.approx((ad.draft_decide_ms + 3 * ad.hold_ms) / 4)
    ad.draft([(r, 3) for r in rs] + [(late, 3)], via(prop), num_other_tokens=0, num_other_seqs=0)
    assert len(choices) == 2 and ("late", 3) in prop.calls[-1]  # the hold is over: a decision, the newcomer in it


def test_holds_never_happen_where_a_decision_is_cheap(monkeypatch):
    """On a CPU-like step (100 ms) a decision (0.4 ms here) is far below HOLD_SHARE of a step: every
    step decides, as before holds existed."""
    cfg = SpeculativeConfig("ngram", 4, num_speculative_tokens_schedule="adaptive")
    prop = Scripted([7] * 4, delay_ms=0.1, clock=fake_time(monkeypatch))
    ad = AdaptiveK(FLAT, lambda c: prop)
    rs = [req(f"r{i}", cfg) for i in range(4)]
    for r in rs:
        ad.add_request(r)
    for _ in range(5):
        ad.draft([(r, 4) for r in rs], via(prop), num_other_tokens=0, num_other_seqs=0)
        assert ad.hold_steps == 0 and ad.rest_steps == 0
        for r in rs:
            commit(ad, r, [7] * 5)
    assert len(prop.calls) == 5


def test_a_recheck_dearer_than_the_proposer_is_not_made(monkeypatch):
    """Skipping the proposer for hopeless requests (`_hopeless`) needs a re-check per request; it is made
    only while a proposer call costs both COSTLY_SHARE of the step and, for a proposer without
    between-step work, more than that re-check (per proposer). A proposer with a `prepare` (a suffix
    tree) saves its ingestion too, so its share alone decides. A check found dearer is timed again every
    RECHECK_EVERY-th decision, so one slow check does not switch it off for good."""
    import specserve.engine.draft_length as dl
    from specserve.spec_decode import proposer_key

    cfg = SpeculativeConfig("ngram", 4, num_speculative_tokens_schedule="adaptive")
    plain, with_prepare = Scripted([7]), Scripted([7])
    with_prepare.prepare = lambda inputs: None
    ad = AdaptiveK(FLAT, lambda c: plain)
    key = proposer_key(cfg)
    assert not ad._costly(key, 1.0, plain)  # not measured yet: cheap
    ad.propose_ms[key] = 0.05
    assert ad._costly(key, 1.0, plain)  # 5% of a 1 ms step, no re-check measured yet
    assert not ad._costly(key, 10.0, plain)  # 0.5% of a 10 ms step
    ad.check_ms[key] = 0.2
    assert not ad._costly(key, 1.0, plain)  # the re-check costs more than the call it would save
    assert ad._costly(key, 1.0, with_prepare)  # ... but retiring also saves the proposer's ingestion
    ad.check_ms[key] = 0.01
    assert ad._costly(key, 1.0, plain)
    # the latch: a check measured dearer is still made every RECHECK_EVERY-th decision, and re-timed
    monkeypatch.setattr(dl, "REST_SHARE", 1e9)
    monkeypatch.setattr(dl, "HOLD_SHARE", 1e9)
    gpu = StepCostModel(list(range(1, 64)), [1.0 + 0.001 * t for t in range(63)])
    prop = Scripted([9] * 4, delay_ms=0.05, clock=fake_time(monkeypatch))
    ad = AdaptiveK(gpu, lambda c: prop)
    rs = [req(f"r{i}", cfg) for i in range(4)]
    for r in rs:
        ad.add_request(r)
    checks = []
    real = ad._check_hopeless
    monkeypatch.setattr(ad, "_check_hopeless", lambda *a: checks.append(1) or real(*a))
    for step in range(2 * dl.RECHECK_EVERY + 4):
        if step == 4:  # measured by now (drafting costly by its share); make the check look dear
            ad.check_ms[key] = 1.0
            ad._check_samples[key].extend([1.0] * 15)
            checks.clear()
        ad.draft([(r, 4) for r in rs], via(prop), num_other_tokens=0, num_other_seqs=0)
        for r in rs:
            commit(ad, r, [4])
    assert len(checks) == 2  # the 16th and 32nd decisions only


def test_a_hold_ends_when_its_drafting_requests_leave_and_never_holds_a_draft_model(monkeypatch):
    """A hold whose requests held with drafts have all finished ends at once (the next step decides for
    the ones that joined); a batch with a draft model's requests is never held (the draft model drafts
    exactly the chosen k, every step)."""
    import specserve.engine.draft_length as dl

    monkeypatch.setattr(dl, "REST_SHARE", 1e9)
    gpu = StepCostModel(list(range(1, 64)), [1.0 + 0.001 * t for t in range(63)])
    cfg = SpeculativeConfig("ngram", 4, num_speculative_tokens_schedule="adaptive")
    prop = Scripted([7] * 4, delay_ms=0.1, clock=fake_time(monkeypatch))
    ad = AdaptiveK(gpu, lambda c: prop)
    rs = [req(f"r{i}", cfg) for i in range(4)]
    for r in rs:
        ad.add_request(r)
    ad.draft([(r, 4) for r in rs], via(prop), num_other_tokens=0, num_other_seqs=0)
    assert ad.hold_steps > 0
    for r in rs:
        ad.finish_request(r)
    new = req("new", cfg)
    ad.add_request(new)
    (p,) = ad.draft([(new, 4)], via(prop), num_other_tokens=0, num_other_seqs=0)
    assert p.token_ids and prop.calls[-1] == [("new", 4)]  # decided (and drafted) at once, not held plain
    dcfg = SpeculativeConfig("draft_model", 3, model="tiny", num_speculative_tokens_schedule="adaptive")
    dprop = Scripted([7] * 3, costly=True, delay_ms=0.1, clock=prop.clock)
    ad2 = AdaptiveK(gpu, lambda c: dprop)
    d = req("d", dcfg)
    ad2.add_request(d)
    for _ in range(3):
        ad2.draft([(d, 3)], via(dprop), num_other_tokens=0, num_other_seqs=0)
        assert ad2.hold_steps == 0
        commit(ad2, d, [7])


def test_chain_ms_prices_each_position_by_the_requests_drafting_that_deep():
    from specserve.engine.draft_length import chain_ms

    cost = StepCostModel([1, 2, 3, 4], [10.0, 11.0, 12.0, 13.0], seqs=[1, 2, 4], seq_extra_ms=[0.0, 1.0, 3.0])
    # ks 3, 1, 0: position 1 drafts for 2 requests, positions 2 and 3 for one
    assert chain_ms(cost, [3, 1, 0]) == pytest.approx(cost.forward_ms(2, 2) + 2 * cost.forward_ms(1, 1))
    assert chain_ms(cost, [0, 0]) == 0.0 and chain_ms(cost, []) == 0.0


class SlowChain(Scripted):
    """A costly proposer whose table says 20 ms per draft forward and whose chain takes `ms_per_position`
    of the fake clock per drafted position. It reports `last_max_feed` as a draft model does: the tokens
    it has not seen (its prompt at first, 2 after a step whose k drafts were all accepted, 1 + the
    tokens committed meanwhile after steps it did not draft in; the target here accepts every draft)."""

    def __init__(self, tokens, ms_per_position, clock):
        super().__init__(tokens, costly=True, clock=clock)
        self.draft_step_cost = lambda: StepCostModel([1, 2], [20.0, 20.0])
        self.ms_per_position = ms_per_position
        self.held: dict[str, int] = {}  # request id -> tokens in its draft cache
        self.last_max_feed = 0

    def propose(self, inputs):
        feeds = []
        for i in inputs:
            feeds.append(len(i.token_ids) - min(self.held.get(i.request_id, 0), len(i.token_ids) - 1))
            self.held[i.request_id] = len(i.token_ids) + i.num_speculative_tokens - 1
        self.last_max_feed = max(feeds, default=0)
        self.clock.now += self.ms_per_position * max(i.num_speculative_tokens for i in inputs) / 1000
        return super().propose(inputs)


def one_draft_request(monkeypatch, ms_per_position):
    """An AdaptiveK with one request of an adaptive draft-model config (k <= 6) over FLAT, whose chain
    takes `ms_per_position` of the fake clock per position (table: 20 ms). Returns (ad, prop, request)."""
    clock = fake_time(monkeypatch)
    cfg = SpeculativeConfig("draft_model", 6, model="m", num_speculative_tokens_schedule="adaptive")
    prop = SlowChain([7] * 6, ms_per_position, clock)
    ad = AdaptiveK(FLAT, lambda c: prop)
    r = req("d", cfg)
    ad.add_request(r)
    return ad, prop, r


def decide(ad, prop, r, steps, every_step=True):
    """`steps` decisions for `r` alone, every draft accepted; returns the k of each. With `every_step`,
    no rest steps (a real engine rests after k = 0; not what these tests are about)."""
    ks = []
    for _ in range(steps):
        (p,) = ad.draft([(r, 6)], via(prop), num_other_tokens=0, num_other_seqs=0)
        ks.append(len(p.token_ids))
        commit(ad, r, [7] * (len(p.token_ids) + 1))
        if every_step:
            ad.rest_steps = 0
    return ks


def test_a_draft_chain_slower_than_its_table_is_priced_at_its_realised_time(monkeypatch):
    """The table prices a draft position at 20 ms against a 100 ms target step: drafting pays. The chain
    really takes 120 ms per position, which does not pay even with every draft accepted: after the first
    steady chain the scale reads 6 and the schedule stops drafting, but for probes every
    DRAFT_PROBE_EVERY-th decision (which measure the scale again: still 6). The chain's time is not counted as the
    decision's own (nothing else takes time here)."""
    from specserve.engine.draft_length import DRAFT_PROBE_EVERY as E

    ad, prop, r = one_draft_request(monkeypatch, 120.0)
    ks = decide(ad, prop, r, 7 * E + 5)
    # the first chain feeds the prompt (not timed), the second sets the scale; then after E decisions
    # without drafts a probe drafts two decisions at the table's price (the second's chain is steady);
    # each probe that is not followed by drafting doubles the interval (E, 2E, 4E)
    assert [i for i, k in enumerate(ks) if k] == [0, 1, 1 + E, 2 + E, 2 + 3 * E, 3 + 3 * E, 3 + 7 * E, 4 + 7 * E]
    assert ks[1 + E] > 1 and ks[2 + E] > 1  # the unscaled choice, not a one-token probe
    assert ad.chain_scale(proposer_key(r.spec_config)) == pytest.approx(6.0)
    assert ad._probe_every[proposer_key(r.spec_config)] == 8 * E  # three probes that confirmed k = 0
    assert ad.draft_decide_ms == 0.0 and ad.decide_ms_per_request == 0.0


def test_a_draft_chain_as_fast_as_its_table_keeps_drafting(monkeypatch):
    """The same request with a chain that takes what the table says: scale 1.0, the deep drafts stay."""
    ad, prop, r = one_draft_request(monkeypatch, 20.0)
    ks = decide(ad, prop, r, 20, every_step=False)
    assert ad.chain_scale(proposer_key(r.spec_config)) == pytest.approx(1.0) and ks[-1] >= 4


def test_a_scale_raised_by_slow_chains_is_measured_again_and_drafting_resumes(monkeypatch):
    """Two chains slowed 10x by something else (a pause) make the scale 10 and stop drafting; a probe
    after DRAFT_PROBE_EVERY decisions in a row without drafts drafts as the table says and takes the
    table's time, so the interval does not back off, and once such chains are the median the schedule
    drafts every step again."""
    from specserve.engine.draft_length import DRAFT_PROBE_EVERY as E

    ad, prop, r = one_draft_request(monkeypatch, 20.0)
    decide(ad, prop, r, 4, every_step=False)  # learn that every draft is accepted, at the table's speed
    key = proposer_key(r.spec_config)
    ad._chain_ratios[key].clear()
    ad._chain_ratios[key].extend([10.0, 10.0])  # two chains that a pause slowed 10x
    drafted = [i for i, k in enumerate(decide(ad, prop, r, 9 * E)) if k]
    # a probe at the E-th decision in a row without drafts is two decisions at the table's price: the
    # first feeds the tokens missed meanwhile (not timed), the second is timed: medians 10 (10, 10, 1),
    # 5.5, then 1.0, and the schedule drafts every step again
    # (a probe whose chain came out cheaper than the scale keeps the interval at E: no backoff)
    assert drafted[:4] == [E - 1, E, 2 * E, 2 * E + 1]
    assert drafted[4:] == list(range(3 * E + 1, 9 * E)) and ad.chain_scale(key) == pytest.approx(1.0)
    assert ad._probe_every[key] == E


def test_a_draft_model_kept_at_k0_by_its_prior_probes_and_learns(monkeypatch):
    """A draft forward priced at 50 ms against a 100 ms step: from the 0.5 prior no k pays, and a draft
    model learns only from drafts it made. Every DRAFT_PROBE_EVERY-th decision in a row without drafts
    drafts one token for one request (the explorer); the target accepts everything, so after a few
    probes the estimates pay for drafting and the schedule drafts deep on its own."""
    from specserve.engine.draft_length import DRAFT_PROBE_EVERY as E

    clock = fake_time(monkeypatch)
    cfg = SpeculativeConfig("draft_model", 6, model="m", num_speculative_tokens_schedule="adaptive")
    prop = SlowChain([7] * 6, 50.0, clock)
    prop.draft_step_cost = lambda: StepCostModel([1, 2], [50.0, 50.0])
    ad = AdaptiveK(FLAT, lambda c: prop)
    rs = [req(f"r{i}", cfg) for i in range(2)]
    for r in rs:
        ad.add_request(r)
    rs.reverse()  # the explorer (the config's first request) is not the first ask
    ks = []
    for _ in range(8 * E):
        props = ad.draft([(r, 6) for r in rs], via(prop), num_other_tokens=0, num_other_seqs=0)
        ks.append([len(p.token_ids) for p in props])
        for r, p in zip(rs, props):
            commit(ad, r, [7] * (len(p.token_ids) + 1))
        ad.rest_steps = 0  # decide every step (a real engine would rest after k = 0; not what is tested)
    assert ks[:E - 1] == [[0, 0]] * (E - 1) and ks[E - 1] == [0, 1]  # the first probe: the explorer, one token
    assert max(max(k) for k in ks[-E:]) >= 3 and all(any(k) for k in ks[-E:])  # learned: drafting on its own


def test_a_chain_that_feeds_a_prompt_is_not_timed_into_the_chain_price(monkeypatch):
    """A draft chain that first ingests a request's prompt (its proposer's `last_max_feed` above
    STEADY_FEED) takes far longer than its table says, but that is not a price of this step's k: it is
    left out of chain_scale, which the steady chains after it set alone."""
    ad, prop, r = one_draft_request(monkeypatch, 20.0)
    orig = prop.propose

    def propose(inputs):  # the first call feeds a 500-token prompt: 10 s more
        first = not prop.calls
        out = orig(inputs)
        if first:
            prop.last_max_feed = 500
            prop.clock.now += 10.0
        return out

    prop.propose = propose
    ks = decide(ad, prop, r, 8, every_step=False)
    key = proposer_key(r.spec_config)
    assert len(ad._chain_ratios[key]) == 7 and ad.chain_scale(key) == pytest.approx(1.0) and ks[-1]


def test_metrics_export_the_draft_chain_scale_and_step_cost():
    """/metrics carries each draft model's chain scale beside the step-cost series."""
    from types import SimpleNamespace

    from specserve.metrics.prometheus import ServerMetrics

    m = ServerMetrics(["p"], "target")
    cfg = SpeculativeConfig("draft_model", 3, model="draft", num_speculative_tokens_schedule="adaptive")
    # a model that drafts for itself: its target and draft tables are both exported, told apart by role
    stats = {"step_cost": {("m", "target"): FLAT, ("m", "draft"): StepCostModel([1, 2], [20.0, 21.0])},
             "chain_scale": {"draft": 1.25}, "configs": [{"config": cfg, "chosen_k": [2, 0, 5], "acceptance": [0.5]}]}
    m.set_speculation(stats, {"p": SimpleNamespace(spec_config=cfg)})
    text = m.render().decode()
    assert 'specserve:step_cost_draft_chain_scale{model="draft"} 1.25' in text
    assert 'specserve:step_cost_forward_seconds{model="m",num_tokens="2",role="draft"} 0.021' in text
    assert 'specserve:step_cost_forward_seconds{model="m",num_tokens="2",role="target"} 0.101' in text
    assert 'specserve:spec_decode_adaptive_steps_total{k="2",profile="p"} 5.0' in text


def test_a_draft_model_is_probed_while_a_free_proposer_beside_it_drafts(monkeypatch):
    """A batch with an ngram request that drafts every step and a draft-model request its prior keeps at
    k = 0: the draft model's count of decisions without drafts is its own, so it is probed all the same."""
    from specserve.engine.draft_length import DRAFT_PROBE_EVERY as E

    clock = fake_time(monkeypatch)
    ncfg = SpeculativeConfig("ngram", 8, num_speculative_tokens_schedule="adaptive")
    dcfg = SpeculativeConfig("draft_model", 6, model="m", num_speculative_tokens_schedule="adaptive")
    free = Scripted([7] * 8)
    dprop = SlowChain([7] * 6, 50.0, clock)
    dprop.draft_step_cost = lambda: StepCostModel([1, 2], [50.0, 50.0])
    ad = AdaptiveK(FLAT, lambda c: dprop if c.method == "draft_model" else free)

    def route(asks):
        return [(dprop if r.spec_config.method == "draft_model" else free).propose(
            [ProposalInput(r.request_id, r.all_token_ids, r.num_prompt_tokens, k, r.params, r.seed)])[0]
            for r, k in asks]

    n, d = req("n", ncfg), req("d", dcfg)
    ad.add_request(n)
    ad.add_request(d)
    ks = []
    for _ in range(E):
        props = ad.draft([(n, 8), (d, 6)], route, num_other_tokens=0, num_other_seqs=0)
        ks.append([len(p.token_ids) for p in props])
        for r, p in zip((n, d), props):
            commit(ad, r, [7] * (len(p.token_ids) + 1))
    assert all(k[0] > 0 for k in ks[1:])  # the ngram request drafts (after its first, cautious step)
    assert [k[1] for k in ks] == [0] * (E - 1) + [1]  # the draft model: probed at its E-th decision without drafts


class FeedingChain(SlowChain):
    """SlowChain with CUDA graphs that take 2 tokens per request (`graph_max_feed`): it says what its
    next propose would feed each request (`pending_feed`), so the schedule gathers the requests whose
    prompt or catch-up would make the chain eager."""

    graph_max_feed = 2

    def pending_feed(self, request_id, token_ids):
        return len(token_ids) - min(self.held.get(request_id, 0), len(token_ids) - 1)


def feeding_batch(monkeypatch, n, batching=True):
    """An AdaptiveK with `n` requests of an adaptive draft-model config whose chain takes what its table
    says (drafting pays); returns (ad, prop, requests, config)."""
    clock = fake_time(monkeypatch)
    cfg = SpeculativeConfig("draft_model", 4, model="m", num_speculative_tokens_schedule="adaptive")
    prop = FeedingChain([7] * 4, 20.0, clock)
    prop.graph_max_feed = 2 if batching else None
    ad = AdaptiveK(FLAT, lambda c: prop)
    rs = [req(f"r{i}", cfg) for i in range(n)]
    for r in rs:
        ad.add_request(r)
    return ad, prop, rs, cfg


def decide_all(ad, prop, rs):
    """One decision for `rs`, every draft accepted; returns {request id: k}."""
    props = ad.draft([(r, 4) for r in rs], via(prop), num_other_tokens=0, num_other_seqs=0)
    ad.rest_steps = 0
    for r, p in zip(rs, props):
        commit(ad, r, [7] * (len(p.token_ids) + 1))
    return {r.request_id: len(p.token_ids) for r, p in zip(rs, props)}


def test_a_draft_model_gathers_prompt_feeds_into_one_forward(monkeypatch):
    """On a launch-bound device a request the draft has not seen (or that missed steps) decodes plainly
    until FEED_BATCH such requests are behind, or it waited FEED_WAIT decisions, so their prompts go
    into one eager forward; requests the draft is in step with draft meanwhile. A batch that is all
    behind (the start, one lone request) drafts at once."""
    from specserve.engine.draft_length import FEED_BATCH, FEED_WAIT

    ad, prop, rs, cfg = feeding_batch(monkeypatch, 6)
    first = decide_all(ad, prop, rs)
    assert all(first.values())  # all six behind (>= FEED_BATCH): fed together
    late = req("late", cfg)
    ad.add_request(late)
    rs.append(late)
    waited = [decide_all(ad, prop, rs)["late"] for _ in range(FEED_WAIT + 1)]
    assert waited == [0] * FEED_WAIT + [waited[-1]] and waited[-1] > 0
    assert all(k > 0 for rid, k in decide_all(ad, prop, rs).items())
    # FEED_BATCH newcomers at once are fed in the next decision
    new = [req(f"n{i}", cfg) for i in range(FEED_BATCH)]
    for r in new:
        ad.add_request(r)
    got = decide_all(ad, prop, rs + new)
    assert all(got[r.request_id] > 0 for r in new)
    # a request that leaves while waiting leaves nothing behind
    gone = req("gone", cfg)
    ad.add_request(gone)
    assert decide_all(ad, prop, rs + [gone])["gone"] == 0
    ad.finish_request(gone)
    assert "gone" not in ad._feed_wait


def test_feeds_are_not_gathered_where_a_forward_costs_its_tokens(monkeypatch):
    """Where the drafter has no graphs (a CPU: `graph_max_feed` None), and for a lone request, a request
    behind drafts at once."""
    ad, prop, rs, cfg = feeding_batch(monkeypatch, 3, batching=False)
    decide_all(ad, prop, rs)
    late = req("late", cfg)
    ad.add_request(late)
    assert decide_all(ad, prop, rs + [late])["late"] > 0
    ad, prop, (lone,), _ = feeding_batch(monkeypatch, 1)
    assert decide_all(ad, prop, [lone])["r0"] > 0


def test_gather_feeds_holds_back_only_requests_behind_that_would_draft_beside_requests_in_step():
    """`_gather_feeds` on a given choice: a request behind (its feed longer than the draft's graphs
    take) that the choice drafts for, beside a request in step that drafts too, is held (k = 0, made
    again without its drafts) and counts a wait; a request the choice gives k = 0 is not waiting (a
    stale count is dropped); where only requests behind draft, nobody waits; FEED_BATCH of them draft
    together; in the second decision of a scale probe they always wait."""
    from specserve.engine.draft_length import FEED_BATCH
    from specserve.spec_decode.adaptive import Choice, DraftOption

    class Drafter:
        graph_max_feed = 16

        def __init__(self, feeds):
            self.feeds = feeds

        def pending_feed(self, rid, tokens):
            return self.feeds[rid]

    def choose(opts):  # drafts one token for every option that may draft
        return Choice([1 if o.acceptance else 0 for o in opts], 0.0, 1.0, 0.0)

    def gather(ks, feeds, second=frozenset()):
        rids = list(feeds)
        opts = [DraftOption([0.9, 0.9], draft_group="d", draft_cost_ms=lambda n: 1.0) for _ in rids]
        choice, _ = ad._gather_feeds(Choice(ks, 0.0, 1.0, 0.0), opts, rids, [[]] * len(rids),
                                     {"d": Drafter(feeds)}, choose, set(second))
        return choice.ks

    ad = AdaptiveK(FLAT, lambda c: None)
    ad._feed_wait["idle"] = 8  # left from an earlier wait
    assert gather([1, 1, 0], {"steady": 1, "new": 300, "idle": 40}) == [1, 0, 1]  # choose() again: idle may draft
    assert ad._feed_wait == {"new": 1}  # "idle" was given k = 0: not waiting, its count dropped
    assert gather([0, 1], {"steady": 1, "new": 300}) == [0, 1]  # only requests behind draft: nobody waits
    many = {"steady": 1, **{f"n{i}": 300 for i in range(FEED_BATCH)}}
    assert gather([1] * len(many), many) == [1] * len(many)  # FEED_BATCH behind: fed together
    assert gather([1] * len(many), many, second={"d"}) == [1] + [0] * FEED_BATCH  # a scale probe's second decision


def test_drafting_time_of_configured_k_is_left_out_of_the_overhead_fit(monkeypatch):
    """`take_drafting_ms` covers the proposals for requests of configured k (a static draft model's chain)
    as well as the adaptive decision, so the engine's overhead fit does not take them for per-step host
    work: on the H200 a static draft model's ~4 ms chains, fitted, priced the next adaptive run's plain
    steps 3.8 ms too high. With only static requests in the step, all of its proposing time is drafting.
    The step's own static proposing is priced into the adaptive choice instead (every option pays it)."""
    clock = fake_time(monkeypatch)
    static = SpeculativeConfig("draft_model", 3, model="m")
    adaptive = SpeculativeConfig("ngram", 4, num_speculative_tokens_schedule="adaptive")
    slow = Scripted([5] * 3, delay_ms=4.0, clock=clock)
    fast = Scripted([7] * 4, delay_ms=0.5, clock=clock)
    ad = AdaptiveK(FLAT, lambda c: slow if c is static else fast)
    a, b = req("s", static), req("f", adaptive)
    ad.add_request(a)
    ad.add_request(b)
    ad.take_drafting_ms()
    (pa,) = ad.draft([(a, 3)], lambda asks: slow.propose(
        [ProposalInput(r.request_id, r.all_token_ids, r.num_prompt_tokens, k, r.params, r.seed) for r, k in asks]),
        num_other_tokens=0, num_other_seqs=0)
    assert pa.token_ids == [5, 5, 5] and ad.take_drafting_ms() == pytest.approx(4.0)
    props = ad.draft([(a, 3), (b, 4)], lambda asks: (slow if asks[0][0] is a else fast).propose(
        [ProposalInput(r.request_id, r.all_token_ids, r.num_prompt_tokens, k, r.params, r.seed) for r, k in asks]),
        num_other_tokens=0, num_other_seqs=0)
    assert props[0].token_ids == [5, 5, 5]
    assert ad.take_drafting_ms() == pytest.approx(4.0 + 0.5)  # the static chain and the adaptive proposing
    assert ad.take_drafting_ms() == 0.0  # taken: reset
    # the choice prices this step's static chain into every option: its expected step time holds the 4 ms
    # (the step: the static request's 1 + 3 tokens, the adaptive one's 1 + k; no decision time measured yet)
    choice = ad.last_choice
    k = sum(choice.ks)
    assert choice.step_ms == pytest.approx(FLAT.step_ms(5 + k, 2) + FLAT.draft_overhead_ms * (3 + k) + 4.0)


def test_retire_check_prices_the_static_proposing_of_the_step(monkeypatch):
    """The re-check that retires requests prices a step as the choice does: beside a static request whose
    proposing takes 5 s, the 0.1 ms per request of proposing for the retired ones is so small a share of
    the step that drafting for them pays again even at their ~0.06% acceptance; beside a static request
    whose proposing is instant it does not. Whether drafting counts as costly is still judged on the
    step cost alone."""
    static = SpeculativeConfig("draft_model", 3, model="m")
    for delay_ms, retired_after in ((0.0, True), (5000.0, False)):
        cfg, prop, ad, rs = retired_batch(monkeypatch)
        slow = Scripted([5] * 3, delay_ms=delay_ms, clock=prop.clock)
        ad.proposer_of = lambda c, prop=prop, slow=slow: slow if c is static else prop
        s = req("static", static)
        ad.add_request(s)
        before = ad.num_retired
        ad.draft([(s, 3)] + [(r, 8) for r in rs], lambda asks, prop=prop, slow=slow: via(
            slow if asks[0][0].spec_config is static else prop)(asks), num_other_tokens=0, num_other_seqs=0)
        assert (ad.num_retired == before) == retired_after, delay_ms
