"""A real server (uvicorn on 127.0.0.1, in-process thread) over the real engine and the tiny
random-weight model, driven by the official `openai` client.

Checks issue 4's "what must hold" plus docs/speculation-cases.md B03, B12 and B15 through the HTTP
layer: streamed text == non-streamed text, one logprobs entry per token, usage == tokens, n choices,
every profile's greedy output (and logprobs) == baseline's, a stop string inside an accepted block,
/metrics counters == the sum of per-response numbers, rollback, bad inputs, and a client disconnect
freeing the KV cache.
"""

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specserve.config import EngineConfig
from specserve.engine.llm_engine import LLMEngine
from specserve.rollout.profiles import profile_set_from_dict
from specserve.server.api import ServerSettings, create_app
from specserve.server.async_engine import AsyncEngine
from specserve.server.launcher import ServerThread
from tests.helpers.waiting import wait_until

PROFILES = {"profiles": {"baseline": None,
                         "ngram_4": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                                     "prompt_lookup_max": 3},
                         "suffix": {"method": "suffix", "num_speculative_tokens": 3}},
            "weights": {"baseline": 1}}
REPEAT = "1: I will not skip any words.\n2: I will not skip any words.\n3:"
TOKEN = "tok"


@pytest.fixture(scope="module")
def srv(tiny_model_dir, tmp_path_factory):
    eng = LLMEngine(EngineConfig(model=str(tiny_model_dir), max_model_len=256, max_num_seqs=4, dtype="float32",
                                 device="cpu"))
    log = tmp_path_factory.mktemp("srv") / "requests.jsonl"
    app = create_app(AsyncEngine(eng), profile_set_from_dict(PROFILES),
                     ServerSettings(allow_profile_override=True, admin_token=TOKEN, request_log=str(log)))
    with ServerThread(app) as s:
        s.state = app.state.specserve
        s.model = eng.model_name
        yield s


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0, timeout=60)


def _stream(chunks, chat):
    text, n_lp, finishes, usage, spec = "", 0, [], None, None
    for ch in chunks:
        d = ch.model_dump()
        usage = d.get("usage") or usage
        spec = d.get("specserve") or spec
        for c in d["choices"]:
            text += (c["delta"].get("content") if chat else c["text"]) or ""
            if c["logprobs"]:
                n_lp += len(c["logprobs"]["content"] if chat else c["logprobs"]["tokens"])
            if c["finish_reason"]:
                finishes.append(c["finish_reason"])
    return text, n_lp, finishes, usage, spec


@pytest.mark.parametrize("chat", [False, True])
def test_profiles_stream_logprobs_equal_baseline(srv, client, chat):
    base_lps = None
    for profile in PROFILES["profiles"]:
        kw = dict(model=srv.model, max_tokens=48, temperature=0, extra_body={"profile": profile, "ignore_eos": True})
        if chat:
            kw.update(messages=[{"role": "user", "content": REPEAT}], logprobs=True, top_logprobs=3)
            r = client.chat.completions.create(**kw)
            text, lps = r.choices[0].message.content, [(e.token, e.logprob) for e in r.choices[0].logprobs.content]
            create = client.chat.completions.create
        else:
            kw.update(prompt=REPEAT, logprobs=3)
            r = client.completions.create(**kw)
            text, lps = r.choices[0].text, list(zip(r.choices[0].logprobs.tokens, r.choices[0].logprobs.token_logprobs))
            create = client.completions.create
        assert len(lps) == r.usage.completion_tokens == 48
        spec = r.model_extra["specserve"]
        assert spec["profile"] == profile
        if profile != "baseline":
            assert spec["num_accepted_tokens"] > 0, spec  # drafts really were accepted
        if base_lps is None:
            base_text, base_lps = text, lps
        else:
            assert text == base_text
            assert [t for t, _ in lps] == [t for t, _ in base_lps]
            assert all(abs(a - b) < 1e-3 for (_, a), (_, b) in zip(lps, base_lps))
        s_text, s_lp, finishes, usage, s_spec = _stream(
            create(stream=True, stream_options={"include_usage": True}, **kw), chat)
        assert s_text == text and s_lp == 48 and finishes == ["length"] and usage["completion_tokens"] == 48
        assert s_spec["profile"] == profile
        if profile != "suffix":  # suffix decoding learns from earlier outputs, so its drafts change
            assert s_spec == spec


