"""`AsyncEngine`: the `EngineClient` over an `LLMEngine`, which it runs in one background thread.

What it does:
- Every engine call (encode, add_request, abort_request, step, stats) happens on ONE thread (the
  engine is not thread-safe). Handlers hand work over through a locked inbox drained between steps;
  the thread sleeps on a `threading.Condition` when there is nothing to do (no busy spin) and steps
  back to back otherwise, so concurrent requests are batched by the engine's scheduler.
- `encode()` tokenizes (and templates) a prompt on a separate tokenizer thread, never the engine
  thread: its own copy of the tokenizer (tokenizers are not safe to share between threads), at the
  low CPU priority (nice 10: about a tenth of a core's time when it competes with the engine thread, so a
  large prompt barely slows the engine's steps; not 19, which a busy machine can starve while it holds
  the GIL), after
  the cheap size check of `specserve.tokenization.PromptEncoder`.
- `submit()` adds one engine request per choice (ids `f"{request_id}-{i}"`) for a prompt (the server
  passes token ids, so the engine thread only checks them); it returns an `EngineRequest`, or raises
  the engine's error (an `InvalidRequestError`) before anything streams. Each step's outputs reach the request's queue as `Output(index, RequestOutput)` items,
  delivered with `loop.call_soon_threadsafe` (one call per step); RequestOutputs are deltas with
  frozen counters, so nothing is shared with the engine thread.
- `abort()` (sync, callable from any coroutine or finally block) cancels engine requests and frees
  their KV at once; the queue then gets `Aborted(index)`.
- If `step()` raises, every request in flight gets `Failed(index, EngineDeadError)` and the engine is
  marked dead (new submits raise EngineDeadError; /health reports 503).
- `last_step_age_s()` (the watchdog's input): how long work has been pending without a finished step.
What it does not do: HTTP, n>1 seeding (the handler builds per-choice SamplingParams), or profiles.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from specserve.config import SpeculativeConfig
from specserve.engine.llm_engine import LLMEngine
from specserve.inputs import Prompt, TokenPrompt
from specserve.sampling_params import SamplingParams
from specserve.server.engine_client import Aborted, EngineDeadError, EngineRequest, Failed, Output, QueueItem
from specserve.tokenization import PromptEncoder

logger = logging.getLogger("specserve.server")


@dataclass
class _Submission:
    """One `submit()` on its way to the engine thread: the future is resolved with the prompt token ids
    (or the engine's error) once the thread has added every choice."""

    prompt: Prompt
    params: Sequence[SamplingParams]
    spec_config: SpeculativeConfig | None
    arrival_time: float
    child_ids: list[str]
    queue: asyncio.Queue
    future: asyncio.Future
    first_index: int = 0


class AsyncEngine:
    """The `EngineClient` over an `LLMEngine` (see the module docstring).

    Args:
        engine: the engine; from now on only this object's thread may call it.
        poll_timeout_s: how long the idle engine thread sleeps between checks (s).
        max_prompt_tokens: the per-request prompt limit (tokens); None: the context minus one.
    """

    def __init__(self, engine: LLMEngine, *, poll_timeout_s: float = 1.0, max_prompt_tokens: int | None = None):
        self.engine = engine
        self.model_name: str = engine.model_name
        self.model_checksum: str | None = engine.model_checksum
        self.max_model_len: int = engine.max_model_len
        self.max_num_seqs: int = engine.config.max_num_seqs
        self.tokenizer: Any = engine.tokenizer
        self.vocab_size: int = engine.prompt_encoder.vocab_size
        self._encoder = PromptEncoder(copy.deepcopy(engine.tokenizer), vocab_size=self.vocab_size,
                                      max_model_len=self.max_model_len, max_prompt_tokens=max_prompt_tokens,
                                      model_name=self.model_name)
        self.max_prompt_tokens: int = self._encoder.max_prompt_tokens
        self._tokenizer_pool: ThreadPoolExecutor | None = None
        self._last_progress = time.monotonic()  # engine thread: last finished step, or waking with work
        self._work_since = time.monotonic()  # event loop: when in_flight last rose from 0
        self._cond = threading.Condition()
        self._inbox: list[tuple[str, Any]] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._routes: dict[str, tuple[_Submission, int]] = {}  # engine thread only
        self._poll_timeout_s = poll_timeout_s
        self._dead: BaseException | None = None
        self._stats: dict[str, Any] = {}
        self.in_flight = 0  # engine requests submitted and not yet finished (event-loop thread only)
        self.num_steps = 0

    def prepare_speculative_config(self, spec_config: SpeculativeConfig) -> None:
        """Build the proposer for `spec_config` now (a draft model loads once).

        Raises:
            RuntimeError: the engine thread already runs (the engine is not thread-safe).
            ConfigError: the engine cannot build that proposer.
        """
        if self._thread is not None:
            raise RuntimeError("prepare_speculative_config() must be called before start()")
        self.engine.prepare_speculative_config(spec_config)

    def stats(self) -> dict[str, Any]:
        """The engine's gauges as of its last step (a copy; see LLMEngine.stats)."""
        return dict(self._stats)

    @property
    def dead(self) -> BaseException | None:
        """The error that stopped the engine thread, or None."""
        return self._dead

    # ---- lifecycle (event-loop thread) ---------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the engine thread and the tokenizer thread; outputs are delivered on `loop` (default: the
        running loop)."""
        self._loop = loop or asyncio.get_running_loop()
        self._tokenizer_pool = ThreadPoolExecutor(1, thread_name_prefix="specserve-tokenizer",
                                                  initializer=_low_priority)
        self._tokenizer_pool.submit(lambda: self._encoder.max_bytes_per_token)  # measured once, off the loop
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
        if self._tokenizer_pool is not None:
            self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)
            self._tokenizer_pool = None

    def last_step_age_s(self) -> float:
        """Seconds since the engine thread last finished a step (or woke up with work), counted only while
        requests are in flight; 0 when idle."""
        if self.in_flight <= 0:
            return 0.0
        return max(0.0, time.monotonic() - max(self._last_progress, self._work_since))

    async def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of `prompt`, computed on the tokenizer thread (see the module docstring).

        Raises:
            InvalidRequestError: the prompt is refused (empty, over the limit, bad ids, template error).
            EngineDeadError: the server is stopping.
        """
        pool = self._tokenizer_pool
        if pool is None:
            raise EngineDeadError("engine is not running")
        self._encoder.precheck(prompt)  # an oversized prompt never waits behind others' tokenization
        try:
            return await asyncio.get_running_loop().run_in_executor(pool, self._encoder.encode, prompt)
        except RuntimeError as e:  # the pool shut down meanwhile
            if "shutdown" in str(e):
                raise EngineDeadError("server is shutting down") from None
            raise

    @property
    def alive(self) -> bool:
        """True while the engine thread runs and no step has failed."""
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    # ---- requests (event-loop thread) ----------------------------------------------------------

    async def submit(self, request_id: str, prompt: Prompt, params: Sequence[SamplingParams],
                     spec_config: SpeculativeConfig | None, arrival_time: float | None = None, *,
                     queue: asyncio.Queue | None = None, first_index: int = 0) -> EngineRequest:
        """Add len(params) engine requests for `prompt` (see EngineClient.submit).

        Raises:
            InvalidRequestError: the engine refused the prompt.
            EngineDeadError: the engine is not running.
            Exception: anything else the engine raised while adding the request (a bug: the server
                answers 500).
        """
        if self._dead is not None or not self.alive:
            raise EngineDeadError(f"engine is not running: {self._dead!r}")
        loop = asyncio.get_running_loop()
        sub = _Submission(prompt, params, spec_config, arrival_time or time.monotonic(),
                          [f"{request_id}-{i}" for i in range(len(params))], queue if queue is not None else asyncio.Queue(),
                          loop.create_future(), first_index)
        if self.in_flight <= 0:
            self._work_since = time.monotonic()
        self.in_flight += len(params)
        self._post("submit", sub)
        try:
            prompt_ids = await sub.future
        except asyncio.CancelledError:
            self.abort(sub.child_ids)  # the client left while we waited: do not leak engine requests
            raise
        return EngineRequest(prompt_ids, sub.child_ids, sub.queue)

    def abort(self, child_ids: Sequence[str]) -> None:
        """Cancel engine requests (unknown or finished ids are ignored). Safe to call twice."""
        if child_ids:
            self._post("abort", list(child_ids))

    def _post(self, kind: str, payload: Any) -> None:
        with self._cond:
            self._inbox.append((kind, payload))
            self._cond.notify()

    # ---- callbacks run on the event loop -------------------------------------------------------

    def _resolve(self, sub: _Submission, result: Any, error: BaseException | None) -> None:
        if error is not None:
            self.in_flight -= len(sub.params)
            if not sub.future.done():
                sub.future.set_exception(error)
        elif not sub.future.done():
            sub.future.set_result(result)

    def _deliver(self, batch: list[tuple[_Submission, QueueItem]]) -> None:
        for sub, item in batch:
            if not isinstance(item, Output) or item.output.finished:
                self.in_flight -= 1
            sub.queue.put_nowait(item)

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
                while not self._inbox and not self._stopping and (self._dead or not eng.has_unfinished_requests()):
                    self._cond.wait(self._poll_timeout_s)
                    self._last_progress = time.monotonic()
                ops, self._inbox = self._inbox, []
                stopping = self._stopping
            if stopping:
                self._fail_all(EngineDeadError("server is shutting down"), ops)
                return
            batch: list[tuple[_Submission, QueueItem]] = []
            for kind, payload in ops:
                if kind == "submit":
                    self._do_submit(payload)
                else:
                    self._do_abort(payload, batch)
            if self._dead is None and eng.has_unfinished_requests():
                try:
                    outs = eng.step()
                    self.num_steps += 1
                    self._last_progress = time.monotonic()
                except Exception as e:  # noqa: BLE001 - report to every waiting client, then stop stepping
                    logger.exception("engine step failed; the engine is now marked dead")
                    self._dead = e
                    self._fail_all(EngineDeadError(f"engine step failed: {type(e).__name__}: {e}"), [])
                    continue
                for out in outs:
                    route = self._routes.get(out.request_id)
                    if route is None:  # aborted earlier; its final "abort" output is dropped
                        continue
                    if out.finished:
                        del self._routes[out.request_id]
                    batch.append((route[0], Output(route[1], out)))
            self._refresh_stats()
            if batch:
                self._call(self._deliver, batch)

    def _do_submit(self, sub: _Submission) -> None:
        eng = self.engine
        if self._dead is not None:
            self._call(self._resolve, sub, None, EngineDeadError(f"engine is dead: {self._dead!r}"))
            return
        added: list[str] = []
        try:
            ids = eng.encode(sub.prompt)
            for cid, params in zip(sub.child_ids, sub.params):
                eng.add_request(cid, TokenPrompt(ids), params, speculative_config=sub.spec_config,
                                arrival_time=sub.arrival_time)
                added.append(cid)
        except Exception as e:  # noqa: BLE001 - the handler maps it to an HTTP status by its type
            for cid in added:
                self._safe_abort(cid)
            self._call(self._resolve, sub, None, e)
            return
        for i, cid in enumerate(sub.child_ids):
            self._routes[cid] = (sub, sub.first_index + i)
        self._call(self._resolve, sub, list(ids), None)

    def _do_abort(self, child_ids: list[str], batch: list[tuple[_Submission, QueueItem]]) -> None:
        for cid in child_ids:
            route = self._routes.pop(cid, None)
            if route is None:
                continue
            self._safe_abort(cid)
            batch.append((route[0], Aborted(route[1])))

    def _safe_abort(self, cid: str) -> None:
        try:
            self.engine.abort_request(cid)
        except Exception:  # noqa: BLE001 - already finished / unknown: nothing to free
            logger.debug("abort of %s ignored", cid, exc_info=True)

    def _fail_all(self, error: BaseException, ops: list) -> None:
        batch: list[tuple[_Submission, QueueItem]] = []
        for cid, (sub, i) in list(self._routes.items()):
            self._safe_abort(cid)
            batch.append((sub, Failed(i, error)))
        self._routes.clear()
        for kind, payload in ops:
            if kind == "submit":
                self._call(self._resolve, payload, None, error)
        if batch:
            self._call(self._deliver, batch)
        self._refresh_stats()

    def _refresh_stats(self) -> None:
        try:
            self._stats = dict(self.engine.stats())
        except Exception:  # noqa: BLE001 - stats are best effort
            logger.debug("engine.stats() failed", exc_info=True)


TOKENIZER_NICE = 10


def _low_priority() -> None:
    """Run the calling thread at nice 10 (Linux applies nice per thread); best effort elsewhere."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), TOKENIZER_NICE)
    except (AttributeError, OSError):
        logger.debug("could not lower the tokenizer thread's priority", exc_info=True)
