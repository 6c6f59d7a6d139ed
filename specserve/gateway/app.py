"""`specserve gateway`: the OpenAI-compatible front over a fleet of backends.

Routes: POST /v1/completions and /v1/chat/completions (forwarded, see `proxy.py`), GET /v1/models (the
fleet's model ids, or `model` from the config), GET /health (200 while some baseline backend is
healthy, else 503), GET /metrics (`metrics.py`), the admin API under /admin (the server's, see
`specserve.rollout.admin`: profiles, weights, rollback, staged rollouts) and GET /admin/backends (each
backend's health). The staged-rollout controller runs here on what the gateway measures itself; it
reverts at once when no healthy backend serves the candidate. A `rollout.plan` in the config starts
when the gateway starts, once per state file (a restart resumes it; it never starts a finished or
reverted plan again).
What it does not do: load models (backends do) or balance by load (weights and stickiness only).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import random
import time
from contextlib import asynccontextmanager

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from specserve.config import ConfigError
from specserve.gateway.backends import Backend, BackendPool, HealthChecker
from specserve.gateway.config import FleetConfig, load_fleet
from specserve.gateway.metrics import GatewayMetrics
from specserve.gateway.exchange import GATEWAY_LOG_FIELDS
from specserve.gateway.proxy import Answer, Proxy
from specserve.metrics.prometheus import CONTENT_TYPE
from specserve.rollout.admin import admin_router, check_admin
from specserve.rollout.policy import RolloutPolicy
from specserve.rollout.profiles import BASELINE, ProfileSet
from specserve.rollout.request_log import RequestLog
from specserve.rollout.runtime import RolloutRuntime
from specserve.server.errors import APIError, BodySizeLimitMiddleware, install_error_handlers

logger = logging.getLogger("specserve.gateway")
HOT_PATHS = {"/v1/completions": False, "/v1/chat/completions": True}  # path -> chat


class GatewayProfile:
    """A profile as the gateway knows it: a name and the speculative config its backends run (as written
    in the fleet file; the gateway does not interpret it)."""

    spec_config = None  # the gateway runs no engine

    def __init__(self, name: str, config: dict | None, backends: list[str]):
        self.name, self.config, self.backends = name, config, backends

    @property
    def method(self) -> str:
        return (self.config or {}).get("method", "none")

    @property
    def num_speculative_tokens(self) -> int:
        return int((self.config or {}).get("num_speculative_tokens") or 0)

    def describe(self) -> dict:
        return {"name": self.name, "method": self.method, "num_speculative_tokens": self.num_speculative_tokens,
                "config": self.config, "backends": self.backends}


class Gateway:
    """The gateway's parts, shared by the routes and the proxy."""

    def __init__(self, cfg: FleetConfig, *, seed: int | None = None):
        self.cfg = cfg
        names = cfg.profile_names
        profiles = {n: GatewayProfile(n, cfg.profiles.get(n), [b.name for b in cfg.backends if b.profile == n])
                    for n in names}
        self.policy = RolloutPolicy(ProfileSet(profiles, {n: cfg.weights.get(n, 0.0) for n in names}),
                                    allow_override=cfg.allow_profile_override, seed=seed)
        self.metrics = GatewayMetrics([(b.name, b.profile) for b in cfg.backends], names)
        self.pool = BackendPool(cfg.backends, rng=random.Random(seed), on_change=self._backend_changed)
        self.metrics.watch_in_flight(self.pool.backends)
        self.request_log = RequestLog(cfg.request_log, fields=GATEWAY_LOG_FIELDS)
        self.session: aiohttp.ClientSession | None = None  # forwarding, health checks and shadow replays
        self.rollout = RolloutRuntime(self.policy, state_path=cfg.rollout_state_file, registry=self.metrics.registry,
                                      availability=self.pool.has_healthy, replay=self._replay)
        self.window, self.shadow = self.rollout.window, self.rollout.shadow
        self.proxy = Proxy(self)
        self.health = None

    def _backend_changed(self, b: Backend, up: bool) -> None:
        self.metrics.backend_up.labels(backend=b.name, profile=b.cfg.profile).set(1 if up else 0)
        if not up:
            self.metrics.ejections.labels(backend=b.name).inc()

    def _acceptance(self, b: Backend, drafts: int, draft_tokens: int, accepted: int) -> None:
        self.window.add_acceptance(b.cfg.profile, drafts, accepted)
        self.metrics.spec(b.cfg.profile, drafts, draft_tokens, accepted)

    def fallback_profile(self) -> str:
        c = self.rollout.controller
        return c.plan.baseline if c.active else BASELINE

    def shadow_baseline(self) -> str | None:
        c = self.rollout.controller
        return c.plan.baseline if c.state == "running" and c.plan.shadow else None

    async def _replay(self, path: str, body: dict, candidate: str) -> dict:
        b = self.pool.pick(candidate)
        if b is None:
            raise RuntimeError(f"no healthy backend serves {candidate!r}")
        if b.cfg.model:
            body = {**body, "model": b.cfg.model}
        headers = {"authorization": f"Bearer {b.cfg.api_key}"} if b.cfg.api_key else {}
        if b.cfg.profile_header:
            headers["x-specserve-profile"] = b.cfg.profile_header
        async with self.session.post(b.cfg.url + path, json=body, headers=headers,
                                     allow_redirects=False) as r:
            if r.status != 200:
                raise RuntimeError(f"{b.name}: HTTP {r.status}: {(await r.text())[:200]}")
            return await r.json(content_type=None)

    async def start(self) -> None:
        cfg = self.cfg
        self.session = open_session(cfg.timeout_s, cfg.connect_timeout_s)
        self.health = HealthChecker(self.pool, self.session, cfg.health, on_acceptance=self._acceptance)
        await self.health.check_all()  # start knowing the fleet
        ctrl = self.rollout.controller
        plan = cfg.rollout_plan
        if plan is not None and not any(e.get("event") == "start" and e.get("digest") == plan.digest
                                        for e in ctrl.history):
            if ctrl.active:
                raise ConfigError(f"rollout state file {cfg.rollout_state_file} holds an active rollout of another "
                                  "plan; revert it (specserve rollout rollback) or remove the file")
            ctrl.start(plan, by="config")
        self.rollout.start()
        self._health_task = asyncio.get_running_loop().create_task(self.health.run())

    async def stop(self) -> None:
        self._health_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._health_task
        await self.rollout.stop()
        await self.session.close()
        self.request_log.close()

    def models(self) -> list[str]:
        if self.cfg.model:
            return [self.cfg.model]
        return list(dict.fromkeys(m for b in self.pool.backends for m in b.models))


