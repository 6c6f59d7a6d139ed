"""End to end: two real specserve servers (smollm2-135m-instruct, fp32, CPU) behind the gateway, a
baseline and an ngram one, and a short staged rollout with the shadow check: the candidate reaches
100% on gates computed by the gateway, every replayed greedy request is identical on the candidate
(lossless speculation, checked in production traffic), and `specserve bench` runs through the gateway."""

import json

import httpx
import pytest

from specserve.cli import main
from specserve.config import EngineConfig
from specserve.engine.llm_engine import LLMEngine
from specserve.gateway.app import create_gateway_app
from specserve.gateway.config import fleet_from_dict
from specserve.rollout.profiles import profile_set_from_dict
from specserve.server.api import ServerSettings, create_app
from specserve.server.async_engine import AsyncEngine
from specserve.server.launcher import ServerThread
from tests.helpers.gateway_fleet import Traffic, wait_for

pytestmark = [pytest.mark.real_model, pytest.mark.usefixtures("torch_threads")]
SMOL = "smollm2-135m-instruct"
TOKEN = "e2e"
PROMPTS = ["Count from one to ten: one, two, three,", "List the days of the week: Monday, Tuesday,",
           "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return", "The alphabet: A B C D E F G",
           "Repeat after me: the cat sat on the mat. the cat sat on the mat. the cat"]


def _server(path, spec):
    eng = LLMEngine(EngineConfig(model=path, max_model_len=512, max_num_seqs=4, dtype="float32", device="cpu"))
    profiles = {"profiles": {"baseline": None, **({"ngram_4": spec} if spec else {})},
                "weights": {"ngram_4" if spec else "baseline": 1}}
    return ServerThread(create_app(AsyncEngine(eng), profile_set_from_dict(profiles), ServerSettings())).start()


def test_rollout_over_two_real_specserve_backends(real_model, tmp_path):
    path = str(real_model(SMOL).path)
    base = _server(path, None)
    cand = _server(path, {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    plan = {"candidate": "ngram_4", "steps": [50, 100], "min_dwell_s": 0, "min_requests": 3, "window_s": 60,
            "interval_s": 0.5, "shadow": {"sample": 1.0, "max_in_flight": 2},
            "gates": {"p95_e2e_ratio": 3.0, "p95_ttft_ratio": None, "median_tpot_ratio": 3.0,
                      "error_rate_diff": 0.0, "min_mean_acceptance_length": 1.0}}
    cfg = fleet_from_dict({
        "backends": [{"name": "smol-base", "url": base.base_url, "profile": "baseline", "kind": "specserve"},
                     {"name": "smol-ngram", "url": cand.base_url, "profile": "ngram_4", "kind": "specserve"}],
        "profiles": {"ngram_4": {"method": "ngram", "num_speculative_tokens": 4}},
        "admin_token": TOKEN, "request_log": str(tmp_path / "gw.jsonl"), "allow_profile_override": True,
        "rollout": {"plan": plan, "state_file": str(tmp_path / "state.json")}})
    gw = ServerThread(create_gateway_app(cfg, seed=0)).start()
    auth = {"authorization": f"Bearer {TOKEN}"}
    try:
        with Traffic(gw.base_url, PROMPTS, max_tokens=12, n_threads=1, timeout_s=120) as traffic:
            st = wait_for(lambda: (s := httpx.get(gw.base_url + "/admin/rollout", headers=auth).json())["state"]
                          in ("completed", "reverted") and s, timeout_s=240, step_s=0.5)
        codes = traffic.codes
        assert st["state"] == "completed", st["history"]
        gates = {g["name"]: g for g in st["last_evaluation"]["gates"]}
        assert gates["shadow"]["verdict"] == "pass" and "identical" in gates["shadow"]["detail"]
        assert gates["min_mean_acceptance_length"]["value"] > 1.0  # real drafts were accepted
        assert set(codes) == {200}
        log = tmp_path / "gw.jsonl"  # a request's line is written after its answer's last byte: wait for all
        wait_for(lambda: len(log.read_text().splitlines()) >= len(codes), timeout_s=10)
        lines = [json.loads(x) for x in log.read_text().splitlines()]
        assert {x["backend"] for x in lines} == {"smol-base", "smol-ngram"}
        assert any(x["rollout_step"] == "ngram_4@50%" for x in lines)
        r = httpx.post(gw.base_url + "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 8}, timeout=120)
        assert r.headers["x-specserve-profile"] == "ngram_4" and r.headers["x-specserve-backend"] == "smol-ngram"
        assert r.json()["specserve"]["method"] == "ngram"
        # `specserve bench` through the gateway (profiles picked per request, acceptance from its /metrics)
        out = tmp_path / "bench"
        assert main(["bench", "--base-url", gw.base_url + "/v1", "--dataset", "code", "--num-prompts", "2",
                     "--max-tokens", "12", "--profile", "baseline", "ngram_4", "--warmup", "0", "--no-progress",
                     "--output-dir", str(out)]) == 0
        summary = json.loads((out / "summary.json").read_text())
        runs = {r["profile"]: r for r in summary["runs"]}
        assert runs["ngram_4"]["overall"]["num_drafts"] > 0 and runs["baseline"]["overall"]["error_rate"] == 0
        assert runs["ngram_4"]["server"]["acceptance_from_metrics"]["num_drafts"] == runs["ngram_4"]["overall"][
            "num_drafts"]
        same, n = summary["comparisons"][0]["overall"]["greedy_match"]
        assert n == 2 and same == 2
    finally:
        gw.stop()
        base.stop()
        cand.stop()
