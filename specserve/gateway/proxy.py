"""Forwarding one completion request through the gateway: choose, send, retry, stream, record.

Per request: read the body with the size limit checked as it arrives (413, OpenAI-shaped, also for a
chunked body that grows past it), parse the JSON (400), choose the profile with the rollout policy
(sticky on `user`, else `x-session-id`; `profile` field / x-specserve-profile only with
allow_profile_override, else 403; unknown 400), pick a healthy backend of it (when none is left and
the profile was drawn, not asked for, the request goes to the baseline, logged as profile_reason
"unavailable"; otherwise 503), and forward the body (the `profile` field removed, `model` rewritten
when the backend names one; a stream gets `stream_options.include_usage` so the gateway learns the
token count, and the added usage chunk is not passed on). Retries: a request that fails before the
client got its first byte (cannot connect, connection lost, or HTTP 502/503/504) is sent to another
healthy backend of the same profile, up to `retries` more times; a stream is retried only before its
response starts. When every try failed, the client gets the last backend's own 5xx answer, or 502. A
connection failure also ejects the backend (passive health check). Streams are passed through as the
backend's chunks arrive (`streaming.SSERelay`); when the client goes away the backend connection is
closed, which makes a specserve or vLLM server abort the request (for a non-streamed request a
watcher starts after 0.25 s, so that fast requests pay for no extra task). Each request yields one
`Outcome` for the rollout window, one request-log line (backend, profile, config, rollout step,
attempts) and its Prometheus series, all recorded after the answer's last byte was sent; responses
carry `x-specserve-profile` and `x-specserve-backend`. Errors are OpenAI-shaped.

Cost: `Proxy.serve` is a plain ASGI handler (no Request/Response objects, no middleware or routing):
the request headers are read in one pass over the ASGI scope, the answer is sent as two ASGI messages
(non-streamed) or one per backend chunk (streamed). The client's body bytes are forwarded as they came
unless something in them must change (a `profile` field, a renamed `model`: re-serialized; the usage
option of a stream: spliced in), and backends are reached with aiohttp's pooled keep-alive connections
(its C HTTP parser costs about a third of httpx's CPU per request, measured in `docs/gateway.md`).
What it does not do: health checks (`backends.py`) or the other routes (`app.py`).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import secrets
import time
from typing import Any, Awaitable, Callable

import aiohttp
from yarl import URL

from specserve.gateway.backends import Backend
from specserve.gateway.exchange import Exchange, record_exchange
from specserve.gateway.streaming import DisconnectGuard, SSERelay
from specserve.inputs import InvalidRequestError
from specserve.rollout.policy import ProfileForbidden, UnknownProfile
from specserve.rollout.shadow import outputs_from_body, outputs_from_events
from specserve.server.errors import APIError, error_body
from specserve.server.parsing import parse_json_body

logger = logging.getLogger("specserve.gateway")

#: attempts that never reached the backend: the backend is ejected at once (passive health check)
_UNREACHABLE = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
#: a kept-alive connection the backend closed just as the request went out (no response at all)
_STALE = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)
#: the connection failed while the response was being read
_LOST = (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError)
_USAGE_OPTION = b', "stream_options": {"include_usage": true}}'

PROFILE_HEADER = "x-specserve-profile"
BACKEND_HEADER = "x-specserve-backend"
SESSION_HEADER = "x-session-id"
RETRY_STATUSES = (502, 503, 504)
_JSON = b"application/json"
_SSE_HEADERS = [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]

Send = Callable[[dict], Awaitable[None]]
Receive = Callable[[], Awaitable[dict]]


class Answer:
    """A whole answer for the client: status, body bytes, content type and extra headers (bytes pairs)."""

    __slots__ = ("status", "content", "content_type", "headers")

    def __init__(self, status: int, content: bytes, content_type: bytes = _JSON,
                 headers: list[tuple[bytes, bytes]] | None = None):
        self.status, self.content, self.content_type = status, content, content_type
        self.headers = headers or []

    @classmethod
    def error(cls, e: APIError) -> "Answer":
        return cls(e.status, json.dumps(e.body()).encode(), _JSON,
                   [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in e.headers.items()])

    @classmethod
    def of_backend(cls, resp: aiohttp.ClientResponse, content: bytes) -> "Answer":
        """The backend's answer as it came: its status, body and content type, its Retry-After kept."""
        ctype, extra = _JSON, []
        for k, v in resp.raw_headers:
            k = k.lower()
            if k == b"content-type":
                ctype = v
            elif k == b"retry-after":
                extra.append((b"retry-after", v))
        return cls(resp.status, content, ctype, extra)

    async def send(self, send: Send, headers: list[tuple[bytes, bytes]]) -> None:
        """Send it whole: `headers` (the gateway's own) after the content headers."""
        await send({"type": "http.response.start", "status": self.status,
                    "headers": [(b"content-type", self.content_type),
                                (b"content-length", str(len(self.content)).encode()), *self.headers, *headers]})
        await send({"type": "http.response.body", "body": self.content})


