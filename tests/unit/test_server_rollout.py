"""Profiles over HTTP (the model-free fake engine): admin API auth, weights, sticky users, rollback, overrides,
/metrics parity with the per-response numbers, and the request log."""

import json
import math
import threading

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specserve.rollout.profiles import profile_set_from_dict
from specserve.server.api import ServerSettings, create_app
from specserve.server.launcher import ServerThread
from tests.helpers.fake_engine import ToyLM, fake_client
from tests.helpers.waiting import wait_until

PROFILES = {"profiles": {"baseline": None, "ngram_4": {"method": "ngram", "num_speculative_tokens": 4},
                         "draftish": {"method": "suffix", "num_speculative_tokens": 2}},
            "weights": {"baseline": 0.5, "ngram_4": 0.5}}
TOKEN = "s3cret"
AUTH = {"authorization": f"Bearer {TOKEN}"}


def _start(tmp_path, engine=None, **settings):
    settings.setdefault("admin_token", TOKEN)
    app = create_app(engine or fake_client(), profile_set_from_dict(PROFILES),
                     ServerSettings(request_log=str(tmp_path / "req.jsonl"), policy_seed=0, **settings))
    return ServerThread(app).start()


def _client(srv):
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0, timeout=30)


def _profile(c, **kw):
    r = c.completions.with_raw_response.create(model="fake-model", prompt="p", max_tokens=2, temperature=0, **kw)
    body = r.parse()
    assert body.model_extra["specserve"]["profile"] == r.headers["x-specserve-profile"]
    return r.headers["x-specserve-profile"]


def test_admin_auth_weights_rollback(tmp_path):
    lm = ToyLM()
    srv = _start(tmp_path, fake_client(lm=lm))
    try:
        u = srv.base_url
        assert httpx.get(u + "/admin/profiles").status_code == 401
        assert httpx.get(u + "/admin/profiles", headers={"authorization": "Bearer nope"}).status_code == 401
        assert httpx.post(u + "/admin/rollback", headers={"authorization": TOKEN}).status_code == 401
        assert httpx.put(u + "/admin/weights", json={"weights": {"baseline": 1}}).status_code == 401
        st = httpx.get(u + "/admin/profiles", headers=AUTH).json()
        assert st["weights"] == {"baseline": 0.5, "ngram_4": 0.5, "draftish": 0.0} and not st["rolled_back"]
        assert st["profiles"]["ngram_4"]["method"] == "ngram"
        for bad in ({"weights": {"zzz": 1}}, {"weights": {"baseline": -1}}, {"w": 1}):
            r = httpx.put(u + "/admin/weights", json=bad, headers=AUTH)
            assert r.status_code == 400 and r.json()["error"]["param"] == "weights"
        c = _client(srv)
        r = httpx.put(u + "/admin/weights", json={"weights": {"draftish": 1}}, headers=AUTH)
        assert r.status_code == 200 and r.json()["weights"]["draftish"] == 1.0
        assert {_profile(c) for _ in range(5)} == {"draftish"}
        # a long request started before the rollback keeps its profile
        box = {}

        def long_request():
            box["r"] = c.completions.create(model="fake-model", prompt="long", max_tokens=120, temperature=0)

        lm.step_delay_s = 0.01
        t = threading.Thread(target=long_request)
        t.start()
        assert wait_until(lambda: srv.server.config.app.state.specserve.engine.in_flight > 0)
        assert httpx.post(u + "/admin/rollback", headers=AUTH).json()["rolled_back"]
        assert _profile(c) == "baseline"  # the very next request
        t.join(30)
        assert box["r"].model_extra["specserve"]["profile"] == "draftish"
        assert {_profile(c, user=f"u{i}") for i in range(10)} == {"baseline"}
        httpx.put(u + "/admin/weights", json={"weights": {"ngram_4": 1}}, headers=AUTH)
        assert _profile(c) == "ngram_4"
    finally:
        srv.stop()


