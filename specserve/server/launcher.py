"""Start a server: from CLI arguments (`specserve serve`), or in a background thread (tests, tools).

What it does: `profile_set_from_args()` reads --profiles / --speculative-config; `serve(args)` loads the
engine (with the --seed, or one drawn at random and printed, so unseeded requests differ across
restarts), prints each profile's effective speculative config, builds the app and runs uvicorn in the
foreground. SIGTERM / SIGINT start the graceful drain (`lifecycle.drain`: 503 for new requests,
`--graceful-shutdown-s` for running ones, then a clean end for the rest), after which uvicorn stops
and the process exits with status 0; a second signal exits at once. `ServerThread` runs any app on
127.0.0.1 and a free port in a daemon thread, with `drain()` and `stop()` (also a context manager).
What it does not do: define the arguments (see `specserve.cli._add_serve`) or the routes (`api.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import secrets
import signal
import threading
import time
from typing import Any

import uvicorn

from specserve.config import ConfigError, SpeculativeConfig
from specserve.rollout.profiles import ProfileSet, default_profile_set, load_profiles

ADMIN_TOKEN_ENV = "SPECSERVE_ADMIN_TOKEN"


def profile_set_from_args(profiles: str | None, speculative_config: str | None) -> ProfileSet:
    """--profiles FILE, else `baseline` + `default` (= --speculative-config, weight 1). Not both."""
    if profiles and speculative_config:
        raise ConfigError("give --profiles or --speculative-config, not both (a profiles file names every setting)")
    if profiles:
        return load_profiles(profiles)
    spec_config = SpeculativeConfig.from_json(speculative_config) if speculative_config else None
    return default_profile_set(spec_config)


def serve(args: argparse.Namespace) -> int:
    """The `specserve serve` command. Returns the exit status."""
    from specserve.config import EngineConfig
    from specserve.engine.llm_engine import LLMEngine
    from specserve.server.api import ServerSettings, create_app
    from specserve.server.async_engine import AsyncEngine

    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    profile_set = profile_set_from_args(args.profiles, args.speculative_config)
    if args.max_queue is not None and args.max_queue < 0:
        raise ConfigError("--max-queue must be >= 0")
    if args.max_prompt_tokens is not None and args.max_prompt_tokens < 1:
        raise ConfigError("--max-prompt-tokens must be >= 1")
    if args.graceful_shutdown_s < 0 or args.watchdog_s < 0:
        raise ConfigError("--graceful-shutdown-s and --watchdog-s must be >= 0")
    token = args.admin_token or os.environ.get(ADMIN_TOKEN_ENV) or None
    seed = args.seed if args.seed is not None else secrets.randbits(63)
    log = logging.getLogger("specserve.server")
    log.info("seed for unseeded requests: %d%s", seed, "" if args.seed is not None else " (drawn at random; "
             "pass --seed to fix it)")
    for name, p in profile_set.profiles.items():
        log.info("profile %s: effective speculative config %s", name,
                 json.dumps(p.spec_config.effective()) if p.spec_config else "none (no speculation)")
    engine = LLMEngine(EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens, seed=seed,
        enforce_eager=args.enforce_eager, batch_invariant=args.batch_invariant,
        refresh_step_cost=args.refresh_step_cost,
        adaptive_objective=args.adaptive_objective,
        cpu_threads=args.cpu_threads,
        cpu_linear=args.cpu_linear,
        enable_prefix_caching=args.enable_prefix_caching,
    ))
    settings = ServerSettings(
        allow_profile_override=args.allow_profile_override, admin_token=token, request_log=args.request_log,
        log_prompts=args.log_prompts, max_queue=args.max_queue, max_num_seqs=args.max_num_seqs,
        rollout_state=args.rollout_state,
        tool_call_parser=None if args.tool_call_parser == "none" else args.tool_call_parser,
        watchdog_s=args.watchdog_s, seed=seed,
    )
    app = create_app(AsyncEngine(engine, max_prompt_tokens=args.max_prompt_tokens), profile_set, settings)
    if engine.adaptive is not None:  # create_app prepared every profile: an adaptive one measured the step cost
        cm = engine.adaptive.step_cost
        log.info("step cost of %s on %s (%s): %s; adaptive objective: %s", engine.model_name, engine.device,
                 cm.meta.get("cache", "not cached"), cm.summary(), engine.adaptive.objective)
    log.info("model %s on %s (%s; linear layers: %s; layer ops: %s; prefix caching %s)", engine.model_name,
             engine.device, f"{engine.cpu_threads} CPU threads" if engine.cpu_threads else "CUDA",
             getattr(engine.target.model, "linear_backend", "torch"),
             getattr(engine.target.model, "layer_backend", "torch"),
             "on" if engine.config.enable_prefix_caching else "off")
    log.info("profiles: %s; admin API %s; tool-call parser %s", {n: p.method for n, p in profile_set.profiles.items()},
             "on" if token else "off (no --admin-token)", app.state.specserve.tool_parser)
    server = DrainingServer(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                                           timeout_graceful_shutdown=5), grace_s=args.graceful_shutdown_s)
    server.run()
    return 0


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose first SIGTERM / SIGINT drains the app (`app.state.drain`) before it stops,
    and which exits normally afterwards (uvicorn would re-raise the signal: status 143). A second signal
    stops at once."""

    def __init__(self, config: uvicorn.Config, grace_s: float):
        super().__init__(config)
        self.grace_s = grace_s
        self._drain_requested = False
        self._drain_task: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._drain_requested or getattr(self.config.app.state, "drain", None) is None:
            self.should_exit = True
            self.force_exit = self._drain_requested
            return
        logging.getLogger("specserve.server").warning("%s: draining (up to %.1f s), then exiting",
                                                      signal.Signals(sig).name, self.grace_s)
        self._drain_requested = True

    async def on_tick(self, counter: int) -> bool:
        if self._drain_requested and self._drain_task is None:
            self._drain_task = asyncio.get_running_loop().create_task(self._drain())
        return await super().on_tick(counter)

    async def _drain(self) -> None:
        try:
            await self.config.app.state.drain(self.grace_s)
        finally:
            self.should_exit = True


class ServerThread:
    """Run an ASGI app with uvicorn in a daemon thread on a free port (127.0.0.1 by default)."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=3,
                                     lifespan="on")
        self.server = uvicorn.Server(self.config)
        self.thread = threading.Thread(target=self.server.run, name="specserve-uvicorn", daemon=True)
        self.host = host
        self.port: int | None = None

    def start(self, timeout_s: float = 60.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def drain(self, grace_s: float, timeout_s: float = 60.0) -> dict[str, int]:
        """Run the app's graceful drain (as SIGTERM does) on the server's loop; returns its counts."""
        fut = asyncio.run_coroutine_threadsafe(self.config.app.state.drain(grace_s), self.config.app.state.loop)
        return fut.result(timeout_s)

    def stop(self, timeout_s: float = 15.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
