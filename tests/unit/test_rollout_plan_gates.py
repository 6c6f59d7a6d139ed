"""Rollout plans (JSON/YAML, errors naming the key) and the gate functions on recorded windows."""

import json

import pytest

from specserve.config import ConfigError
from specserve.rollout.gates import SideStats, ShadowStats, decide, evaluate_gates, percentile
from specserve.rollout.plan import DEFAULT_GATES, load_plan, parse_plan_text, plan_from_dict
from specserve.rollout.window import Outcome, OutcomeWindow, outcome_from_record


def test_plan_defaults_and_yaml_json(tmp_path):
    p = plan_from_dict({"candidate": "ngram_4"})
    assert [s.percent for s in p.steps] == [1, 5, 25, 50, 100]
    assert p.baseline == "baseline" and p.gates == DEFAULT_GATES and p.shadow is None
    assert all(s.min_dwell_s == 300 and s.min_requests == 100 for s in p.steps)
    assert p.weights(1) == {"ngram_4": 5.0, "baseline": 95.0}
    y = tmp_path / "plan.yaml"
    y.write_text("candidate: suffix\nsteps: [10, {percent: 50, min_dwell_s: 5, min_requests: 3}, 100]\n"
                 "min_dwell_s: 1\nmin_requests: 2\nwindow_s: 30\ninterval_s: 2\n"
                 "gates: {p95_ttft_ratio: null, min_mean_acceptance_length: 1.5}\nshadow: {sample: 0.5}\n")
    q = load_plan(y)
    assert [(s.percent, s.min_dwell_s, s.min_requests) for s in q.steps] == [(10, 1, 2), (50, 5, 3), (100, 1, 2)]
    assert q.gates["p95_ttft_ratio"] is None and q.gates["min_mean_acceptance_length"] == 1.5
    assert q.shadow.sample == 0.5 and q.shadow.max_in_flight == 2
    j = tmp_path / "plan.json"
    j.write_text(json.dumps(q.to_dict()))
    assert load_plan(j) == q and load_plan(j).digest == q.digest != p.digest


@pytest.mark.parametrize("doc, needle", [
    ({}, "candidate: must be a profile name"),
    ({"candidate": "baseline"}, "candidate: must differ from baseline"),
    ({"candidate": "x", "stepz": [1]}, "unknown key(s) ['stepz']"),
    ({"candidate": "x", "steps": [5, 5, 100]}, "steps[1].percent: must be above the previous"),
    ({"candidate": "x", "steps": [5, 50]}, "steps[1].percent: the last step must be 100"),
    ({"candidate": "x", "steps": [0, 100]}, "steps[0].percent: must be > 0"),
    ({"candidate": "x", "steps": [{"percent": 100, "min_requests": 0}]}, "steps[0].min_requests: must be >= 1"),
    ({"candidate": "x", "steps": [{"pct": 100}]}, "steps[0]: unknown key(s) ['pct']"),
    ({"candidate": "x", "gates": {"p99": 1}}, "gates: unknown key(s) ['p99']"),
    ({"candidate": "x", "gates": {"p95_e2e_ratio": "fast"}}, "gates.p95_e2e_ratio: must be a finite number"),
    ({"candidate": "x", "window_s": 10, "interval_s": 20}, "interval_s: must be <= window_s"),
    ({"candidate": "x", "shadow": {"sample": 2}}, "shadow.sample: must be a fraction"),
    ({"candidate": "x", "min_requests": 1.5}, "min_requests: must be a whole number"),
    ([1, 2], "plan: must be an object"),
])
def test_plan_errors_name_the_key(doc, needle):
    with pytest.raises(ConfigError) as e:
        plan_from_dict(doc)
    assert needle in str(e.value)


def test_plan_text_errors(tmp_path):
    with pytest.raises(ConfigError, match="not valid JSON or YAML"):
        parse_plan_text("candidate: [unclosed")
    with pytest.raises(ConfigError, match="cannot read plan file"):
        load_plan(tmp_path / "missing.yaml")


def _side(e2e=(), ttft=(), tpot=(), requests=None, errors=0, drafts=0, accepted=0):
    return SideStats(requests=len(e2e) + errors if requests is None else requests, errors=errors,
                     e2e_s=tuple(e2e), ttft_s=tuple(ttft), tpot_s=tuple(tpot), num_drafts=drafts,
                     num_accepted_tokens=accepted)


GATES = {"p95_e2e_ratio": 1.2, "p95_ttft_ratio": 1.5, "median_tpot_ratio": 1.1, "error_rate_diff": 0.01,
         "min_mean_acceptance_length": 1.5}


