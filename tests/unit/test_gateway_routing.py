"""Gateway over stub backends: the fleet file, routing by weight and sticky key, what is forwarded,
and OpenAI-shaped errors."""

import json
import math
from collections import Counter

import httpx
import pytest

from specserve.config import ConfigError
from specserve.gateway.config import fleet_from_dict, load_fleet
from tests.helpers.gateway_fleet import AUTH, fleet

URL = "http://127.0.0.1:1"


HTTP = httpx.Client(timeout=10)  # one client: a new one costs ~50 ms (it loads the CA bundle)


def _post(gw, body=None, path="/v1/completions", **kw):
    body = {"prompt": "hello", "max_tokens": 4, "temperature": 0} if body is None else body
    return HTTP.post(gw.base_url + path, json=body, **kw)


def test_fleet_file_minimal_yaml_and_errors(tmp_path):
    f = tmp_path / "fleet.yaml"
    f.write_text('backends: [{name: b1, url: "http://127.0.0.1:8001", profile: baseline}]\n')
    cfg = load_fleet(f)
    assert cfg.backends[0].kind == "openai" and cfg.weights == {"baseline": 1.0} and cfg.retries == 2
    plan = tmp_path / "plan.yaml"
    plan.write_text("candidate: ngram\nsteps: [50, 100]\n")
    f.write_text('backends: [{name: b1, url: "http://h:1", profile: baseline}, {name: n1, url: "http://h:2", '
                 'profile: ngram, kind: vllm}]\nprofiles: {ngram: {method: ngram, num_speculative_tokens: 4}}\n'
                 'rollout: {plan: plan.yaml, state_file: s.json}\n')
    cfg = load_fleet(f)
    assert cfg.rollout_plan.candidate == "ngram" and cfg.profile_names == ["baseline", "ngram"]


@pytest.mark.parametrize("doc, needle", [
    ({}, "backends: must be a non-empty list"),
    ({"backends": [{"name": "b", "url": URL, "profile": "ngram"}]}, 'no backend serves the profile "baseline"'),
    ({"backends": [{"name": "b", "url": "ftp://x", "profile": "baseline"}]}, "backends[0].url: must be an http(s)"),
    ({"backends": [{"url": URL, "profile": "baseline"}]}, "backends[0].name: is required"),
    ({"backends": [{"name": "b", "url": URL, "profile": "baseline", "wieght": 2}]}, "backends[0]: unknown key(s)"),
    ({"backends": [{"name": "b", "url": URL, "profile": "baseline", "weight": 0}]}, "backends[0].weight: must be >"),
    ({"backends": [{"name": "b", "url": URL, "profile": "baseline", "kind": "sglang"}]}, "backends[0].kind: must be"),
    ({"backends": [{"name": "b", "url": URL, "profile": "baseline"}, {"name": "b", "url": URL, "profile": "x"}]},
     "backends[1].name: 'b' is used twice"),
    ({"backends": [{"name": "b", "url": URL, "profile": "baseline"}], "weights": {"nope": 1}}, "weights.nope: no"),
    ({"backends": [{"name": "b", "url": URL, "profile": "baseline"}], "health": {"interval_s": 0}},
     "health.interval_s: must be > 0"),
    ({"backends": [{"name": "b", "url": URL, "profile": "baseline"}], "rollout": {"plan": {"candidate": "x"}}},
     "rollout.plan.candidate: no backend serves 'x'"),
    ({"backends": [{"name": "b", "url": URL, "profile": "baseline"}], "rollout": {"plan": {"candidate": "x",
                                                                                          "steps": [5]}}},
     "rollout.plan: steps[0].percent: the last step must be 100"),
    ({"backends": [{"name": "b", "url": URL, "profile": "baseline"}], "retry": 1}, "fleet config: unknown key(s)"),
])
def test_fleet_errors_name_the_key(doc, needle):
    with pytest.raises(ConfigError) as e:
        fleet_from_dict(doc)
    assert needle in str(e.value)


