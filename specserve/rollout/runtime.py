"""The rollout pieces of one server or gateway, built and started together.

`RolloutRuntime(policy, state_path=..., replay=..., availability=..., registry=...)` holds the outcome
window, the controller (restored from `state_path`), the shadow replayer (when a `replay` function is
given) and the Prometheus gauges (`RolloutCollector`, registered in `registry`); `start()` runs the
controller's evaluation loop on the running event loop and `stop()` ends it and any shadow replays.
Gauges: specserve:rollout_state{state} (1 for the current one of idle/running/paused/completed/
reverted), specserve:rollout_step (0-based, -1 without a rollout), specserve:rollout_candidate_percent,
specserve:rollout_weight{profile} (traffic fraction), specserve:rollout_reverted (1 while reverted to
baseline).
What it does not do: feed the window (the server subscribes it to its request log; the gateway adds
what it measures) or serve HTTP (`admin.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

from prometheus_client.core import GaugeMetricFamily

from specserve.rollout.controller import RolloutController
from specserve.rollout.policy import RolloutPolicy
from specserve.rollout.shadow import ShadowReplayer
from specserve.rollout.window import OutcomeWindow

STATES = ("idle", "running", "paused", "completed", "reverted")


class RolloutCollector:
    """Prometheus collector reading the controller and policy at scrape time (see the module docstring)."""

    def __init__(self, controller: RolloutController):
        self.controller = controller

    def describe(self):
        return []

    def collect(self):
        c = self.controller
        st = c.status()
        g = GaugeMetricFamily("specserve:rollout_state", "Staged rollout state (1 = current)", labels=["state"])
        for s in STATES:
            g.add_metric([s], 1.0 if st["state"] == s else 0.0)
        yield g
        yield GaugeMetricFamily("specserve:rollout_step", "Current rollout step (0-based; -1 = no rollout)",
                                value=float(st["step"]) if "step" in st else -1.0)
        yield GaugeMetricFamily("specserve:rollout_candidate_percent", "Candidate's percent at the current step",
                                value=float(st.get("percent") or 0.0))
        w = GaugeMetricFamily("specserve:rollout_weight", "Fraction of new traffic per profile", labels=["profile"])
        for name, f in st["fractions"].items():
            w.add_metric([name], f)
        yield w
        yield GaugeMetricFamily("specserve:rollout_reverted", "1 while all traffic is reverted to baseline",
                                value=1.0 if st["reverted_to_baseline"] else 0.0)


class RolloutRuntime:
    """See the module docstring."""

    def __init__(self, policy: RolloutPolicy, *, state_path: str | Path | None = None,
                 replay: Callable[[str, dict, str], Awaitable[dict]] | None = None,
                 availability: Callable[[str], bool] | None = None, registry: Any = None,
                 clock: Callable[[], float] = time.time):
        self.window = OutcomeWindow(clock=clock)
        self.controller = RolloutController(policy, state_path=state_path, window=self.window, clock=clock,
                                            availability=availability)
        self.shadow = ShadowReplayer(self.controller, replay) if replay is not None else None
        if registry is not None:
            registry.register(RolloutCollector(self.controller))
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.controller.run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self.shadow is not None:
            await self.shadow.aclose()
