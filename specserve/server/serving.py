"""POST /v1/completions and /v1/chat/completions: from raw body to a running `Generation`.

What it does, in order: read + parse JSON (400), validate with pydantic and `SamplingParams` (400),
check the model name (404), choose the speculation profile (explicit `profile` field or
`x-specserve-profile` header only with --allow-profile-override, else 403; unknown name 400; otherwise
the rollout weights, sticky on the `user` field, else the `x-session-id` header), check the queue
(503 + Retry-After when running + waiting would pass max_num_seqs + --max-queue), then submit the
typed prompt to the `EngineClient` as n engine requests (`{id}-{i}`; with a seed s, choice i uses seed
s + i, so choices differ but the whole response is reproducible). Errors map to a status by their
type alone: an `InvalidRequestError` (bad value, prompt empty / longer than the context, bad token
ids, a chat the template refuses) is 400 with its `param` and `code`; `EngineDeadError` 503; anything
else the engine raises is 500, logged with its traceback, and the body says nothing internal (so is a
choice the engine finishes with "error", see `generation.py`). Every
outcome, errors included, gets one request log line and one `specserve:requests_total` increment. The
response carries `x-specserve-profile`.
What it does not do: format chunks (`formatting.py`) or drive the stream (`generation.py`).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from specserve.inputs import InvalidRequestError, Prompt, TextPrompt, TokenPrompt
from specserve.metrics.prometheus import ServerMetrics
from specserve.rollout.policy import ProfileForbidden, RolloutPolicy, UnknownProfile
from specserve.rollout.request_log import RequestLog
from specserve.server import protocol
from specserve.server.engine_client import EngineClient, EngineDeadError
from specserve.server.errors import APIError, internal_error, validation_message, validation_param
from specserve.server.formatting import TokenText
from specserve.server.generation import Generation

logger = logging.getLogger("specserve.server")

PROFILE_HEADER = "x-specserve-profile"
SESSION_HEADER = "x-session-id"


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


def _bad_request(e: InvalidRequestError) -> APIError:
    return APIError(400, str(e), param=e.param, code=e.code)


def _error_from_engine(rid: str, e: BaseException) -> APIError:
    """The HTTP error for an exception from `EngineClient.submit`, chosen by its type alone."""
    if isinstance(e, InvalidRequestError):
        return _bad_request(e)
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), code="engine_unavailable", headers={"Retry-After": "5"})
    logger.error("%s: the engine failed while adding the request", rid, exc_info=e)
    return internal_error(rid)


def _prompt_for_log(prompt: Prompt) -> Any:
    """What the request log records as "prompt" (with --log-prompts)."""
    if isinstance(prompt, TextPrompt):
        return prompt.text
    if isinstance(prompt, TokenPrompt):
        return list(prompt.token_ids)
    return list(prompt.messages)


async def _parse(request: Request, chat: bool) -> protocol.CompletionRequest | protocol.ChatCompletionRequest:
    try:
        raw = await request.body()
    except ClientDisconnect:
        raise APIError(499, "client disconnected while sending the request") from None
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    model = protocol.ChatCompletionRequest if chat else protocol.CompletionRequest
    try:
        return model.model_validate(body)
    except ValidationError as e:
        errs = e.errors()
        raise APIError(400, validation_message(errs), param=validation_param(errs)) from None


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
        req = await _parse(request, chat)
        record.update(n=req.n, stream=req.stream)
        if req.model is not None and req.model != state.model_name:
            raise APIError(404, f"model {req.model!r} does not exist; this server serves {state.model_name!r}",
                           param="model", code="model_not_found")
        try:
            params = protocol.sampling_params(req)
            prompt = protocol.engine_prompt(req)
        except InvalidRequestError as e:
            raise _bad_request(e) from None
        requested = req.profile or request.headers.get(PROFILE_HEADER)
        try:
            choice = state.policy.choose(sticky_key=req.user or request.headers.get(SESSION_HEADER),
                                         requested=requested)
        except ProfileForbidden as e:
            raise APIError(403, str(e), param="profile", code="profile_override_forbidden") from None
        except UnknownProfile as e:
            raise APIError(400, str(e), param="profile", code="unknown_profile") from None
        profile = choice.profile
        record.update(profile=profile.name, profile_reason=choice.reason, rollout_step=choice.step,
                      method=profile.method, k=profile.num_speculative_tokens)
        n = params.n
        if state.max_queue is not None and state.engine.in_flight + n > state.max_num_seqs + state.max_queue:
            raise APIError(503, f"server is at capacity ({state.engine.in_flight} requests in flight); retry later",
                           code="queue_full", headers={"Retry-After": "1"})
        children = [params.for_choice(i) for i in range(n)]
        try:
            submitted = await state.engine.submit(rid, prompt, children, profile.spec_config, arrival_time=t0)
        except Exception as e:  # noqa: BLE001 - mapped to a status by its type
            raise _error_from_engine(rid, e) from None
    except APIError as e:
        status = "cancelled" if e.status == 499 else "error"
        record.update(status=status, http_status=e.status, error=e.message)
        state.request_log.write(record)
        state.metrics.observe_finished(profile=profile.name if profile else "none", status=status, code=e.status)
        if profile is not None:
            e.headers.setdefault(PROFILE_HEADER, profile.name)
        raise
    gen = Generation(state, rid, chat, record, profile, submitted, t0=t0,
                     want_logprobs=params.logprobs is not None,
                     include_usage=bool(req.stream_options and req.stream_options.include_usage),
                     continuous_usage=bool(req.stream_options and req.stream_options.continuous_usage_stats),
                     prompt_for_log=_prompt_for_log(prompt) if state.request_log.log_prompts else None)
    headers = {PROFILE_HEADER: profile.name, "x-request-id": rid}
    if req.stream:
        headers.update({"cache-control": "no-cache", "x-accel-buffering": "no"})
        return _AbortingStream(gen, headers=headers)
    body = await gen.collect(request)
    return JSONResponse(body, headers=headers)
