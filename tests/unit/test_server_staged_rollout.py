"""Staged rollouts inside the server (the model-free fake engine over HTTP): the admin API, automatic promotion and
revert on a failing candidate, the shadow check, request log and gauges, and resume after a restart."""

import json
import time

import httpx
import pytest

from specserve.rollout.profiles import profile_set_from_dict
from specserve.server.api import ServerSettings, create_app
from specserve.server.launcher import ServerThread
from specserve.server.async_engine import AsyncEngine
from tests.helpers.fake_engine import fake_client, fake_engine

PROFILES = {"profiles": {"baseline": None, "ngram_4": {"method": "ngram", "num_speculative_tokens": 4}},
            "weights": {"baseline": 1}}
TOKEN = "t0k"
AUTH = {"authorization": f"Bearer {TOKEN}"}
FAST = {"candidate": "ngram_4", "steps": [50, 100], "min_dwell_s": 0, "min_requests": 6, "window_s": 5,
        "interval_s": 0.2, "gates": {"p95_e2e_ratio": 50, "p95_ttft_ratio": 50, "median_tpot_ratio": 50,
                                     "error_rate_diff": 0.05}}


class FailingSpecClient(AsyncEngine):
    """The candidate fails on purpose: every speculative request is an engine error (HTTP 500)."""

    async def submit(self, request_id, prompt, params, spec_config, arrival_time=None, **kw):
        if spec_config is not None:
            raise RuntimeError("injected candidate failure")
        return await super().submit(request_id, prompt, params, spec_config, arrival_time, **kw)


class LossySpecClient(AsyncEngine):
    """A broken candidate whose greedy output differs (one token short): what the shadow check catches."""

    async def submit(self, request_id, prompt, params, spec_config, arrival_time=None, **kw):
        if spec_config is not None:
            params = [p.clone(max_tokens=p.max_tokens - 1) for p in params]
        return await super().submit(request_id, prompt, params, spec_config, arrival_time, **kw)


def _start(tmp_path, engine=None, state="state.json"):
    app = create_app(engine or fake_client(), profile_set_from_dict(PROFILES),
                     ServerSettings(admin_token=TOKEN, request_log=str(tmp_path / "req.jsonl"), policy_seed=0,
                                    rollout_state=str(tmp_path / state)))
    return ServerThread(app).start()


HTTP = httpx.Client(timeout=30)


def _send(url, n, **kw):
    """n greedy requests, every other one streamed (the shadow check captures both kinds)."""
    out = []
    for i in range(n):
        body = {"prompt": f"p{i % 5}", "max_tokens": 8, "temperature": 0, "stream": i % 2 == 1, **kw}
        out.append(HTTP.post(url + "/v1/completions", json=body))
    return out


def _wait_state(url, states, timeout_s=15, traffic=True):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = HTTP.get(url + "/admin/rollout", headers=AUTH).json()
        if st["state"] in states:
            return st
        if traffic:
            _send(url, 4)
        else:
            time.sleep(0.05)
    raise AssertionError(f"rollout stayed {st['state']}: {st.get('last_evaluation')}")


