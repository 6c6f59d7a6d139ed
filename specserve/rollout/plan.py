"""Rollout plans: a staged canary of one candidate profile against a baseline, read from JSON or YAML.

A plan (file, or the body of `POST /admin/rollout`):

    candidate: ngram_4            # required: the profile being rolled out
    baseline: baseline            # the profile it is compared with, and where a revert sends traffic
    steps: [1, 5, 25, 50, 100]    # percent of traffic on the candidate at each step (the default);
                                  # or objects {percent, min_dwell_s, min_requests}
    min_dwell_s: 300              # per step: least time at a step before it may be promoted
    min_requests: 100             # per step: least finished requests on EACH side inside the window
    window_s: 300                 # gates compare both sides over the last window_s seconds of the step
    interval_s: 15                # the controller evaluates every interval_s (<= window_s)
    gates:                        # each a threshold; null turns a gate off
      p95_e2e_ratio: 1.2          # candidate P95 E2E latency / baseline's, fails above
      p95_ttft_ratio: 1.5         # candidate P95 TTFT / baseline's, fails above
      median_tpot_ratio: 1.1      # candidate median TPOT / baseline's, fails above
      error_rate_diff: 0.01       # candidate 5xx rate - baseline's, fails above
      min_mean_acceptance_length: null  # candidate mean acceptance length, fails below
    shadow:                       # optional: replay baseline greedy requests on the candidate
      sample: 0.05                # fraction of baseline's non-streamed-or-streamed greedy requests
      max_in_flight: 2            # replays running at once (extra samples are skipped, not queued)

The last step must be 100 (the candidate then takes all traffic and the rollout completes); percents
must rise. Every error is a `ConfigError` that names the key (`steps[2].percent: ...`).
What it does not do: evaluate gates (`gates.py`) or move traffic (`controller.py`).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specserve.config import ConfigError
from specserve.rollout.profiles import BASELINE

DEFAULT_STEPS = (1.0, 5.0, 25.0, 50.0, 100.0)
DEFAULT_GATES = {
    "p95_e2e_ratio": 1.2,
    "p95_ttft_ratio": 1.5,
    "median_tpot_ratio": 1.1,
    "error_rate_diff": 0.01,
    "min_mean_acceptance_length": None,
}
_PLAN_KEYS = ("candidate", "baseline", "steps", "min_dwell_s", "min_requests", "window_s", "interval_s", "gates",
              "shadow")
_STEP_KEYS = ("percent", "min_dwell_s", "min_requests")
_SHADOW_KEYS = ("sample", "max_in_flight")


@dataclass(frozen=True)
class Step:
    """One stage: `percent` of traffic on the candidate (0 < percent <= 100)."""

    percent: float
    min_dwell_s: float
    min_requests: int


@dataclass(frozen=True)
class ShadowCheck:
    """Replay a `sample` fraction of baseline's greedy requests on the candidate, at most
    `max_in_flight` at once; any output difference fails the `shadow` gate."""

    sample: float = 0.05
    max_in_flight: int = 2


@dataclass(frozen=True)
class RolloutPlan:
    """A validated plan (see the module docstring). `gates` maps gate name -> threshold (None = off)."""

    candidate: str
    baseline: str = BASELINE
    steps: tuple[Step, ...] = ()
    window_s: float = 300.0
    interval_s: float = 15.0
    gates: dict[str, float | None] = field(default_factory=lambda: dict(DEFAULT_GATES))
    shadow: ShadowCheck | None = None

    def to_dict(self) -> dict[str, Any]:
        """The plan in its file shape (steps as objects), JSON-serializable; `from_dict` reads it back."""
        d = asdict(self)
        d["steps"] = [asdict(s) for s in self.steps]
        d["shadow"] = asdict(self.shadow) if self.shadow else None
        return d

    @property
    def digest(self) -> str:
        """A short hash of the plan, to tell whether a persisted rollout runs this same plan."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]

    def weights(self, step_index: int) -> dict[str, float]:
        """Traffic weights at a step: the candidate gets `percent`, the baseline the rest."""
        p = self.steps[step_index].percent
        return {self.candidate: p, self.baseline: 100.0 - p}

    def check_profiles(self, profiles: Any) -> None:
        """Raise ConfigError unless candidate and baseline are (different) names in `profiles`."""
        names = list(profiles)
        for key in ("candidate", "baseline"):
            if getattr(self, key) not in names:
                raise ConfigError(f"{key}: unknown profile {getattr(self, key)!r}; profiles: {names}")


def number_field(d: dict, key: str, where: str, default: float, *, minimum: float = 0.0, integer: bool = False,
                 allow_equal: bool = True) -> Any:
    """d[key] (or `default`) checked to be a finite number >= minimum (> with allow_equal=False), whole
    with `integer`. Raises ConfigError naming `where + key`. Shared by the plan and the fleet file."""
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(float(v)):
        raise ConfigError(f"{where}{key}: must be a finite number, got {v!r}")
    if integer and float(v) != int(v):
        raise ConfigError(f"{where}{key}: must be a whole number, got {v!r}")
    if float(v) < minimum or (not allow_equal and float(v) == minimum):
        raise ConfigError(f"{where}{key}: must be {'>=' if allow_equal else '>'} {minimum:g}, got {v!r}")
    return int(v) if integer else float(v)


