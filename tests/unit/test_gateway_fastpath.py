"""The gateway's hot path as a plain ASGI handler: the body-size limit checked while the body arrives
(413 before a chunked body ends), the SSE fast path (backend chunks passed on as the same bytes, usage
and TTFT still recorded), and recording after the answer's last byte."""

import json
import socket
from urllib.parse import urlparse

import httpx

from specserve.gateway.exchange import Exchange
from specserve.gateway.streaming import SSERelay
from tests.helpers.gateway_fleet import fleet, wait_for

HTTP = httpx.Client(timeout=20)


def _ex(capture=False):
    return Exchange(rid="r", path="/v1/completions", chat=False, raw=b"", body={}, profile="p", reason="weighted",
                    step=None, sticky=None, capture=capture)


def _ev(d):
    return b"data: " + json.dumps(d).encode() + b"\n\n"


def _log_lines(path, n):
    wait_for(lambda: path.exists() and len(path.read_text().splitlines()) >= n, timeout_s=5)
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_relay_fast_path_passes_chunks_unchanged_and_still_measures():
    ex = _ex()
    relay = SSERelay(ex, drop_usage=True)
    first = _ev({"choices": [{"index": 0, "text": "a", "finish_reason": None}]})
    assert relay.feed(first) == first and ex.ttft_s is not None  # parsed: the first token
    ttft = ex.ttft_s
    middle = (_ev({"choices": [{"index": 0, "text": " b", "finish_reason": None}]})
              + _ev({"choices": [{"index": 0, "text": " c", "finish_reason": None}]}))
    assert relay.feed(middle) is middle  # fast path: the very same bytes object, not split or re-joined
    nulls = _ev({"choices": [{"index": 0, "text": " d"}], "usage": None})
    assert relay.feed(nulls) == nulls  # "usage": null is scanned, parsed away, passed on
    last = _ev({"choices": [{"index": 0, "text": " e", "finish_reason": "length"}],
                "specserve": {"num_drafts": 1, "num_accepted_tokens": 2}})
    usage = _ev({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5}})
    assert relay.feed(last + usage + b"data: [DONE]\n\n") == last + b"data: [DONE]\n\n"  # added usage dropped
    assert ex.completion_tokens == 5 and ex.prompt_tokens == 3 and ex.spec["num_accepted_tokens"] == 2
    assert ex.ttft_s == ttft
    # an event split across chunks is held until its blank line, then passed on whole
    relay2 = SSERelay(_ex(), drop_usage=False)
    relay2.feed(first)
    assert relay2.feed(middle[:7]) == b"" and relay2.feed(middle[7:]) == middle and relay2.buf == b""


def test_stream_through_gateway_is_byte_identical_and_recorded(tmp_path):
    config = {"request_log": str(tmp_path / "gw.jsonl")}
    with fleet({"b1": "baseline"}, config, n_chunks=12) as (gw, states, stubs):
        body = {"prompt": "same bytes", "max_tokens": 12, "stream": True, "stream_options": {"include_usage": True}}
        direct = HTTP.post(stubs["b1"].base_url + "/v1/completions", json=body).content
        via = HTTP.post(gw.base_url + "/v1/completions", json=body)
        assert via.status_code == 200 and via.headers["x-specserve-backend"] == "b1"
        assert via.content == direct and b'"usage"' in via.content  # asked for: passed on, nothing changed
        plain = {**body, "stream_options": None}
        plain.pop("stream_options")
        via = HTTP.post(gw.base_url + "/v1/completions", json=plain).content
        events = direct.split(b"\n\n")
        assert via.split(b"\n\n") == [e for e in events if b'"usage"' not in e]  # only the added usage chunk goes
        lines = _log_lines(tmp_path / "gw.jsonl", 2)
        for line in lines:
            assert line["status"] == "ok" and line["completion_tokens"] == 12 and line["prompt_tokens"] == 2
            assert 0 < line["ttft_s"] <= line["e2e_s"]
        m = HTTP.get(gw.base_url + "/metrics").text
        assert 'specserve:time_to_first_token_seconds_count{profile="baseline"} 2.0' in m
        assert 'specserve:generation_tokens_total{profile="baseline"} 24.0' in m