def test_rollout_admin_api_promotes_logs_and_resumes(tmp_path):
    srv = _start(tmp_path)
    try:
        u = srv.base_url
        assert HTTP.get(u + "/admin/rollout").status_code == 401
        assert HTTP.get(u + "/admin/rollout", headers=AUTH).json()["state"] == "idle"
        r = HTTP.post(u + "/admin/rollout", headers=AUTH, json={"candidate": "ngram_4", "steps": [5, 50]})
        assert r.status_code == 400 and "steps[1].percent: the last step must be 100" in r.json()["error"]["message"]
        r = HTTP.post(u + "/admin/rollout", headers=AUTH, json={"candidate": "nope"})
        assert r.status_code == 400 and "candidate: unknown profile 'nope'" in r.json()["error"]["message"]
        for action in ("pause", "resume", "promote"):
            assert HTTP.post(u + f"/admin/rollout/{action}", headers=AUTH).status_code == 409
        assert HTTP.post(u + "/admin/rollout/bogus", headers=AUTH).status_code == 404
        slow = {**FAST, "min_dwell_s": 3600, "steps": [10, 50, 100]}
        st = HTTP.post(u + "/admin/rollout", headers=AUTH, json={"plan": slow}).json()
        assert st["state"] == "running" and st["weights"] == {"baseline": 90.0, "ngram_4": 10.0}
        assert HTTP.post(u + "/admin/rollout", headers=AUTH, json=slow).status_code == 409
        r = HTTP.put(u + "/admin/weights", headers=AUTH, json={"weights": {"baseline": 1}})
        assert r.status_code == 409 and r.json()["error"]["code"] == "rollout_conflict"
        _send(u, 12)
        lines = [json.loads(x) for x in (tmp_path / "req.jsonl").read_text().splitlines()]
        assert {x["rollout_step"] for x in lines} == {"ngram_4@10%"}
        assert HTTP.post(u + "/admin/rollout/pause", headers=AUTH).json()["state"] == "paused"
        assert HTTP.post(u + "/admin/rollout/promote", headers=AUTH).json()["percent"] == 50
        metrics = HTTP.get(u + "/metrics").text
        assert 'specserve:rollout_state{state="paused"} 1.0' in metrics and "specserve:rollout_step 1.0" in metrics
        assert 'specserve:rollout_weight{profile="ngram_4"} 0.5' in metrics
    finally:
        srv.stop()
    # restart over the same state file: same step, still paused, same split
    srv = _start(tmp_path)
    try:
        u = srv.base_url
        st = HTTP.get(u + "/admin/rollout", headers=AUTH).json()
        assert (st["state"], st["step"], st["percent"]) == ("paused", 1, 50)
        assert st["history"][-1]["event"] == "restart" and st["weights"]["ngram_4"] == 50
        assert HTTP.post(u + "/admin/rollout/resume", headers=AUTH).json()["state"] == "running"
        st = HTTP.post(u + "/admin/rollback", headers=AUTH).json()
        assert st["rolled_back"]
        st = HTTP.get(u + "/admin/rollout", headers=AUTH).json()
        assert st["state"] == "reverted" and "POST /admin/rollback" in st["reason"]
        assert {r.headers["x-specserve-profile"] for r in _send(u, 5)} == {"baseline"}
    finally:
        srv.stop()


def test_healthy_candidate_completes_and_failing_candidate_reverts(tmp_path):
    srv = _start(tmp_path)
    try:
        HTTP.post(srv.base_url + "/admin/rollout", headers=AUTH, json=FAST).raise_for_status()
        st = _wait_state(srv.base_url, ("completed", "reverted"))
        assert st["state"] == "completed", st["history"]
        assert [e["event"] for e in st["history"]] == ["start", "complete"]
        assert {r.headers["x-specserve-profile"] for r in _send(srv.base_url, 4)} == {"ngram_4"}
    finally:
        srv.stop()
    srv = _start(tmp_path, FailingSpecClient(fake_engine()), state="failing.json")
    try:
        HTTP.post(srv.base_url + "/admin/rollout", headers=AUTH, json=FAST).raise_for_status()
        st = _wait_state(srv.base_url, ("completed", "reverted"))
        assert st["state"] == "reverted" and "gate error_rate_diff failed" in st["reason"]
        assert st["history"][-1]["by"] == "controller"
    finally:
        srv.stop()


@pytest.mark.parametrize("client, expect", [(AsyncEngine, "completed"), (LossySpecClient, "reverted")])
def test_shadow_check_in_the_server(tmp_path, client, expect):
    srv = _start(tmp_path, client(fake_engine()))
    try:
        plan = {**FAST, "steps": [10, 100], "min_requests": 1, "shadow": {"sample": 1.0, "max_in_flight": 4},
                "gates": {"p95_e2e_ratio": None, "p95_ttft_ratio": None, "median_tpot_ratio": None}}
        HTTP.post(srv.base_url + "/admin/rollout", headers=AUTH, json=plan).raise_for_status()
        st = _wait_state(srv.base_url, ("completed", "reverted"))
        assert st["state"] == expect, st["history"]
        shadow = [g for g in st["last_evaluation"]["gates"] if g["name"] == "shadow"][0]
        if expect == "reverted":
            assert "gate shadow failed" in st["reason"] and "differs at character" in st["reason"]
        else:
            assert shadow["verdict"] == "pass" and "identical" in shadow["detail"]
        lines = [json.loads(x) for x in (tmp_path / "req.jsonl").read_text().splitlines()]
        replays = [x for x in lines if x["profile_reason"] == "shadow"]
        assert replays and all(x["profile"] == "ngram_4" for x in replays)
    finally:
        srv.stop()