def open_session(timeout_s: float, connect_timeout_s: float) -> aiohttp.ClientSession:
    """The gateway's one HTTP client towards its backends. Connections are kept alive without a limit on
    their number; an idle one is dropped after 2 s, before the backends' own keep-alive timeout (uvicorn's,
    and so specserve's and vLLM's, is 5 s) can close it just as a request goes out on it. Timeouts:
    `connect_timeout_s` to connect, `timeout_s` for each read; no cookies, no compression asked for, no
    User-Agent, no redirects followed by the proxy (it passes answers on as they are)."""
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0)
    return aiohttp.ClientSession(
        connector=connector, cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False,
        skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding"),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s, sock_read=timeout_s))


def create_gateway_app(cfg: FleetConfig, *, seed: int | None = None) -> "FrontDoor":
    """The gateway's ASGI app for a validated fleet config (its parts are `app.state.gateway`)."""
    gw = Gateway(cfg, seed=seed)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        await gw.start()
        logger.info("gateway over %d backends, profiles %s", len(cfg.backends), gw.policy.weights)
        gc.freeze()  # what startup made lives on: keep it out of the collector's full passes (p99 pauses)
        try:
            yield
        finally:
            await gw.stop()

    app = FastAPI(title="specserve gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.gateway = gw
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=cfg.max_body_bytes)
    install_error_handlers(app)
    router = admin_router(gw.policy, cfg.admin_token, gw.rollout.controller)

    @router.get("/backends")
    async def backends(request: Request):
        check_admin(request, cfg.admin_token)
        return {"backends": [b.describe() for b in gw.pool.backends]}

    app.include_router(router)


    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": m, "object": "model", "created": created, "owned_by": "specserve-gateway",
            "specserve": {"profiles": list(gw.policy.profiles), "backends": [b.name for b in gw.pool.backends]},
        } for m in gw.models()]}

    @app.get("/health")
    async def health():
        if gw.pool.has_healthy(gw.fallback_profile()):
            return {"status": "ok", "healthy_backends": [b.name for b in gw.pool.backends if b.healthy]}
        return JSONResponse({"status": "unavailable", "error": "no healthy baseline backend"}, status_code=503)

    @app.get("/metrics")
    async def metrics():
        return Response(gw.metrics.render(), media_type=CONTENT_TYPE)

    return FrontDoor(app, gw)


class FrontDoor:
    """The ASGI app: POST /v1/completions and /v1/chat/completions go straight to `Proxy.serve`, a plain
    ASGI handler (no middleware stack, routing, parameter parsing or Request/Response objects on the hot
    path; the body-size limit is checked as the body is read; errors still OpenAI-shaped); everything
    else, lifespan included, to the FastAPI app (with its own body-size limit middleware)."""

    def __init__(self, app: FastAPI, gw: Gateway):
        self.app, self.gw, self.state = app, gw, app.state
        self._serve = gw.proxy.serve

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST":
            chat = HOT_PATHS.get(scope["path"])
            if chat is not None:
                try:
                    return await self._serve(scope, receive, send, scope["path"], chat)
                except Exception as e:  # noqa: BLE001 - never a bare 500 without a body
                    logger.exception("gateway: unhandled error: %s", e)
                    # (when the answer had already started, uvicorn refuses this and closes the connection)
                    with contextlib.suppress(RuntimeError):
                        await Answer.error(APIError(500, "internal gateway error; the gateway log has the details",
                                                    code="internal_error")).send(send, [])
                    return
        return await self.app(scope, receive, send)


def serve(args: argparse.Namespace) -> int:
    """The `specserve gateway` command. Returns the exit status."""
    import uvicorn

    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = load_fleet(args.config)
    app = create_gateway_app(cfg)
    logger.info("backends: %s; admin API %s", {b.name: f"{b.profile} {b.url}" for b in cfg.backends},
                "on" if cfg.admin_token else "off (no admin_token / SPECSERVE_ADMIN_TOKEN)")
    # no access log (the gateway's request log names backend, profile and step); no X-Forwarded-* rewriting of
    # the client address (the gateway uses none), which saves a middleware per request; no `server` header
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower(), timeout_graceful_shutdown=5,
                access_log=False, proxy_headers=False, server_header=False)
    return 0
