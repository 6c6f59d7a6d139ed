"""Server health and shutdown: the engine watchdog and the graceful drain.

What it does:
- `health()`: the /health answer. 503 when the engine thread died, when the engine watchdog fires
  (requests are pending and no step has finished for `watchdog_s`: a hung forward, a wedged device), or
  while the server drains; 200 otherwise. It recovers by itself when steps resume. The Prometheus gauges
  `specserve:engine_last_step_age_seconds`, `specserve:engine_healthy` and `specserve:server_draining`
  follow it.
- `drain()`: what SIGTERM / SIGINT start (`launcher.py`): new generation requests get 503 +
  Retry-After at once; running requests get up to `grace_s` seconds to finish; the rest are ended with
  a clean error (streams: an error event and `[DONE]`; non-streamed: a 503 body), and every one of them
  is in the request log (finish_reason "abort"). Then the server can exit with status 0.
What it does not do: stop uvicorn or the engine (the launcher and the app's lifespan do).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specserve.server.serving import ServerState

logger = logging.getLogger("specserve.server")


def health(state: ServerState, watchdog_s: float) -> tuple[int, dict[str, Any]]:
    """(HTTP status, body) of /health; also updates the health gauges."""
    engine = state.engine
    age = engine.last_step_age_s() if engine.alive else 0.0
    stalled = watchdog_s > 0 and age > watchdog_s
    healthy = engine.alive and not stalled
    state.metrics.set_health(age, healthy, state.draining)
    body: dict[str, Any] = {"status": "ok", "last_step_age_s": round(age, 3), "in_flight": engine.in_flight}
    if not engine.alive:
        body.update(status="unavailable", reason="the engine is not running")
    elif stalled:
        body.update(status="unavailable",
                    reason=f"engine watchdog: requests are pending and no step finished for {age:.1f} s "
                           f"(limit {watchdog_s:g} s)")
    elif state.draining:
        body.update(status="draining", reason="the server is shutting down")
    return (200 if body["status"] == "ok" else 503), body


async def drain(state: ServerState, grace_s: float, *, poll_s: float = 0.05) -> dict[str, int]:
    """Stop admitting, give running requests `grace_s` seconds, then end the rest (see the module
    docstring). Returns {"finished": ..., "ended": ...}: requests that finished within the grace, and
    requests the server ended."""
    state.draining = True
    start = len(state.generations)
    logger.warning("draining: %d request(s) running; new requests get 503; grace %.1f s", start, grace_s)
    deadline = time.monotonic() + max(0.0, grace_s)
    while state.generations and time.monotonic() < deadline:
        await asyncio.sleep(poll_s)
    left = list(state.generations)
    for gen in left:
        gen.shutdown(f"the server is shutting down: the request was ended after the {grace_s:g} s grace period")
    end_by = time.monotonic() + 5.0  # the streams send their error event and [DONE], the log lines are written
    while state.generations and time.monotonic() < end_by:
        await asyncio.sleep(poll_s)
    for gen in list(state.generations):  # a consumer that never read its queue (client gone): record it now
        gen.cancel()
        state.generations.discard(gen)
    logger.warning("drained: %d finished within the grace period, %d ended", start - len(left), len(left))
    return {"finished": start - len(left), "ended": len(left)}
