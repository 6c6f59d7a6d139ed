"""The HTTP server over the model-free fake engine (tests/helpers/fake_engine.py), driven by the official
`openai` client.

Fast (no torch model): response shapes, streaming == non-streaming, usage, n, logprobs, stop strings,
profile naming, and the OpenAI-shaped errors with the server still serving afterwards.
The same properties over the real engine are in tests/e2e/test_server_e2e.py.
"""

import json

import httpx
import openai
import pytest

from specserve.rollout.profiles import profile_set_from_dict
from specserve.server.api import ServerSettings, create_app
from specserve.server.launcher import ServerThread
from tests.helpers.fake_engine import fake_client

PROFILES = {"profiles": {"baseline": None, "ngram_4": {"method": "ngram", "num_speculative_tokens": 4},
                         # no global tree: a request's counters do not depend on the requests before it
                         "suffix": {"method": "suffix", "num_speculative_tokens": 3,
                                    "suffix_decoding_max_cached_requests": 0}},
            "weights": {"baseline": 1, "ngram_4": 1, "suffix": 1}}
MODEL = "fake-model"


@pytest.fixture(scope="module")
def server():
    app = create_app(fake_client(max_model_len=128), profile_set_from_dict(PROFILES),
                     ServerSettings(allow_profile_override=True, max_body_bytes=64 * 1024))
    with ServerThread(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=30)


def _stream_text(chunks, chat):
    texts, finishes, usage, blocks = {}, [], None, []
    for ch in chunks:
        d = ch.model_dump()
        if d.get("specserve"):
            blocks.append(d["specserve"])
        if d.get("usage"):
            usage = d["usage"]
        for c in d["choices"]:
            piece = (c["delta"].get("content") if chat else c["text"]) or ""
            texts[c["index"]] = texts.get(c["index"], "") + piece
            if c["finish_reason"]:
                finishes.append((c["index"], c["finish_reason"]))
    return texts, finishes, usage, blocks


@pytest.mark.parametrize("profile", ["baseline", "ngram_4", "suffix"])
def test_completions_stream_equals_non_stream(client, profile):
    kw = dict(model=MODEL, prompt="The quick brown fox", max_tokens=40, temperature=0, extra_body={"profile": profile})
    r = client.completions.create(**kw)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 40 and r.usage.prompt_tokens == len("The quick brown fox")
    spec = r.model_extra["specserve"]
    assert spec["profile"] == profile
    texts, finishes, usage, blocks = _stream_text(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **kw), chat=False)
    assert texts == {0: r.choices[0].text}
    assert finishes == [(0, "length")]
    assert usage["completion_tokens"] == 40
    assert len(blocks) == 2 and blocks[-1] == spec  # finish chunk + usage chunk; same numbers as non-streamed
    if profile != "baseline":
        assert spec["num_drafts"] > 0 and spec["num_accepted_tokens"] > 0


def test_every_profile_greedy_equals_baseline(client):
    outs = {}
    for p in PROFILES["profiles"]:
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=30,
                                           temperature=0, extra_body={"profile": p})
        outs[p] = r.choices[0].message.content
    assert len(set(outs.values())) == 1, outs


def test_chat_stream_shape(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=25, temperature=0)
    r = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    texts, finishes, usage, _ = _stream_text(chunks, chat=True)
    assert texts[0] == r.choices[0].message.content
    assert finishes == [(0, "length")]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (r.usage.prompt_tokens, r.usage.completion_tokens)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 25
    # without include_usage there is no usage chunk
    plain = list(client.chat.completions.create(stream=True, **kw))
    assert all(c.usage is None for c in plain) and plain[-1].choices[0].finish_reason == "length"


def test_n_choices_and_seeds(client):
    r = client.completions.create(model=MODEL, prompt="abc", max_tokens=12, temperature=1.0, seed=7, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.text for c in r.choices}) > 1
    assert r.usage.completion_tokens == 36
    again = client.completions.create(model=MODEL, prompt="abc", max_tokens=12, temperature=1.0, seed=7, n=3)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]
    texts, finishes, usage, _ = _stream_text(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=9, temperature=1.0, seed=7, n=2,
        stream=True, stream_options={"include_usage": True}), chat=True)
    assert set(texts) == {0, 1} and sorted(finishes) == [(0, "length"), (1, "length")]
    assert usage["completion_tokens"] == 18


