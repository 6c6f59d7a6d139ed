"""Gateway over stub backends: ejection and return, retries, streaming pass-through, client
disconnects, and a backend process killed in the middle of a run."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from tests.helpers.gateway_fleet import AUTH, fleet, wait_for

HTTP = httpx.Client(timeout=20)
ROOT = Path(__file__).resolve().parents[2]


def _post(gw, body=None, **kw):
    body = {"prompt": "hello", "max_tokens": 4, "temperature": 0} if body is None else body
    return HTTP.post(gw.base_url + "/v1/completions", json=body, **kw)


def _log_lines(path, n, timeout_s=5.0):
    """The request log's first `n` lines, waiting for them: the gateway writes a request's line after
    the answer's last byte went out, so a client can read the log before its own request's line is there."""
    wait_for(lambda: path.exists() and len(path.read_text().splitlines()) >= n, timeout_s=timeout_s)
    return [json.loads(x) for x in path.read_text().splitlines()]


def _backends(gw):
    return {b["name"]: b for b in HTTP.get(gw.base_url + "/admin/backends", headers=AUTH).json()["backends"]}


def test_health_checks_eject_and_return():
    with fleet({"b1": "baseline", "b2": "baseline"}) as (gw, states, _):
        states["b1"].healthy = False
        wait_for(lambda: not _backends(gw)["b1"]["healthy"], timeout_s=10)
        # Ejected by the first failed check, i.e. within one check interval (counted in checks, not in
        # wall time, which a loaded machine stretches).
        assert _backends(gw)["b1"]["last_error"].startswith("health check failed 1x"), _backends(gw)["b1"]
        assert {_post(gw).headers["x-specserve-backend"] for _ in range(10)} == {"b2"}
        m = HTTP.get(gw.base_url + "/metrics").text
        assert 'specserve:gateway_backend_up{backend="b1",profile="baseline"} 0.0' in m
        assert 'specserve:gateway_ejections_total{backend="b1"} 1.0' in m
        states["b1"].healthy = True
        wait_for(lambda: _backends(gw)["b1"]["healthy"], timeout_s=2)
        assert "b1" in {_post(gw).headers["x-specserve-backend"] for _ in range(30)}
        states["b1"].healthy = states["b2"].healthy = False
        wait_for(lambda: HTTP.get(gw.base_url + "/health").status_code == 503, timeout_s=2)


def test_retries_on_another_backend_of_the_same_profile(tmp_path):
    config = {"request_log": str(tmp_path / "gw.jsonl"), "weights": {"baseline": 1, "ngram": 0}}
    with fleet({"b1": "baseline", "b2": "baseline", "n1": "ngram"}, config) as (gw, states, stubs):
        states["b1"].fail_status = 503
        for user in ("u1", "u2", "u3", "u4", "u5", "u6"):  # sticky users: some land on b1 first
            r = _post(gw, {"prompt": "x", "max_tokens": 2, "user": user})
            assert r.status_code == 200 and r.headers["x-specserve-backend"] == "b2"
        lines = _log_lines(tmp_path / "gw.jsonl", 6)
        assert ["b1", "b2"] in [x["attempts"] for x in lines] and all(x["status"] == "ok" for x in lines)
        states["b2"].fail_status = 503  # every baseline backend fails: the last answer passes through
        r = _post(gw)
        assert r.status_code == 503 and "fails on purpose" in r.json()["error"]["message"]
        assert not states["n1"].requests  # never retried on another profile
        states["b1"].fail_status, states["b2"].fail_status = 500, None  # a 500 is an answer: not retried
        codes = {_post(gw).status_code for _ in range(20)}
        assert codes == {200, 500}
        lines = _log_lines(tmp_path / "gw.jsonl", 6 + 1 + 20)
        assert all(x["attempts"] == ["b1"] for x in lines if x["http_status"] == 500)
        states["b1"].fail_status = None
        stubs["b2"].stop()  # connection refused: retried on b1, and b2 is ejected at once (passive check)
        for _ in range(5):
            assert _post(gw).status_code == 200
        assert not _backends(gw)["b2"]["healthy"]
        m = HTTP.get(gw.base_url + "/metrics").text
        assert 'specserve:gateway_retries_total{backend="b1"}' in m


def test_streaming_pass_through_usage_and_disconnect(tmp_path):
    config = {"request_log": str(tmp_path / "gw.jsonl")}
    with fleet({"b1": "baseline"}, config, n_chunks=6, chunk_delay_s=0.15) as (gw, states, _):
        body = {"prompt": "hi", "max_tokens": 6, "stream": True}
        t0 = time.monotonic()
        arrivals, raw = [], b""
        with HTTP.stream("POST", gw.base_url + "/v1/completions", json=body) as r:
            assert r.headers["x-specserve-backend"] == "b1"
            assert r.headers["content-type"].startswith("text/event-stream")
            for chunk in r.iter_raw():
                arrivals.append(time.monotonic() - t0)
                raw += chunk
        assert arrivals[0] < 0.45 and arrivals[-1] > 0.8  # chunk by chunk, not buffered to the end
        events = [json.loads(x[6:]) for x in raw.decode().split("\n\n") if x.startswith("data: {")]
        assert len(events) == 6 and all(e["choices"] for e in events)  # the usage chunk we asked for is dropped
        assert raw.endswith(b"data: [DONE]\n\n")
        assert states["b1"].requests[-1]["body"]["stream_options"] == {"include_usage": True}
        with HTTP.stream("POST", gw.base_url + "/v1/completions",
                         json={**body, "stream_options": {"include_usage": True}}) as r:
            raw = r.read()
        assert b'"usage"' in raw  # asked for: passed on
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "stream": True}
        with HTTP.stream("POST", gw.base_url + "/v1/chat/completions", json=chat) as r:
            raw = r.read()
        deltas = [json.loads(x[6:])["choices"][0]["delta"] for x in raw.decode().split("\n\n")
                  if x.startswith("data: {")]
        assert deltas[0] == {"role": "assistant", "content": ""} and len(deltas) == 7
        r = HTTP.post(gw.base_url + "/v1/chat/completions", json={**chat, "stream": False})
        assert r.json()["choices"][0]["message"]["content"] == "".join(d.get("content", "") for d in deltas)
        # a client that leaves mid-stream: the backend's stream is closed too
        before = states["b1"].disconnects
        with httpx.Client(timeout=10) as c, c.stream("POST", gw.base_url + "/v1/completions",
                                                     json={**body, "max_tokens": 40}) as r:
            states["b1"].n_chunks = 40
            next(r.iter_raw())
        wait_for(lambda: states["b1"].disconnects == before + 1, timeout_s=3)
        lines = _log_lines(tmp_path / "gw.jsonl", 4)
        assert lines[0]["status"] == "ok" and lines[0]["ttft_s"] > 0 and lines[0]["completion_tokens"] == 6
        assert lines[2]["endpoint"] == "chat" and 0 < lines[2]["ttft_s"] < lines[2]["e2e_s"]
        wait_for(lambda: "cancelled" in (tmp_path / "gw.jsonl").read_text(), timeout_s=3)
        # a non-streamed request whose client gives up is recorded as cancelled (499) as well
        states["b1"].delay_s = 2.0
        try:
            httpx.post(gw.base_url + "/v1/completions", json={"prompt": "slow"}, timeout=0.6)
        except httpx.TimeoutException:
            pass
        wait_for(lambda: sum('"http_status": 499' in x for x in (tmp_path / "gw.jsonl").read_text().splitlines())
                 == 2, timeout_s=3)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stub_process(port, delay_s):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.Popen([sys.executable, "-m", "tests.helpers.stub_backend", "--port", str(port), "--delay-s",
                          str(delay_s)], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(lambda: _up(port), timeout_s=30, step_s=0.1)
    return p


def _up(port):
    try:
        return HTTP.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_killed_backend_loses_no_request_is_ejected_and_returns():
    """Goal: SIGKILL one of two backends mid-run: every non-streamed request still succeeds (retried),
    the backend is ejected within one health-check interval and returns when restarted."""
    from specserve.gateway.app import create_gateway_app
    from specserve.gateway.config import fleet_from_dict
    from specserve.server.launcher import ServerThread

    ports = [_free_port(), _free_port()]
    procs = [_stub_process(p, 0.05) for p in ports]
    interval = 0.5
    cfg = fleet_from_dict({"backends": [{"name": f"b{i}", "url": f"http://127.0.0.1:{p}", "profile": "baseline"}
                                        for i, p in enumerate(ports)],
                           "admin_token": "gw-token", "health": {"interval_s": interval, "timeout_s": 0.5}})
    gw = ServerThread(create_gateway_app(cfg, seed=0)).start()
    results, stop = [], threading.Event()

    def client():
        with httpx.Client(timeout=20) as c:
            while not stop.is_set():
                r = c.post(gw.base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
                results.append((r.status_code, r.headers.get("x-specserve-backend")))

    threads = [threading.Thread(target=client) for _ in range(4)]
    try:
        for t in threads:
            t.start()
        wait_for(lambda: len(results) > 20)
        procs[0].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        procs[0].wait()
        wait_for(lambda: not _backends(gw)["b0"]["healthy"], timeout_s=interval + 1.5, step_s=0.01)
        ejected_after = time.monotonic() - killed_at
        n_at_kill = len(results)
        wait_for(lambda: len(results) > n_at_kill + 40)
        procs[0] = _stub_process(ports[0], 0.05)
        wait_for(lambda: _backends(gw)["b0"]["healthy"], timeout_s=interval + 1.5)
        n = len(results)
        wait_for(lambda: sum(b == "b0" for _, b in results[n:]) >= 3)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        gw.stop()
        for p in procs:
            p.kill()
            p.wait()
    metrics = gw.server.config.app.state.gateway.metrics
    retried = metrics.registry.get_sample_value("specserve:gateway_retries_total", {"backend": "b0"})
    assert [s for s, _ in results if s != 200] == []  # nothing lost
    assert ejected_after <= interval + 0.6, ejected_after  # passive + active checks: within one interval
    assert retried >= 1  # requests in flight on b0 (or sent to it before its ejection) were retried on b1


def test_timeout_bounds_silence_not_the_whole_request():
    """timeout_s is aiohttp's sock_read: a backend silent for longer than it (a non-streamed answer that
    starts late) gets 504; a stream longer than it whose chunks keep coming passes whole."""
    with fleet({"b1": "baseline"}, {"timeout_s": 0.5, "retries": 0}) as (gw, states, _):
        states["b1"].delay_s = 1.5
        r = _post(gw)
        assert r.status_code == 504 and r.json()["error"]["code"] == "gateway_timeout"
        states["b1"].delay_s, states["b1"].n_chunks, states["b1"].chunk_delay_s = 0.0, 10, 0.1
        with HTTP.stream("POST", gw.base_url + "/v1/completions",
                         json={"prompt": "hello", "max_tokens": 10, "temperature": 0, "stream": True}) as r:
            t0 = time.monotonic()
            body = b"".join(r.iter_bytes())
        assert r.status_code == 200 and time.monotonic() - t0 >= 0.9  # longer than timeout_s in all
        assert body.count(b'"text"') == 10 and body.rstrip().endswith(b"data: [DONE]")