def test_admin_disabled_and_override_forbidden(tmp_path):
    srv = _start(tmp_path, admin_token=None)
    try:
        assert httpx.get(srv.base_url + "/admin/profiles", headers=AUTH).status_code == 403
        c = _client(srv)
        with pytest.raises(openai.PermissionDeniedError):
            c.completions.create(model="fake-model", prompt="p", max_tokens=2, extra_body={"profile": "ngram_4"})
        r = httpx.post(srv.base_url + "/v1/completions", json={"prompt": "p", "max_tokens": 2},
                       headers={"x-specserve-profile": "ngram_4"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "profile_override_forbidden"
        assert c.completions.create(model="fake-model", prompt="p", max_tokens=2).usage.completion_tokens == 2
    finally:
        srv.stop()


def test_weights_and_sticky_over_http(tmp_path):
    srv = _start(tmp_path)
    try:
        c = _client(srv)
        n = 120
        names = [_profile(c) for _ in range(n)]
        k = names.count("ngram_4")
        assert abs(k - n / 2) < 4.5 * math.sqrt(n / 4) and set(names) == {"baseline", "ngram_4"}
        for user in ("alice", "bob", "carol", "dave"):
            assert len({_profile(c, user=user) for _ in range(6)}) == 1
        for sess in ("s1", "s2", "s3"):
            assert len({_profile(c, extra_headers={"x-session-id": sess}) for _ in range(6)}) == 1
    finally:
        srv.stop()


def _samples(text):
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_agree_with_responses_and_request_log(tmp_path):
    srv = _start(tmp_path, allow_profile_override=True)
    try:
        c = _client(srv)
        sums = {}
        for i, p in enumerate(["ngram_4", "ngram_4", "draftish", "baseline", "ngram_4"]):
            if i % 2:
                blocks = [ch.model_extra.get("specserve") for ch in c.completions.create(
                    model="fake-model", prompt=f"m{i}", max_tokens=17 + i, temperature=0, stream=True,
                    stream_options={"include_usage": True}, extra_body={"profile": p})]
                spec = [b for b in blocks if b][-1]
            else:
                spec = c.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": f"m{i}"}],
                                                 max_tokens=15 + i, temperature=0, n=2, seed=1,
                                                 extra_body={"profile": p}).model_extra["specserve"]
            s = sums.setdefault(p, {"d": 0, "dt": 0, "a": 0, "pos": {}})
            s["d"] += spec["num_drafts"]
            s["dt"] += spec["num_draft_tokens"]
            s["a"] += spec["num_accepted_tokens"]
            for j, v in enumerate(spec["num_accepted_tokens_per_pos"]):
                s["pos"][j] = s["pos"].get(j, 0) + v
        httpx.post(srv.base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 0})
        m = _samples(httpx.get(srv.base_url + "/metrics").text)
        for p, s in sums.items():
            lab = (("profile", p),)
            assert m[("specserve:spec_decode_num_drafts_total", lab)] == s["d"]
            assert m[("specserve:spec_decode_num_draft_tokens_total", lab)] == s["dt"]
            assert m[("specserve:spec_decode_num_accepted_tokens_total", lab)] == s["a"]
            for j, v in s["pos"].items():
                assert m[("specserve:spec_decode_num_accepted_tokens_per_pos_total",
                          (("position", str(j)), ("profile", p)))] == v
        assert sums["ngram_4"]["a"] > 0
        assert m[("specserve:requests_total", (("code", "200"), ("profile", "ngram_4"), ("status", "ok")))] == 3
        assert m[("specserve:requests_total", (("code", "400"), ("profile", "none"), ("status", "error")))] == 1
        assert m[("specserve:time_to_first_token_seconds_count", (("profile", "ngram_4"),))] == 3
    finally:
        srv.stop()
    recs = [json.loads(x) for x in (tmp_path / "req.jsonl").read_text().splitlines()]
    assert len(recs) == 6
    ok = [r for r in recs if r["status"] == "ok"]
    assert len(ok) == 5 and recs[-1]["status"] == "error" and recs[-1]["http_status"] == 400
    r0 = ok[0]
    assert r0["profile"] == "ngram_4" and r0["method"] == "ngram" and r0["k"] == 4 and r0["n"] == 2
    assert r0["model"] == "fake-model" and r0["model_checksum"] == "fake-checksum"
    assert r0["completion_tokens"] == 30 and r0["prompt_tokens"] > 0 and r0["ttft_s"] <= r0["e2e_s"]
    assert r0["finish_reason"] == "length,length" and r0["num_drafts"] > 0
    assert all("prompt" not in r for r in recs)


