"""Real models behind the real server: a tool call parsed from qwen2.5-coder-0.5b-instruct's own output
(issue 11), and SIGTERM during 8 long smollm2 streams (issue 12): every client sees a clean end, every
request is in the request log, the process exits with status 0; unseeded requests differ across
restarts (a seed is drawn at start-up)."""

import json
import os
import signal
import threading

import httpx
import openai
import pytest

from specserve.bench.server_process import ServerProcess
from specserve.config import EngineConfig
from specserve.engine.llm_engine import LLMEngine
from specserve.server.api import ServerSettings, create_app
from specserve.server.async_engine import AsyncEngine
from specserve.server.launcher import ServerThread

pytestmark = [pytest.mark.real_model, pytest.mark.usefixtures("torch_threads")]
QWEN, SMOL = "qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city name"}},
                   "required": ["city"]}}}]
ASK = [{"role": "user", "content": "What's the weather in Paris? Use the tool."}]


@pytest.fixture(scope="module")
def qwen_server(real_model):
    real_model(QWEN)
    eng = LLMEngine(EngineConfig(model=QWEN, max_model_len=1024, max_num_seqs=2, dtype="float32", device="cpu"))
    with ServerThread(create_app(AsyncEngine(eng), None, ServerSettings())) as srv:
        yield openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0, timeout=300), srv


def test_qwen_tool_call_is_parsed(qwen_server):
    client, srv = qwen_server
    assert httpx.get(srv.base_url + "/v1/models").json()["data"][0]["specserve"]["tool_call_parser"] == "hermes"
    r = client.chat.completions.create(model=QWEN, messages=ASK, tools=TOOLS, temperature=0, max_tokens=60)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and not ch.message.content
    (call,) = ch.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    deltas = []
    for chunk in client.chat.completions.create(model=QWEN, messages=ASK, tools=TOOLS, temperature=0, max_tokens=60,
                                                stream=True):
        for c in chunk.choices:
            deltas += c.delta.tool_calls or []
            if c.finish_reason:
                assert c.finish_reason == "tool_calls"
    assert [(d.function.name, json.loads(d.function.arguments)) for d in deltas] == [("get_weather", {"city": "Paris"})]
    # the result goes back as a role "tool" message through the chat template
    back = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                  {"role": "tool", "tool_call_id": call.id, "content": "18 degrees C and sunny"}]
    r = client.chat.completions.create(model=QWEN, messages=back, tools=TOOLS, temperature=0, max_tokens=40)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def _stream(base, body, out, started):
    lines = []
    with httpx.Client(base_url=base, timeout=120) as c, c.stream("POST", "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line[6:])
                if len(lines) == 2:
                    started.release()
    out.append(lines)


def test_sigterm_during_long_streams_ends_cleanly_and_exits_0(real_model, tmp_path):
    real_model(SMOL)
    log = tmp_path / "requests.jsonl"
    srv = ServerProcess(["--model", SMOL, "--max-model-len", "2048", "--request-log", str(log),
                         "--graceful-shutdown-s", "2"], tmp_path / "server.log").start(300)
    try:
        seed = httpx.get(srv.base_url + "/v1/models").json()["data"][0]["specserve"]["seed"]
        assert "drawn at random" in srv.log_tail(100000)
        results, started = [], threading.Semaphore(0)
        body = {"prompt": "Once upon a time", "max_tokens": 1800, "ignore_eos": True, "stream": True}
        threads = [threading.Thread(target=_stream, args=(srv.base_url, body, results, started)) for _ in range(8)]
        for t in threads:
            t.start()
        for _ in threads:
            assert started.acquire(timeout=120)
        os.kill(srv.proc.pid, signal.SIGTERM)
        for t in threads:
            t.join(60)
        assert srv.proc.wait(60) == 0
    finally:
        srv.stop()
    assert len(results) == 8
    for lines in results:
        assert lines[-1] == "[DONE]" and json.loads(lines[-2])["error"]["code"] == "server_shutting_down"
    recs = [json.loads(x) for x in log.read_text().splitlines()]
    assert len(recs) == 8 and {r["finish_reason"] for r in recs} == {"abort"} and {r["http_status"] for r in recs} == {503}
    # a restart draws another seed: unseeded requests differ across restarts
    srv2 = ServerProcess(["--model", SMOL, "--max-model-len", "256"], tmp_path / "server2.log").start(300)
    try:
        assert httpx.get(srv2.base_url + "/v1/models").json()["data"][0]["specserve"]["seed"] != seed
    finally:
        srv2.stop()
