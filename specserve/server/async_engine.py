"""Runs the (not thread-safe) `LLMEngine` in one background thread and talks to asyncio handlers.

What it does:
- Every engine call (tokenize, add_request, abort_request, step, stats) happens on ONE thread.
  Handlers hand work over through a locked inbox drained between steps; the thread sleeps on a
  `threading.Condition` when there is nothing to do (no busy spin) and steps back to back otherwise,
  so concurrent requests are batched by the engine's scheduler.
- `submit()` tokenizes the prompt (text, token ids or chat messages) and adds one engine request per
  choice (ids `f"{request_id}-{i}"`); it resolves with the prompt token ids, or raises the engine's
  error (e.g. RequestError: prompt too long) so the handler can answer 400 before any streaming.
  Outputs arrive on the submission's `asyncio.Queue` as `(choice_index, RequestOutput)`, delivered with
  `loop.call_soon_threadsafe` (one call per step).
- `abort()` (sync, callable from any coroutine or finally block) cancels engine requests and frees
  their KV at once; the queue then gets `(index, ABORTED)`.
- If `step()` raises, every request in flight gets `(index, EngineDeadError)` and the engine is
  marked dead (new submits raise EngineDeadError; /health reports 503).
What it does not do: HTTP, n>1 seeding (the handler builds per-choice SamplingParams), or profiles.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

logger = logging.getLogger("specserve.server")

ABORTED = "aborted"


class EngineDeadError(RuntimeError):
    """The engine loop failed; the server cannot generate any more."""


@dataclass
class Submission:
    """One HTTP request's engine work: its prompt, one SamplingParams per choice, its profile's
    speculative config, the asyncio queue its outputs arrive on, and the future resolved with the
    prompt token ids (or the engine's error) once the engine thread has added it."""

    request_id: str
    prompt: tuple  # ("text", str) | ("ids", list[int]) | ("chat", messages, tools)
    params: list[Any]  # one SamplingParams per choice
    spec_config: Any  # SpeculativeConfig | None
    arrival_time: float
    queue: asyncio.Queue
    future: asyncio.Future
    child_ids: list[str] = field(default_factory=list)


class AsyncEngine:
    """The bridge between asyncio handlers and the engine thread (see the module docstring).

    Args:
        engine: an object with the LLMEngine API.
        poll_timeout_s: how long the idle engine thread sleeps between checks (s).
    """

    def __init__(self, engine: Any, *, poll_timeout_s: float = 1.0):
        self.engine = engine
        self._cond = threading.Condition()
        self._inbox: list[tuple[str, Any]] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._routes: dict[str, tuple[Submission, int]] = {}  # engine thread only
        self._poll_timeout_s = poll_timeout_s
        self.dead: BaseException | None = None
        self.stats: dict[str, Any] = {}
        self.in_flight = 0  # engine requests submitted and not yet finished (event-loop thread only)
        self.num_steps = 0

    # ---- lifecycle (event-loop thread) ---------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the engine thread; outputs are delivered on `loop` (default: the running loop)."""
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="specserve-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the engine thread; requests in flight get EngineDeadError. Waits up to timeout_s (s)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.error("engine thread did not stop within %.1f s", timeout_s)
        self._thread = None

    @property
    def alive(self) -> bool:
        """True while the engine thread runs and no step has failed."""
        return self._thread is not None and self._thread.is_alive() and self.dead is None

    # ---- requests (event-loop thread) ----------------------------------------------------------

    async def submit(self, request_id: str, prompt: tuple, params: list[Any], spec_config: Any,
                     arrival_time: float | None = None) -> tuple[list[int], asyncio.Queue, list[str]]:
        """Tokenize + add len(params) engine requests. Returns (prompt_ids, queue, child_ids)."""
        if self.dead is not None or not self.alive:
            raise EngineDeadError(f"engine is not running: {self.dead!r}")
        loop = asyncio.get_running_loop()
        sub = Submission(request_id, prompt, params, spec_config, arrival_time or time.monotonic(),
                         asyncio.Queue(), loop.create_future(),
                         [f"{request_id}-{i}" for i in range(len(params))])
        self.in_flight += len(params)
        self._post("submit", sub)
        try:
            prompt_ids = await sub.future
        except asyncio.CancelledError:
            self.abort(sub.child_ids)  # the client left while we waited: do not leak engine requests
            raise
        return prompt_ids, sub.queue, sub.child_ids

    def abort(self, child_ids: list[str]) -> None:
        """Cancel engine requests (unknown or finished ids are ignored). Safe to call twice."""
        if child_ids:
            self._post("abort", list(child_ids))

    def _post(self, kind: str, payload: Any) -> None:
        with self._cond:
            self._inbox.append((kind, payload))
            self._cond.notify()

    # ---- callbacks run on the event loop -------------------------------------------------------

    def _resolve(self, sub: Submission, result: Any, error: BaseException | None) -> None:
        if error is not None:
            self.in_flight -= len(sub.params)
            if not sub.future.done():
                sub.future.set_exception(error)
        elif not sub.future.done():
            sub.future.set_result(result)

    def _deliver(self, batch: list[tuple[Submission, int, Any, bool]]) -> None:
        for sub, index, item, final in batch:
            if final:
                self.in_flight -= 1
            sub.queue.put_nowait((index, item))

    def _call(self, fn, *args) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # loop closed between the check and the call (shutdown)
                pass

    # ---- engine thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        eng = self.engine
        self._refresh_stats()
        while True:
            with self._cond:
                while not self._inbox and not self._stopping and (self.dead or not eng.has_unfinished_requests()):
                    self._cond.wait(self._poll_timeout_s)
                ops, self._inbox = self._inbox, []
                stopping = self._stopping
            if stopping:
                self._fail_all(EngineDeadError("server is shutting down"), ops)
                return
            batch: list[tuple[Submission, int, Any, bool]] = []
            for kind, payload in ops:
                if kind == "submit":
                    self._do_submit(payload)
                else:
                    self._do_abort(payload, batch)
            if self.dead is None and eng.has_unfinished_requests():
                try:
                    outs = eng.step()
                    self.num_steps += 1
                except Exception as e:  # noqa: BLE001 - report to every waiting client, then stop stepping
                    logger.exception("engine step failed; the engine is now marked dead")
                    self.dead = e
                    self._fail_all(EngineDeadError(f"engine step failed: {type(e).__name__}: {e}"), [])
                    continue
                for out in outs:
                    route = self._routes.get(out.request_id)
                    if route is None:  # aborted earlier; its final "abort" output is dropped
                        continue
                    if out.finished:
                        del self._routes[out.request_id]
                    out.spec_stats = replace(out.spec_stats, num_accepted_tokens_per_pos=list(out.spec_stats.num_accepted_tokens_per_pos))
                    batch.append((route[0], route[1], out, out.finished))
            self._refresh_stats()
            if batch:
                self._call(self._deliver, batch)

    def _do_submit(self, sub: Submission) -> None:
        eng = self.engine
        if self.dead is not None:
            self._call(self._resolve, sub, None, EngineDeadError(f"engine is dead: {self.dead!r}"))
            return
        added: list[str] = []
        try:
            kind = sub.prompt[0]
            if kind == "text":
                ids = eng.encode_prompt(sub.prompt[1])
            elif kind == "chat":
                ids = eng.encode_chat(sub.prompt[1], tools=sub.prompt[2])
            else:
                ids = list(sub.prompt[1])
            for cid, params in zip(sub.child_ids, sub.params):
                eng.add_request(cid, ids, params, speculative_config=sub.spec_config, arrival_time=sub.arrival_time)
                added.append(cid)
        except Exception as e:  # noqa: BLE001 - the handler maps it to an HTTP status
            for cid in added:
                self._safe_abort(cid)
            self._call(self._resolve, sub, None, e)
            return
        for i, cid in enumerate(sub.child_ids):
            self._routes[cid] = (sub, i)
        self._call(self._resolve, sub, list(ids), None)

    def _do_abort(self, child_ids: list[str], batch: list) -> None:
        for cid in child_ids:
            route = self._routes.pop(cid, None)
            if route is None:
                continue
            self._safe_abort(cid)
            batch.append((route[0], route[1], ABORTED, True))

    def _safe_abort(self, cid: str) -> None:
        try:
            self.engine.abort_request(cid)
        except Exception:  # noqa: BLE001 - already finished / unknown: nothing to free
            logger.debug("abort of %s ignored", cid, exc_info=True)

    def _fail_all(self, error: BaseException, ops: list) -> None:
        batch = []
        for cid, (sub, i) in list(self._routes.items()):
            self._safe_abort(cid)
            batch.append((sub, i, error, True))
        self._routes.clear()
        for kind, payload in ops:
            if kind == "submit":
                self._call(self._resolve, payload, None, error)
        if batch:
            self._call(self._deliver, batch)
        self._refresh_stats()

    def _refresh_stats(self) -> None:
        try:
            self.stats = dict(self.engine.stats())
        except Exception:  # noqa: BLE001 - stats are best effort
            logger.debug("engine.stats() failed", exc_info=True)
