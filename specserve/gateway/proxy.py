"""Forwarding one completion request through the gateway: choose, send, retry, stream, record.

Per request: parse the JSON body (400), choose the profile with the rollout policy (sticky on `user`,
else `x-session-id`; `profile` field / x-specserve-profile only with allow_profile_override, else 403;
unknown 400), pick a healthy backend of it (when none is left and the profile was drawn, not asked for,
the request goes to the baseline, logged as profile_reason "unavailable"; otherwise 503), and forward
the body (the `profile` field removed, `model` rewritten when the backend names one; a stream gets
`stream_options.include_usage` so the gateway learns the token count, and the added usage chunk is
not passed on). Retries: a request that fails before the client got its first byte (cannot connect,
connection lost, or HTTP 502/503/504) is sent to another healthy backend of the same profile, up to
`retries` more times; a stream is retried only before its response starts. When every try failed,
the client gets the last backend's own 5xx answer, or 502. A connection failure also ejects the
backend (passive health check). Streams are passed through event by event as they arrive; when the
client goes away the backend connection is closed, which makes a specserve or vLLM server abort the
request (for a non-streamed request a watcher starts after 0.25 s, so that fast requests pay for no
extra task). Each request yields one `Outcome` for the rollout window, one request-log line (backend,
profile, config, rollout step, attempts) and its Prometheus series; responses carry
`x-specserve-profile` and `x-specserve-backend`. Errors are OpenAI-shaped.
What it does not do: health checks (`backends.py`) or the app and its routes (`app.py`).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

import httpx
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from specserve.gateway.backends import Backend
from specserve.gateway.exchange import Exchange, record_exchange
from specserve.gateway.streaming import DisconnectGuard, RelayStream, SSERelay
from specserve.inputs import InvalidRequestError
from specserve.rollout.policy import ProfileForbidden, UnknownProfile
from specserve.rollout.shadow import outputs_from_body, outputs_from_events
from specserve.server.errors import APIError, error_body
from specserve.server.parsing import parse_json_body

PROFILE_HEADER = "x-specserve-profile"
BACKEND_HEADER = "x-specserve-backend"
SESSION_HEADER = "x-session-id"
RETRY_STATUSES = (502, 503, 504)


class _GiveUp(Exception):
    """Every try failed; `response` is what the client gets."""

    def __init__(self, response: Response):
        super().__init__("every try failed")
        self.response = response


class _Retry(Exception):
    """This attempt failed before the client saw a byte; `response` is the backend's own answer, if any."""

    def __init__(self, message: str, response: Response | None = None):
        super().__init__(message)
        self.response = response


def _gateway_adds_usage(body: dict) -> bool:
    """A stream whose client did not ask for usage: the gateway asks for it (and drops the usage chunk)."""
    options = body.get("stream_options")
    return body.get("stream") is True and (options is None or (isinstance(options, dict)
                                                               and not options.get("include_usage")))


