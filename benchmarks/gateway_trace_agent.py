"""Per-process tracer for `gateway_trace.py`: runs the stub backend or the gateway with timestamps.

    python benchmarks/gateway_trace_agent.py stub|gateway ARGS...   (env TRACE_OUT=file.json)

Installs, before the process's own `main()` runs:
- a raw ASGI wrapper around the served app that records, per POST request (keyed by `x-request-id`),
  `time.perf_counter()` (CLOCK_MONOTONIC, comparable across processes) at receive, first body byte
  sent, last body byte sent and exit, each with the thread's cumulative run-queue delay
  (`/proc/thread-self/schedstat`, ns the thread was runnable but not running);
- in the gateway, also the upstream send and the upstream response head (`Proxy._send`), the
  upstream body's end (`Proxy._read_whole`, non-streamed) and each health-check round;
- `gc.callbacks`: start, end (wall and thread CPU time) and generation of every collection;
- an event-loop lag monitor (a 5 ms sleep in a loop; lag = how late it woke), started with the app's
  lifespan.
Everything is written as JSON to `$TRACE_OUT` when the app's lifespan shuts down (uvicorn's graceful
shutdown on SIGTERM).
What it does not do: change what the process serves or how; it costs a few µs per event.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

_perf = time.perf_counter
_thread_time = time.thread_time
T: dict = {"requests": {}, "upstream": {}, "gc": [], "lag": [], "pid": os.getpid()}
_fd: int | None = None


def run_delay_ns() -> int:
    """This thread's cumulative run-queue delay (ns) from /proc/thread-self/schedstat (0 if absent)."""
    global _fd
    try:
        if _fd is None:
            _fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        return int(os.pread(_fd, 64, 0).split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def install_gc_trace(store: list) -> None:
    """Append (start, end, cpu_s, generation, collected) of every collection to `store`."""
    state = {}

    def cb(phase, info):
        if phase == "start":
            state["t"], state["c"] = _perf(), _thread_time()
        else:
            store.append((state.get("t", 0.0), _perf(), _thread_time() - state.get("c", 0.0), info["generation"],
                          info["collected"]))

    gc.callbacks.append(cb)


async def lag_monitor(store: list, period_s: float = 0.005) -> None:
    """Record (time, lag s) whenever a `period_s` sleep wakes more than 0.5 ms late."""
    while True:
        t = _perf()
        await asyncio.sleep(period_s)
        lag = _perf() - t - period_s
        if lag > 0.0005:
            store.append((t + period_s, lag))


class TraceASGI:
    def __init__(self, app):
        self.app = app
        self.state = getattr(app, "state", None)
        self._lag_task = None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            self._lag_task = asyncio.get_running_loop().create_task(lag_monitor(T["lag"]))

            async def lifespan_send(msg):
                if msg["type"] == "lifespan.shutdown.complete":
                    self._lag_task.cancel()
                    _dump()  # (uvicorn re-raises SIGTERM after its shutdown: atexit would not run)
                await send(msg)

            return await self.app(scope, receive, lifespan_send)
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        t_in, d_in = _perf(), run_delay_ns()
        rid = next((v.decode() for k, v in scope["headers"] if k == b"x-request-id"), None)
        rec = [t_in, d_in, None, None, None, None, None]

        async def traced_send(msg):
            if msg["type"] == "http.response.body":
                if rec[2] is None:
                    rec[2] = _perf()
                if not msg.get("more_body", False):
                    await send(msg)
                    rec[3], rec[4] = _perf(), run_delay_ns()
                    return
            await send(msg)

        try:
            await self.app(scope, receive, traced_send)
        finally:
            rec[5], rec[6] = _perf(), run_delay_ns()
            if rid is not None:
                T["requests"][rid] = rec


def _patch_gateway() -> None:
    import specserve.gateway.app as A
    from specserve.gateway.proxy import Proxy

    create = A.create_gateway_app
    A.create_gateway_app = lambda *a, **k: TraceASGI(create(*a, **k))
    send0, read0 = Proxy._send, Proxy._read_whole

    async def _send(self, ex, b):
        t = _perf()
        try:
            return await send0(self, ex, b)
        finally:
            T["upstream"].setdefault(ex.rid, {}).update(send=t, head=_perf())

    async def _read_whole(self, ex, b):
        try:
            return await read0(self, ex, b)
        finally:
            T["upstream"].setdefault(ex.rid, {})["done"] = _perf()

    Proxy._send, Proxy._read_whole = _send, _read_whole
    from specserve.gateway.backends import HealthChecker

    check0 = HealthChecker.check_all

    async def check_all(self):  # (start, end) of every health-check round
        t = _perf()
        try:
            return await check0(self)
        finally:
            T.setdefault("health", []).append((t, _perf()))

    HealthChecker.check_all = check_all


def _patch_stub() -> None:
    import tests.helpers.stub_backend as S

    make = S.make_stub_app
    S.make_stub_app = lambda *a, **k: TraceASGI(make(*a, **k))


def _dump() -> None:
    out = os.environ.get("TRACE_OUT")
    if out:
        T["gc_frozen"] = gc.get_freeze_count()
        Path(out).write_text(json.dumps(T))


def main() -> None:
    which, argv = sys.argv[1], sys.argv[2:]
    install_gc_trace(T["gc"])
    if which == "gateway":
        _patch_gateway()
        from specserve.cli import main as cli_main

        sys.argv = ["specserve", "gateway", *argv]
        sys.exit(cli_main())
    elif which == "stub":
        _patch_stub()
        import tests.helpers.stub_backend as S

        sys.argv = ["stub_backend", *argv]
        S.main()
    else:
        raise SystemExit(f"unknown process {which!r} (stub or gateway)")


if __name__ == "__main__":
    main()
