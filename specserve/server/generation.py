"""One accepted completion request while it runs: the engine's deltas in, SSE chunks or one response
body out, and the outcome recorded exactly once (request log line + Prometheus series).

What it does: reads the `QueueItem`s of the request's `EngineRequest`. An `Output` is one choice's
step delta (new text, new token ids, new logprobs, a frozen counter snapshot): `stream()` sends it as
it comes (chat sends a role chunk first; a delta with nothing new is skipped; with
`continuous_usage_stats` every chunk carries that choice's usage so far, and a delta whose tokens add
no text yet still gets a chunk, so per-chunk token counts are exact; the chunk with finish_reason and
the usage chunk carry the `specserve` block), and both modes sum each choice's
deltas (`OutputAccumulator`) for usage, the counters and the non-streaming body (`collect()`).
`Aborted` ends a choice; `Failed` (the engine died) ends the request with 503, and a choice the
engine finished with "error" (it failed on this request alone) with 500. A client that
disconnects (or a cancelled handler) gets its engine requests aborted, which frees their KV at once,
and is logged as "cancelled" (code 499).
What it does not do: parse requests or choose the profile (see `serving.py`), or decide what text is
final (the engine does; its deltas are sent as they are).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from specserve.outputs import OutputAccumulator, RequestOutput, SpecStats
from specserve.rollout.profiles import Profile
from specserve.server import formatting as fmt
from specserve.server.engine_client import Aborted, EngineRequest, Failed, QueueItem
from specserve.server.errors import APIError, error_body, internal_error

if TYPE_CHECKING:
    from specserve.server.serving import ServerState


@dataclass
class _Choice:
    acc: OutputAccumulator = field(default_factory=OutputAccumulator)
    aborted: bool = False
    text_offset: int = 0  # completions logprobs: where the next streamed token starts in the text

    @property
    def done(self) -> bool:
        return self.aborted or self.acc.finished

    @property
    def finish_reason(self) -> str | None:
        return "abort" if self.aborted else self.acc.finish_reason


class Generation:
    """Drives one submitted request to its response (see the module docstring).

    Args:
        state: the server's state (metrics, request log, token text, model name, engine client).
        rid: the response id; chat: chat or completions shapes; record: the request log line so far.
        profile: the speculation profile chosen; submitted: what `EngineClient.submit` returned.
        t0: when the request arrived (s, time.monotonic); want_logprobs, include_usage: from the body;
        continuous_usage: `stream_options.continuous_usage_stats` (vLLM's key; only with include_usage).
        prompt_for_log: what the request log records as "prompt" (with --log-prompts), else None.
    """

    def __init__(self, state: ServerState, rid: str, chat: bool, record: dict, profile: Profile, submitted: EngineRequest,
                 *, t0: float, want_logprobs: bool, include_usage: bool, continuous_usage: bool = False,
                 prompt_for_log: Any = None):
        self.state, self.rid, self.chat, self.record, self.profile = state, rid, chat, record, profile
        self.prompt_ids, self.queue, self.child_ids = submitted.prompt_token_ids, submitted.queue, submitted.child_ids
        self.t0, self.want_logprobs, self.include_usage = t0, want_logprobs, include_usage
        self.continuous_usage = include_usage and continuous_usage  # vLLM: needs include_usage too
        self.prompt_for_log = prompt_for_log
        self.created = int(time.time())
        self.choices = [_Choice() for _ in self.child_ids]
        self.first_token_t: float | None = None
        self.last_token_t: float | None = None
        self.recorded = False

    # ---- bookkeeping -----------------------------------------------------------------------------

    def _take(self, item: QueueItem) -> RequestOutput | None:
        """Absorb one queue item into its choice; returns the output delta it carried, if any.

        Raises:
            APIError: 503 when the engine died; 500 when it failed this request alone (finish_reason
                "error"; the engine logged the traceback).
        """
        if isinstance(item, Failed):
            raise APIError(503, f"generation failed: {item.error}", code="engine_error")
        c = self.choices[item.index]
        if isinstance(item, Aborted):
            c.aborted = True
            return None
        out = item.output
        n_new = len(out.new_token_ids)
        if n_new:
            now = time.monotonic()
            if self.first_token_t is None:
                self.first_token_t = now
                self.state.metrics.observe_first_token(self.profile.name, now - self.t0)
            else:
                self.state.metrics.observe_tokens(self.profile.name, now - self.last_token_t, n_new)
            self.last_token_t = now
        c.acc.add(out)
        if out.finish_reason == "error":
            raise internal_error(self.rid)
        return out

    def total_spec(self) -> SpecStats:
        return sum((c.acc.spec_stats for c in self.choices), SpecStats())

    def spec_block(self) -> dict:
        return fmt.specserve_block(self.profile, self.total_spec())

    def completion_tokens(self) -> int:
        return sum(len(c.acc.token_ids) for c in self.choices)

    def usage(self) -> dict:
        return fmt.usage(len(self.prompt_ids), self.completion_tokens())

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
        completion_tokens = self.completion_tokens()
        rec = self.record
        rec.update(
            prompt_tokens=len(self.prompt_ids), completion_tokens=completion_tokens,
            ttft_s=None if self.first_token_t is None else self.first_token_t - self.t0,
            e2e_s=now - self.t0, finish_reason=",".join(str(c.finish_reason) for c in self.choices),
            status=status, http_status=code, error=error, **{k: v for k, v in spec_stats.to_dict().items()},
        )
        if self.state.request_log.log_prompts:
            rec["prompt"] = self.prompt_for_log
            texts = [c.acc.text for c in self.choices]
            rec["output"] = texts if len(texts) > 1 else texts[0]
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
                    self._take(await asyncio.wait_for(self.queue.get(), timeout=0.5))
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
            lps = c.acc.logprobs or []
            if self.chat:
                lp = fmt.chat_logprobs(lps, tok) if self.want_logprobs else None
                choices.append(fmt.chat_choice(i, c.acc.text, lp, c.finish_reason, c.acc.stop_reason))
            else:
                lp = fmt.completion_logprobs(lps, tok) if self.want_logprobs else None
                choices.append(fmt.completion_choice(i, c.acc.text, lp, c.finish_reason, c.acc.stop_reason))
        build = fmt.chat_body if self.chat else fmt.completion_body
        return build(self.rid, self.created, self.state.model_name, choices, self.usage(), self.spec_block())

    def _fail(self, e: APIError) -> None:
        self.state.engine.abort([cid for cid, c in zip(self.child_ids, self.choices) if not c.done])
        self.finish("error", e.status, e.message)

    # ---- streaming -----------------------------------------------------------------------------------

    def _delta_chunk(self, index: int, out: RequestOutput) -> dict | None:
        """The chunk for one choice's delta, or None when it carries nothing new."""
        lp, new_lps = None, []
        c = self.choices[index]
        if self.want_logprobs:
            new_lps = out.new_logprobs or []
            if self.chat:
                lp = fmt.chat_logprobs(new_lps, self.state.token_text)
            else:
                lp = fmt.completion_logprobs(new_lps, self.state.token_text, c.text_offset)
                c.text_offset += sum(len(t) for t in lp["tokens"])
        counted = self.continuous_usage and bool(out.new_token_ids)  # tokens whose text is held back still count
        if not (out.new_text or out.finished or counted or new_lps):
            return None
        return fmt.chunk(self.chat, self.rid, self.created, self.state.model_name, index,
                         text=out.new_text, logprobs=lp, finish_reason=out.finish_reason if out.finished else None,
                         include_usage=self.include_usage, chunk_usage=self._chunk_usage(len(c.acc.token_ids)),
                         spec_block=self.spec_block() if out.finished else None)

    def _chunk_usage(self, completion_tokens: int) -> dict | None:
        """Continuous usage stats: the choice's tokens so far (vLLM's per-choice count), else None."""
        return fmt.usage(len(self.prompt_ids), completion_tokens) if self.continuous_usage else None

    async def stream(self):
        """The SSE body. Any exit before the end (disconnect, cancel) aborts the engine requests."""
        name = self.state.model_name
        try:
            if self.chat:
                for i in range(len(self.choices)):
                    yield fmt.sse(fmt.chunk(True, self.rid, self.created, name, i, role="assistant", text="",
                                            include_usage=self.include_usage, chunk_usage=self._chunk_usage(0)))
            while not self.done:
                item = await self.queue.get()
                try:
                    out = self._take(item)
                except APIError as e:
                    self._fail(e)
                    yield fmt.sse(error_body(e.status, e.message, code=e.code))
                    yield fmt.SSE_DONE
                    return
                ch = self._delta_chunk(item.index, out) if out is not None else None
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