class Proxy:
    """The forwarding logic over the gateway's parts (`gw`: see `app.Gateway`)."""

    def __init__(self, gw: Any):
        self.gw = gw
        self._urls: dict[tuple[str, str], httpx.URL] = {}

    # ---- choosing -------------------------------------------------------------------------------

    async def _exchange(self, request: Request, path: str, chat: bool) -> Exchange:
        gw = self.gw
        try:
            raw = await request.body()
        except ClientDisconnect:
            raise APIError(499, "client disconnected while sending the request") from None
        try:
            body = parse_json_body(raw)  # the server's limits: depth, NaN, UTF-8, an object
        except InvalidRequestError as e:
            raise APIError(400, str(e), code=e.code) from None
        requested = body.get("profile") or request.headers.get(PROFILE_HEADER)
        if requested is not None and not isinstance(requested, str):
            raise APIError(400, "profile must be a string", param="profile")
        sticky = body.get("user") or request.headers.get(SESSION_HEADER)
        sticky = str(sticky) if sticky else None
        try:
            choice = gw.policy.choose(sticky_key=sticky, requested=requested)
        except ProfileForbidden as e:
            raise APIError(403, str(e), param="profile", code="profile_override_forbidden") from None
        except UnknownProfile as e:
            raise APIError(400, str(e), param="profile", code="unknown_profile") from None
        profile, reason = choice.profile.name, choice.reason
        if reason in ("weighted", "sticky") and not gw.pool.has_healthy(profile):
            fallback = gw.fallback_profile()
            if fallback != profile and gw.pool.has_healthy(fallback):
                profile, reason = fallback, "unavailable"
        rid = request.headers.get("x-request-id") or f"gw-{uuid.uuid4().hex}"
        ex = Exchange(rid=rid, path=path, chat=chat, raw=raw, body=body, profile=profile, reason=reason,
                      step=choice.step, sticky=sticky)
        ex.capture = gw.shadow is not None and profile == gw.shadow_baseline() and gw.shadow.wants(body)
        return ex

    def _upstream(self, ex: Exchange, b: Backend, request: Request) -> httpx.Request:
        body = ex.body
        options = body.get("stream_options")
        add_usage = _gateway_adds_usage(body)
        changed = "profile" in body or (b.cfg.model and body.get("model") != b.cfg.model) or add_usage
        if changed:  # (a malformed stream_options goes as it is: the backend names the error)
            body = {k: v for k, v in body.items() if k != "profile"}
            if b.cfg.model:
                body["model"] = b.cfg.model
            if add_usage:
                body["stream_options"] = {**(options or {}), "include_usage": True}
        headers = [(b"content-type", b"application/json"), (b"x-request-id", ex.rid.encode())]
        auth = f"Bearer {b.cfg.api_key}" if b.cfg.api_key else request.headers.get("authorization")
        if auth:
            headers.append((b"authorization", auth.encode()))
        if b.cfg.profile_header:
            headers.append((PROFILE_HEADER.encode(), b.cfg.profile_header.encode()))
        url = self._urls.get((b.name, ex.path))
        if url is None:
            url = self._urls[(b.name, ex.path)] = httpx.URL(b.cfg.url + ex.path)
        return httpx.Request("POST", url, headers=headers, content=json.dumps(body).encode() if changed else ex.raw,
                             extensions={"timeout": self.gw.timeouts})

    # ---- handling -------------------------------------------------------------------------------

    async def handle(self, request: Request, path: str, chat: bool) -> Response:
        """The whole handler of POST /v1/completions and /v1/chat/completions. Raises APIError."""
        try:
            ex = await self._exchange(request, path, chat)
        except APIError as e:  # refused before a profile was chosen
            status = "cancelled" if e.status == 499 else "error"
            self.gw.metrics.request("none", status, e.status)
            self.gw.request_log.write({"id": request.headers.get("x-request-id"), "time": time.time(),
                                       "endpoint": "chat" if chat else "completions", "status": status,
                                       "http_status": e.status, "error": e.message})
            raise
        try:
            if ex.body.get("stream"):
                return await self._stream(request, ex)
            return await self._unary(request, ex)
        except APIError as e:
            record_exchange(self.gw, ex, "cancelled" if e.status == 499 else "error", e.status, e.message)
            e.headers.setdefault(PROFILE_HEADER, ex.profile)
            if ex.backend is not None:
                e.headers.setdefault(BACKEND_HEADER, ex.backend.name)
            raise

    def _next_backend(self, ex: Exchange, errors: list[str]) -> Backend:
        gw = self.gw
        if len(ex.attempts) > gw.cfg.retries:
            raise APIError(502, f"every try failed ({'; '.join(errors)})", code="bad_gateway")
        b = gw.pool.pick(ex.profile, ex.sticky, exclude=ex.attempts)
        if b is None:
            if ex.attempts:
                raise APIError(502, f"no other healthy backend serves profile {ex.profile!r} "
                                    f"({'; '.join(errors)})", code="bad_gateway")
            raise APIError(503, f"no healthy backend serves profile {ex.profile!r}", code="no_healthy_backend",
                           headers={"Retry-After": "1"})
        ex.attempts.append(b.name)
        ex.backend = b
        return b

    def _failed_attempt(self, ex: Exchange, b: Backend, e: BaseException | None, code: int) -> str:
        gw = self.gw
        msg = f"{b.name}: {type(e).__name__}: {e}" if e is not None else f"{b.name}: HTTP {code}"
        gw.metrics.attempt(b.name, ex.profile, "error", code)
        gw.metrics.retries.labels(backend=b.name).inc()
        if isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)):
            gw.pool.eject(b, f"{type(e).__name__}: {e}")
        return msg

    async def _send(self, request: Request, ex: Exchange, b: Backend) -> httpx.Response:
        """Send one attempt and wait for the response head. Raises _Retry for retryable failures. A kept-alive
        connection that the backend closed at that moment (no response at all) is retried once on a new
        connection to the same backend, as HTTP clients do for requests without side effects."""
        try:
            try:
                return await self.gw.transport.handle_async_request(self._upstream(ex, b, request))
            except (httpx.RemoteProtocolError, httpx.ReadError):
                return await self.gw.transport.handle_async_request(self._upstream(ex, b, request))
        except httpx.TimeoutException as e:
            if isinstance(e, httpx.ConnectTimeout):
                raise _Retry(self._failed_attempt(ex, b, e, 502)) from None
            raise APIError(504, f"backend {b.name} timed out: {e}", code="gateway_timeout") from None
        except httpx.TransportError as e:
            raise _Retry(self._failed_attempt(ex, b, e, 502)) from None

    @staticmethod
    def _passthrough(resp: httpx.Response, content: bytes) -> Response:
        headers = {k: v for k, v in resp.headers.items() if k.lower() == "retry-after"}
        return Response(content, status_code=resp.status_code, headers=headers,
                        media_type=resp.headers.get("content-type", "application/json"))

    def _give_up(self, ex: Exchange, last: _Retry | None, e: APIError) -> Response:
        """All tries failed: the last backend's own 5xx answer when there was one, else raise `e`."""
        if last is None or last.response is None:
            raise e
        resp = last.response
        record_exchange(self.gw, ex, "error", resp.status_code, f"every try failed: {e.message}")
        resp.headers.update({PROFILE_HEADER: ex.profile, BACKEND_HEADER: ex.backend.name, "x-request-id": ex.rid})
        return resp

    def _headers(self, ex: Exchange) -> dict[str, str]:
        h = {PROFILE_HEADER: ex.profile, BACKEND_HEADER: ex.backend.name, "x-request-id": ex.rid}
        if ex.reason == "unavailable":
            h["x-specserve-profile-reason"] = "unavailable"
        return h

    def _busy(self, b: Backend, delta: int) -> None:
        b.in_flight += delta
        self.gw.metrics.busy(b.name, delta)

    async def _tries(self, request: Request, ex: Exchange, attempt: Any) -> tuple[Backend, Any, float, float]:
        """Run `attempt(b)` on backends of the request's profile until one does not raise _Retry.
        Returns (backend, its result, when its try started, seconds spent waiting on backends); raises
        _GiveUp with the answer for the client when every try failed, APIError(499) when the client left."""
        errors: list[str] = []
        last: _Retry | None = None
        waited = 0.0
        guard = DisconnectGuard(request)
        try:
            while True:
                try:
                    b = self._next_backend(ex, errors)
                except APIError as e:
                    raise _GiveUp(self._give_up(ex, last, e)) from None
                t_send = time.perf_counter()
                try:
                    result = await attempt(b)
                    return b, result, t_send, waited + time.perf_counter() - t_send
                except _Retry as e:
                    errors.append(str(e))
                    last = e
                    waited += time.perf_counter() - t_send
        except asyncio.CancelledError:
            if guard.gone():
                raise APIError(499, "client disconnected") from None
            raise
        finally:
            guard.close()

    async def _read_whole(self, request: Request, ex: Exchange, b: Backend) -> tuple[httpx.Response, bytes]:
        """One non-streamed try: the whole answer, or _Retry (the client has seen nothing yet)."""
        self._busy(b, 1)
        try:
            resp = await self._send(request, ex, b)
            try:
                content = await resp.aread()
            except httpx.TimeoutException as e:
                raise APIError(504, f"backend {b.name} timed out: {e}", code="gateway_timeout") from None
            except httpx.TransportError as e:  # lost mid-response
                raise _Retry(self._failed_attempt(ex, b, e, 502)) from None
            finally:
                await resp.aclose()
        finally:
            self._busy(b, -1)
        if resp.status_code in RETRY_STATUSES:
            raise _Retry(self._failed_attempt(ex, b, None, resp.status_code), self._passthrough(resp, content))
        return resp, content

    async def _open_stream(self, request: Request, ex: Exchange, b: Backend) -> httpx.Response | Response:
        """One streamed try: the backend's open 200 stream, or its error answer (read whole), or _Retry."""
        resp = await self._send(request, ex, b)
        if resp.status_code == 200:
            return resp
        try:
            content = await resp.aread()
        except httpx.HTTPError as e:
            content = f"reading the error body failed: {e}".encode()
        finally:
            await resp.aclose()
        if resp.status_code in RETRY_STATUSES:
            raise _Retry(self._failed_attempt(ex, b, None, resp.status_code), self._passthrough(resp, content))
        self.gw.metrics.attempt(b.name, ex.profile, "error", resp.status_code)
        record_exchange(self.gw, ex, "error", resp.status_code, content[:300].decode("utf-8", "replace"))
        return Response(content, status_code=resp.status_code, headers=self._headers(ex),
                        media_type=resp.headers.get("content-type", "application/json"))

    async def _unary(self, request: Request, ex: Exchange) -> Response:
        gw = self.gw
        try:
            b, (resp, content), t_send, waited = await self._tries(
                request, ex, lambda b: self._read_whole(request, ex, b))
        except _GiveUp as g:
            return g.response
        code = resp.status_code
        gw.metrics.child(gw.metrics.backend_latency, b.name).observe(time.perf_counter() - t_send)
        gw.metrics.attempt(b.name, ex.profile, "ok" if code == 200 else "error", code)
        if code == 200:
            try:
                data = json.loads(content)
                usage = data.get("usage") or {}
                ex.prompt_tokens, ex.completion_tokens = usage.get("prompt_tokens"), usage.get("completion_tokens")
                ex.spec = data.get("specserve") if isinstance(data.get("specserve"), dict) else None
                if ex.capture:
                    gw.shadow.submit(ex.path, ex.body, ex.profile, outputs_from_body(data, ex.chat), ex.rid)
            except (ValueError, AttributeError, RecursionError):
                pass
        record_exchange(gw, ex, "ok" if code == 200 else "error", code,
                        None if code == 200 else content[:300].decode("utf-8", "replace"))
        out = Response(content, status_code=code, headers=self._headers(ex),
                       media_type=resp.headers.get("content-type", "application/json"))
        gw.metrics.overhead.observe(max(0.0, time.perf_counter() - ex.t0 - waited))
        return out

    async def _stream(self, request: Request, ex: Exchange) -> Response:
        try:
            b, resp, t_send, _ = await self._tries(request, ex, lambda b: self._open_stream(request, ex, b))
        except _GiveUp as g:
            return g.response
        if isinstance(resp, Response):  # the backend's own (non-retryable) error answer
            return resp
        relay = SSERelay(ex, drop_usage=_gateway_adds_usage(ex.body))
        headers = {**self._headers(ex), "cache-control": "no-cache", "x-accel-buffering": "no"}
        return RelayStream(self._relay(ex, b, resp, relay, t_send), headers=headers,
                           media_type=resp.headers.get("content-type", "text/event-stream"))

    async def _relay(self, ex: Exchange, b: Backend, resp: httpx.Response, relay: SSERelay, t_send: float):
        gw = self.gw
        status, code, error = "cancelled", 499, "client disconnected"
        self._busy(b, 1)
        try:
            async for chunk in resp.aiter_raw():
                out = relay.feed(chunk)
                if out:
                    yield out
            if relay.buf:
                yield relay.buf
            status, code, error = "ok", 200, None
        except (httpx.TransportError, httpx.TimeoutException) as e:
            status, code, error = "error", 502, f"backend {b.name} failed mid-stream: {type(e).__name__}: {e}"
            yield f"data: {json.dumps(error_body(502, error, code='bad_gateway'))}\n\ndata: [DONE]\n\n".encode()
        finally:
            self._busy(b, -1)
            await resp.aclose()
            gw.metrics.child(gw.metrics.backend_latency, b.name).observe(time.perf_counter() - t_send)
            gw.metrics.attempt(b.name, ex.profile, status, code)
            record_exchange(self.gw, ex, status, code, error)
            if status == "ok" and ex.capture:
                gw.shadow.submit(ex.path, ex.body, ex.profile, outputs_from_events(ex.events, ex.chat), ex.rid)