def test_stop_string_inside_accepted_block(srv, client):
    kw = dict(model=srv.model, prompt=REPEAT, max_tokens=64, temperature=0, extra_body={"ignore_eos": True})
    base = client.completions.create(**kw).choices[0].text
    stop = base[20:26] if len(base) > 30 else base[-4:]
    for profile in ("baseline", "ngram_4"):
        kw2 = dict(kw, stop=[stop], logprobs=2, extra_body={"ignore_eos": True, "profile": profile})
        r = client.completions.create(**kw2)
        c = r.choices[0]
        assert c.text == base[: base.index(stop)] and c.finish_reason == "stop"
        assert len(c.logprobs.tokens) == r.usage.completion_tokens
        s_text, s_lp, finishes, usage, _ = _stream(client.completions.create(stream=True, **kw2), chat=False)
        assert s_text == c.text and finishes == ["stop"] and s_lp == r.usage.completion_tokens


def test_n_choices_seeded(srv, client):
    kw = dict(model=srv.model, prompt="The quick brown fox", max_tokens=10, temperature=1.0, seed=5, n=3)
    r = client.completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == sum(
        len(client.completions.create(**dict(kw, n=1, seed=5 + i, logprobs=0)).choices[0].logprobs.tokens)
        for i in range(3))
    assert [c.text for c in client.completions.create(**kw).choices] == [c.text for c in r.choices]


def _counters(text):
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("specserve:spec_decode"):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_deltas_equal_responses_and_rollback(srv, client):
    before = _counters(httpx.get(srv.base_url + "/metrics").text)
    want: dict = {}
    for i, profile in enumerate(["ngram_4", "suffix", "ngram_4"]):
        r = client.chat.completions.create(model=srv.model, messages=[{"role": "user", "content": REPEAT + str(i)}],
                                           max_tokens=30, temperature=0, extra_body={"profile": profile})
        s = r.model_extra["specserve"]
        for name, v in (("num_drafts", s["num_drafts"]), ("num_draft_tokens", s["num_draft_tokens"]),
                        ("num_accepted_tokens", s["num_accepted_tokens"])):
            key = (f"specserve:spec_decode_{name}_total", (("profile", profile),))
            want[key] = want.get(key, 0) + v
        for pos, v in enumerate(s["num_accepted_tokens_per_pos"]):
            key = ("specserve:spec_decode_num_accepted_tokens_per_pos_total",
                   (("position", str(pos)), ("profile", profile)))
            want[key] = want.get(key, 0) + v
    after = _counters(httpx.get(srv.base_url + "/metrics").text)
    for key, v in want.items():
        assert after[key] - before.get(key, 0) == v, key
    auth = {"authorization": f"Bearer {TOKEN}"}
    assert httpx.put(srv.base_url + "/admin/weights", json={"weights": {"suffix": 1}}).status_code == 401
    assert httpx.put(srv.base_url + "/admin/weights", json={"weights": {"suffix": 1}}, headers=auth).status_code == 200
    prof = lambda: client.completions.with_raw_response.create(  # noqa: E731
        model=srv.model, prompt="x", max_tokens=2).headers["x-specserve-profile"]
    assert prof() == "suffix"
    assert httpx.post(srv.base_url + "/admin/rollback", headers=auth).status_code == 200
    assert prof() == "baseline"


@pytest.mark.parametrize("body, status", [
    ({"prompt": "x", "max_tokens": 0}, 400), ({"prompt": "x", "temperature": -1}, 400),
    ({"prompt": "x", "top_p": 2}, 400), ({"prompt": "x", "n": 0}, 400),
    ({"prompt": "word " * 400, "max_tokens": 5}, 400), ({"prompt": [10 ** 7]}, 400),
    ({"prompt": "x", "model": "nope"}, 404),
])
def test_bad_inputs_then_still_serving(srv, client, body, status):
    r = httpx.post(srv.base_url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == status and r.json()["error"]["message"]
    assert client.completions.create(model=srv.model, prompt="ok", max_tokens=2).usage.completion_tokens == 2


def test_disconnect_mid_stream_frees_kv(srv):
    st = srv.state.engine
    body = {"prompt": REPEAT, "max_tokens": 200, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=srv.base_url, timeout=30) as c, c.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        next(lines)
    wait_until(lambda: st.in_flight == 0 and st.stats().get("num_kv_tokens") == 0
               and st.stats().get("num_running") == 0, timeout_s=20)
    assert st.in_flight == 0 and st.stats()["num_running"] == 0 and st.stats()["num_kv_tokens"] == 0, st.stats()