def test_admin_adds_a_profile_at_run_time(tmp_path, monkeypatch):
    """POST /admin/profiles validates, prepares the config on the engine thread (an adaptive one measures
    the step cost), and the profile serves (by override at weight 0, by weight when given), no restart."""
    from specserve.config import ConfigError

    monkeypatch.setenv("SPECSERVE_HOME", str(tmp_path))  # where the toy model's step cost is cached
    client = fake_client()
    srv = _start(tmp_path, engine=client, allow_profile_override=True)
    try:
        u = srv.base_url
        new = {"method": "ngram", "num_speculative_tokens": 8, "num_speculative_tokens_schedule": "adaptive"}
        assert httpx.post(u + "/admin/profiles", json={"name": "x", "config": new}).status_code == 401
        bad = [({"name": "ad", "config": {"method": "ngram", "bogus": 1}}, "config"),
               ({"name": "ad", "config": {"method": "eagle"}}, "config"),
               ({"name": "bad name!", "config": new}, "name"),
               ({"name": "ad", "config": new, "weight": -1}, "weight"),
               ({"name": "ad", "config": new, "weight": True}, "weight"),
               ({"name": "ad", "config": new, "extra": 1}, "extra"),
               ({"config": new}, "name")]
        for body, param in bad:
            r = httpx.post(u + "/admin/profiles", json=body, headers=AUTH)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
        assert httpx.post(u + "/admin/profiles", content=b"{", headers=AUTH).status_code == 400
        r = httpx.post(u + "/admin/profiles", json={"name": "ngram_4", "config": new}, headers=AUTH)
        assert r.status_code == 409 and r.json()["error"]["code"] == "profile_exists"
        assert client.engine.adaptive is None
        r = httpx.post(u + "/admin/profiles", json={"name": "ad", "config": new}, headers=AUTH)
        assert r.status_code == 201, r.text
        st = r.json()
        assert st["profiles"]["ad"]["config"]["num_speculative_tokens_schedule"] == "adaptive"
        assert st["weights"]["ad"] == 0.0 and client.engine.adaptive is not None  # step cost measured
        c = _client(srv)
        assert _profile(c, extra_body={"profile": "ad"}) == "ad"
        assert {_profile(c) for _ in range(6)} <= {"baseline", "ngram_4"}  # weight 0: no traffic of its own
        r = httpx.post(u + "/admin/profiles", json={"name": "all_in", "config": None, "weight": 5}, headers=AUTH)
        assert r.status_code == 201 and r.json()["weights"]["all_in"] == 5.0
        assert httpx.put(u + "/admin/weights", json={"weights": {"ad": 1}}, headers=AUTH).status_code == 200
        assert {_profile(c) for _ in range(4)} == {"ad"}
        # the engine cannot prepare it (e.g. a draft model with another vocabulary): 400, nothing added

        def refuse(cfg):
            raise ConfigError("draft model does not share the target's tokenizer")

        client.engine.prepare_speculative_config = refuse
        r = httpx.post(u + "/admin/profiles", json={"name": "d", "config": {"method": "draft_model", "model": "m"}},
                       headers=AUTH)
        assert r.status_code == 400 and "tokenizer" in r.json()["error"]["message"]
        assert "d" not in httpx.get(u + "/admin/profiles", headers=AUTH).json()["profiles"]
    finally:
        srv.stop()
