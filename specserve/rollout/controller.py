"""The rollout controller: runs a staged plan over a `RolloutPolicy`, promoting or reverting on its gates.

What it does: `start(plan)` puts the candidate at the first step's percent; `tick()` (every
`plan.interval_s`, from `run()`) evaluates the gates over the step's window (the last `window_s`
seconds since the step began, both sides over the same time range) and promotes to the next step, or
reverts to baseline with the failed gate, its figures and the window in the reason (logged, and kept
in the history). Reaching the 100% step completes the rollout. By hand: `pause()` (no automatic
decision while paused; traffic keeps its split), `resume()`, `promote()`, `revert()`, and
`set_weights()` (refused while a rollout is active). On the gateway an `availability(profile)`
callback reverts at once when no healthy backend serves the candidate.
Persistence: every change writes {traffic split, rollout, history} to `state_path` atomically (temp file
in the same folder, fsync, rename, fsync of the folder). A new controller over the same file applies
the saved split to the policy (a reverted rollout stays reverted) and resumes an active rollout at the
same step; its window starts empty, so nothing is decided until each side again has the step's
minimum requests: no flapping. Dwell counts wall time at the step, paused time excluded.
What it does not do: HTTP (`admin.py`) or measure requests (`window.py`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

from specserve.config import ConfigError
from specserve.rollout.gates import Decision, decide, evaluate_gates
from specserve.rollout.plan import RolloutPlan, plan_from_dict
from specserve.rollout.policy import RolloutPolicy
from specserve.rollout.profiles import BASELINE
from specserve.rollout.window import OutcomeWindow

logger = logging.getLogger("specserve.rollout")
ACTIVE = ("running", "paused")
MAX_HISTORY = 500


class RolloutConflict(Exception):
    """The action does not fit the rollout's state (HTTP 409); the message says why."""


