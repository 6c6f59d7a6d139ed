"""Issue 12 over the model-free fake engine: bodies that used to give 500 or a 200 with an error inside,
admin input, log hygiene, tool calls end to end, the graceful drain and the engine watchdog."""

import json
import threading

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specserve.rollout.profiles import profile_set_from_dict
from specserve.server.api import ServerSettings, create_app
from specserve.server.launcher import ServerThread
from tests.helpers.fake_engine import ToyLM, fake_client, scripted_logits
from tests.helpers.waiting import wait_until

TOKEN = "t0ken"
PROFILES = {"profiles": {"baseline": None, "ngram": {"method": "ngram", "num_speculative_tokens": 3}},
            "weights": {"baseline": 1, "ngram": 1}}
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("log") / "requests.jsonl"
    app = create_app(fake_client(max_model_len=1024, lm=ToyLM(scripted_logits(f"<tool_call>\n{CALL}\n</tool_call>"))),
                     profile_set_from_dict(PROFILES),
                     ServerSettings(admin_token=TOKEN, request_log=str(log), tool_call_parser="hermes"))
    with ServerThread(app) as srv:
        srv.log = log
        yield srv


def _last_log(srv):
    return json.loads(srv.log.read_text().splitlines()[-1])


DEEP = "[" * 1000 + "]" * 1000


@pytest.mark.parametrize("method, path", [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                                          ("PUT", "/admin/weights")])
@pytest.mark.parametrize("body", [DEEP, '{"prompt": ' + DEEP + "}", '{"prompt": NaN}', '{"prompt": "x", "n": '
                                  + "9" * 5000 + "}", "\xff\xfe", "[]", '"x"'])
def test_bodies_that_used_to_500_are_400(server, method, path, body):
    r = httpx.request(method, server.base_url + path, content=body.encode("latin-1"),
                      headers={"authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and "Recursion" not in r.text and "Traceback" not in r.text


def test_top_p_that_underflowed_is_refused_and_tiny_top_p_is_greedy(server):
    r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "x", "top_p": 1e-300, "max_tokens": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_p"
    r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "x", "top_p": 1e-6, "max_tokens": 5, "seed": 1})
    g = httpx.post(server.base_url + "/v1/completions", json={"prompt": "x", "temperature": 0, "max_tokens": 5})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == g.json()["choices"][0]["text"]
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_admin_weights_strict(server):
    h = {"authorization": f"Bearer {TOKEN}"}
    for weights, param in [({"baseline": 1e308, "ngram": 1e308}, "weights"), ({"baseline": True}, "weights"),
                           ({"x" * 5000: 1}, "weights"), ({"baseline": 0, "ngram": 0}, "weights")]:
        r = httpx.put(server.base_url + "/admin/weights", json={"weights": weights}, headers=h)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert len(r.text) < 600  # a long name is not copied whole
    r = httpx.put(server.base_url + "/admin/weights", json={"weights": {"baseline": 1}, "extra": 1}, headers=h)
    assert r.status_code == 400 and r.json()["error"]["param"] == "extra"
    r = httpx.put(server.base_url + "/admin/weights", json={"weights": {"baseline": 3, "ngram": 1}}, headers=h)
    assert r.status_code == 200 and r.json()["fractions"] == {"baseline": 0.75, "ngram": 0.25}
    models = httpx.get(server.base_url + "/v1/models").json()["data"][0]["specserve"]
    assert models["speculative_configs"]["ngram"]["prompt_lookup_max"] == 4  # the effective config, defaults in
    assert httpx.get(server.base_url + "/admin/profiles", headers=h).json()["profiles"]["ngram"][
        "effective_config"]["prompt_lookup_min"] == 1


def test_long_header_is_cut_in_body_and_log_and_null_is_null(server):
    r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                   headers={"x-specserve-profile": "p" * 20000})
    assert r.status_code in (400, 403) and len(r.text) < 1000
    rec = _last_log(server)
    assert all(len(v) <= 512 for v in rec.values() if isinstance(v, str))
    assert rec["finish_reason"] == "error"
    r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
    rec = _last_log(server)
    assert rec["finish_reason"] == "length" and rec["error"] is None  # null, not "None"


def test_tool_call_parsed_streamed_and_sent_back(server):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    msgs = [{"role": "user", "content": "What's the weather in Paris? Use the tool."}]
    r = client.chat.completions.create(model="fake-model", messages=msgs, tools=TOOLS, temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    call = ch.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"} and call.id.startswith("call_")
    deltas, finish = [], None
    for chunk in client.chat.completions.create(model="fake-model", messages=msgs, tools=TOOLS, temperature=0,
                                                stream=True):
        for c in chunk.choices:
            deltas += c.delta.tool_calls or []
            finish = c.finish_reason or finish
            assert not (c.delta.content or "").strip()
    assert finish == "tool_calls" and [d.function.name for d in deltas] == ["get_weather"]
    assert json.loads(deltas[0].function.arguments) == {"city": "Paris"} and deltas[0].index == 0
    # tool_choice none: no parsing, the text is content
    r = client.chat.completions.create(model="fake-model", messages=msgs, tools=TOOLS, tool_choice="none",
                                       temperature=0)
    assert r.choices[0].finish_reason == "stop" and "<tool_call>" in r.choices[0].message.content
    # the tool result goes back through the template (role tool, the assistant's tool_calls)
    back = msgs + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                   {"role": "tool", "tool_call_id": call.id, "content": "18 C"}]
    r = client.chat.completions.create(model="fake-model", messages=back, tools=TOOLS, temperature=0)
    assert r.choices[0].message.tool_calls  # the scripted model calls again; what matters: accepted, rendered
    with pytest.raises(openai.BadRequestError) as ei:  # parallel_tool_calls false is enforced only by a grammar
        client.chat.completions.create(model="fake-model", messages=msgs, tools=TOOLS, parallel_tool_calls=False)
    assert ei.value.body["param"] == "parallel_tool_calls"