def test_logprobs_shapes_and_counts(client):
    r = client.completions.create(model=MODEL, prompt="lp", max_tokens=10, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert all(len(t) == 3 for t in lp.top_logprobs) and "".join(lp.tokens) == r.choices[0].text
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=10,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens and all(len(e.top_logprobs) == 2 for e in content)
    assert content[0].bytes == list(content[0].token.encode())
    n = 0
    for ch in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=10,
                                             temperature=0, logprobs=True, top_logprobs=2, stream=True,
                                             extra_body={"profile": "ngram_4"}):
        if ch.choices and ch.choices[0].logprobs:
            n += len(ch.choices[0].logprobs.content)
    assert n == 10


def test_stop_string_streaming(client):
    base = client.completions.create(model=MODEL, prompt="stop test", max_tokens=30, temperature=0).choices[0].text
    third_digit = [i for i, ch in enumerate(base) if ch.isdigit()][2]
    stop = base[third_digit - 2: third_digit + 1]  # first occurs after ~20 tokens, while drafts are accepted
    kw = dict(model=MODEL, prompt="stop test", max_tokens=30, temperature=0, stop=[stop],
              extra_body={"profile": "ngram_4"})
    r = client.completions.create(**kw)
    assert r.choices[0].text == base[: base.index(stop)] and r.choices[0].finish_reason == "stop"
    texts, finishes, _, _ = _stream_text(client.completions.create(stream=True, **kw), chat=False)
    assert texts[0] == r.choices[0].text and finishes == [(0, "stop")]


def test_headers_models_health(server, client):
    resp = client.completions.with_raw_response.create(model=MODEL, prompt="h", max_tokens=2,
                                                       extra_body={"profile": "suffix"})
    assert resp.headers["x-specserve-profile"] == "suffix"
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.base_url + "/health").json() == {"status": "ok", "last_step_age_s": 0.0, "in_flight": 0}


BAD = [
    ("/v1/completions", b"{not json", 400),
    ("/v1/completions", b"[1, 2]", 400),
    ("/v1/completions", b'{"model": "fake-model", "prompt": "x", "max_tokens": "many"}', 400),
    ("/v1/completions", b'{"model": "fake-model", "prompt": "x", "max_tokens": 0}', 400),
    ("/v1/completions", b'{"model": "fake-model", "prompt": "x", "max_tokens": -1}', 400),
    ("/v1/completions", b'{"model": "fake-model", "prompt": "x", "temperature": -1}', 400),
    ("/v1/completions", b'{"model": "fake-model", "prompt": "x", "top_p": 0}', 400),
    ("/v1/completions", b'{"model": "fake-model", "prompt": "x", "top_p": 1.01}', 400),
    ("/v1/completions", b'{"model": "fake-model", "prompt": "x", "n": 0}', 400),
    ("/v1/completions", b'{"model": "fake-model", "prompt": "' + b"y" * 300 + b'"}', 400),
    ("/v1/completions", b'{"model": "fake-model", "prompt": [999999]}', 400),
    ("/v1/completions", b'{"model": "fake-model", "prompt": "x", "profile": "nope"}', 400),
    ("/v1/chat/completions", b'{"model": "fake-model", "messages": "x"}', 400),
    ("/v1/chat/completions", b'{"model": "fake-model", "messages": []}', 400),
    ("/v1/completions", b'{"model": "other-model", "prompt": "x"}', 404),
    ("/v1/nothing", b'{}', 404),
    ("/v1/completions", b'{"model": "fake-model", "prompt": "' + b"z" * 70000 + b'"}', 413),
]