def _fmt_time(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


def write_json_atomic(path: Path, doc: Any) -> None:
    """Write JSON so that a crash leaves the old file or the new one, never a torn one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=1, default=str)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    try:
        dfd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


class RolloutController:
    """See the module docstring. Thread-safe; all times are `clock()` seconds (wall time)."""

    def __init__(self, policy: RolloutPolicy, *, state_path: str | Path | None = None,
                 window: OutcomeWindow | None = None, clock: Callable[[], float] = time.time,
                 availability: Callable[[str], bool] | None = None):
        self.policy = policy
        self.clock = clock
        self.window = window or OutcomeWindow(clock=clock)
        self.availability = availability
        self.state_path = Path(state_path) if state_path else None
        self._lock = threading.RLock()
        self.plan: RolloutPlan | None = None
        self.rollout: dict[str, Any] | None = None
        self.history: list[dict[str, Any]] = []
        self.last_evaluation: dict[str, Any] | None = None
        self.next_evaluation_at: float | None = None
        self._restore()

    # ---- state ---------------------------------------------------------------------------------

    @property
    def state(self) -> str:
        return self.rollout["state"] if self.rollout else "idle"

    @property
    def active(self) -> bool:
        return self.state in ACTIVE

    def step_label(self) -> str | None:
        """'candidate@percent%' while a rollout is active, else None (written to the request log)."""
        if not self.active:
            return None
        return f"{self.plan.candidate}@{self.plan.steps[self.rollout['step']].percent:g}%"

    def _event(self, event: str, by: str, reason: str = "", **extra: Any) -> dict:
        e = {"time": self.clock(), "event": event, "by": by, "reason": reason}
        if self.rollout:
            e.update(step=self.rollout["step"], percent=self.plan.steps[self.rollout["step"]].percent)
        e.update(extra)
        self.history.append(e)
        del self.history[:-MAX_HISTORY]
        return e

    def _save(self) -> None:
        if self.state_path is None:
            return
        pol = self.policy.state()
        traffic = {"weights": pol["weights"], "reverted_to": pol["reverted_to"], "step": pol["rollout_step"]}
        write_json_atomic(self.state_path, {"format": 1, "traffic": traffic, "rollout": self.rollout,
                                            "history": self.history})

    def _restore(self) -> None:
        if self.state_path is None or not self.state_path.exists():
            return
        try:
            doc = json.loads(self.state_path.read_text())
            traffic, rollout, history = doc["traffic"], doc.get("rollout"), list(doc.get("history") or [])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"rollout state file {self.state_path} is unreadable ({e}); fix or remove it") from None
        plan = None
        if rollout:
            try:
                plan = plan_from_dict(rollout["plan"])
                plan.check_profiles(self.policy.profiles)
            except (ConfigError, KeyError) as e:
                raise ConfigError(f"rollout state file {self.state_path}: {e}") from None
        try:
            if traffic.get("reverted_to"):
                self.policy.revert_to_baseline(traffic["reverted_to"])
            elif traffic.get("weights"):
                self.policy.set_weights(traffic["weights"], step=traffic.get("step"))
        except (ConfigError, ValueError) as e:
            raise ConfigError(f"rollout state file {self.state_path}: saved traffic split does not fit these "
                              f"profiles: {e}") from None
        self.plan, self.rollout, self.history = plan, rollout, history
        self._size_window()
        if self.active:
            self.next_evaluation_at = self.clock() + self.plan.interval_s
            self._event("restart", "controller", f"resumed {self.state} at step {rollout['step'] + 1}/"
                                                 f"{len(plan.steps)} after a restart; the window starts empty")
            logger.warning("rollout: resumed %s at %s from %s", self.state, self.step_label(), self.state_path)
            self._save()

    # ---- actions -------------------------------------------------------------------------------

    def start(self, plan: RolloutPlan, by: str = "admin") -> dict:
        """Start a rollout at its first step. Raises RolloutConflict if one is active, ConfigError for
        profiles this policy does not have."""
        with self._lock:
            if self.active:
                raise RolloutConflict(f"a rollout of {self.plan.candidate!r} is {self.state}; revert it or let it "
                                      "finish before starting another")
            plan.check_profiles(self.policy.profiles)
            now = self.clock()
            self.plan = plan
            self._size_window()
            self.rollout = {"plan": plan.to_dict(), "digest": plan.digest, "state": "running", "step": 0,
                            "started_at": now, "step_started_at": now, "paused_at": None, "paused_s": 0.0,
                            "ended_at": None, "reason": ""}
            self.last_evaluation = None
            self._apply_step()
            self._event("start", by, f"{plan.candidate} vs {plan.baseline}, steps "
                                     f"{', '.join(f'{s.percent:g}%' for s in plan.steps)}", digest=plan.digest)
            self._save()
            logger.warning("rollout: started %s at %s", plan.candidate, self.step_label())
            return self.status()

    def _size_window(self) -> None:
        """Keep outcomes as long as the plan's window needs them (memory stays bounded by traffic x window)."""
        if self.plan is not None:
            self.window.horizon_s = self.plan.window_s + 2 * self.plan.interval_s

    def _apply_step(self) -> None:
        i = self.rollout["step"]
        self.policy.set_weights(self.plan.weights(i), step=self.step_label() if self.active else None)
        self.next_evaluation_at = self.clock() + self.plan.interval_s

    def _require_active(self, action: str) -> None:
        if not self.active:
            raise RolloutConflict(f"cannot {action}: no rollout is running (state: {self.state})")

    def pause(self, by: str = "admin") -> dict:
        with self._lock:
            self._require_active("pause")
            if self.state == "running":
                self.rollout.update(state="paused", paused_at=self.clock())
                self._event("pause", by, "automatic decisions stopped; traffic keeps its split")
                self._save()
            return self.status()

    def resume(self, by: str = "admin") -> dict:
        with self._lock:
            self._require_active("resume")
            if self.state == "paused":
                now = self.clock()
                self.rollout["paused_s"] += now - (self.rollout["paused_at"] or now)
                self.rollout.update(state="running", paused_at=None)
                self.next_evaluation_at = now + self.plan.interval_s
                self._event("resume", by)
                self._save()
            return self.status()

    def promote(self, by: str = "admin", reason: str = "promoted by hand") -> dict:
        """Move to the next step (completing the rollout at the last one), gates or not."""
        with self._lock:
            self._require_active("promote")
            r = self.rollout
            now = self.clock()
            if r["paused_at"] is not None:
                r["paused_at"] = now
            r.update(step=r["step"] + 1, step_started_at=now, paused_s=0.0)
            if r["step"] == len(self.plan.steps) - 1:
                r.update(state="completed", ended_at=now, paused_at=None, reason=reason)
            self._apply_step()
            self._event("complete" if r["state"] == "completed" else "promote", by, reason)
            self._save()
            logger.warning("rollout: %s %s to %g%% (%s)", "completed" if r["state"] == "completed" else "promoted",
                           self.plan.candidate, self.plan.steps[r["step"]].percent, reason)
            return self.status()

    def revert(self, reason: str = "reverted by hand", by: str = "admin") -> dict:
        """Revert to baseline: all traffic to the plan's baseline (or `baseline` with no active rollout)."""
        with self._lock:
            if self.active:
                self.rollout.update(state="reverted", ended_at=self.clock(), paused_at=None, reason=reason)
                self.policy.revert_to_baseline(self.plan.baseline)
            else:
                self.policy.revert_to_baseline(BASELINE)
            self._event("revert", by, reason)
            self._save()
            logger.warning("rollout: reverted to baseline by %s: %s", by, reason)
            return self.status()

    def set_weights(self, weights: dict[str, Any], by: str = "admin") -> dict:
        """Weights by hand (PUT /admin/weights). Raises RolloutConflict while a rollout is active."""
        with self._lock:
            if self.active:
                raise RolloutConflict(f"a rollout of {self.plan.candidate!r} is {self.state} and owns the weights; "
                                      "pause and revert it (POST /admin/rollback) first")
            st = self.policy.set_weights(weights)
            self._event("weights", by, f"weights set to {st['weights']}")
            self._save()
            return st

    # ---- evaluation ----------------------------------------------------------------------------

    def tick(self, now: float | None = None) -> Decision | None:
        """Evaluate the gates once and act. None when no rollout is running."""
        with self._lock:
            if self.state != "running":
                return None
            now = self.clock() if now is None else now
            plan, r = self.plan, self.rollout
            step = plan.steps[r["step"]]
            since = max(now - plan.window_s, r["step_started_at"])
            if self.availability is not None and not self.availability(plan.candidate):
                decision = Decision("revert", f"no healthy backend serves the candidate {plan.candidate!r}")
                cand = base = None
            else:
                cand = self.window.side(plan.candidate, since, now)
                base = self.window.side(plan.baseline, since, now)
                shadow = self.window.shadow(since, now) if plan.shadow else None
                results = evaluate_gates(plan.gates, cand, base, shadow)
                dwell = now - r["step_started_at"] - r["paused_s"]
                decision = decide(results, cand, base, min_requests=step.min_requests, dwell_s=dwell,
                                  min_dwell_s=step.min_dwell_s)
            window = f"window {_fmt_time(since)}-{_fmt_time(now)} ({now - since:.0f} s) at {step.percent:g}%"
            self.last_evaluation = {
                "time": now, "window": [since, now], "step": r["step"], "action": decision.action,
                "reason": decision.reason, "gates": [g.to_dict() for g in decision.results],
                "candidate": cand.summary() if cand else None, "baseline": base.summary() if base else None,
            }
            self.next_evaluation_at = now + plan.interval_s
            if decision.action == "promote":
                self.promote(by="controller", reason=f"{window}: {decision.reason}")
            elif decision.action == "revert":
                self.revert(reason=f"{window}: {decision.reason}", by="controller")
            return decision

    async def run(self, poll_s: float = 0.25) -> None:
        """Evaluate every plan.interval_s while a rollout runs (cancel the task to stop)."""
        while True:
            await asyncio.sleep(poll_s)
            due = self.next_evaluation_at
            if self.state == "running" and due is not None and self.clock() >= due:
                try:  # off the event loop: sorting a busy window's latencies takes milliseconds
                    await asyncio.to_thread(self.tick)
                except Exception:  # noqa: BLE001 - one bad evaluation must not end the loop
                    logger.exception("rollout: evaluation failed")

    def status(self) -> dict:
        """Plan, state, step, weights, the last evaluation's gate figures and the history."""
        with self._lock:
            pol = self.policy.state()
            out: dict[str, Any] = {"state": self.state, "weights": pol["weights"], "fractions": pol["fractions"],
                                   "reverted_to_baseline": pol["rolled_back"], "step_label": self.step_label(),
                                   "persisted_to": str(self.state_path) if self.state_path else None,
                                   "history": list(self.history), "last_evaluation": self.last_evaluation}
            if self.rollout:
                r, now = self.rollout, self.clock()
                paused_now = (now - r["paused_at"]) if r["paused_at"] else 0.0
                out.update(plan=self.plan.to_dict(), step=r["step"], num_steps=len(self.plan.steps),
                           percent=self.plan.steps[r["step"]].percent, started_at=r["started_at"],
                           step_started_at=r["step_started_at"], ended_at=r["ended_at"], reason=r["reason"],
                           dwell_s=(now - r["step_started_at"] - r["paused_s"] - paused_now) if self.active else None,
                           next_evaluation_at=self.next_evaluation_at if self.state == "running" else None)
            return out
