"""The gateway's backends: which are healthy, which one serves a request, and the health-check loop.

What it does: `BackendPool.pick(profile, sticky_key, exclude)` returns a healthy backend of a profile:
with a sticky key (the `user` field or `x-session-id`) by weighted rendezvous hashing (the backend with
the highest -weight / ln(u), u = a stable hash of key and backend name), so a user stays on one backend
and only the users of an ejected backend move; without a key at random by weight. `HealthChecker.run()`
checks every backend every `interval_s` (GET url + health.path, 200 = good): `unhealthy_after`
consecutive failures eject it (no new requests), `healthy_after` good checks return it. A request that
cannot connect to a backend ejects it at once (passive check); the loop returns it when it answers.
For `kind: vllm` backends each good check also reads the speculation counters from /metrics
(vllm:spec_decode_num_drafts / _num_draft_tokens / _num_accepted_tokens, summed over labels) and
reports their increase,
since vLLM gives acceptance only there. A backend's model ids (GET /v1/models) are read once.
What it does not do: forward requests (`proxy.py`) or choose the profile (the rollout policy does).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import time
from dataclasses import dataclass, field
from typing import Callable

import aiohttp

from specserve.bench.prom import parse as parse_prometheus
from specserve.gateway.config import BackendConfig, HealthConfig
from specserve.rollout.policy import stable_unit

logger = logging.getLogger("specserve.gateway")
VLLM_DRAFTS = "vllm:spec_decode_num_drafts_total"
VLLM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
VLLM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"


@dataclass
class Backend:
    """One backend and its live state."""

    cfg: BackendConfig
    healthy: bool = True  # until a check or a failed connection says otherwise
    checked: bool = False
    fails: int = 0  # consecutive failed checks
    oks: int = 0  # consecutive good checks while ejected
    in_flight: int = 0
    ejected_at: float | None = None
    last_error: str = ""
    models: list[str] = field(default_factory=list)
    spec_counts: tuple[float, float, float] | None = None  # last scraped (drafts, draft tokens, accepted), vLLM

    @property
    def name(self) -> str:
        return self.cfg.name

    def describe(self) -> dict:
        c = self.cfg
        return {"name": c.name, "url": c.url, "profile": c.profile, "kind": c.kind, "weight": c.weight,
                "healthy": self.healthy, "checked": self.checked, "in_flight": self.in_flight,
                "ejected_at": self.ejected_at, "last_error": self.last_error, "models": self.models}


class BackendPool:
    """All backends by profile, with the eject/return bookkeeping. `on_change(backend, up)` is called on
    every ejection and return (metrics and logs)."""

    def __init__(self, configs: tuple[BackendConfig, ...], rng: random.Random | None = None,
                 on_change: Callable[[Backend, bool], None] | None = None):
        self.backends = [Backend(c) for c in configs]
        self.by_name = {b.name: b for b in self.backends}
        self.by_profile: dict[str, list[Backend]] = {}
        for b in self.backends:
            self.by_profile.setdefault(b.cfg.profile, []).append(b)
        self.rng = rng or random.Random()
        self.on_change = on_change

    def healthy(self, profile: str) -> list[Backend]:
        return [b for b in self.by_profile.get(profile, ()) if b.healthy]

    def has_healthy(self, profile: str) -> bool:
        return any(b.healthy for b in self.by_profile.get(profile, ()))

    def pick(self, profile: str, sticky_key: str | None = None, exclude: set[str] | frozenset = frozenset()
             ) -> Backend | None:
        """A healthy backend of `profile` not in `exclude` (names), or None (see the module docstring)."""
        cands = [b for b in self.by_profile.get(profile, ()) if b.healthy and b.name not in exclude]
        if len(cands) <= 1:
            return cands[0] if cands else None
        if sticky_key:
            return max(cands, key=lambda b: -b.cfg.weight / math.log(
                min(max(stable_unit(f"{sticky_key}\x00{b.name}"), 1e-12), 1 - 1e-12)))
        return self.rng.choices(cands, weights=[b.cfg.weight for b in cands])[0]

    def eject(self, b: Backend, error: str) -> None:
        b.last_error = error
        b.oks = 0
        if b.healthy:
            b.healthy = False
            b.ejected_at = time.time()
            logger.warning("gateway: backend %s (%s) ejected: %s", b.name, b.cfg.url, error)
            if self.on_change:
                self.on_change(b, False)

    def restore(self, b: Backend) -> None:
        if not b.healthy:
            b.healthy = True
            b.ejected_at = None
            logger.warning("gateway: backend %s (%s) returned", b.name, b.cfg.url)
            if self.on_change:
                self.on_change(b, True)

    def record_check(self, b: Backend, ok: bool, error: str, health: HealthConfig) -> None:
        b.checked = True
        if ok:
            b.fails = 0
            b.oks += 1
            if not b.healthy and b.oks >= health.healthy_after:
                self.restore(b)
        else:
            b.oks = 0
            b.fails += 1
            b.last_error = error
            if b.healthy and b.fails >= health.unhealthy_after:
                self.eject(b, f"health check failed {b.fails}x: {error}")


class HealthChecker:
    """Checks every backend every `interval_s` (see the module docstring). `on_acceptance(backend,
    drafts, draft_tokens, accepted)` receives the increase of a vLLM backend's speculation counters."""

    def __init__(self, pool: BackendPool, session: aiohttp.ClientSession, health: HealthConfig,
                 on_acceptance: Callable[[Backend, int, int, int], None] | None = None):
        self.pool = pool
        self.session = session
        self._timeout = aiohttp.ClientTimeout(total=health.timeout_s)
        self.health = health
        self.on_acceptance = on_acceptance

    async def _get(self, url: str) -> tuple[int, bytes]:
        async with self.session.get(url, timeout=self._timeout, allow_redirects=False) as r:
            return r.status, await r.read()

    async def check(self, b: Backend) -> bool:
        try:
            status, _ = await self._get(b.cfg.url + self.health.path)
            ok, error = status == 200, f"HTTP {status}"
        except (aiohttp.ClientError, TimeoutError) as e:
            ok, error = False, f"{type(e).__name__}: {e}"
        self.pool.record_check(b, ok, error, self.health)
        if ok:
            try:
                if not b.models:
                    status, content = await self._get(b.cfg.url + "/v1/models")
                    if status == 200:
                        b.models = [m.get("id") for m in json.loads(content).get("data", []) if m.get("id")]
                if b.cfg.kind == "vllm":
                    await self._scrape(b)
            except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError) as e:
                logger.debug("gateway: reading %s failed: %s", b.name, e)
        return ok

    async def _scrape(self, b: Backend) -> None:
        status, content = await self._get(b.cfg.url + "/metrics")
        if status != 200:
            return
        samples = parse_prometheus(content.decode("utf-8", "replace"))
        now = tuple(sum(v for (name, _), v in samples.items() if name == key)
                    for key in (VLLM_DRAFTS, VLLM_DRAFT_TOKENS, VLLM_ACCEPTED))
        prev, b.spec_counts = b.spec_counts, now
        if prev is not None and self.on_acceptance and all(x >= y for x, y in zip(now, prev)):
            d, t, a = (int(x - y) for x, y in zip(now, prev))  # a restarted server's counters start over: skipped
            if d > 0:
                self.on_acceptance(b, d, t, a)

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(b) for b in self.pool.backends))

    async def run(self) -> None:
        """Check forever, every interval_s (cancel the task to stop)."""
        while True:
            t0 = time.monotonic()
            try:
                await self.check_all()
            except Exception:  # noqa: BLE001 - the loop must survive anything
                logger.exception("gateway: health check round failed")
            await asyncio.sleep(max(0.0, self.health.interval_s - (time.monotonic() - t0)))
