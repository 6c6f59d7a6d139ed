"""The rollout controller on recorded metric windows (no model, a fake clock): promotion through every
step, revert on each gate within one window, dwell and minimum counts, pause/resume, manual actions,
and persistence across a restart."""

import json
import random

import pytest

from specserve.config import ConfigError
from specserve.rollout.controller import RolloutConflict, RolloutController
from specserve.rollout.plan import plan_from_dict
from specserve.rollout.policy import RolloutPolicy
from specserve.rollout.profiles import profile_set_from_dict
from specserve.rollout.window import Outcome, OutcomeWindow

PROFILES = {"profiles": {"baseline": None, "ngram_4": {"method": "ngram", "num_speculative_tokens": 4}},
            "weights": {"baseline": 1}}
PLAN = {"candidate": "ngram_4", "steps": [10, 25, 50, 100], "min_dwell_s": 20, "min_requests": 20,
        "window_s": 30, "interval_s": 5,
        "gates": {"p95_e2e_ratio": 1.2, "p95_ttft_ratio": 1.5, "median_tpot_ratio": 1.1, "error_rate_diff": 0.02,
                  "min_mean_acceptance_length": 1.5}}

HEALTHY = dict(e2e=0.8, ttft=0.10, tokens=41, err=0.0, acc=2.0)  # speculation: faster decode, same prefill
BASE = dict(e2e=1.0, ttft=0.10, tokens=41, err=0.0, acc=None)
BAD = {  # one broken figure each
    "p95_e2e_ratio": dict(HEALTHY, e2e=1.6, ttft=0.10, tokens=2),  # tokens=2 keeps TPOT from failing too
    "p95_ttft_ratio": dict(HEALTHY, e2e=0.85, ttft=0.30),
    "median_tpot_ratio": dict(HEALTHY, e2e=1.15),
    "error_rate_diff": dict(HEALTHY, err=0.3),
    "min_mean_acceptance_length": dict(HEALTHY, acc=1.2),
}


class Clock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


def _controller(tmp_path, clock, name="state.json"):
    policy = RolloutPolicy(profile_set_from_dict(PROFILES), seed=0)
    return RolloutController(policy, state_path=tmp_path / name, window=OutcomeWindow(clock=clock), clock=clock)


def _outcome(rng, t, profile, m):
    if rng.random() < m["err"]:
        return Outcome(t, profile, "error", 503)
    e2e = m["e2e"] * rng.uniform(0.95, 1.05)
    drafts = 10 if m["acc"] else 0
    return Outcome(t, profile, "ok", 200, e2e, m["ttft"] * rng.uniform(0.95, 1.05), m["tokens"], drafts,
                   round(drafts * (m["acc"] - 1)) if m["acc"] else 0)


def simulate(ctrl, clock, seconds, cand, rate=20, seed=0, base=BASE):
    """`rate` requests per second routed by the controller's policy, each recorded with the profile's
    figures; the controller evaluates when due. Returns the decisions (time, action)."""
    rng = random.Random(seed)
    decisions = []
    for _ in range(int(seconds)):
        clock.t += 1
        for _ in range(rate):
            p = ctrl.policy.choose().profile.name
            ctrl.window.add(_outcome(rng, clock.t, p, cand if p == ctrl.plan.candidate else base))
        if ctrl.state == "running" and clock.t >= ctrl.next_evaluation_at:
            d = ctrl.tick()
            decisions.append((clock.t, d.action))
    return decisions


def test_healthy_candidate_reaches_100_through_every_step(tmp_path):
    clock = Clock()
    ctrl = _controller(tmp_path, clock)
    ctrl.start(plan_from_dict(PLAN))
    assert ctrl.policy.weights == {"baseline": 90.0, "ngram_4": 10.0} and ctrl.step_label() == "ngram_4@10%"
    simulate(ctrl, clock, 200, HEALTHY)
    st = ctrl.status()
    assert st["state"] == "completed" and ctrl.policy.weights == {"baseline": 0.0, "ngram_4": 100.0}
    events = [(e["event"], e["percent"]) for e in st["history"]]
    assert events == [("start", 10), ("promote", 25), ("promote", 50), ("complete", 100)]
    assert all("all gates pass" in e["reason"] for e in st["history"][1:])
    starts = [e["time"] for e in st["history"]]
    assert all(b - a >= 20 for a, b in zip(starts, starts[1:]))  # each step served its dwell
    assert ctrl.step_label() is None and ctrl.policy.choose().step is None


@pytest.mark.parametrize("gate", list(BAD))
def test_each_gate_reverts_within_one_window(tmp_path, gate):
    clock = Clock()
    ctrl = _controller(tmp_path, clock)
    ctrl.start(plan_from_dict({**PLAN, "steps": [25, 100], "min_dwell_s": 100}))
    simulate(ctrl, clock, 10, HEALTHY)  # healthy for 10 s, then one figure goes bad
    assert ctrl.state == "running"
    bad_from = clock.t
    decisions = simulate(ctrl, clock, 60, BAD[gate], seed=1)
    st = ctrl.status()
    assert st["state"] == "reverted", decisions
    revert = st["history"][-1]
    assert revert["event"] == "revert" and revert["by"] == "controller"
    assert revert["time"] - bad_from <= PLAN["window_s"]
    assert f"gate {gate} failed" in revert["reason"] and "window " in revert["reason"] and "at 25%" in revert["reason"]
    assert ctrl.policy.state()["rolled_back"] and {ctrl.policy.choose().profile.name for _ in range(20)} == {"baseline"}
    assert st["last_evaluation"]["action"] == "revert"
    assert ctrl.tick() is None  # a reverted rollout is never evaluated again