class _GiveUp(Exception):
    """Every try failed; `answer` (the last backend's own 5xx answer) is what the client gets."""

    def __init__(self, answer: Answer, message: str):
        super().__init__(message)
        self.answer, self.message = answer, message


class _Retry(Exception):
    """This attempt failed before the client saw a byte; `answer` is the backend's own answer, if any."""

    def __init__(self, message: str, answer: Answer | None = None):
        super().__init__(message)
        self.answer = answer


class _Head:
    """The request headers the gateway uses, read in one pass over the ASGI scope's (first of each)."""

    __slots__ = ("content_length", "authorization", "profile", "session", "request_id")

    def __init__(self, headers: list[tuple[bytes, bytes]]):
        cl = auth = prof = sess = rid = None
        for k, v in headers:  # (uvicorn gives names lowercased)
            if k == b"content-length":
                cl = cl if cl is not None else v
            elif k == b"authorization":
                auth = auth if auth is not None else v.decode("latin-1")
            elif k == b"x-specserve-profile":
                prof = prof if prof is not None else v.decode("latin-1")
            elif k == b"x-session-id":
                sess = sess if sess is not None else v.decode("latin-1")
            elif k == b"x-request-id":
                rid = rid if rid is not None else v.decode("latin-1")
        self.content_length, self.authorization, self.profile, self.session, self.request_id = cl, auth, prof, sess, rid


def _with_usage_option(body: dict, raw: bytes) -> bytes:
    """`raw` (the bytes of `body`) with stream_options.include_usage set: spliced in before the closing
    brace when the client sent no stream_options (no re-serialization), else re-serialized."""
    raw = raw.rstrip()
    if "stream_options" not in body and raw.endswith(b"}"):
        return raw[:-1] + _USAGE_OPTION
    options = body.get("stream_options") or {}
    return json.dumps({**body, "stream_options": {**options, "include_usage": True}}).encode()


def _gateway_adds_usage(body: dict) -> bool:
    """A stream whose client did not ask for usage: the gateway asks for it (and drops the usage chunk)."""
    options = body.get("stream_options")
    return body.get("stream") is True and (options is None or (isinstance(options, dict)
                                                               and not options.get("include_usage")))


async def read_limited_body(receive: Receive, head: _Head, limit: int) -> bytes:
    """The request body, with the size limit checked as it arrives. Raises APIError 413
    (`request_too_large`, with Connection: close) when Content-Length or the bytes received pass
    `limit`, 499 when the client disconnected while sending it."""
    if head.content_length is not None:
        try:
            declared = int(head.content_length)
        except ValueError:
            declared = 0
        if declared > limit:
            raise APIError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes",
                           code="request_too_large", headers={"connection": "close"})
    msg = await receive()
    if msg["type"] != "http.request":
        raise APIError(499, "client disconnected while sending the request")
    body = msg.get("body", b"")
    if not msg.get("more_body", False) and len(body) <= limit:
        return body
    parts, n = [body], len(body)
    while True:
        if n > limit:
            raise APIError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large",
                           headers={"connection": "close"})
        if not msg.get("more_body", False):
            return b"".join(parts)
        msg = await receive()
        if msg["type"] != "http.request":
            raise APIError(499, "client disconnected while sending the request")
        chunk = msg.get("body", b"")
        parts.append(chunk)
        n += len(chunk)


