"""Server robustness over the model-free fake engine: client disconnects free the engine request (and its KV),
a full queue answers 503 + Retry-After, oversized bodies 413, and the server keeps serving."""

import json
import socket

import httpx
import openai
import pytest

from specserve.server.api import ServerSettings, create_app
from specserve.server.launcher import ServerThread
from tests.helpers.fake_engine import ToyLM, fake_client, toy_logits
from tests.helpers.waiting import wait_until


@pytest.fixture()
def slow(tmp_path):
    eng = fake_client(lm=ToyLM(step_delay_s=0.02), max_num_seqs=2, max_model_len=512)
    app = create_app(eng, None, ServerSettings(request_log=str(tmp_path / "log.jsonl"), max_queue=1,
                                               max_body_bytes=2048))
    srv = ServerThread(app).start()
    yield srv, app.state.specserve, tmp_path / "log.jsonl"
    srv.stop()


def _idle(state):
    s = state.engine.stats()
    return state.engine.in_flight == 0 and s.get("num_running") == 0 and s.get("num_waiting") == 0 \
        and s.get("num_kv_tokens") == 0


@pytest.mark.parametrize("chat", [False, True])
def test_disconnect_mid_stream_aborts_and_frees_kv(slow, chat):
    srv, state, log = slow
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"max_tokens": 400, "temperature": 0, "stream": True}
    body.update({"messages": [{"role": "user", "content": "go"}]} if chat else {"prompt": "go"})
    with httpx.Client(base_url=srv.base_url, timeout=10) as c:
        with c.stream("POST", path, json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(x.startswith("data: ") for x in got)
            assert state.engine.stats().get("num_kv_tokens", 0) > 0
    # the response context closed the connection mid-stream
    assert wait_until(lambda: _idle(state)), state.engine.stats()
    recs = [json.loads(x) for x in log.read_text().splitlines()]
    assert recs[-1]["status"] == "cancelled" and recs[-1]["http_status"] == 499
    assert 0 < recs[-1]["completion_tokens"] < 400
    ok = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0).completions.create(
        model="fake-model", prompt="after", max_tokens=3)
    assert ok.usage.completion_tokens == 3


def test_disconnect_non_streaming_aborts(slow):
    srv, state, log = slow
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 400}, timeout=0.3)
    assert wait_until(lambda: _idle(state)), state.engine.stats()
    assert json.loads(log.read_text().splitlines()[-1])["status"] == "cancelled"


def test_queue_full_503_retry_after_then_recovers(slow):
    srv, state, _ = slow
    streams = []
    with httpx.Client(base_url=srv.base_url, timeout=10) as c:
        try:
            for i in range(3):  # max_num_seqs 2 + max_queue 1
                s = c.stream("POST", "/v1/completions", json={"prompt": f"q{i}", "max_tokens": 300, "stream": True})
                r = s.__enter__()
                lines = r.iter_lines()  # keep a reference: a collected iterator closes the response
                streams.append((s, lines))
                assert r.status_code == 200
                if i < 2:
                    next(lines)
            assert wait_until(lambda: state.engine.in_flight == 3)
            r = c.post("/v1/completions", json={"prompt": "overflow", "max_tokens": 2})
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "queue_full"
            r = c.post("/v1/completions", json={"prompt": "overflow", "max_tokens": 2, "n": 1})
            assert r.status_code == 503
        finally:
            for s, _ in streams:
                s.__exit__(None, None, None)
        assert wait_until(lambda: _idle(state))
        assert c.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2}).status_code == 200


def test_body_too_large_413(slow):
    srv, _, _ = slow
    big = json.dumps({"prompt": "x" * 5000, "max_tokens": 2}).encode()
    r = httpx.post(srv.base_url + "/v1/completions", content=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: chunked transfer
        for i in range(0, len(big), 1000):
            yield big[i:i + 1000]

    r = httpx.post(srv.base_url + "/v1/completions", content=chunks())
    assert r.status_code == 413
    assert httpx.post(srv.base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_raw_socket_hangup_before_body(slow):
    srv, state, _ = slow
    s = socket.create_connection(("127.0.0.1", srv.port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"prompt\":")
    s.close()
    assert wait_until(lambda: not srv.server.server_state.connections), "the server should drop the half request"
    assert httpx.get(srv.base_url + "/health").status_code == 200
    assert _idle(state)


def _exploding(context):
    if bytes(context[:4]) == b"boom":
        raise RuntimeError("kaboom")
    return toy_logits(context)


def test_engine_failure_is_503_not_a_hang():
    app = create_app(fake_client(lm=ToyLM(_exploding)), None, ServerSettings())
    with ServerThread(app) as srv:
        r = httpx.post(srv.base_url + "/v1/completions", json={"prompt": "boom", "max_tokens": 3}, timeout=10)
        assert r.status_code == 503 and "kaboom" not in r.text  # nothing internal in the body
        assert httpx.get(srv.base_url + "/health").status_code == 503
        r = httpx.post(srv.base_url + "/v1/completions", json={"prompt": "fine", "max_tokens": 3}, timeout=10)
        assert r.status_code == 503 and r.headers["retry-after"]