def reject_unknown(d: dict, valid: tuple[str, ...], where: str) -> None:
    """ConfigError naming the keys of `d` not in `valid`."""
    extra = sorted(set(d) - set(valid))
    if extra:
        raise ConfigError(f"{where or 'plan'}: unknown key(s) {extra}; valid: {list(valid)}")


def _steps(raw: Any, dwell: float, min_requests: int) -> tuple[Step, ...]:
    if raw is None:
        raw = list(DEFAULT_STEPS)
    if not isinstance(raw, list) or not raw:
        raise ConfigError("steps: must be a non-empty list of percents or of {percent, min_dwell_s, min_requests}")
    out: list[Step] = []
    for i, s in enumerate(raw):
        where = f"steps[{i}]."
        if not isinstance(s, dict):
            s = {"percent": s}
        reject_unknown(s, _STEP_KEYS, f"steps[{i}]")
        if "percent" not in s:
            raise ConfigError(f"{where}percent: is required")
        pct = number_field(s, "percent", where, 0.0, allow_equal=False)
        if pct > 100:
            raise ConfigError(f"{where}percent: must be <= 100, got {s['percent']!r}")
        if out and pct <= out[-1].percent:
            raise ConfigError(f"{where}percent: must be above the previous step's {out[-1].percent:g}, got {pct:g}")
        out.append(Step(pct, number_field(s, "min_dwell_s", where, dwell),
                        number_field(s, "min_requests", where, min_requests, minimum=1, integer=True)))
    if out[-1].percent != 100:
        raise ConfigError(f"steps[{len(out) - 1}].percent: the last step must be 100, got {out[-1].percent:g}")
    return tuple(out)


def _gates(raw: Any) -> dict[str, float | None]:
    if raw is None:
        return dict(DEFAULT_GATES)
    if not isinstance(raw, dict):
        raise ConfigError(f"gates: must be an object of gate name -> threshold; gates: {list(DEFAULT_GATES)}")
    reject_unknown(raw, tuple(DEFAULT_GATES), "gates")
    gates = dict(DEFAULT_GATES)
    for name in raw:
        if raw[name] is None:
            gates[name] = None
        elif name == "error_rate_diff":
            gates[name] = number_field(raw, name, "gates.", 0.0, minimum=-1.0)
        else:
            gates[name] = number_field(raw, name, "gates.", 0.0, allow_equal=False)
    return gates


def _shadow(raw: Any) -> ShadowCheck | None:
    if raw is None or raw is False:
        return None
    if raw is True:
        return ShadowCheck()
    if not isinstance(raw, dict):
        raise ConfigError("shadow: must be an object {sample, max_in_flight}, true, or null")
    reject_unknown(raw, _SHADOW_KEYS, "shadow")
    sample = number_field(raw, "sample", "shadow.", ShadowCheck.sample, allow_equal=False)
    if sample > 1:
        raise ConfigError(f"shadow.sample: must be a fraction in (0, 1], got {raw['sample']!r}")
    return ShadowCheck(sample, number_field(raw, "max_in_flight", "shadow.", ShadowCheck.max_in_flight, minimum=1,
                                       integer=True))


def plan_from_dict(d: Any) -> RolloutPlan:
    """Validate a parsed plan. Raises ConfigError naming the offending key."""
    if not isinstance(d, dict):
        raise ConfigError(f"plan: must be an object with keys {list(_PLAN_KEYS)}")
    reject_unknown(d, _PLAN_KEYS, "")
    for key in ("candidate", "baseline"):
        v = d.get(key, BASELINE if key == "baseline" else None)
        if not isinstance(v, str) or not v:
            raise ConfigError(f"{key}: must be a profile name, got {v!r}")
    if d["candidate"] == d.get("baseline", BASELINE):
        raise ConfigError(f"candidate: must differ from baseline ({d['candidate']!r})")
    dwell = number_field(d, "min_dwell_s", "", 300.0)
    min_requests = number_field(d, "min_requests", "", 100, minimum=1, integer=True)
    window_s = number_field(d, "window_s", "", 300.0, allow_equal=False)
    interval_s = number_field(d, "interval_s", "", min(15.0, window_s), allow_equal=False)
    if interval_s > window_s:
        raise ConfigError(f"interval_s: must be <= window_s ({window_s:g}), got {interval_s:g}")
    return RolloutPlan(candidate=d["candidate"], baseline=d.get("baseline", BASELINE),
                       steps=_steps(d.get("steps"), dwell, min_requests), window_s=window_s, interval_s=interval_s,
                       gates=_gates(d.get("gates")), shadow=_shadow(d.get("shadow")))


def parse_yaml(text: str, what: str) -> Any:
    """JSON or YAML text (YAML is a superset of JSON, so one parser reads both). Raises ConfigError."""
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{what} is not valid JSON or YAML: {' '.join(str(e).split())}") from None


def read_yaml_file(path: str | Path, what: str) -> Any:
    """Parse a JSON or YAML file; a ConfigError names `what` and the file when it cannot be read or parsed."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read {what} {p}: {e}") from None
    return parse_yaml(text, f"{what} {p}")


def parse_plan_text(text: str, *, name: str = "plan") -> RolloutPlan:
    """A plan from JSON or YAML text."""
    return plan_from_dict(parse_yaml(text, name))


def load_plan(path: str | Path) -> RolloutPlan:
    """Read a plan file (.json, .yaml, .yml). Raises ConfigError."""
    return plan_from_dict(read_yaml_file(path, "plan file"))