class Proxy:
    """The forwarding logic over the gateway's parts (`gw`: see `app.Gateway`)."""

    def __init__(self, gw: Any):
        self.gw = gw
        self._urls: dict[tuple[str, str], URL] = {}
        self._names: dict[str, bytes] = {}  # profile / backend name -> header value bytes
        # request ids: a random prefix per process and a counter (unique, without os.urandom per request)
        self._id_prefix, self._ids = f"gw-{secrets.token_hex(6)}-", itertools.count(1)

    # ---- the ASGI handler -----------------------------------------------------------------------

    async def serve(self, scope: dict, receive: Receive, send: Send, path: str, chat: bool) -> None:
        """The whole ASGI handler of POST /v1/completions and /v1/chat/completions: answers the client,
        then records the request (metrics, rollout window, request log)."""
        head = _Head(scope["headers"])
        try:
            raw = await read_limited_body(receive, head, self.gw.cfg.max_body_bytes)
            ex = self._exchange(raw, head, path, chat)
        except APIError as e:  # refused before a profile was chosen
            await Answer.error(e).send(send, [])
            status = "cancelled" if e.status == 499 else "error"
            self.gw.metrics.request("none", status, e.status)
            self.gw.request_log.write({"id": head.request_id, "time": time.time(),
                                       "endpoint": "chat" if chat else "completions", "status": status,
                                       "http_status": e.status, "error": e.message})
            return
        if ex.body.get("stream"):
            await self._stream(ex, receive, send)
        else:
            await self._unary(ex, receive, send)

    # ---- choosing -------------------------------------------------------------------------------

    def _exchange(self, raw: bytes, head: _Head, path: str, chat: bool) -> Exchange:
        gw = self.gw
        try:
            body = parse_json_body(raw)  # the server's limits: depth, NaN, UTF-8, an object
        except InvalidRequestError as e:
            raise APIError(400, str(e), code=e.code) from None
        requested = body.get("profile") or head.profile
        if requested is not None and not isinstance(requested, str):
            raise APIError(400, "profile must be a string", param="profile")
        sticky = body.get("user") or head.session
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
        rid = head.request_id or f"{self._id_prefix}{next(self._ids)}"
        ex = Exchange(rid=rid, path=path, chat=chat, raw=raw, body=body, profile=profile, reason=reason,
                      step=choice.step, sticky=sticky, auth=head.authorization)
        ex.capture = gw.shadow is not None and profile == gw.shadow_baseline() and gw.shadow.wants(body)
        return ex

    def _upstream(self, ex: Exchange, b: Backend) -> tuple[URL, bytes, dict[str, str]]:
        """(url, body bytes, headers) of one attempt on backend `b`. The client's bytes go as they came
        unless the body must change: without `profile`, with the backend's `model`, with the usage option."""
        body, data = ex.body, ex.raw
        add_usage = _gateway_adds_usage(body)
        if "profile" in body or (b.cfg.model and body.get("model") != b.cfg.model):
            body = {k: v for k, v in body.items() if k != "profile"}
            if b.cfg.model:
                body["model"] = b.cfg.model
            if add_usage:  # (a malformed stream_options goes as it is: the backend names the error)
                body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
            data = json.dumps(body).encode()
        elif add_usage:
            data = _with_usage_option(body, data)
        headers = {"content-type": "application/json", "x-request-id": ex.rid}
        auth = f"Bearer {b.cfg.api_key}" if b.cfg.api_key else ex.auth
        if auth:
            headers["authorization"] = auth
        if b.cfg.profile_header:
            headers[PROFILE_HEADER] = b.cfg.profile_header
        url = self._urls.get((b.name, ex.path))
        if url is None:
            url = self._urls[(b.name, ex.path)] = URL(b.cfg.url + ex.path)
        return url, data, headers

    def _name(self, name: str) -> bytes:
        v = self._names.get(name)
        if v is None:
            v = self._names[name] = name.encode("latin-1", "replace")
        return v

    def _headers(self, ex: Exchange) -> list[tuple[bytes, bytes]]:
        """The gateway's own response headers: profile, backend (once one was tried), request id."""
        h = [(b"x-specserve-profile", self._name(ex.profile))]
        if ex.backend is not None:
            h.append((b"x-specserve-backend", self._name(ex.backend.name)))
        h.append((b"x-request-id", ex.rid.encode("latin-1", "replace")))
        if ex.reason == "unavailable":
            h.append((b"x-specserve-profile-reason", b"unavailable"))
        return h

    # ---- trying backends ------------------------------------------------------------------------

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
        if isinstance(e, _UNREACHABLE):
            gw.pool.eject(b, f"{type(e).__name__}: {e}")
        return msg

    async def _send(self, ex: Exchange, b: Backend) -> aiohttp.ClientResponse:
        """Send one attempt and wait for the response head. Raises _Retry for retryable failures. A kept-alive
        connection that the backend closed at that moment (no response at all) is retried once on a new
        connection to the same backend, as HTTP clients do for requests without side effects."""
        url, data, headers = self._upstream(ex, b)
        session = self.gw.session
        try:
            try:
                return await session.post(url, data=data, headers=headers, allow_redirects=False)
            except _STALE as e:
                if isinstance(e, _UNREACHABLE):
                    raise
                return await session.post(url, data=data, headers=headers, allow_redirects=False)
        except aiohttp.ConnectionTimeoutError as e:
            raise _Retry(self._failed_attempt(ex, b, e, 502)) from None
        except TimeoutError as e:
            raise APIError(504, f"backend {b.name} timed out: {type(e).__name__}: {e}", code="gateway_timeout") from None
        except aiohttp.ClientError as e:
            raise _Retry(self._failed_attempt(ex, b, e, 502)) from None

    async def _tries(self, ex: Exchange, receive: Receive, attempt: Any) -> tuple[Backend, Any, float, float]:
        """Run `attempt(b)` on backends of the request's profile until one does not raise _Retry.
        Returns (backend, its result, when its try started, seconds spent waiting on backends); raises
        _GiveUp with the answer for the client when every try failed, APIError(499) when the client left."""
        errors: list[str] = []
        last: _Retry | None = None
        waited = 0.0
        guard = DisconnectGuard(receive)
        try:
            while True:
                try:
                    b = self._next_backend(ex, errors)
                except APIError as e:
                    if last is None or last.answer is None:
                        raise
                    raise _GiveUp(last.answer, f"every try failed: {e.message}") from None
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

    async def _read_whole(self, ex: Exchange, b: Backend) -> tuple[aiohttp.ClientResponse, bytes]:
        """One non-streamed try: the whole answer, or _Retry (the client has seen nothing yet)."""
        b.in_flight += 1
        try:
            resp = await self._send(ex, b)
            try:
                content = await resp.read()  # (returns the connection to the pool)
            except TimeoutError as e:
                raise APIError(504, f"backend {b.name} timed out: {type(e).__name__}: {e}",
                               code="gateway_timeout") from None
            except _LOST as e:  # lost mid-response
                raise _Retry(self._failed_attempt(ex, b, e, 502)) from None
            finally:
                resp.close()  # (a no-op after a whole read; else the connection is dropped, not reused)
        finally:
            b.in_flight -= 1
        if resp.status in RETRY_STATUSES:
            raise _Retry(self._failed_attempt(ex, b, None, resp.status), Answer.of_backend(resp, content))
        return resp, content

    async def _open_stream(self, ex: Exchange, b: Backend) -> aiohttp.ClientResponse | Answer:
        """One streamed try: the backend's open 200 stream, or its error answer (read whole), or _Retry."""
        resp = await self._send(ex, b)
        if resp.status == 200:
            return resp
        try:
            content = await resp.read()
        except (aiohttp.ClientError, TimeoutError) as e:
            content = f"reading the error body failed: {e}".encode()
        finally:
            resp.close()
        if resp.status in RETRY_STATUSES:
            raise _Retry(self._failed_attempt(ex, b, None, resp.status), Answer.of_backend(resp, content))
        return Answer.of_backend(resp, content)

    # ---- answering, then recording --------------------------------------------------------------

    async def _fail(self, ex: Exchange, send: Send, answer: Answer, status: str, error: str) -> None:
        """Send an error answer (the gateway's or a backend's), then record the request."""
        await answer.send(send, self._headers(ex))
        ex.t_end = time.perf_counter()
        record_exchange(self.gw, ex, status, answer.status, error)

    async def _unary(self, ex: Exchange, receive: Receive, send: Send) -> None:
        gw = self.gw
        try:
            b, (resp, content), t_send, waited = await self._tries(ex, receive, lambda b: self._read_whole(ex, b))
        except _GiveUp as g:
            return await self._fail(ex, send, g.answer, "error", g.message)
        except APIError as e:
            return await self._fail(ex, send, Answer.error(e), "cancelled" if e.status == 499 else "error", e.message)
        t_backend = time.perf_counter() - t_send
        answer = Answer.of_backend(resp, content)
        await answer.send(send, self._headers(ex))
        ex.t_end = t_end = time.perf_counter()
        # ---- after the last byte: measure and record
        code = resp.status
        gw.metrics.child(gw.metrics.backend_latency, b.name).observe(t_backend)
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
        gw.metrics.overhead.observe(max(0.0, t_end - ex.t0 - waited))

    async def _stream(self, ex: Exchange, receive: Receive, send: Send) -> None:
        gw = self.gw
        try:
            b, resp, t_send, _ = await self._tries(ex, receive, lambda b: self._open_stream(ex, b))
        except _GiveUp as g:
            return await self._fail(ex, send, g.answer, "error", g.message)
        except APIError as e:
            return await self._fail(ex, send, Answer.error(e), "cancelled" if e.status == 499 else "error", e.message)
        if isinstance(resp, Answer):  # the backend's own (non-retryable) error answer
            gw.metrics.attempt(b.name, ex.profile, "error", resp.status)
            return await self._fail(ex, send, resp, "error", resp.content[:300].decode("utf-8", "replace"))
        relay = SSERelay(ex, drop_usage=_gateway_adds_usage(ex.body))
        ctype = resp.headers.get("content-type", "text/event-stream").encode("latin-1")
        status, code, error = "cancelled", 499, "client disconnected"
        b.in_flight += 1
        guard = DisconnectGuard(receive, delay_s=0)
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", ctype), *self._headers(ex), *_SSE_HEADERS]})
            try:
                async for chunk in resp.content.iter_any():
                    out = relay.feed(chunk)
                    if out:
                        await send({"type": "http.response.body", "body": out, "more_body": True})
                tail = relay.buf  # (an unterminated last event goes as it is)
                status, code, error = "ok", 200, None
            except (aiohttp.ClientError, TimeoutError) as e:
                status, code, error = "error", 502, f"backend {b.name} failed mid-stream: {type(e).__name__}: {e}"
                tail = f"data: {json.dumps(error_body(502, error, code='bad_gateway'))}\n\ndata: [DONE]\n\n".encode()
            except Exception as e:  # noqa: BLE001 - a bug here must still end the stream readably
                logger.exception("gateway: stream relay failed: %s", e)
                status, code, error = "error", 500, f"internal gateway error: {type(e).__name__}"
                tail = (f"data: {json.dumps(error_body(500, 'internal gateway error; the gateway log has the details', code='internal_error'))}"
                        "\n\ndata: [DONE]\n\n").encode()
            guard.finish()
            await send({"type": "http.response.body", "body": tail, "more_body": False})
            ex.t_end = time.perf_counter()
        except asyncio.CancelledError:
            if not guard.gone():
                raise
            status, code, error = "cancelled", 499, "client disconnected"
        finally:
            guard.close()
            b.in_flight -= 1
            if status == "ok":
                resp.release()  # whole: the connection goes back to the pool
            else:
                resp.close()  # the client left or the backend failed: drop the connection (the backend aborts)
            # ---- after the last byte (or the client's leaving): record
            gw.metrics.child(gw.metrics.backend_latency, b.name).observe(time.perf_counter() - t_send)
            gw.metrics.attempt(b.name, ex.profile, status, code)
            record_exchange(gw, ex, status, code, error)
            if status == "ok" and ex.capture:
                gw.shadow.submit(ex.path, ex.body, ex.profile, outputs_from_events(ex.events, ex.chat), ex.rid)