def test_routing_by_weight_sticky_and_headers(tmp_path):
    spec = {"b1": "baseline", "b2": "baseline", "n1": "ngram"}
    config = {"weights": {"baseline": 1, "ngram": 1}, "request_log": str(tmp_path / "gw.jsonl"),
              "profiles": {"ngram": {"method": "ngram", "num_speculative_tokens": 4}},
              "backends_extra": {"b1": {"weight": 3}, "n1": {"model": "renamed", "kind": "specserve"}}}
    with fleet(spec, config, acceptance=None) as (gw, states, _):
        n = 400
        seen = Counter()
        for _ in range(n):
            r = _post(gw)
            assert r.status_code == 200
            seen[(r.headers["x-specserve-profile"], r.headers["x-specserve-backend"])] += 1
        k = seen[("ngram", "n1")]
        assert abs(k - n / 2) < 4.5 * math.sqrt(n / 4)  # profiles 50/50
        base = seen[("baseline", "b1")] + seen[("baseline", "b2")]
        assert abs(seen[("baseline", "b1")] - 0.75 * base) < 4.5 * math.sqrt(base * 0.75 * 0.25)  # backends 3:1
        assert set(seen) == {("ngram", "n1"), ("baseline", "b1"), ("baseline", "b2")}
        for user in ("alice", "bob", "carol", "dave", "erin"):
            got = {(r.headers["x-specserve-profile"], r.headers["x-specserve-backend"])
                   for r in (_post(gw, {"prompt": "x", "max_tokens": 2, "user": user}) for _ in range(5))}
            assert len(got) == 1
        got = {_post(gw, headers={"x-session-id": "s1"}).headers["x-specserve-backend"] for _ in range(5)}
        assert len(got) == 1
        # forwarded body: `model` rewritten for n1, nothing else touched; the request id travels
        last = states["n1"].requests[-1]
        assert last["body"]["model"] == "renamed" and last["headers"]["x-request-id"].startswith("gw-")
        models = HTTP.get(gw.base_url + "/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["stub-model"]
        assert HTTP.get(gw.base_url + "/health").json()["status"] == "ok"
        assert HTTP.get(gw.base_url + "/admin/profiles", headers=AUTH).json()["profiles"]["ngram"]["method"] == "ngram"
    lines = [json.loads(x) for x in (tmp_path / "gw.jsonl").read_text().splitlines()]
    ng = [x for x in lines if x["profile"] == "ngram"][0]
    assert ng["backend"] == "n1" and ng["config"] == {"method": "ngram", "num_speculative_tokens": 4}
    assert ng["kind"] == "specserve" and ng["attempts"] == ["n1"] and ng["status"] == "ok" and ng["e2e_s"] > 0


def test_error_shapes_and_overrides():
    with fleet({"b1": "baseline", "n1": "ngram"}) as (gw, states, stubs):
        r = HTTP.post(gw.base_url + "/v1/completions", content=b"{nope", timeout=10)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        r = HTTP.post(gw.base_url + "/v1/completions", json=[1, 2], timeout=10)
        assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
        for raw in (b"[" * 1000 + b"]" * 1000, b'{"prompt": NaN}'):  # the server's body limits (issue 12)
            r = HTTP.post(gw.base_url + "/v1/completions", content=raw, timeout=10)
            assert r.status_code == 400 and "Recursion" not in r.text, r.text
        r = _post(gw, {"prompt": "x", "profile": "ngram"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "profile_override_forbidden"
        r = _post(gw, headers={"x-specserve-profile": "ngram"})
        assert r.status_code == 403
        assert HTTP.get(gw.base_url + "/v1/nothing").status_code == 404
        assert HTTP.get(gw.base_url + "/admin/backends").status_code == 401
        r = _post(gw, {"prompt": "x", "stream": True, "stream_options": [1]})  # malformed: forwarded as is,
        assert states[r.headers["x-specserve-backend"]].requests[-1]["body"]["stream_options"] == [1]  # no 500 here
        states["b1"].fail_status = 400  # a backend's own 4xx passes through untouched, not retried
        r = _post(gw)
        assert r.status_code == 400 and "b1 fails on purpose" in r.json()["error"]["message"]
        assert r.headers["x-specserve-backend"] == "b1"
    with fleet({"b1": "baseline", "n1": "ngram"}, {"allow_profile_override": True}) as (gw, states, stubs):
        r = _post(gw, {"prompt": "x", "max_tokens": 2, "profile": "ngram"})
        assert r.status_code == 200 and r.headers["x-specserve-profile"] == "ngram"
        assert "profile" not in states["n1"].requests[-1]["body"]  # the gateway consumed it
        r = _post(gw, {"prompt": "x", "profile": "zzz"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_profile"
        stubs["n1"].stop()  # connection refused: ejected; an explicit request then gets 503
        r = _post(gw, {"prompt": "x", "profile": "ngram"})
        assert r.status_code == 502 or r.status_code == 503
        r = _post(gw, {"prompt": "x", "profile": "ngram"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_backend"
        assert r.headers["retry-after"] == "1"


def test_gateway_cli_bad_config_is_one_line(tmp_path, capsys):
    from specserve.cli import main

    f = tmp_path / "fleet.yaml"
    f.write_text("backends: [{name: b1, url: 'http://127.0.0.1:1', profile: ngram}]\n")
    assert main(["gateway", "--config", str(f), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("specserve: error: backends: no backend serves the profile") and "\n" not in err
    assert main(["gateway", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "cannot read fleet config" in capsys.readouterr().err
