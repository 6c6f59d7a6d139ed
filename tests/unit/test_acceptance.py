"""Acceptance estimates: per-position conditional counts, the prior chain (request -> config ->
proposer -> the position before), outcomes read from committed tokens (also beyond the verified k),
the calibration of the proposers' own confidence, the monotone prior and the request-level shift."""

import math

import pytest

from specserve.spec_decode.acceptance import (
    DEFAULT_ACCEPTANCE, REQUEST_SHIFT_WEIGHT, REQUEST_WEIGHT, AcceptanceTracker, PositionCounts, RequestShift,
    confidence_bucket,
)


def test_position_counts_are_conditional():
    c = PositionCounts()
    c.observe(4, 2)  # drafts 1, 2 accepted, 3 rejected, 4 never tested
    c.observe(4, 4)
    c.observe(2, 0)
    assert c.tested == [3, 2, 2, 1] and c.accepted == [2, 2, 1, 1]
    est = c.estimates(6, None, 0.0)  # no prior weight: the raw rates, untested positions carry the last
    assert est == pytest.approx([2 / 3, 1.0, 0.5, 1.0, 1.0, 1.0])
    assert PositionCounts().estimates(3, None, 1.0) == [DEFAULT_ACCEPTANCE] * 3
    decayed = PositionCounts(decay=0.5)
    decayed.observe(1, 1)
    decayed.observe(1, 0)
    assert decayed.tested == [1.5] and decayed.accepted == [0.5]


def test_outcomes_from_committed_tokens_beyond_k():
    t = AcceptanceTracker()
    t.add_request("r", "cfg", "prop")
    ids = [1, 2, 3]
    t.add_draft("r", len(ids), [7, 8, 9, 10])  # a draft of 4 tokens; say only 1 was verified
    ids += [7, 8]  # this step committed the accepted draft 7 and the bonus 8 (= draft 2, not verified)
    t.on_commit("r", ids)
    assert t._requests["r"].pending  # draft 3 and 4 are not known yet; 1 and 2 are recorded already
    assert t._requests["r"].counts.tested == [1, 1] and t._requests["r"].counts.accepted == [1, 1]
    ids += [9, 11]
    t.on_commit("r", ids)  # 9 matches, 11 != 10: 3 of 4 would have been accepted
    counts = t._requests["r"].counts
    assert counts.tested == [1, 1, 1, 1] and counts.accepted == [1, 1, 1, 0]
    assert not t._requests["r"].pending
    prof = t._configs["cfg"]
    assert prof.tested == [1, 1, 1, 1] and prof.accepted == [1, 1, 1, 0]
    # a rejection at the first position
    t.add_draft("r", len(ids), [5, 5])
    t.on_commit("r", ids + [6])
    assert counts.tested[0] == pytest.approx(1 * 0.92 + 1) and counts.accepted[0] == pytest.approx(0.92)


def test_positions_are_recorded_as_soon_as_known_and_kept_at_finish():
    t = AcceptanceTracker()
    t.add_request("r", "cfg", "prop")
    t.add_draft("r", 2, [4, 5, 6])
    t.on_commit("r", [0, 1, 4])  # a plain decode step: position 1 is known, and counts at once
    assert t.estimates("r", 1)[0] > 0.5 and t._configs["cfg"].tested == [1]
    t.on_commit("r", [0, 1, 4, 5])  # request ends here (e.g. max_tokens)
    t.finish_request("r")
    assert t._configs["cfg"].tested == [1, 1] and t._configs["cfg"].accepted == [1, 1]
    assert t.num_requests == 0
    t.finish_request("r")  # unknown: ignored
    t.on_commit("unknown", [1])


def test_prior_chain_request_config_proposer():
    t = AcceptanceTracker()
    t.add_request("a", "cfg", "prop")
    assert t.estimates("a", 3) == pytest.approx([DEFAULT_ACCEPTANCE] * 3)
    for _ in range(30):  # request a: the first draft always accepted, the second never
        t.add_draft("a", 0, [1, 2])
        t.on_commit("a", [1, 3])
    est = t.estimates("a", 3)
    assert est[0] > 0.95 and est[1] < 0.1 and est[2] < 0.1  # position 3, never tested, carries position 2
    # a new request of the same config starts from the config's prior, not from 0.5
    t.add_request("b", "cfg", "prop")
    b = t.estimates("b", 2)
    assert b[0] > 0.9 and b[1] < 0.15
    # a new config of the same proposer starts from the proposer's prior
    t.add_request("c", "cfg2", "prop")
    c = t.estimates("c", 2)
    assert c[0] > 0.8 and c[1] < 0.3
    # a request's own evidence overrides the prior: b never gets its first draft accepted
    for _ in range(20):
        t.add_draft("b", 0, [1])
        t.on_commit("b", [2])
    assert t.estimates("b", 1)[0] < 0.3
    assert REQUEST_WEIGHT > 0
    with pytest.raises(KeyError):
        t.estimates("nobody", 2)


def test_confidence_is_calibrated_per_bucket():
    t = AcceptanceTracker()
    t.add_request("r", "cfg", "prop")
    for i in range(60):  # long matches are accepted, short ones are not
        long_match = i % 2 == 0
        t.add_draft("r", 0, [1], match_len=4 if long_match else 1)
        t.on_commit("r", [1 if long_match else 2])
    plain = t.estimates("r", 1)[0]
    hi = t.estimates("r", 1, match_len=4)[0]
    lo = t.estimates("r", 1, match_len=1)[0]
    assert 0.3 < plain < 0.7 and hi > 0.85 and lo < 0.15
    assert confidence_bucket(None, None) is None
    assert confidence_bucket(3, None) == (3, None) and confidence_bucket(7, 1.0) == (5, 4)
    assert confidence_bucket(None, 0.3) == (None, 1) and confidence_bucket(12, 0.99) == (9, 3)


