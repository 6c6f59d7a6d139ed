"""Staged rollouts on the gateway over stub backends, computed from what the gateway measures: a
healthy candidate reaches 100%, a slow / failing / ejected / lossy one is reverted within one window,
a restart resumes the same step, and the `specserve rollout` commands work against the gateway."""

import json
import time
from collections import Counter

import httpx
import pytest

from specserve.cli import main
from tests.helpers.gateway_fleet import AUTH, TOKEN, Traffic, fleet, wait_for

HTTP = httpx.Client(timeout=20)
GATES = {"p95_e2e_ratio": 3.0, "p95_ttft_ratio": None, "median_tpot_ratio": None, "error_rate_diff": 0.05}
PLAN = {"candidate": "ngram", "steps": [25, 50, 100], "min_dwell_s": 0, "min_requests": 5, "window_s": 3,
        "interval_s": 0.2, "gates": GATES}
# Every stub answers after 20 ms: with answers in ~1 ms, one scheduling hiccup of a loaded machine made a
# healthy candidate's p95 E2E 3x the baseline's and tripped the latency gate (or tripped it before the
# gate a fault test expects); a 20 ms floor keeps such noise well under the 3.0 ratio.
BASE_DELAY_S = 0.02


def _rollout(gw):
    return HTTP.get(gw.base_url + "/admin/rollout", headers=AUTH).json()


def _finish(gw, timeout_s=20):
    return wait_for(lambda: (st := _rollout(gw))["state"] in ("completed", "reverted") and st, timeout_s=timeout_s)


def test_healthy_candidate_reaches_100_percent(tmp_path):
    config = {"weights": {"baseline": 1}, "request_log": str(tmp_path / "gw.jsonl"),
              "rollout": {"state_file": str(tmp_path / "state.json")}}
    plan = {**PLAN, "gates": {**GATES, "min_mean_acceptance_length": 2.0}}
    with fleet({"b1": "baseline", "n1": "ngram"}, config, acceptance=(10, 20), delay_s=BASE_DELAY_S) as (gw, states, _), \
            Traffic(gw.base_url):
        r = HTTP.post(gw.base_url + "/admin/rollout", headers=AUTH, json=plan)
        assert r.status_code == 200 and r.json()["weights"] == {"baseline": 75.0, "ngram": 25.0}
        st = _finish(gw)
        assert st["state"] == "completed", st["history"]
        assert [e["event"] for e in st["history"]] == ["start", "promote", "complete"]
        gates = {g["name"]: g for g in st["last_evaluation"]["gates"]}
        assert gates["min_mean_acceptance_length"]["value"] == 3.0  # 1 + 20/10, from the responses' numbers
        m = HTTP.get(gw.base_url + "/metrics").text
        assert 'specserve:rollout_state{state="completed"} 1.0' in m
        assert 'specserve:rollout_weight{profile="ngram"} 1.0' in m
        assert 'specserve:spec_decode_num_drafts_total{profile="ngram"}' in m
    steps = {json.loads(x)["rollout_step"] for x in (tmp_path / "gw.jsonl").read_text().splitlines()}
    assert {"ngram@25%", "ngram@50%"} <= steps


@pytest.mark.parametrize("fault, gate", [
    ("slow", "gate p95_e2e_ratio failed"),
    ("failing", "gate error_rate_diff failed"),
    ("ejected", "no healthy backend serves the candidate 'ngram'"),
    ("lossy", "gate shadow failed"),
])
def test_bad_candidate_reverted_within_one_window(fault, gate):
    plan = {**PLAN, "steps": [50, 100], "min_dwell_s": 60}
    if fault == "lossy":
        plan["shadow"] = {"sample": 1.0, "max_in_flight": 4}
    with fleet({"b1": "baseline", "n1": "ngram"}, delay_s=BASE_DELAY_S) as (gw, states, _), \
            Traffic(gw.base_url) as traffic:
        n1 = states["n1"]
        if fault == "slow":
            n1.delay_s = BASE_DELAY_S + 0.1  # p95 ratio >= 6
        elif fault == "failing":
            n1.fail_status = 500
        elif fault == "lossy":
            n1.lossy = True
        HTTP.post(gw.base_url + "/admin/rollout", headers=AUTH, json=plan).raise_for_status()
        if fault == "ejected":
            time.sleep(0.5)
            n1.healthy = False
        st = _finish(gw)
        assert st["state"] == "reverted" and gate in st["reason"], st["reason"]
        # Reverted at the first step, before any promotion: the gate caught the fault in that step's window
        # (counted in events, not wall time, which a loaded machine stretches).
        events = [e["event"] for e in st["history"]]
        assert "promote" not in events and st["history"][-1]["event"] == "revert", events
        assert st["history"][-1]["step"] == 0, st["history"][-1]
        codes = Counter(traffic.codes)
        if fault in ("slow", "lossy", "ejected"):
            assert set(codes) == {200}  # no client saw an error
        time.sleep(0.3)  # a request routed to the candidate just before the revert may still be on its way
        n = len(n1.requests)
        time.sleep(0.3)
        assert len(n1.requests) - n <= (4 if fault == "lossy" else 0)  # no new traffic (at most replays ending)