@pytest.mark.parametrize("path, body, status", BAD)
def test_bad_input_gets_its_code_and_server_keeps_serving(server, client, path, body, status):
    r = httpx.post(server.base_url + path, content=body, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    ok = client.completions.create(model=MODEL, prompt="still alive", max_tokens=3, temperature=0)
    assert ok.usage.completion_tokens == 3


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=MODEL, prompt="x", max_tokens=3, temperature=-2)
    assert ei.value.body["param"] == "temperature"
    assert ei.value.body["code"] is None  # OpenAI sends null when there is no reason beyond the status
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=MODEL, prompt="q" * 200, max_tokens=3, stream=True)
    assert ei.value.body["code"] == "context_length_exceeded"


def _sse(server, path, body):
    """The parsed `data:` events of one streamed request (raw, so every key the server sent is seen)."""
    with httpx.stream("POST", server.base_url + path, json=body, timeout=30) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[5:]) for line in r.iter_lines()
                if line.startswith("data:") and line[5:].strip() != "[DONE]"]


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("profile", ["baseline", "ngram_4"])
def test_continuous_usage_stats_counts_every_chunk_exactly(server, chat, profile):
    """stream_options.continuous_usage_stats (vLLM's key): usage on every chunk, its completion_tokens
    the choice's tokens so far, so each chunk's increase is exactly its token count (= its logprob
    entries), also for a chunk whose tokens add no text yet (held back by a stop string prefix)."""
    base = {"model": MODEL, "max_tokens": 30, "temperature": 0, "n": 2, "seed": 1, "stream": True,
            "profile": profile, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if chat:
        path, body, lp = "/v1/chat/completions", {**base, "messages": [{"role": "user", "content": "hi"}],
                                                  "logprobs": True}, "content"
    else:
        path, body, lp = "/v1/completions", {**base, "prompt": "The quick brown fox", "logprobs": 0}, "tokens"
    plain = _sse(server, path, {**body, "stream_options": {"include_usage": True}, "n": 1})
    text = "".join((c["delta"].get("content") if chat else c["text"]) or "" for e in plain for c in e["choices"])
    body["stop"] = [text[9] + "#"]  # never matches, but holds back text after every occurrence of text[9]
    events = _sse(server, path, body)
    choice_events = [e for e in events if e["choices"]]
    assert all(e["usage"] is not None for e in choice_events)
    last, held = {0: 0, 1: 0}, 0
    for e in choice_events:
        c = e["choices"][0]
        n_new = e["usage"]["completion_tokens"] - last[c["index"]]
        last[c["index"]] = e["usage"]["completion_tokens"]
        assert n_new == len((c["logprobs"] or {}).get(lp) or [])
        assert e["usage"]["prompt_tokens"] + e["usage"]["completion_tokens"] == e["usage"]["total_tokens"]
        held += n_new > 0 and not ((c["delta"].get("content") if chat else c["text"]) or "")
    assert last == {0: 30, 1: 30} and (held > 0 or profile != "baseline")  # one token a step: some held back
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 60
    if chat:
        assert events[0]["choices"][0]["delta"]["role"] == "assistant" and events[0]["usage"]["completion_tokens"] == 0
    if profile != "baseline":
        assert max(n for n in (e["usage"]["completion_tokens"] for e in choice_events)) == 30
        assert any(len((e["choices"][0]["logprobs"] or {}).get(lp) or []) > 1 for e in choice_events)
    # continuous_usage_stats alone (without include_usage) adds nothing, as in vLLM
    alone = _sse(server, path, {**body, "stream_options": {"continuous_usage_stats": True}, "n": 1})
    assert all(e.get("usage") is None for e in alone)


def test_an_unknown_profile_error_names_where_it_came_from(server):
    """The `profile` body field or the x-specserve-profile header: the 400's `param` names the one used."""
    url = server.base_url + "/v1/completions"
    body = {"model": MODEL, "prompt": "p", "max_tokens": 2}
    r = httpx.post(url, json={**body, "profile": "nope"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "profile"
    assert r.json()["error"]["code"] == "unknown_profile"
    r = httpx.post(url, json=body, headers={"x-specserve-profile": "nope"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "x-specserve-profile"
