"""One accepted completion request while it runs: the engine's deltas in, SSE chunks or one response
body out, and the outcome recorded exactly once (request log line + Prometheus series).

What it does: reads the `QueueItem`s of the request's engine requests (one per prompt, all on one
queue; choice `i` of prompt `p` is index `p * best_of + i`). An `Output` is one choice's step delta:
`stream()` sends it as it comes (chat sends a role chunk first; completions with `echo` send the prompt
first; a delta with nothing new is skipped, except that with
`continuous_usage_stats` every chunk carries that choice's usage so far and a delta whose tokens add
no text yet still gets a chunk, so per-chunk token counts are exact; with tools, `ToolCallStream` turns tool-call text into
`tool_calls` deltas; the chunk with finish_reason and the usage chunk carry the `specserve` block), and
both modes sum each choice's deltas (`OutputAccumulator`) for usage, the counters and the
non-streaming body (`collect()`, which with best_of > n keeps the n choices per prompt with the highest
mean token logprob). `Aborted` ends a choice; `Failed` (the engine died) ends the request with 503, a
choice the engine finished with "error" (it failed on this request alone) with 500, and a server
shutdown (`shutdown()`) with 503 "server_shutting_down": streams then get an error event and
`[DONE]`. A client that disconnects (or a cancelled handler) gets its engine requests aborted, which
frees their KV at once, and is logged as "cancelled" (code 499). Choices that did not finish are
logged with finish_reason "abort" (cancelled, shut down) or "error".
What it does not do: parse requests or choose the profile (see `serving.py`), or decide what text is
final (the engine does; its deltas are sent as they are).
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from specserve.outputs import OutputAccumulator, RequestOutput, SpecStats
from specserve.rollout.profiles import Profile
from specserve.server import formatting as fmt
from specserve.server.engine_client import Aborted, Failed, QueueItem
from specserve.server.errors import APIError, error_body, internal_error
from specserve.server.protocol import ParsedRequest
from specserve.server.tool_parsers import ToolCallStream, parse_tool_calls

if TYPE_CHECKING:
    from specserve.server.serving import ServerState


@dataclass(frozen=True)
class ShutDown:
    """Queue item: the server ends this request (graceful drain ran out of time)."""

    message: str


@dataclass
class _Choice:
    prompt_index: int
    acc: OutputAccumulator = field(default_factory=OutputAccumulator)
    aborted: bool = False
    text_offset: int = 0  # completions logprobs: where the next streamed token starts in the text
    tools: ToolCallStream | None = None
    num_tool_calls: int = 0

    @property
    def done(self) -> bool:
        return self.aborted or self.acc.finished

    @property
    def finish_reason(self) -> str | None:
        if self.aborted:
            return "abort"
        if self.num_tool_calls and self.acc.finish_reason == "stop":
            return "tool_calls"
        return self.acc.finish_reason


class Generation:
    """Drives one submitted request to its response (see the module docstring).

    Args:
        state: the server's state (metrics, request log, token text, model name, engine client).
        rid: the response id; parsed: the checked request; record: the request log line so far.
        profile: the speculation profile chosen; prompt_ids: the token ids of each prompt.
        child_ids: the engine request ids of every choice, in index order; queue: where their items arrive.
        t0: when the request arrived (s, time.monotonic); echo_texts: completions echo, one per prompt.
        tool_parser: the parser name when tool calls are parsed; prompt_for_log: with --log-prompts.
    """

    def __init__(self, state: ServerState, rid: str, parsed: ParsedRequest, record: dict, profile: Profile,
                 prompt_ids: list[list[int]], child_ids: list[str], queue: asyncio.Queue, *, t0: float,
                 echo_texts: list[str] | None = None, tool_parser: str | None = None, prompt_for_log: Any = None):
        self.state, self.rid, self.parsed, self.record, self.profile = state, rid, parsed, record, profile
        self.chat = parsed.chat
        self.prompt_ids, self.child_ids, self.queue = prompt_ids, child_ids, queue
        self.t0, self.echo_texts, self.prompt_for_log = t0, echo_texts, prompt_for_log
        self.want_logprobs, self.include_usage = parsed.want_logprobs, parsed.include_usage
        self.continuous_usage = parsed.continuous_usage  # vLLM's continuous_usage_stats (needs include_usage)
        self.created = int(time.time())
        names = {t["function"]["name"] for t in parsed.tools or []}
        self.choices = [_Choice(i // parsed.best_of,
                                tools=ToolCallStream(tool_parser, names) if tool_parser and parsed.parse_tools else None)
                        for i in range(len(child_ids))]
        self.tool_parser = tool_parser if parsed.parse_tools else None
        self.tool_names = names
        self.first_token_t: float | None = None
        self.last_token_t: float | None = None
        self.recorded = False

    # ---- bookkeeping -----------------------------------------------------------------------------

    def _take(self, item: QueueItem | ShutDown) -> RequestOutput | None:
        """Absorb one queue item into its choice; returns the output delta it carried, if any.

        Raises:
            APIError: 503 when the engine died or the server shuts down; 500 when the engine failed this
                request alone (finish_reason "error"; the engine logged the traceback).
        """
        if isinstance(item, ShutDown):
            raise APIError(503, item.message, code="server_shutting_down", headers={"Retry-After": "5"})
        if isinstance(item, Failed):
            raise APIError(503, "generation failed: the engine stopped; retry later", code="engine_error",
                           headers={"Retry-After": "5"})
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

    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompt_ids)

    def usage(self) -> dict:
        return fmt.usage(self.prompt_tokens(), self.completion_tokens())

    @property
    def done(self) -> bool:
        return all(c.done for c in self.choices)

    def finish(self, status: str, code: int, error: str | None = None) -> None:
        """Write the request log line and the Prometheus series, once. Choices that did not finish are
        logged as "abort" (cancelled or shut down) or "error"."""
        if self.recorded:
            return
        self.recorded = True
        spec_stats = self.total_spec()
        now = time.monotonic()
        completion_tokens = self.completion_tokens()
        unfinished = "error" if status == "error" and code != 503 else "abort"
        reasons = [c.finish_reason or unfinished for c in self.choices]
        rec = self.record
        rec.update(
            prompt_tokens=self.prompt_tokens(), completion_tokens=completion_tokens,
            ttft_s=None if self.first_token_t is None else self.first_token_t - self.t0,
            e2e_s=now - self.t0, finish_reason=",".join(reasons) if reasons else None,
            status=status, http_status=code, error=error, **{k: v for k, v in spec_stats.to_dict().items()},
        )
        if self.state.request_log.log_prompts:
            rec["prompt"] = self.prompt_for_log
            texts = [c.acc.text for c in self.choices]
            rec["output"] = texts if len(texts) > 1 else texts[0]
        self.state.request_log.write(rec)
        self.state.metrics.observe_finished(
            profile=self.profile.name, status=status, code=code, prompt_tokens=self.prompt_tokens(),
            completion_tokens=completion_tokens, e2e_s=now - self.t0 if status == "ok" else None, spec_stats=spec_stats,
        )

    def _abort_running(self) -> None:
        running = [cid for cid, c in zip(self.child_ids, self.choices) if not c.done]
        if running:
            self.state.engine.abort(running)

    def cancel(self) -> None:
        self._abort_running()
        self.finish("cancelled", 499)

    def shutdown(self, message: str) -> None:
        """End the request now (graceful drain out of time): free its engine requests; the consumer sees
        a `ShutDown` item and answers 503 (stream: error event + [DONE])."""
        if not self.recorded:
            self._abort_running()
            self.queue.put_nowait(ShutDown(message))

    def _fail(self, e: APIError) -> None:
        self._abort_running()
        self.finish("error", e.status, e.message)

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
        for out_index, c in enumerate(self._returned()):
            lps = c.acc.logprobs or []
            if self.chat:
                lp = fmt.chat_logprobs(lps, tok) if self.want_logprobs else None
                content, calls = c.acc.text, []
                if self.tool_parser:
                    content, calls = parse_tool_calls(self.tool_parser, c.acc.text, self.tool_names)
                    c.num_tool_calls = len(calls)
                choices.append(fmt.chat_choice(out_index, content, lp, c.finish_reason, c.acc.stop_reason,
                                               [t.to_dict() for t in calls]))
            else:
                echo = self.echo_texts[c.prompt_index] if self.echo_texts else ""
                lp = fmt.completion_logprobs(lps, tok, len(echo)) if self.want_logprobs else None
                choices.append(fmt.completion_choice(out_index, echo + c.acc.text, lp, c.finish_reason,
                                                     c.acc.stop_reason))
        build = fmt.chat_body if self.chat else fmt.completion_body
        return build(self.rid, self.created, self.state.model_name, choices, self.usage(), self.spec_block())

    def _returned(self) -> list[_Choice]:
        """The choices the response shows: all of them, or with best_of > n the n per prompt whose tokens
        have the highest mean logprob (OpenAI's "highest log probability per token")."""
        p = self.parsed
        if p.best_of == p.n:
            return self.choices
        out = []
        for i in range(0, len(self.choices), p.best_of):
            group = self.choices[i: i + p.best_of]
            out += sorted(group, key=_mean_logprob, reverse=True)[: p.n]
        return out

    # ---- streaming -----------------------------------------------------------------------------------

    def _delta_chunk(self, index: int, out: RequestOutput) -> dict | None:
        """The chunk for one choice's delta, or None when it carries nothing new."""
        c = self.choices[index]
        text, calls, first = out.new_text, [], c.num_tool_calls
        if c.tools is not None:
            text, calls = c.tools.feed(out.new_text)
            if out.finished:
                more_text, more_calls = c.tools.finish()
                text, calls = text + more_text, calls + more_calls
            c.num_tool_calls += len(calls)
        lp, new_lps = None, []
        if self.want_logprobs:
            new_lps = out.new_logprobs or []
            if self.chat:
                lp = fmt.chat_logprobs(new_lps, self.state.token_text)
            else:
                lp = fmt.completion_logprobs(new_lps, self.state.token_text, c.text_offset)
                c.text_offset += sum(len(t) for t in lp["tokens"])
        counted = self.continuous_usage and bool(out.new_token_ids)  # tokens whose text is held back still count
        if not (text or calls or out.finished or counted or new_lps):
            return None
        tool_calls = [t.to_dict(first + j) for j, t in enumerate(calls)] if calls else None
        return fmt.chunk(self.chat, self.rid, self.created, self.state.model_name, index,
                         text=text, logprobs=lp, finish_reason=c.finish_reason if out.finished else None,
                         include_usage=self.include_usage, chunk_usage=self._chunk_usage(c, len(c.acc.token_ids)),
                         spec_block=self.spec_block() if out.finished else None, tool_calls=tool_calls)

    def _chunk_usage(self, c: "_Choice", completion_tokens: int) -> dict | None:
        """Continuous usage stats: the choice's tokens so far (vLLM's per-choice count), else None."""
        if not self.continuous_usage:
            return None
        return fmt.usage(len(self.prompt_ids[c.prompt_index]), completion_tokens)

    async def stream(self):
        """The SSE body. Any exit before the end (disconnect, cancel) aborts the engine requests."""
        name = self.state.model_name
        try:
            for i, c in enumerate(self.choices):
                if self.chat:
                    yield fmt.sse(fmt.chunk(True, self.rid, self.created, name, i, role="assistant", text="",
                                            include_usage=self.include_usage, chunk_usage=self._chunk_usage(c, 0)))
                elif self.echo_texts:
                    c.text_offset = len(self.echo_texts[c.prompt_index])
                    yield fmt.sse(fmt.chunk(False, self.rid, self.created, name, i,
                                            text=self.echo_texts[c.prompt_index], include_usage=self.include_usage,
                                            chunk_usage=self._chunk_usage(c, 0)))
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


def _mean_logprob(c: _Choice) -> float:
    lps = c.acc.logprobs or []
    return sum(x.logprob for x in lps) / len(lps) if lps else -math.inf
