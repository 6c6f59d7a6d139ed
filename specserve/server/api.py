"""The FastAPI application: routes, start-up/shutdown of the engine thread, error handling.

Endpoints: POST /v1/completions, POST /v1/chat/completions (see `serving.py`), GET /v1/models (the
model, its context, and each profile's effective speculative config), GET /health (200 while the
engine runs and its watchdog is quiet, else 503; see `lifecycle.py`), GET /metrics (Prometheus text,
this app's own registry), and the admin API under /admin (see `specserve.rollout.admin`), with staged
rollouts (`specserve.rollout.runtime`: fed from the request log, state in --rollout-state).
`app.state.drain(grace_s)` starts the graceful drain (`lifecycle.drain`; the launcher calls it on
SIGTERM / SIGINT).
`create_app()` takes an `EngineClient` (engine_client.py; `AsyncEngine` over an `LLMEngine`, whose
target is a model-free stand-in in the tests: tests/helpers/fake_engine.py), prepares each profile's
proposer once (draft models are loaded once and shared), starts the engine when the app starts
(lifespan) and stops it, cleanly, when the app stops.
What it does not do: parse the command line, load the engine or run uvicorn (see `launcher.py`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from specserve.config import ConfigError
from specserve.metrics.prometheus import CONTENT_TYPE, ServerMetrics
from specserve.rollout.admin import admin_router
from specserve.rollout.policy import RolloutPolicy
from specserve.rollout.profiles import ProfileSet, default_profile_set
from specserve.rollout.request_log import RequestLog
from specserve.rollout.runtime import RolloutRuntime
from specserve.rollout.shadow import ShadowCapture, replay_in_process
from specserve.server.engine_client import EngineClient
from specserve.server.errors import BodySizeLimitMiddleware, install_error_handlers
from specserve.server.formatting import TokenText
from specserve.server.lifecycle import drain, health
from specserve.server.serving import ServerState, handle_generate
from specserve.server.tool_parsers import PARSERS, detect_tool_parser

logger = logging.getLogger("specserve.server")


@dataclass
class ServerSettings:
    """Server options that are not engine options (CLI flags of `specserve serve`)."""

    allow_profile_override: bool = False
    admin_token: str | None = None
    request_log: str | None = None
    log_prompts: bool = False
    max_queue: int | None = 256
    max_body_bytes: int = 4 * 1024 * 1024
    policy_seed: int | None = None
    max_num_seqs: int | None = None  # for the queue limit; default: the engine's max_num_seqs
    rollout_state: str | None = None  # staged-rollout state file (resumed after a restart); None = in memory
    tool_call_parser: str | None = "auto"  # "auto" (from the chat template), "hermes", "llama3_json", None (off)
    watchdog_s: float = 60.0  # pending work with no finished step for this long -> /health 503 (0 = off)
    seed: int | None = None  # the engine's seed for unseeded requests (shown in /v1/models)


def create_app(engine: EngineClient, profile_set: ProfileSet | None = None,
               settings: ServerSettings | None = None) -> FastAPI:
    """The app serving `engine` with `profile_set` (default: baseline only).

    Raises:
        ConfigError: the engine cannot build a profile's proposer; an unknown tool-call parser.
    """
    settings = settings or ServerSettings()
    profile_set = profile_set or default_profile_set(None)
    for spec_config in profile_set.unique_spec_configs():
        engine.prepare_speculative_config(spec_config)  # before the engine thread exists: no concurrent calls
    policy = RolloutPolicy(profile_set, allow_override=settings.allow_profile_override, seed=settings.policy_seed)
    model_name = engine.model_name
    parser = settings.tool_call_parser
    if parser == "auto":
        parser = detect_tool_parser(getattr(engine.tokenizer, "chat_template", None))
    elif parser is not None and parser not in PARSERS:
        raise ConfigError(f"--tool-call-parser must be auto, none or one of {', '.join(PARSERS)}, got {parser!r}")
    state = ServerState(
        engine=engine,
        policy=policy,
        metrics=ServerMetrics(list(profile_set.profiles), model_name),
        request_log=RequestLog(settings.request_log, log_prompts=settings.log_prompts),
        token_text=TokenText(engine.tokenizer),
        model_name=model_name,
        model_checksum=engine.model_checksum,
        max_num_seqs=settings.max_num_seqs or engine.max_num_seqs,
        max_queue=settings.max_queue,
        tool_parser=parser,
    )
    rollout = RolloutRuntime(policy, state_path=settings.rollout_state, registry=state.metrics.registry,
                             replay=lambda path, body, candidate: replay_in_process(app, path, body, candidate))
    state.request_log.subscribe(rollout.window.add_record)
    max_model_len = engine.max_model_len
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        _app.state.loop = asyncio.get_running_loop()
        state.engine.start(asyncio.get_running_loop())
        rollout.start()
        logger.info("serving %s with profiles %s", model_name, policy.weights)
        try:
            yield
        finally:
            await rollout.stop()
            state.engine.stop()
            state.request_log.close()

    app = FastAPI(title="specserve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.specserve = state
    app.add_middleware(ShadowCapture, replayer_getter=lambda: rollout.shadow)
    app.state.drain = lambda grace_s: drain(state, grace_s)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_body_bytes)
    install_error_handlers(app)
    app.include_router(admin_router(policy, settings.admin_token, rollout.controller))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle_generate(state, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle_generate(state, request, chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": created, "owned_by": "specserve",
            "root": model_name, "max_model_len": max_model_len,
            "specserve": {"model_checksum": state.model_checksum, "profiles": list(policy.profiles),
                          "speculative_configs": {n: p.describe()["effective_config"] for n, p in policy.profiles.items()},
                          "max_prompt_tokens": engine.max_prompt_tokens, "tool_call_parser": parser,
                          "seed": settings.seed},
        }]}

    @app.get("/health")
    async def health_route():
        status, body = health(state, settings.watchdog_s)
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def metrics():
        health(state, settings.watchdog_s)
        state.metrics.set_engine_stats(state.engine.stats(), state.engine.in_flight)
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    return app
