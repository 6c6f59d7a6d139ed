"""Start a server: from CLI arguments (`specserve serve`), or in a background thread (tests, tools).

What it does: `profile_set_from_args()` reads --profiles / --speculative-config; `serve(args)` loads the
engine, builds the app and runs uvicorn in the foreground until Ctrl-C / SIGTERM (in-flight streams get
`--graceful-shutdown-s` to finish, then the engine thread is stopped). `ServerThread` runs any app on
127.0.0.1 and a free port in a daemon thread, with `stop()` (also a context manager).
What it does not do: define the arguments (see `specserve.cli._add_serve`) or the routes (`api.py`).
"""

from __future__ import annotations

import argparse
import logging
import os
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
    token = args.admin_token or os.environ.get(ADMIN_TOKEN_ENV) or None
    engine = LLMEngine(EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens, seed=args.seed,
        enforce_eager=args.enforce_eager, batch_invariant=args.batch_invariant,
        refresh_step_cost=args.refresh_step_cost,
    ))
    settings = ServerSettings(
        allow_profile_override=args.allow_profile_override, admin_token=token, request_log=args.request_log,
        log_prompts=args.log_prompts, max_queue=args.max_queue, max_num_seqs=args.max_num_seqs,
        rollout_state=args.rollout_state,
    )
    app = create_app(AsyncEngine(engine), profile_set, settings)  # prepares every profile: an adaptive one measures the step cost
    if engine.adaptive is not None:
        cm = engine.adaptive.step_cost
        logging.getLogger("specserve.server").info("step cost of %s on %s (%s): %s", engine.model_name, engine.device,
                                                   cm.meta.get("cache", "not cached"), cm.summary())
    logging.getLogger("specserve.server").info(
        "profiles: %s; admin API %s", {n: p.method for n, p in profile_set.profiles.items()},
        "on" if token else "off (no --admin-token)",
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                timeout_graceful_shutdown=args.graceful_shutdown_s)
    return 0


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

    def stop(self, timeout_s: float = 15.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