def learn_config(t, rid, first_ok_every, n=40, depth=8):
    """Teach the config's prior with a request whose drafts of `depth` tokens are accepted in full every
    `first_ok_every`-th time and rejected at position 1 otherwise (conditional acceptance: low at
    position 1, 1.0 deeper)."""
    t.add_request(rid, "cfg", "prop")
    ids = []
    for i in range(n):
        draft = list(range(100, 100 + depth))
        t.add_draft(rid, len(ids), draft)
        ids += draft + [1] if i % first_ok_every == 0 else [1]
        t.on_commit(rid, ids)
    t.finish_request(rid)


def test_prior_is_monotone_but_a_request_can_lift_its_own_deep_positions():
    t = AcceptanceTracker()
    learn_config(t, "old", first_ok_every=2)  # position 1: ~0.5, positions 2..8: 1.0
    raw = t.prior("cfg", "prop", 8)
    assert raw[0] < 0.7 and raw[-1] > 0.9  # the learned curve rises
    mono = t.monotone_prior("cfg", "prop", 8)
    assert mono == pytest.approx([raw[0]] * 8)
    t.add_request("new", "cfg", "prop")
    est = t.estimates("new", 8)
    assert all(b <= a + 1e-12 for a, b in zip(est, est[1:]))  # no own evidence: non-increasing
    assert est[-1] < 0.7
    # the request's own drafts are accepted in full: its deep positions rise above its first
    ids = []
    for i in range(6):
        draft = list(range(200 + 10 * i, 208 + 10 * i))
        t.add_draft("new", len(ids), draft)
        ids += draft + [1] if i % 2 == 0 else [1]
        t.on_commit("new", ids)
    est = t.estimates("new", 8)
    assert est[3] > est[0] + 0.1


def test_request_shift_moves_untested_positions_toward_the_request():
    """A prior learned on text where drafts run long (every position ~0.95); a new request whose drafts
    are rejected at position 1: after 3 rejections its deep positions, which it never tested, drop too
    (the request-level shift), not only position 1."""
    t = AcceptanceTracker()
    learn_config(t, "summary", first_ok_every=1, n=30)
    t.add_request("tool", "cfg", "prop")
    before = t.estimates("tool", 8)
    assert min(before) > 0.9 and t.request_shift("tool") == 0.0
    ids = []
    for _ in range(3):
        t.add_draft("tool", len(ids), [100, 101, 102, 103])
        ids += [1]
        t.on_commit("tool", ids)
    delta = t.request_shift("tool")
    p = before[0]
    rate = (0 + REQUEST_SHIFT_WEIGHT * p) / (3 + REQUEST_SHIFT_WEIGHT)
    expect = math.log(rate / (1 - rate)) - math.log(p / (1 - p))
    assert delta == pytest.approx(max(expect, -3.0), abs=0.05)
    after = t.estimates("tool", 8)
    assert after[0] < 0.5 and max(after[1:]) < before[1] - 0.2  # positions 2..8 never tested, lowered
    # and it recovers as quickly when the request's drafts start to be accepted
    for i in range(6):
        draft = [300 + i, 400 + i]
        t.add_draft("tool", len(ids), draft)
        ids += draft + [1]
        t.on_commit("tool", ids)
    assert t.request_shift("tool") > delta + 1.0


def test_request_shift_formula():
    s = RequestShift()
    assert s.delta() == 0.0
    for _ in range(3):
        s.observe(0, 0.7, False)
    assert s.delta(2.0) == pytest.approx(math.log(0.28 / 0.72) - math.log(0.7 / 0.3))
    s2 = RequestShift()
    for _ in range(50):
        s2.observe(0, 0.5, True)
    assert s2.delta() == pytest.approx(3.0)  # capped at MAX_CALIBRATION
    d = RequestShift(decay=0.5)
    d.observe(0, 1.0, True)
    d.observe(0, 0.0, False)
    assert (d.tested, d.accepted, d.predicted) == (1.5, 0.5, 0.5)


def test_ageing_a_request_moves_its_estimates_to_the_prior():
    """A request rejected 3 times against a prior of ~0.95 (estimates < 0.5): `age` weighs its own
    evidence down (counts and request-level shift by the factor), so repeated ageing without new
    outcomes brings its estimates back to the prior; one ageing by 1.0 changes nothing, unknown ids are
    ignored."""
    t = AcceptanceTracker()
    learn_config(t, "summary", first_ok_every=1, n=30)
    t.add_request("tool", "cfg", "prop")
    ids = []
    for _ in range(3):
        t.add_draft("tool", len(ids), [100, 101, 102, 103])
        ids += [1]
        t.on_commit("tool", ids)
    low = t.estimates("tool", 4)
    prior = t.monotone_prior("cfg", "prop", 4)  # the rejections went into the profile's prior too
    assert low[0] < 0.5 < prior[0]
    t.age("tool", 1.0)
    assert t.estimates("tool", 4) == low
    t.age("tool", 0.5)
    half = t.estimates("tool", 4)
    assert low[0] < half[0] < prior[0]
    for _ in range(60):
        t.age("tool")
    assert t.estimates("tool", 4) == pytest.approx(prior, abs=0.02)
    t.age("nobody")
