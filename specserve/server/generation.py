"""One accepted completion request while it runs: gathers engine outputs, streams or collects them,
and records the outcome exactly once (request log line + Prometheus series).

What it does: `collect()` waits for all n choices and returns the non-streaming body; `stream()` is the
SSE generator (chat sends a role chunk first; each chunk carries one choice's new text and, when asked,
one logprobs entry per new token, even while text is held back; the chunk with finish_reason and the
usage chunk carry the `specserve` block). A client that disconnects (or a cancelled handler) gets its
engine requests aborted, which frees their KV at once, and is logged as "cancelled" (code 499).
What it does not do: parse requests or choose the profile (see `serving.py`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from specserve.outputs import SpecStats
from specserve.server import formatting as fmt
from specserve.server.async_engine import ABORTED
from specserve.server.errors import APIError, error_body

logger = logging.getLogger("specserve.server")


@dataclass
class _Choice:
    text: str = ""
    streamed: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] | None = None
    num_lp_sent: int = 0
    text_offset: int = 0
    finish_reason: str | None = None
    stop_reason: Any = None
    spec_stats: SpecStats = field(default_factory=SpecStats)
    done: bool = False


class Generation:
    def __init__(self, state: Any, rid: str, chat: bool, record: dict, profile: Any, prompt_ids: list[int],
                 queue: asyncio.Queue, child_ids: list[str], *, t0: float, want_logprobs: bool,
                 include_usage: bool, prompt_text: Any = None):
        self.state, self.rid, self.chat, self.record, self.profile = state, rid, chat, record, profile
        self.prompt_ids, self.queue, self.child_ids = prompt_ids, queue, child_ids
        self.t0, self.want_logprobs, self.include_usage = t0, want_logprobs, include_usage
        self.prompt_text = prompt_text
        self.created = int(time.time())
        self.choices = [_Choice() for _ in child_ids]
        self.first_token_t: float | None = None
        self.last_token_t: float | None = None
        self.recorded = False

    # ---- bookkeeping -----------------------------------------------------------------------------

    def _absorb(self, index: int, out: Any) -> _Choice:
        if isinstance(out, BaseException):
            raise APIError(503, f"generation failed: {out}", code="engine_error")
        c = self.choices[index]
        if out == ABORTED:
            c.done, c.finish_reason = True, "abort"
            return c
        now = time.monotonic()
        n_new = len(out.new_token_ids)
        if n_new:
            if self.first_token_t is None:
                self.first_token_t = now
                self.state.metrics.observe_first_token(self.profile.name, now - self.t0)
            else:
                self.state.metrics.observe_tokens(self.profile.name, now - self.last_token_t, n_new)
            self.last_token_t = now
        c.token_ids, c.text, c.spec_stats = list(out.token_ids), out.text, out.spec_stats
        c.logprobs = out.logprobs
        if out.finished:
            c.done, c.finish_reason, c.stop_reason = True, out.finish_reason, out.stop_reason
        return c

    def total_spec(self) -> SpecStats:
        total = SpecStats()
        for c in self.choices:
            total.add(c.spec_stats)
        return total

    def spec_block(self) -> dict:
        return fmt.specserve_block(self.profile, self.total_spec())

    def usage(self) -> dict:
        return fmt.usage(len(self.prompt_ids), sum(len(c.token_ids) for c in self.choices))

    @property
    def done(self) -> bool:
        return all(c.done for c in self.choices)

    def finish(self, status: str, code: int, error: str | None = None) -> None:
        """Write the request log line and the Prometheus series, once."""
        if self.recorded:
            return
        self.recorded = True
        spec_stats = self.total_spec()
        now = time.monotonic()
        completion_tokens = sum(len(c.token_ids) for c in self.choices)
        rec = self.record
        rec.update(
            prompt_tokens=len(self.prompt_ids), completion_tokens=completion_tokens,
            ttft_s=None if self.first_token_t is None else self.first_token_t - self.t0,
            e2e_s=now - self.t0, finish_reason=",".join(str(c.finish_reason) for c in self.choices),
            status=status, http_status=code, error=error, **{k: v for k, v in spec_stats.to_dict().items()},
        )
        if self.state.request_log.log_prompts:
            rec["prompt"] = self.prompt_text
            rec["output"] = [c.text for c in self.choices] if len(self.choices) > 1 else self.choices[0].text
        self.state.request_log.write(rec)
        self.state.metrics.observe_finished(
            profile=self.profile.name, status=status, code=code, prompt_tokens=len(self.prompt_ids),
            completion_tokens=completion_tokens, e2e_s=now - self.t0 if status == "ok" else None, spec_stats=spec_stats,
        )

    def cancel(self) -> None:
        if not self.done:
            self.state.engine.abort([cid for cid, c in zip(self.child_ids, self.choices) if not c.done])
        self.finish("cancelled", 499)

    # ---- non-streaming -----------------------------------------------------------------------------

    async def collect(self, request: Any) -> dict:
        next_check = time.monotonic() + 0.5
        try:
            while not self.done:
                try:
                    index, out = await asyncio.wait_for(self.queue.get(), timeout=0.5)
                    self._absorb(index, out)
                except asyncio.TimeoutError:
                    pass
                if time.monotonic() >= next_check:  # a gone client's request is aborted (KV freed)
                    next_check = time.monotonic() + 0.5
                    if await request.is_disconnected():
                        self.cancel()
                        raise APIError(499, "client disconnected") from None
        except asyncio.CancelledError:
            self.cancel()
            raise
        except APIError as e:
            if not self.recorded:
                self.cancel() if e.status == 499 else self._fail(e)
            raise
        self.finish("ok", 200)
        tok = self.state.token_text
        choices = []
        for i, c in enumerate(self.choices):
            if self.chat:
                lp = fmt.chat_logprobs(c.logprobs or [], tok) if self.want_logprobs else None
                choices.append(fmt.chat_choice(i, c.text, lp, c.finish_reason, c.stop_reason))
            else:
                lp = fmt.completion_logprobs(c.logprobs or [], tok) if self.want_logprobs else None
                choices.append(fmt.completion_choice(i, c.text, lp, c.finish_reason, c.stop_reason))
        build = fmt.chat_body if self.chat else fmt.completion_body
        return build(self.rid, self.created, self.state.model_name, choices, self.usage(), self.spec_block())

    def _fail(self, e: APIError) -> None:
        self.state.engine.abort([cid for cid, c in zip(self.child_ids, self.choices) if not c.done])
        self.finish("error", e.status, e.message)

    # ---- streaming -----------------------------------------------------------------------------------

    def _delta_chunk(self, index: int, c: _Choice, out: Any) -> dict | None:
        delta = out.new_text or ""
        if c.done and c.text != c.streamed + delta:
            if c.text.startswith(c.streamed + delta):  # flush anything the engine still held back
                delta = c.text[len(c.streamed):]
            else:
                logger.warning("%s: streamed text diverged from final text", self.rid)
        c.streamed += delta
        lp = None
        if self.want_logprobs:
            new_lps = (c.logprobs or [])[c.num_lp_sent:]
            c.num_lp_sent += len(new_lps)
            if self.chat:
                lp = fmt.chat_logprobs(new_lps, self.state.token_text)
            else:
                lp = fmt.completion_logprobs(new_lps, self.state.token_text, c.text_offset)
                c.text_offset += sum(len(t) for t in lp["tokens"])
            if not new_lps and not delta and not c.done:
                return None
        elif not delta and not c.done:
            return None
        return fmt.chunk(self.chat, self.rid, self.created, self.state.model_name, index,
                         text=delta, logprobs=lp, finish_reason=c.finish_reason if c.done else None,
                         include_usage=self.include_usage, spec_block=self.spec_block() if c.done else None)

    async def stream(self):
        """The SSE body. Any exit before the end (disconnect, cancel) aborts the engine requests."""
        name = self.state.model_name
        try:
            if self.chat:
                for i in range(len(self.choices)):
                    yield fmt.sse(fmt.chunk(True, self.rid, self.created, name, i, role="assistant", text="",
                                            include_usage=self.include_usage))
            while not self.done:
                index, out = await self.queue.get()
                try:
                    c = self._absorb(index, out)
                except APIError as e:
                    self._fail(e)
                    yield fmt.sse(error_body(e.status, e.message, code=e.code))
                    yield fmt.SSE_DONE
                    return
                if out == ABORTED:
                    continue
                ch = self._delta_chunk(index, c, out)
                if ch is not None:
                    yield fmt.sse(ch)
            if self.include_usage:
                yield fmt.sse(fmt.usage_chunk(self.chat, self.rid, self.created, name, self.usage(),
                                              self.spec_block()))
            self.finish("ok", 200)
            yield fmt.SSE_DONE
        finally:
            if not self.recorded:
                self.cancel()