def _raw_http(base_url: str, head: bytes, first_part: bytes) -> bytes:
    """Send a request head and the first part of its body, never the rest; the whole answer read."""
    u = urlparse(base_url)
    with socket.create_connection((u.hostname, u.port), timeout=10) as s:
        s.sendall(head + first_part)
        out = b""
        while chunk := s.recv(65536):  # the gateway closes the connection after its 413
            out += chunk
    return out


def test_body_limit_413_while_the_body_streams_in(tmp_path):
    config = {"request_log": str(tmp_path / "gw.jsonl"), "max_body_bytes": 1000}
    with fleet({"b1": "baseline"}, config) as (gw, states, _):
        # chunked, no Content-Length: answered 413 once 1500 bytes are in, before the body ends
        head = (b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
                b"transfer-encoding: chunked\r\n\r\n")
        out = _raw_http(gw.base_url, head, b"5dc\r\n" + b" " * 1500 + b"\r\n")
        status, _, rest = out.partition(b"\r\n")
        assert status.startswith(b"HTTP/1.1 413"), out
        headers, _, payload = rest.partition(b"\r\n\r\n")
        assert b"connection: close" in headers.lower()
        err = json.loads(payload)["error"]
        assert err["code"] == "request_too_large" and err["type"] == "invalid_request_error"
        assert "1000 bytes" in err["message"]
        # a declared Content-Length over the limit: 413 at once, nothing read
        head = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
                b"content-length: 5000\r\n\r\n")
        out = _raw_http(gw.base_url, head, b"{")
        assert out.startswith(b"HTTP/1.1 413") and b"request body of 5000 bytes exceeds" in out
        # under the limit in several chunks: read whole and forwarded unchanged
        parts = [b'{"prompt": "', b"x" * 600, b'", "max_tokens": 2}']
        r = HTTP.post(gw.base_url + "/v1/completions", content=iter(parts),
                      headers={"content-type": "application/json"})
        assert r.status_code == 200 and states["b1"].requests[-1]["body"]["prompt"] == "x" * 600
        assert not any(len(q["body"].get("prompt", "")) > 600 for q in states["b1"].requests)
        lines = _log_lines(tmp_path / "gw.jsonl", 3)
        assert [x["http_status"] for x in lines] == [413, 413, 200]
        m = HTTP.get(gw.base_url + "/metrics").text
        assert 'specserve:requests_total{code="413",profile="none",status="error"} 2.0' in m
        # the other routes keep their limit too
        r = HTTP.post(gw.base_url + "/admin/weights", content=b" " * 2000)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_gateway_import_loads_no_numpy_or_httpx():
    """The gateway serves with aiohttp and its own code: importing it (and the CLI) loads neither numpy
    (the rollout gates import it at their first evaluation) nor httpx (the benchmark tools' client)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    code = ("import sys, specserve.cli, specserve.gateway.app, specserve.gateway.proxy; "
            "print(sorted(m for m in ('numpy', 'httpx', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_streams_leave_no_reference_cycles():
    """A finished stream frees its objects at once: its disconnect watcher, once cancelled, must not keep
    the request (task, scope, ASGI cycle) in a reference cycle for the garbage collector (whose passes
    would then come every few dozen streams, a pause on the gateway's event loop each)."""
    import asyncio
    import gc

    from specserve.gateway.streaming import DisconnectGuard

    body = json.dumps({"prompt": "hello", "max_tokens": 4, "temperature": 0, "stream": True}).encode()
    with fleet({"b1": "baseline"}) as (gw, _, _):
        u = urlparse(gw.base_url)
        with socket.create_connection((u.hostname, u.port)) as s:
            def stream():
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n" % len(body) + body)
                buf = b""
                while not buf.endswith(b"0\r\n\r\n"):  # the chunked body's end
                    buf += s.recv(65536)
                assert b"[DONE]" in buf

            stream()
            gc.collect()
            gc.set_debug(gc.DEBUG_SAVEALL)
            try:
                for _ in range(20):
                    stream()
                gc.collect()
                leaked = [o for o in gc.garbage if isinstance(o, (DisconnectGuard, asyncio.Task))]
            finally:
                gc.set_debug(0)
                gc.garbage.clear()
    assert leaked == []