def test_completions_batch_echo_best_of(server):
    c = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    r = c.completions.create(model="fake-model", prompt=[[97, 98], [104, 105]], max_tokens=3, n=2, temperature=0)
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3] and r.usage.prompt_tokens == 4
    assert r.choices[0].text == r.choices[1].text and r.usage.completion_tokens == 12
    r = c.completions.create(model="fake-model", prompt="ab", max_tokens=3, echo=True, temperature=0)
    assert r.choices[0].text.startswith("ab") and len(r.choices[0].text) == 5
    r = c.completions.create(model="fake-model", prompt="ab", max_tokens=3, best_of=3, n=1, seed=5)
    assert len(r.choices) == 1 and r.choices[0].logprobs is None and r.usage.completion_tokens == 9
    r = c.completions.create(model="fake-model", prompt="ab", extra_body={"max_completion_tokens": 7})
    assert r.usage.completion_tokens == 7


def _metric(srv, name):
    for fam in text_string_to_metric_families(httpx.get(srv.base_url + "/metrics").text):
        for s in fam.samples:
            if s.name == name:
                return s.value
    return None


def test_watchdog_marks_a_hung_engine_unhealthy_and_recovers():
    lm = ToyLM()
    app = create_app(fake_client(lm=lm), None, ServerSettings(watchdog_s=0.3))
    with ServerThread(app) as srv:
        assert httpx.get(srv.base_url + "/health").status_code == 200
        lm.gate.clear()  # every forward now hangs
        with httpx.Client(base_url=srv.base_url, timeout=30) as c:
            with c.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 5, "stream": True}) as r:
                assert wait_until(lambda: httpx.get(srv.base_url + "/health").status_code == 503, timeout_s=10)
                body = httpx.get(srv.base_url + "/health").json()
                assert "watchdog" in body["reason"] and body["last_step_age_s"] > 0.3
                assert _metric(srv, "specserve:engine_last_step_age_seconds") > 0.3
                assert _metric(srv, "specserve:engine_healthy") == 0
                lm.gate.set()  # steps resume
                text = r.read().decode()
        assert text.rstrip().endswith("data: [DONE]")
        assert wait_until(lambda: httpx.get(srv.base_url + "/health").status_code == 200)
        assert _metric(srv, "specserve:engine_healthy") == 1


def test_drain_ends_running_requests_cleanly(tmp_path):
    log = tmp_path / "log.jsonl"
    app = create_app(fake_client(lm=ToyLM(step_delay_s=0.02), max_model_len=512), None,
                     ServerSettings(request_log=str(log)))
    with ServerThread(app) as srv:
        state = app.state.specserve
        with httpx.Client(base_url=srv.base_url, timeout=30) as c:
            streams = []
            for i in range(3):
                cm = c.stream("POST", "/v1/completions", json={"prompt": f"s{i}", "max_tokens": 400, "stream": True})
                r = cm.__enter__()
                streams.append((cm, r, r.iter_lines()))
                next(streams[-1][2])
            plain = {}  # a non-streamed request cut by the drain gets a 503 body
            t_plain = threading.Thread(target=lambda: plain.update(r=httpx.post(
                srv.base_url + "/v1/completions", json={"prompt": "p", "max_tokens": 400}, timeout=30)))
            t_plain.start()
            assert wait_until(lambda: len(state.generations) == 4)
            # started last, just before the drain: 10 steps of 20 ms end well inside the 1 s grace, and
            # not before the drain begins (3 tokens raced the drain's start on a loaded machine)
            quick = c.stream("POST", "/v1/completions", json={"prompt": "q", "max_tokens": 10, "stream": True})
            qr = quick.__enter__()
            assert wait_until(lambda: len(state.generations) == 5)
            result = {}
            t = threading.Thread(target=lambda: result.update(srv.drain(grace_s=1.0)))
            t.start()
            assert wait_until(lambda: state.draining)
            r = httpx.post(srv.base_url + "/v1/completions", json={"prompt": "new", "max_tokens": 2})
            assert r.status_code == 503 and r.headers["retry-after"] and r.json()["error"]["code"] == "server_shutting_down"
            assert qr.read().decode().rstrip().endswith("data: [DONE]")  # finished within the grace
            for cm, r, lines in streams:
                rest = [x for x in lines if x.startswith("data: ")]
                assert rest[-1] == "data: [DONE]"
                assert json.loads(rest[-2][6:])["error"]["code"] == "server_shutting_down"
                cm.__exit__(None, None, None)
            quick.__exit__(None, None, None)
            t.join(30)
            t_plain.join(30)
        assert plain["r"].status_code == 503 and plain["r"].json()["error"]["code"] == "server_shutting_down"
        assert result == {"finished": 1, "ended": 4}
        recs = [json.loads(x) for x in log.read_text().splitlines()]
        ended = [x for x in recs if x["http_status"] == 503 and x["finish_reason"] == "abort"]
        assert len(ended) == 4 and len([x for x in recs if x["status"] == "ok"]) == 1
        assert len(recs) == 6  # 4 ended, 1 finished, 1 refused while draining (finish_reason "error")
        assert state.engine.stats()["num_kv_tokens"] == 0

