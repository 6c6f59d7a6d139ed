"""SSERelay on recorded byte streams: events split across chunks, CRLF framing, the usage chunk the
gateway added, TTFT on the first token-bearing event, and the `specserve` numbers."""

import json

from specserve.gateway.exchange import Exchange
from specserve.gateway.streaming import SSERelay


def _ex(capture=False):
    return Exchange(rid="r", path="/v1/chat/completions", chat=True, raw=b"", body={}, profile="p", reason="weighted",
                    step=None, sticky=None, capture=capture)


def _ev(d):
    return b"data: " + json.dumps(d).encode() + b"\n\n"


def test_relay_splits_events_and_measures():
    ex = _ex(capture=True)
    relay = SSERelay(ex, drop_usage=True)
    role = _ev({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    tok = _ev({"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}]})
    last = _ev({"choices": [{"index": 0, "delta": {"content": "!"}, "finish_reason": "stop"}],
                "specserve": {"num_drafts": 2, "num_accepted_tokens": 3}})
    usage = _ev({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}})
    stream = role + tok + last + usage + b"data: [DONE]\n\n"
    assert relay.feed(role) == role and ex.ttft_s is None  # the role chunk carries no token
    assert relay.feed(tok[:10]) == b""  # half an event is held back
    assert relay.feed(tok[10:]) == tok and ex.ttft_s is not None
    out = relay.feed(last + usage + b"data: [DONE]\n\n")
    assert out == last + b"data: [DONE]\n\n"  # the usage chunk the client did not ask for is dropped
    assert ex.completion_tokens == 2 and ex.prompt_tokens == 5 and ex.spec["num_accepted_tokens"] == 3
    assert [e["choices"][0]["delta"].get("content") for e in ex.events if e["choices"]] == ["", "Hi", "!"]
    kept = SSERelay(_ex(), drop_usage=False)
    assert kept.feed(stream) == stream


def test_relay_crlf_and_junk_pass_through():
    relay = SSERelay(_ex(), drop_usage=True)
    crlf = b'data: {"choices": [{"index": 0, "text": "a"}]}\r\n\r\n'
    junk = b": keep-alive comment\n\ndata: not json\n\n"
    assert relay.feed(crlf + junk) == crlf + junk and relay.ex.ttft_s is not None
