"""Streaming helpers of the gateway: SSE pass-through with measurement, and client-disconnect watching.

`SSERelay` splits a backend's SSE bytes into events, passes each on as soon as it is complete, and
reads from them what the gateway measures (TTFT = first token-bearing event, usage, the `specserve`
numbers); only events that can carry something new are parsed. `RelayStream` is the streaming
response that notices a client's disconnect even while the backend is silent and then closes the
backend stream. `DisconnectGuard` does the same for a non-streamed request, starting only after
`WATCH_AFTER_S` so that fast requests pay for no extra task.
What it does not do: choose backends or retry (`proxy.py`).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse

WATCH_AFTER_S = 0.25  # a non-streamed request starts watching for the client's disconnect after this
_EVENT_END = re.compile(rb"\r?\n\r?\n")


def _has_token(ev: dict) -> bool:
    for c in ev.get("choices") or ():
        if c.get("text"):
            return True
        d = c.get("delta")
        if d and (d.get("content") or d.get("tool_calls") or d.get("reasoning_content")):
            return True
    return False


class SSERelay:
    """Splits a backend's SSE bytes into events, passes them on, and reads TTFT, usage and the
    `specserve` numbers from them. Drops the usage-only chunk when the client did not ask for usage."""

    def __init__(self, ex: Any, drop_usage: bool):
        self.ex = ex
        self.drop_usage = drop_usage
        self.buf = b""

    def feed(self, chunk: bytes) -> bytes:
        self.buf += chunk
        out = []
        pos = 0
        for m in _EVENT_END.finditer(self.buf):
            event = self.buf[pos:m.end()]
            pos = m.end()
            if self._observe(event):
                out.append(event)
        self.buf = self.buf[pos:]
        return b"".join(out)

    def _observe(self, event: bytes) -> bool:
        data = b"".join(line[5:].strip() for line in event.splitlines() if line.startswith(b"data:"))
        if not data or data == b"[DONE]":
            return True
        ex = self.ex
        if (ex.ttft_s is not None and not ex.capture and b'"specserve"' not in data
                and (b'"usage"' not in data or b'"usage":null' in data or b'"usage": null' in data)):
            return True  # a middle event: nothing to learn from it, pass it on unparsed
        try:
            ev = json.loads(data)
        except (ValueError, RecursionError):
            return True
        if not isinstance(ev, dict):
            return True
        if ex.ttft_s is None and _has_token(ev):
            ex.ttft_s = time.perf_counter() - ex.t0
        if isinstance(ev.get("specserve"), dict):
            ex.spec = ev["specserve"]
        if ex.capture:
            ex.events.append(ev)
        usage = ev.get("usage")
        if isinstance(usage, dict):
            ex.prompt_tokens = usage.get("prompt_tokens")
            ex.completion_tokens = usage.get("completion_tokens")
            if self.drop_usage and not ev.get("choices"):
                return False
        return True


class RelayStream(StreamingResponse):
    """StreamingResponse that notices the client's disconnect even while the backend is silent, and
    always closes the body iterator (which closes the backend connection)."""

    async def __call__(self, scope, receive, send):
        try:
            async with anyio.create_task_group() as tg:
                async def stream():
                    try:
                        await self.stream_response(send)
                    except OSError:  # the client is gone
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            await self.body_iterator.aclose()


class DisconnectGuard:
    """After `delay_s`, watch for the client's disconnect and cancel the handler's task when it comes."""

    def __init__(self, request: Request, delay_s: float = WATCH_AFTER_S):
        self.request = request
        self.task = asyncio.current_task()
        self.fired = False
        self.watcher: asyncio.Task | None = None
        self.timer = asyncio.get_running_loop().call_later(delay_s, self._start)

    def _start(self) -> None:
        self.watcher = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while (await self.request.receive())["type"] != "http.disconnect":
            pass
        self.fired = True
        self.task.cancel()

    def close(self) -> None:
        self.timer.cancel()
        if self.watcher is not None:
            self.watcher.cancel()

    def gone(self) -> bool:
        """After a CancelledError: True (and the cancellation undone) when the client went away."""
        if self.fired:
            self.task.uncancel()
            return True
        return False
