"""The server's one seam to the engine: `EngineClient`. The client the tests serve (AsyncEngine over the
model-free target) implements it exactly; the toy model keeps `CausalLM`'s forward signature; the
HTTP modules import nothing from the engine side but the Protocol; and errors get their status by
type: a request the engine refuses is a 400 naming its param, an engine bug (while adding the request,
or while generating it alone) is a 500 with a logged traceback and nothing internal in the body."""

import ast
import inspect
import logging
from pathlib import Path

import httpx
import pytest

from specserve.model.llama import CausalLM
from specserve.server.api import ServerSettings, create_app
from specserve.server.async_engine import AsyncEngine
from specserve.server.engine_client import EngineClient
from specserve.server.launcher import ServerThread
from tests.helpers.fake_engine import ToyLM, fake_client

SERVER_DIR = Path(__file__).resolve().parents[2] / "specserve" / "server"


def _protocol_methods() -> list[str]:
    return [n for n, v in vars(EngineClient).items()
            if not n.startswith("_") and (inspect.isfunction(v) or isinstance(v, property))]


def test_fake_client_implements_engine_client_exactly():
    client = fake_client()
    assert isinstance(client, EngineClient)
    names = _protocol_methods()
    assert {"submit", "abort", "stats", "alive", "dead", "start", "stop", "prepare_speculative_config"} <= set(names)
    for name in names:
        proto, impl = vars(EngineClient)[name], inspect.getattr_static(AsyncEngine, name)
        if isinstance(proto, property):
            assert isinstance(impl, property), name
            continue
        assert inspect.iscoroutinefunction(proto) == inspect.iscoroutinefunction(impl), name
        assert inspect.signature(impl, eval_str=True) == inspect.signature(proto, eval_str=True), name
    for name in inspect.get_annotations(EngineClient, eval_str=True):
        assert hasattr(client, name), name
    assert (client.model_name, client.model_checksum, client.max_num_seqs) == ("fake-model", "fake-checksum", 8)


def test_toy_model_keeps_the_causal_lm_forward_signature():
    assert list(inspect.signature(ToyLM.forward).parameters) == list(inspect.signature(CausalLM.forward).parameters)


def test_http_modules_reach_the_engine_only_through_the_protocol():
    for name in ("api.py", "serving.py", "generation.py", "formatting.py", "protocol.py", "errors.py"):
        tree = ast.parse((SERVER_DIR / name).read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert not any(m.startswith(("specserve.engine", "specserve.server.async_engine")) for m in imported), name


@pytest.fixture(scope="module")
def server():
    client = fake_client(max_model_len=64)
    with ServerThread(create_app(client, None, ServerSettings())) as srv:
        srv.client = client
        yield srv


@pytest.mark.parametrize("error", [KeyError, TypeError, ValueError, IndexError])
def test_an_engine_bug_is_a_500_with_a_logged_traceback(server, monkeypatch, caplog, error):
    def broken(text, *a, **kw):
        raise error("secret internal detail")

    monkeypatch.setattr(server.client._encoder.tokenizer, "encode", broken)  # called on the tokenizer thread
    with caplog.at_level(logging.ERROR, logger="specserve.server"):
        r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["type"] == "internal_server_error" and err["code"] == "internal_error"
    assert "secret" not in r.text and error.__name__ not in r.text
    logged = [rec for rec in caplog.records if rec.exc_info and rec.exc_info[0] is error]
    assert logged and "broken" in logging.Formatter().formatException(logged[0].exc_info)  # the whole traceback
    # the engine is fine: a token prompt does not tokenize, and is served
    r = httpx.post(server.base_url + "/v1/completions", json={"prompt": [104, 105], "max_tokens": 2}, timeout=10)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("path, body, param, code", [
    ("/v1/completions", {"prompt": "x" * 64}, "prompt", "context_length_exceeded"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 64}]}, "messages",
     "context_length_exceeded"),
    ("/v1/completions", {"prompt": [300]}, "prompt", None),
    ("/v1/completions", {"prompt": "x", "top_k": -2}, "top_k", None),
])
def test_a_refused_request_is_a_400_naming_its_param(server, path, body, param, code):
    r = httpx.post(server.base_url + path, json=body, timeout=10)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"], err["type"]) == (param, code, "invalid_request_error")


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_the_engine_fails_alone_is_a_500_and_the_others_go_on(server, monkeypatch, caplog, stream):
    from specserve.engine import llm_engine

    real = llm_engine.commit_tokens

    def failing(req, *args):  # the engine's per-request step after the batched verifier
        if bytes(req.prompt_token_ids[:4]) == b"fail":
            raise RuntimeError("secret sampler detail")
        return real(req, *args)

    monkeypatch.setattr(llm_engine, "commit_tokens", failing)
    body = {"prompt": "fail here", "max_tokens": 4, "stream": stream}
    with caplog.at_level(logging.ERROR):
        r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=10)
    assert "secret" not in r.text
    if stream:  # the 200 was sent before the failure: the stream ends with an error event
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and '"code":"internal_error"' in events[-2]
    else:
        assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
    assert any(rec.exc_info and "secret sampler detail" in str(rec.exc_info[1]) for rec in caplog.records)
    r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "fine", "max_tokens": 3}, timeout=10)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