def test_gates_pass_and_each_fail():
    base = _side(e2e=[1.0] * 100, ttft=[0.1] * 100, tpot=[0.05] * 100)
    good = _side(e2e=[0.8] * 100, ttft=[0.1] * 100, tpot=[0.03] * 100, drafts=10, accepted=15)
    res = {r.name: r for r in evaluate_gates(GATES, good, base)}
    assert all(r.verdict == "pass" for r in res.values()) and set(res) == set(GATES)
    assert res["p95_e2e_ratio"].value == pytest.approx(0.8) and res["min_mean_acceptance_length"].value == 2.5
    cases = {
        "p95_e2e_ratio": _side(e2e=[0.8] * 90 + [2.0] * 10, ttft=[0.1] * 100, tpot=[0.03] * 100, drafts=1, accepted=1),
        "p95_ttft_ratio": _side(e2e=[0.8] * 100, ttft=[0.2] * 100, tpot=[0.03] * 100, drafts=1, accepted=1),
        "median_tpot_ratio": _side(e2e=[0.8] * 100, ttft=[0.1] * 100, tpot=[0.06] * 100, drafts=1, accepted=1),
        "error_rate_diff": _side(e2e=[0.8] * 98, ttft=[0.1] * 98, tpot=[0.03] * 98, errors=2, drafts=1, accepted=1),
        "min_mean_acceptance_length": _side(e2e=[0.8] * 100, ttft=[0.1] * 100, tpot=[0.03] * 100, drafts=10,
                                            accepted=4),
    }
    for gate, cand in cases.items():
        res = evaluate_gates(GATES, cand, base)
        assert [r.name for r in res if r.verdict == "fail"] == [gate], gate
        d = decide(res, cand, base, min_requests=50, dwell_s=1e9, min_dwell_s=0)
        assert d.action == "revert" and f"gate {gate} failed" in d.reason


def test_gates_no_data_off_and_percentile():
    base = _side(e2e=[1.0] * 10)
    cand = _side(e2e=[1.0] * 10)
    res = {r.name: r for r in evaluate_gates(GATES, cand, base)}
    assert res["p95_ttft_ratio"].verdict == "no_data" and res["min_mean_acceptance_length"].verdict == "no_data"
    d = decide(list(res.values()), cand, base, min_requests=5, dwell_s=10, min_dwell_s=0)
    assert d.action == "wait" and "p95_ttft_ratio" in d.reason  # no data holds promotion back, never fails
    assert evaluate_gates({k: None for k in GATES}, cand, base) == []
    assert percentile([], 50) is None and percentile([1, 2, 3, 4], 50) == 2.5
    zero = _side(e2e=[0.0] * 5)
    assert evaluate_gates({"p95_e2e_ratio": 1.2}, zero, zero)[0].verdict == "pass"
    assert evaluate_gates({"p95_e2e_ratio": 1.2}, cand, zero)[0].verdict == "fail"


def test_decide_minimum_counts_dwell_and_shadow():
    base = _side(e2e=[1.0] * 20)
    cand = _side(e2e=[5.0] * 3)
    res = evaluate_gates({"p95_e2e_ratio": 1.2}, cand, base)
    d = decide(res, cand, base, min_requests=5, dwell_s=100, min_dwell_s=0)
    assert d.action == "wait" and "candidate 3, baseline 20" in d.reason  # too few to judge, even a failing gate
    ok = _side(e2e=[1.0] * 20)
    res = evaluate_gates({"p95_e2e_ratio": 1.2}, ok, base)
    assert decide(res, ok, base, min_requests=5, dwell_s=10, min_dwell_s=60).action == "wait"
    assert decide(res, ok, base, min_requests=5, dwell_s=60, min_dwell_s=60).action == "promote"
    res = evaluate_gates({}, cand, base, ShadowStats(replays=4, mismatches=1, first_mismatch="req 7: 'a' != 'b'"))
    d = decide(res, cand, base, min_requests=50, dwell_s=0, min_dwell_s=60)
    assert d.action == "revert" and "req 7" in d.reason  # a mismatch is definite: no minimum applies


def test_window_counts_and_record_feed():
    now = [100.0]
    w = OutcomeWindow(horizon_s=50, clock=lambda: now[0])
    w.add(Outcome(10, "a", "ok", 200, 1.0, 0.1, 11, 4, 6))  # pruned later (older than the horizon)
    w.add(Outcome(90, "a", "ok", 200, 1.0, 0.1, 11, 4, 6))
    w.add(Outcome(91, "a", "error", 503))
    w.add(Outcome(92, "a", "error", 400))  # the client's error: not counted
    w.add(Outcome(93, "a", "cancelled", 499))
    w.add(Outcome(94, "b", "ok", 200, 2.0, None, 5))
    w.add_acceptance("a", 10, 10, t=95)
    s = w.side("a", 0, 100)
    assert (s.requests, s.errors, s.e2e_s, s.ttft_s) == (2, 1, (1.0,), (0.1,))
    assert s.tpot_s == (pytest.approx(0.09),) and s.num_drafts == 14 and s.mean_acceptance_length == 1 + 16 / 14
    assert w.side("b", 0, 100).tpot_s == () and w.side("a", 91, 92).requests == 1
    rec = {"profile": "a", "profile_reason": "weighted", "status": "ok", "http_status": 200, "e2e_s": 0.5,
           "ttft_s": 0.1, "completion_tokens": 3, "num_drafts": 1, "num_accepted_tokens": 1}
    w.add_record(rec)
    w.add_record({**rec, "profile_reason": "shadow"})
    w.add_record({**rec, "profile": None})
    assert w.side("a", 100, 100).requests == 1
    assert outcome_from_record(rec, 5.0).tpot_s == pytest.approx(0.2)


def test_window_keeps_outcomes_out_of_the_garbage_collector():
    """A busy window holds tens of thousands of outcomes; kept as plain tuples of numbers and strings, the
    collector stops tracking them after one pass (objects would lengthen every full collection)."""
    import gc

    w = OutcomeWindow(horizon_s=600, clock=lambda: 100.0)
    for i in range(100):
        w.add(Outcome(float(i), "a", "ok", 200, 0.01, None, 16))
    gc.collect()
    assert not any(gc.is_tracked(row) for row in w._outcomes)
    assert w.side("a", 0, 100).requests == 100