def test_restart_resumes_same_step_and_config_plan_starts_once(tmp_path):
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text(json.dumps({**PLAN, "min_dwell_s": 3600}))
    config = {"rollout": {"plan": str(plan_file), "state_file": str(tmp_path / "state.json")}}
    with fleet({"b1": "baseline", "n1": "ngram"}, config) as (gw, _, _):
        st = _rollout(gw)
        assert st["state"] == "running" and st["history"][0]["by"] == "config"
        HTTP.post(gw.base_url + "/admin/rollout/promote", headers=AUTH).raise_for_status()
    with fleet({"b1": "baseline", "n1": "ngram"}, config) as (gw, _, _):
        st = _rollout(gw)
        assert (st["state"], st["percent"]) == ("running", 50) and st["history"][-1]["event"] == "restart"
        assert [e["event"] for e in st["history"]] == ["start", "promote", "restart"]  # not started again
        HTTP.post(gw.base_url + "/admin/rollback", headers=AUTH).raise_for_status()
    with fleet({"b1": "baseline", "n1": "ngram"}, config) as (gw, _, _):
        st = _rollout(gw)
        assert st["state"] == "reverted" and st["weights"] == {"baseline": 1.0, "ngram": 0.0}
        r = HTTP.post(gw.base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.headers["x-specserve-profile"] == "baseline"


def test_vllm_backend_acceptance_from_its_metrics():
    config = {"backends_extra": {"n1": {"kind": "vllm"}}, "health": {"interval_s": 0.1}}
    plan = {**PLAN, "steps": [50, 100], "gates": {**GATES, "min_mean_acceptance_length": 4.0}}
    with fleet({"b1": "baseline", "n1": "ngram"}, config, acceptance=(10, 20), vllm_counters=True) as (gw, _, _), \
            Traffic(gw.base_url):
        HTTP.post(gw.base_url + "/admin/rollout", headers=AUTH, json=plan).raise_for_status()
        st = _finish(gw)
        # the counters say 1 + 20/10 = 3.0 < 4.0: reverted on the acceptance gate, read from /metrics
        assert st["state"] == "reverted" and "gate min_mean_acceptance_length failed" in st["reason"]
        assert "candidate mean acceptance length 3.000" in st["reason"]
        m = HTTP.get(gw.base_url + "/metrics").text  # exposed under our names, so bench reads them as from a server
        key = 'specserve:spec_decode_num_draft_tokens_total{profile="ngram"}'
        assert float(next(x for x in m.splitlines() if x.startswith(key)).split()[-1]) > 0


def test_rollout_cli_against_the_gateway(tmp_path, monkeypatch, capsys):
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text("candidate: ngram\nsteps: [10, 100]\nmin_dwell_s: 3600\nmin_requests: 1\n"
                         "window_s: 30\ninterval_s: 0.2\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text("candidate: ngram\nsteps: [10, 90]\n")
    monkeypatch.delenv("SPECSERVE_ADMIN_TOKEN", raising=False)
    with fleet({"b1": "baseline", "n1": "ngram"}) as (gw, _, _):
        url = ["--url", gw.base_url]
        assert main(["rollout", "status", *url]) == 2
        assert "SPECSERVE_ADMIN_TOKEN" in capsys.readouterr().err
        monkeypatch.setenv("SPECSERVE_ADMIN_TOKEN", TOKEN)
        assert main(["rollout", "start", *url, "--plan", str(bad)]) == 2
        assert "steps[1].percent: the last step must be 100" in capsys.readouterr().err
        assert main(["rollout", "start", *url, "--plan", str(plan_file)]) == 0
        out = capsys.readouterr().out
        assert "rollout of ngram vs baseline: running, step 1/2 (10%)" in out and "baseline 90%, ngram 10%" in out
        for _ in range(6):
            HTTP.post(gw.base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "temperature": 0})
        wait_for(lambda: _rollout(gw).get("last_evaluation"))  # the controller has evaluated the gates
        assert main(["rollout", "status", *url]) == 0
        out = capsys.readouterr().out
        assert "GATE" in out and "p95_e2e_ratio" in out and "history (latest last)" in out
        assert main(["rollout", "pause", *url]) == 0 and "paused" in capsys.readouterr().out
        assert main(["rollout", "resume", *url]) == 0
        assert main(["rollout", "start", *url, "--plan", str(plan_file)]) == 2
        assert "HTTP 409" in capsys.readouterr().err
        assert main(["rollout", "promote", *url]) == 0 and "completed" in capsys.readouterr().out
        assert main(["rollout", "rollback", *url]) == 0
        assert "reverted to baseline" in capsys.readouterr().out
        assert main(["rollout", "status", *url, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["reverted_to_baseline"] is True

