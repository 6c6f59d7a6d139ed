"""Streaming helpers of the gateway: SSE pass-through with measurement, and client-disconnect watching.

`SSERelay` passes a backend's SSE bytes on as soon as they form complete events and reads from them
what the gateway measures (TTFT = first token-bearing event, usage, the `specserve` numbers). Fast
path: once TTFT is known, a chunk that ends on an event boundary and holds neither `"usage"` nor
`"specserve"` (two substring scans) is passed on as the very same bytes object, unsplit and unparsed;
otherwise the chunk's event boundaries are found and only the events holding one of those markers
are read (the rest pass on unread, and the chunk is cut only around a dropped usage chunk).
`DisconnectGuard` watches for the client's disconnect and cancels the handler's task when it comes: a
stream watches from its start (`delay_s=0`), a non-streamed request only after `WATCH_AFTER_S` so that
fast requests pay for no extra task.
What it does not do: choose backends, retry or send (`proxy.py`).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any, Awaitable, Callable

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


def _next_marker(chunk: bytes, start: int) -> int:
    """Where the next `"usage"` or `"specserve"` in `chunk` from `start` is (len(chunk) when none)."""
    u = chunk.find(b'"usage"', start)
    v = chunk.find(b'"specserve"', start)
    if u < 0:
        return v if v >= 0 else len(chunk)
    return u if v < 0 or u < v else v


class SSERelay:
    """Passes a backend's SSE bytes on, complete events only, and reads TTFT, usage and the `specserve`
    numbers from them (into the `Exchange` `ex`). Drops the usage-only chunk when the client did not ask
    for usage (`drop_usage`). With `ex.capture` (a shadow-check sample) every event is parsed and kept
    in `ex.events`."""

    __slots__ = ("ex", "drop_usage", "buf")

    def __init__(self, ex: Any, drop_usage: bool):
        self.ex = ex
        self.drop_usage = drop_usage
        self.buf = b""  # the start of an event whose terminating blank line has not arrived yet

    def feed(self, chunk: bytes) -> bytes:
        """The bytes to pass on now for `chunk` (possibly b""; `chunk` itself on the fast path)."""
        if self.buf:
            chunk = self.buf + chunk
            self.buf = b""
        ex = self.ex
        skim = ex.ttft_s is not None and not ex.capture  # only events with a marker need reading
        if skim and chunk.endswith(b"\n\n") and b'"usage"' not in chunk and b'"specserve"' not in chunk:
            return chunk  # fast path: whole events with nothing to learn from them
        drop: list[tuple[int, int]] = []  # (start, end) of events not passed on
        nxt = _next_marker(chunk, 0) if skim else 0
        pos = 0
        for m in _EVENT_END.finditer(chunk):
            start, pos = pos, m.end()
            if skim and nxt >= pos:
                continue  # no marker in this event: passed on unread
            if not self._observe(chunk[start:pos]):
                drop.append((start, pos))
            skim = ex.ttft_s is not None and not ex.capture
            if skim:
                nxt = _next_marker(chunk, pos)
        self.buf = chunk[pos:]
        if not drop:
            return chunk if pos == len(chunk) else chunk[:pos]
        parts, last = [], 0
        for start, end in drop:
            parts.append(chunk[last:start])
            last = end
        parts.append(chunk[last:pos])
        return b"".join(parts)

    def _observe(self, event: bytes) -> bool:
        """Read what the gateway measures from one event; False when the event is not passed on."""
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


class DisconnectGuard:
    """After `delay_s` (0: at once), watch the ASGI `receive` for the client's disconnect and cancel the
    handler's task (the current one) when it comes. Call `finish()` just before the answer's last byte
    goes out (from then on a disconnect is the normal end, not a cancellation) and `close()` after."""

    __slots__ = ("receive", "task", "fired", "finished", "watcher", "timer")

    def __init__(self, receive: Callable[[], Awaitable[dict]], delay_s: float = WATCH_AFTER_S):
        self.receive = receive
        self.task = asyncio.current_task()
        self.fired = False
        self.finished = False
        self.watcher: asyncio.Task | None = None
        self.timer: asyncio.TimerHandle | None = None
        loop = asyncio.get_running_loop()
        if delay_s > 0:
            self.timer = loop.call_later(delay_s, self._start)
        else:
            self._start()

    def _start(self) -> None:
        self.watcher = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while (await self.receive())["type"] != "http.disconnect":
            pass
        if not self.finished:
            self.fired = True
            self.task.cancel()

    def finish(self) -> None:
        self.finished = True

    def close(self) -> None:
        """Stop watching. The references to both tasks are dropped: the cancelled watcher's CancelledError
        holds its frame, which holds this guard; kept, they would form a reference cycle holding the whole
        request (scope, ASGI cycle, task) until the next garbage collection, about 20 objects a stream."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.watcher is not None:
            self.watcher.cancel()
            self.watcher = None
        self.task = None

    def gone(self) -> bool:
        """After a CancelledError: True (and the cancellation undone) when the client went away."""
        if self.fired:
            self.task.uncancel()
            return True
        return False
