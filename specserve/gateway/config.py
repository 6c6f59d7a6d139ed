"""The gateway's fleet file (YAML or JSON): backends, each tagged with the profile it serves, and options.

The smallest file is a list of backends:

    backends: [{name: b1, url: "http://127.0.0.1:8001", profile: baseline}]

Every key (see docs/gateway.md for the whole reference):

    backends:                       # required; at least one serves the profile "baseline"
      - name: b1                    # required, unique (letters, digits, _ . -)
        url: http://127.0.0.1:8001  # required; requests go to url + /v1/...
        profile: baseline           # required: the profile this server runs (one speculative config)
        weight: 1                   # share among the backends of its profile (default 1)
        kind: specserve             # specserve | vllm | openai (default openai); vllm: acceptance is
                                    # scraped from its /metrics (vllm:spec_decode_*)
        model: my-model             # send this model name to this backend (default: the client's)
        api_key: ...                # sent as Authorization: Bearer (default: the client's header)
        profile_header: ngram_4     # send x-specserve-profile (a specserve server with profiles)
    profiles:                       # optional: each profile's speculative config (logged, shown)
      ngram_4: {method: ngram, num_speculative_tokens: 4}
    weights: {baseline: 1}          # optional profile weights (default: all traffic to baseline)
    model: qwen2.5-coder-0.5b-instruct  # optional: the model id /v1/models lists (default: the backends')
    allow_profile_override: false   # let a request pick its profile (body `profile` / x-specserve-profile)
    admin_token: ...                # admin API token (or env SPECSERVE_ADMIN_TOKEN); none = admin off
    request_log: gateway.jsonl      # one JSON line per request (backend, profile, config, step, ...)
    health: {path: /health, interval_s: 2, timeout_s: 1, unhealthy_after: 1, healthy_after: 1}
    retries: 2                      # more tries on other backends of the same profile
    timeout_s: 600                  # longest silence of a backend (s): until its answer starts, between chunks
    connect_timeout_s: 2
    max_body_bytes: 4194304
    rollout: {plan: plan.yaml, state_file: rollout-state.json}   # plan: a file or an inline object

Errors are `ConfigError`s naming the key (`backends[1].url: ...`).
What it does not do: talk to backends (`backends.py`) or route (`app.py`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from specserve.config import ConfigError
from specserve.rollout.plan import (
    RolloutPlan, load_plan, number_field, plan_from_dict, read_yaml_file, reject_unknown,
)
from specserve.rollout.profiles import BASELINE

KINDS = ("specserve", "vllm", "openai")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")
_TOP = ("backends", "profiles", "weights", "model", "allow_profile_override", "admin_token", "request_log",
        "health", "retries", "timeout_s", "connect_timeout_s", "max_body_bytes", "rollout")
_BACKEND = ("name", "url", "profile", "weight", "kind", "model", "api_key", "profile_header")
_HEALTH = ("path", "interval_s", "timeout_s", "unhealthy_after", "healthy_after")
_ROLLOUT = ("plan", "state_file")


@dataclass(frozen=True)
class BackendConfig:
    name: str
    url: str  # without a trailing slash
    profile: str
    weight: float = 1.0
    kind: str = "openai"
    model: str | None = None
    api_key: str | None = None
    profile_header: str | None = None


@dataclass(frozen=True)
class HealthConfig:
    path: str = "/health"
    interval_s: float = 2.0
    timeout_s: float = 1.0
    unhealthy_after: int = 1  # consecutive failed checks that eject a backend
    healthy_after: int = 1  # consecutive good checks that return it


@dataclass(frozen=True)
class FleetConfig:
    backends: tuple[BackendConfig, ...]
    profiles: dict[str, dict | None] = field(default_factory=dict)  # name -> speculative config (informational)
    weights: dict[str, float] = field(default_factory=dict)
    model: str | None = None
    allow_profile_override: bool = False
    admin_token: str | None = None
    request_log: str | None = None
    health: HealthConfig = HealthConfig()
    retries: int = 2
    timeout_s: float = 600.0
    connect_timeout_s: float = 2.0
    max_body_bytes: int = 4 * 1024 * 1024
    rollout_plan: RolloutPlan | None = None
    rollout_state_file: str | None = None

    @property
    def profile_names(self) -> list[str]:
        """Profiles in first-seen order of the backends."""
        return list(dict.fromkeys(b.profile for b in self.backends))


def _str(d: dict, key: str, where: str, required: bool = False) -> str | None:
    v = d.get(key)
    if v is None:
        if required:
            raise ConfigError(f"{where}{key}: is required")
        return None
    if not isinstance(v, str) or not v:
        raise ConfigError(f"{where}{key}: must be a non-empty string, got {v!r}")
    return v


def _backend(i: int, d: Any) -> BackendConfig:
    where = f"backends[{i}]."
    if not isinstance(d, dict):
        raise ConfigError(f"backends[{i}]: must be an object with name, url, profile")
    reject_unknown(d, _BACKEND, f"backends[{i}]")
    name = _str(d, "name", where, True)
    profile = _str(d, "profile", where, True)
    for key, val in (("name", name), ("profile", profile)):
        if not _NAME.match(val):
            raise ConfigError(f"{where}{key}: {val!r} must be 1-64 letters, digits, _ . -")
    url = _str(d, "url", where, True).rstrip("/")
    u = urlparse(url)
    if u.scheme not in ("http", "https") or not u.netloc:
        raise ConfigError(f"{where}url: must be an http(s) URL like http://127.0.0.1:8001, got {url!r}")
    kind = d.get("kind", "openai")
    if kind not in KINDS:
        raise ConfigError(f"{where}kind: must be one of {list(KINDS)}, got {kind!r}")
    return BackendConfig(name=name, url=url, profile=profile,
                         weight=number_field(d, "weight", where, 1.0, allow_equal=False),
                         kind=kind, model=_str(d, "model", where), api_key=_str(d, "api_key", where),
                         profile_header=_str(d, "profile_header", where))


def fleet_from_dict(d: Any, base_dir: Path | None = None) -> FleetConfig:
    """Validate a parsed fleet file; relative plan paths are read from `base_dir`. Raises ConfigError."""
    if not isinstance(d, dict):
        raise ConfigError("fleet config: must be an object with a 'backends' list")
    reject_unknown(d, _TOP, "fleet config")
    raw = d.get("backends")
    if not isinstance(raw, list) or not raw:
        raise ConfigError("backends: must be a non-empty list of {name, url, profile}")
    backends = tuple(_backend(i, b) for i, b in enumerate(raw))
    seen: set[str] = set()
    for i, b in enumerate(backends):
        if b.name in seen:
            raise ConfigError(f"backends[{i}].name: {b.name!r} is used twice")
        seen.add(b.name)
    names = list(dict.fromkeys(b.profile for b in backends))
    if BASELINE not in names:
        raise ConfigError(f'backends: no backend serves the profile "{BASELINE}" (a revert to baseline sends all '
                          f"traffic there); profiles: {names}")
    profiles = d.get("profiles") or {}
    if not isinstance(profiles, dict):
        raise ConfigError("profiles: must be an object of profile name -> speculative config (or null)")
    for name, cfg in profiles.items():
        if name not in names:
            raise ConfigError(f"profiles.{name}: no backend serves this profile; profiles: {names}")
        if cfg is not None and not isinstance(cfg, dict):
            raise ConfigError(f"profiles.{name}: must be a speculative config object or null, got {cfg!r}")
    weights = d.get("weights") or {BASELINE: 1.0}
    if not isinstance(weights, dict):
        raise ConfigError("weights: must be an object of profile name -> number")
    for name in weights:
        if name not in names:
            raise ConfigError(f"weights.{name}: no backend serves this profile; profiles: {names}")
        number_field(weights, name, "weights.", 0.0)
    if sum(float(w) for w in weights.values()) <= 0:
        raise ConfigError("weights: must not all be zero")
    health = d.get("health") or {}
    if not isinstance(health, dict):
        raise ConfigError(f"health: must be an object with keys {list(_HEALTH)}")
    reject_unknown(health, _HEALTH, "health")
    path = health.get("path", "/health")
    if not isinstance(path, str) or not path.startswith("/"):
        raise ConfigError(f"health.path: must start with '/', got {path!r}")
    h = "health."
    hc = HealthConfig(path=path, interval_s=number_field(health, "interval_s", h, 2.0, allow_equal=False),
                      timeout_s=number_field(health, "timeout_s", h, 1.0, allow_equal=False),
                      unhealthy_after=number_field(health, "unhealthy_after", h, 1, minimum=1, integer=True),
                      healthy_after=number_field(health, "healthy_after", h, 1, minimum=1, integer=True))
    rollout = d.get("rollout") or {}
    if not isinstance(rollout, dict):
        raise ConfigError(f"rollout: must be an object with keys {list(_ROLLOUT)}")
    reject_unknown(rollout, _ROLLOUT, "rollout")
    plan = None
    if rollout.get("plan") is not None:
        raw_plan = rollout["plan"]
        try:
            if isinstance(raw_plan, str):
                p = Path(raw_plan)
                plan = load_plan(p if p.is_absolute() or base_dir is None else base_dir / p)
            else:
                plan = plan_from_dict(raw_plan)
        except ConfigError as e:
            raise ConfigError(f"rollout.plan: {e}") from None
        for key in ("candidate", "baseline"):
            if getattr(plan, key) not in names:
                raise ConfigError(f"rollout.plan.{key}: no backend serves {getattr(plan, key)!r}; profiles: {names}")
    if "allow_profile_override" in d and not isinstance(d["allow_profile_override"], bool):
        raise ConfigError(f"allow_profile_override: must be true or false, got {d['allow_profile_override']!r}")
    return FleetConfig(
        backends=backends, profiles=profiles, weights={n: float(w) for n, w in weights.items()},
        model=_str(d, "model", ""), allow_profile_override=bool(d.get("allow_profile_override", False)),
        admin_token=_str(d, "admin_token", "") or os.environ.get("SPECSERVE_ADMIN_TOKEN") or None,
        request_log=_str(d, "request_log", ""), health=hc,
        retries=number_field(d, "retries", "", 2, integer=True),
        timeout_s=number_field(d, "timeout_s", "", 600.0, allow_equal=False),
        connect_timeout_s=number_field(d, "connect_timeout_s", "", 2.0, allow_equal=False),
        max_body_bytes=number_field(d, "max_body_bytes", "", 4 * 1024 * 1024, minimum=1, integer=True),
        rollout_plan=plan, rollout_state_file=_str(rollout, "state_file", "rollout."),
    )


def load_fleet(path: str | Path) -> FleetConfig:
    """Read a fleet file (YAML or JSON). Raises ConfigError."""
    return fleet_from_dict(read_yaml_file(path, "fleet config"), base_dir=Path(path).parent)