def test_dwell_and_minimum_counts_hold_promotion(tmp_path):
    clock = Clock()
    ctrl = _controller(tmp_path, clock)
    ctrl.start(plan_from_dict({**PLAN, "min_requests": 50, "min_dwell_s": 10}))
    simulate(ctrl, clock, 15, HEALTHY, rate=20)  # 10% of 300 = ~30 candidate requests < 50
    ev = ctrl.last_evaluation
    assert ctrl.status()["step"] == 0 and ev["action"] == "wait" and "waiting for 50 answered" in ev["reason"]
    while ctrl.status()["step"] == 0:
        simulate(ctrl, clock, 1, HEALTHY, rate=20)
        assert clock.t < 1100
    promoted = ctrl.history[-1]
    assert promoted["event"] == "promote" and ctrl.last_evaluation["candidate"]["requests"] >= 50
    ctrl2 = _controller(tmp_path, clock, "other.json")
    ctrl2.start(plan_from_dict({**PLAN, "min_requests": 5, "min_dwell_s": 100, "window_s": 200}))
    simulate(ctrl2, clock, 60, HEALTHY)
    assert ctrl2.status()["step"] == 0 and "dwell" in ctrl2.last_evaluation["reason"]
    simulate(ctrl2, clock, 45, HEALTHY)
    assert ctrl2.status()["step"] == 1


def test_pause_resume_manual_promote_revert_and_conflicts(tmp_path):
    clock = Clock()
    ctrl = _controller(tmp_path, clock)
    with pytest.raises(RolloutConflict, match="no rollout is running"):
        ctrl.pause()
    with pytest.raises(ConfigError, match="candidate: unknown profile 'nope'"):
        ctrl.start(plan_from_dict({"candidate": "nope"}))
    ctrl.start(plan_from_dict(PLAN))
    with pytest.raises(RolloutConflict, match="is running"):
        ctrl.start(plan_from_dict(PLAN))
    with pytest.raises(RolloutConflict, match="owns the weights"):
        ctrl.set_weights({"baseline": 1})
    ctrl.pause()
    simulate(ctrl, clock, 100, BAD["error_rate_diff"])  # paused: no automatic decision, traffic keeps its split
    assert ctrl.state == "paused" and ctrl.tick() is None and ctrl.policy.weights["ngram_4"] == 10
    assert ctrl.status()["dwell_s"] == 0
    ctrl.resume()
    clock.t += 7
    assert ctrl.status()["dwell_s"] == 7  # the paused 100 s do not count as dwell
    ctrl.promote()
    assert ctrl.status()["percent"] == 25 and ctrl.history[-1]["by"] == "admin"
    ctrl.revert("operator saw a bad dashboard")
    assert ctrl.state == "reverted" and ctrl.history[-1]["reason"] == "operator saw a bad dashboard"
    ctrl.set_weights({"baseline": 3, "ngram_4": 1})  # after the rollout: allowed
    assert ctrl.policy.weights == {"baseline": 3.0, "ngram_4": 1.0}
    ctrl.start(plan_from_dict({**PLAN, "steps": [50, 100]}))
    ctrl.promote()
    assert ctrl.state == "completed" and ctrl.history[-1]["event"] == "complete"


def test_availability_reverts_at_once(tmp_path):
    clock = Clock()
    ctrl = _controller(tmp_path, clock)
    ctrl.availability = lambda profile: False
    ctrl.start(plan_from_dict(PLAN))
    clock.t += 5
    assert ctrl.tick().action == "revert"
    assert "no healthy backend serves the candidate 'ngram_4'" in ctrl.history[-1]["reason"]


def test_restart_resumes_same_step_without_flapping(tmp_path):
    clock = Clock()
    ctrl = _controller(tmp_path, clock)
    ctrl.start(plan_from_dict(PLAN))
    simulate(ctrl, clock, 30, HEALTHY)
    assert ctrl.status()["percent"] == 25
    step_started = ctrl.status()["step_started_at"]
    doc = json.loads((tmp_path / "state.json").read_text())
    assert doc["rollout"]["step"] == 1 and doc["traffic"]["weights"]["ngram_4"] == 25
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]  # the temp file was renamed away
    clock.t += 3
    # "restart": a new policy (profile-file weights: all baseline) and controller over the same file
    again = _controller(tmp_path, clock)
    st = again.status()
    assert st["state"] == "running" and st["percent"] == 25 and st["step_started_at"] == step_started
    assert again.policy.weights == {"baseline": 75.0, "ngram_4": 25.0} and again.step_label() == "ngram_4@25%"
    assert again.history[-1]["event"] == "restart"
    clock.t += 5
    d = again.tick()  # empty window after the restart: wait, never revert or promote on no data
    assert d.action == "wait" and "candidate 0, baseline 0" in d.reason and again.status()["step"] == 1
    simulate(again, clock, 200, HEALTHY)
    assert again.state == "completed"
    # a reverted rollout stays reverted across a restart
    again.start(plan_from_dict(PLAN))
    again.revert("test")
    third = _controller(tmp_path, clock)
    assert third.state == "reverted" and third.policy.state()["rolled_back"]
    assert third.policy.choose().profile.name == "baseline"


def test_restart_with_bad_state_file(tmp_path):
    clock = Clock()
    (tmp_path / "state.json").write_text("{not json")
    with pytest.raises(ConfigError, match="unreadable"):
        _controller(tmp_path, clock)
    ctrl = _controller(tmp_path, clock, "ok.json")
    ctrl.start(plan_from_dict(PLAN))
    policy = RolloutPolicy(profile_set_from_dict({"profiles": {"baseline": None}}))
    with pytest.raises(ConfigError, match="candidate: unknown profile 'ngram_4'"):
        RolloutController(policy, state_path=tmp_path / "ok.json", clock=clock)
