"""POST /v1/completions and /v1/chat/completions: from raw body to a running `Generation`.

What it does, in order: refuse new work while the server drains (503 + Retry-After); read the body and
parse it (`parsing.py`: JSON depth/size, strict types; `protocol.py`: every field honoured or refused;
a body over 64 KiB is parsed on a worker thread so the event loop keeps streaming); check the model
name (404); choose the speculation profile (explicit `profile` field or `x-specserve-profile` header
only with --allow-profile-override, else 403; unknown name 400; otherwise the rollout weights, sticky
on the `user` field, else the `x-session-id` header); check the queue (503 + Retry-After when running +
waiting would pass max_num_seqs + --max-queue); tokenize each prompt off the engine thread
(`EngineClient.encode`: size check, template, per-request token limit) and compile a structured-output
grammar there too (`EngineClient.compile_grammar`; a schema that does not compile is a 400 naming its
field); check prompt + max_tokens
against the context (400 naming `max_tokens` or `max_completion_tokens`); then submit the token ids
to the `EngineClient` as best_of engine requests per prompt (`{id}-{p}-{i}`; with a seed s, choice i
uses seed s + i). Errors map to a status by their type alone: an `InvalidRequestError` is 400 with
its `param` and `code`; `EngineDeadError` 503; anything else is 500, logged with its traceback, and the
body says nothing internal. Every outcome, errors included, gets one request log line and one
`specserve:requests_total` increment. The response carries `x-specserve-profile`.
What it does not do: format chunks (`formatting.py`) or drive the stream (`generation.py`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from specserve.inputs import InvalidRequestError, Prompt, TextPrompt, TokenPrompt
from specserve.metrics.prometheus import ServerMetrics
from specserve.rollout.policy import ProfileForbidden, RolloutPolicy, UnknownProfile
from specserve.rollout.request_log import RequestLog
from specserve.server import protocol
from specserve.server.engine_client import EngineClient, EngineDeadError
from specserve.server.errors import APIError, internal_error, read_body
from specserve.server.formatting import TokenText
from specserve.server.generation import Generation
from specserve.server.parsing import UnknownFieldNotes, parse_json_body

logger = logging.getLogger("specserve.server")

PROFILE_HEADER = "x-specserve-profile"
SESSION_HEADER = "x-session-id"
THREAD_PARSE_BYTES = 64 * 1024  # bodies larger than this are parsed on a worker thread


@dataclass
class ServerState:
    engine: EngineClient
    policy: RolloutPolicy
    metrics: ServerMetrics
    request_log: RequestLog
    token_text: TokenText
    model_name: str
    model_checksum: str | None
    max_num_seqs: int
    max_queue: int | None
    tool_parser: str | None = None
    draining: bool = False
    generations: set[Generation] = field(default_factory=set)
    unknown_fields: UnknownFieldNotes = field(default_factory=UnknownFieldNotes)


class _AbortingStream(StreamingResponse):
    """StreamingResponse that cancels the generation if the response ends early for any reason."""

    def __init__(self, gen: Generation, **kw):
        super().__init__(gen.stream(), media_type="text/event-stream", **kw)
        self._gen = gen

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self._gen.recorded:
                self._gen.cancel()
            self._gen.state.generations.discard(self._gen)


def bad_request(e: InvalidRequestError) -> APIError:
    return APIError(400, str(e), param=e.param, code=e.code)


def _error_from_engine(rid: str, e: BaseException) -> APIError:
    """The HTTP error for an exception from the `EngineClient`, chosen by its type alone."""
    if isinstance(e, InvalidRequestError):
        return bad_request(e)
    if isinstance(e, EngineDeadError):
        return APIError(503, "the engine is not running; retry later", code="engine_unavailable",
                        headers={"Retry-After": "5"})
    logger.error("%s: the engine failed while adding the request", rid, exc_info=e)
    return internal_error(rid)


def _prompt_for_log(prompts: list[Prompt]) -> Any:
    """What the request log records as "prompt" (with --log-prompts)."""
    out = []
    for p in prompts:
        out.append(p.text if isinstance(p, TextPrompt) else list(p.token_ids) if isinstance(p, TokenPrompt)
                   else list(p.messages))
    return out[0] if len(out) == 1 else out


def _parse(state: ServerState, raw: bytes, chat: bool) -> protocol.ParsedRequest:
    body = parse_json_body(raw)
    return protocol.parse_request(body, chat=chat, max_model_len=state.engine.max_model_len,
                                  vocab_size=state.engine.vocab_size, notes=state.unknown_fields)


def draining_error() -> APIError:
    return APIError(503, "the server is shutting down; retry on another server or later",
                    code="server_shutting_down", headers={"Retry-After": "5", "Connection": "close"})


async def handle_generate(state: ServerState, request: Request, chat: bool):
    """The whole handler for both generation endpoints."""
    t0 = time.monotonic()
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    record: dict[str, Any] = {
        "id": rid, "time": time.time(), "endpoint": "chat" if chat else "completions",
        "model": state.model_name, "model_checksum": state.model_checksum,
    }
    profile = None
    try:
        if state.draining:
            raise draining_error()
        raw = await read_body(request)
        try:
            parsed = (await asyncio.to_thread(_parse, state, raw, chat) if len(raw) > THREAD_PARSE_BYTES
                      else _parse(state, raw, chat))
        except InvalidRequestError as e:
            raise bad_request(e) from None
        req = parsed.req
        record.update(n=parsed.n, stream=parsed.stream)
        if req.model is not None and req.model != state.model_name:
            raise APIError(404, f"model {req.model[:80]!r} does not exist; this server serves {state.model_name!r}",
                           param="model", code="model_not_found")
        requested = req.profile or request.headers.get(PROFILE_HEADER)
        # the error names where the profile came from: the body's `profile` field or the header
        source = "profile" if req.profile else PROFILE_HEADER
        try:
            choice = state.policy.choose(sticky_key=parsed.sticky_key or request.headers.get(SESSION_HEADER),
                                         requested=requested)
        except ProfileForbidden as e:
            raise APIError(403, str(e), param=source, code="profile_override_forbidden") from None
        except UnknownProfile as e:
            raise APIError(400, str(e), param=source, code="unknown_profile") from None
        profile = choice.profile
        record.update(profile=profile.name, profile_reason=choice.reason, rollout_step=choice.step,
                      method=profile.method, k=profile.num_speculative_tokens)
        if parsed.parse_tools and state.tool_parser is None:
            raise APIError(400, f"this server has no tool-call parser for {state.model_name} (its chat template shows "
                           "no tool-call format); start it with --tool-call-parser hermes or llama3_json, or send "
                           'tool_choice "none"', param="tools", code="unsupported_value")
        num_choices = parsed.best_of * len(parsed.prompts)
        if state.max_queue is not None and state.engine.in_flight + num_choices > state.max_num_seqs + state.max_queue:
            raise APIError(503, f"server is at capacity ({state.engine.in_flight} requests in flight); retry later",
                           code="queue_full", headers={"Retry-After": "1"})
        gen = await _start(state, rid, parsed, record, profile, t0)
    except APIError as e:
        status = "cancelled" if e.status == 499 else "error"
        record.update(status=status, http_status=e.status, error=e.message,
                      finish_reason="abort" if status == "cancelled" else "error")
        state.request_log.write(record)
        state.metrics.observe_finished(profile=profile.name if profile else "none", status=status, code=e.status)
        if profile is not None:
            e.headers.setdefault(PROFILE_HEADER, profile.name)
        raise
    headers = {PROFILE_HEADER: profile.name, "x-request-id": rid}
    if parsed.stream:
        headers.update({"cache-control": "no-cache", "x-accel-buffering": "no"})
        return _AbortingStream(gen, headers=headers)
    try:
        body = await gen.collect(request)
    finally:
        state.generations.discard(gen)
    return JSONResponse(body, headers=headers)


async def _start(state: ServerState, rid: str, parsed: protocol.ParsedRequest, record: dict, profile: Any,
                 t0: float) -> Generation:
    """Tokenize every prompt, check the output budget, submit every choice; the running Generation."""
    try:
        if parsed.params.structured_outputs is not None:  # compiled off the engine thread (a 400 if it cannot be)
            await state.engine.compile_grammar(parsed.params.structured_outputs)
        prompt_ids = [await state.engine.encode(p) for p in parsed.prompts]
    except Exception as e:  # noqa: BLE001 - mapped to a status by its type
        raise _error_from_engine(rid, e) from None
    max_tokens = parsed.params.max_tokens
    longest = max(len(ids) for ids in prompt_ids)
    if max_tokens is not None and longest + max_tokens > state.engine.max_model_len:
        raise APIError(400, f"this model's context is {state.engine.max_model_len} tokens; the prompt has {longest} "
                       f"and {parsed.max_tokens_param} asks for {max_tokens} more", param=parsed.max_tokens_param,
                       code="context_length_exceeded")
    if state.draining:
        raise draining_error()
    queue: asyncio.Queue = asyncio.Queue()
    child_ids: list[str] = []
    children = [parsed.params.for_choice(i) for i in range(parsed.best_of)]
    try:
        for p, ids in enumerate(prompt_ids):
            sub = await state.engine.submit(f"{rid}-{p}", TokenPrompt(tuple(ids)), children, profile.spec_config,
                                            arrival_time=t0, queue=queue, first_index=p * parsed.best_of)
            child_ids += sub.child_ids
    except BaseException as e:
        if child_ids:
            state.engine.abort(child_ids)
        if isinstance(e, Exception):
            raise _error_from_engine(rid, e) from None
        raise
    echo = None
    if parsed.echo:
        echo = [p.text if isinstance(p, TextPrompt) else state.engine.tokenizer.decode(list(ids))
                for p, ids in zip(parsed.prompts, prompt_ids)]
    gen = Generation(state, rid, parsed, record, profile, prompt_ids, child_ids, queue, t0=t0, echo_texts=echo,
                     tool_parser=state.tool_parser,
                     prompt_for_log=_prompt_for_log(parsed.prompts) if state.request_log.log_prompts else None)
    state.generations.add(gen)
    return gen
