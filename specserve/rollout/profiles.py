"""Speculation profiles: named `SpeculativeConfig`s that live side by side over one target model.

What it does: loads a profiles file (JSON, or TOML when the name ends in .toml) of the shape

    {"profiles": {"baseline": null,
                  "ngram_4": {"method": "ngram", "num_speculative_tokens": 4},
                  "draft_5": {"method": "draft_model", "model": "...", "num_speculative_tokens": 5}},
     "weights": {"baseline": 0.9, "ngram_4": 0.1}}

or builds the default set from the CLI (`baseline` plus `default` = --speculative-config). A profile
whose config is null is "no speculation"; a set always has one named `baseline` with no speculation
(added when the file lacks it), because rollback routes to it. Missing weights are 0; without any
weights, the non-baseline profiles share nothing and all traffic goes to baseline.
What it does not do: choose a profile per request (see `policy.py`) or load draft models (the engine's
`prepare_speculative_config` does, once per config, at start-up).
"""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specserve.config import ConfigError, SpeculativeConfig

BASELINE = "baseline"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")


@dataclass(frozen=True)
class Profile:
    """One named speculation setting. `spec_config` None = no speculation."""

    name: str
    spec_config: SpeculativeConfig | None

    @property
    def method(self) -> str:
        return self.spec_config.method if self.spec_config else "none"

    @property
    def num_speculative_tokens(self) -> int:
        return self.spec_config.num_speculative_tokens if self.spec_config else 0

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "method": self.method,
            "num_speculative_tokens": self.num_speculative_tokens,
            "config": self.spec_config.to_dict() if self.spec_config else None,
            "effective_config": self.spec_config.effective() if self.spec_config else None,
        }


@dataclass(frozen=True)
class ProfileSet:
    """The profiles of one server (insertion order kept) and their starting weights."""

    profiles: dict[str, Profile]
    weights: dict[str, float]

    def __post_init__(self) -> None:
        if BASELINE not in self.profiles or self.profiles[BASELINE].spec_config is not None:
            raise ConfigError(f'profile set needs a "{BASELINE}" profile with no speculation')
        check_weights(self.weights, self.profiles)

    def unique_spec_configs(self) -> list[SpeculativeConfig]:
        """Distinct speculative configs, for preparing each proposer / draft model once."""
        seen: list[SpeculativeConfig] = []
        for p in self.profiles.values():
            if p.spec_config is not None and p.spec_config not in seen:
                seen.append(p.spec_config)
        return seen


MAX_WEIGHT = 1e9


def _shown(x: Any, limit: int = 64) -> str:
    s = repr(x) if not isinstance(x, int) or abs(x) < 10**30 else f"<{len(str(abs(x)))}-digit integer>"
    return s if len(s) <= limit else s[: limit - 3] + "..."


def check_weights(weights: dict[str, Any], profiles: dict[str, Profile]) -> dict[str, float]:
    """Validate a weights mapping: known names, numbers in [0, 1e9] (so their sum is finite and every
    share is representable), a positive sum. Returns floats. Raises ConfigError (names cut to 64 chars)."""
    if not isinstance(weights, dict):
        raise ConfigError("weights must be an object of profile name -> number")
    out: dict[str, float] = {}
    for name, w in weights.items():
        if name not in profiles:
            raise ConfigError(f"weights name unknown profile {_shown(name)}; profiles: {list(profiles)}")
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= w <= MAX_WEIGHT:
            raise ConfigError(f"weight of {name!r} must be a number in [0, {MAX_WEIGHT:g}], got {_shown(w)}")
        out[name] = float(w)
    if not sum(out.values()) > 0:
        raise ConfigError("weights must not all be zero")
    return out


def _make_profiles(raw: dict[str, Any]) -> dict[str, Profile]:
    if not isinstance(raw, dict) or not raw:
        raise ConfigError('"profiles" must be a non-empty object of name -> speculative config or null')
    profiles: dict[str, Profile] = {}
    for name, cfg in raw.items():
        if not _NAME_RE.match(name):
            raise ConfigError(f"profile name {name!r} must be 1-64 characters of letters, digits, _ . -")
        try:
            spec_config = SpeculativeConfig.from_dict(cfg)
        except ConfigError as e:
            raise ConfigError(f"profile {name!r}: {e}") from None
        if name == BASELINE and spec_config is not None:
            raise ConfigError(f'profile "{BASELINE}" must have no speculation (null)')
        profiles[name] = Profile(name, spec_config)
    if BASELINE not in profiles:
        profiles = {BASELINE: Profile(BASELINE, None), **profiles}
    return profiles


def profile_set_from_dict(d: dict[str, Any]) -> ProfileSet:
    """Build from the parsed file shape above. Raises ConfigError naming what is wrong."""
    if not isinstance(d, dict):
        raise ConfigError("profiles file must hold an object with 'profiles' and optional 'weights'")
    unknown = sorted(set(d) - {"profiles", "weights"})
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in profiles file; valid: ['profiles', 'weights']")
    profiles = _make_profiles(d.get("profiles"))
    weights = d.get("weights") or {BASELINE: 1.0}
    weights = check_weights(weights, profiles)
    return ProfileSet(profiles, {n: weights.get(n, 0.0) for n in profiles})


def load_profiles(path: str | Path) -> ProfileSet:
    """Read a profiles file (.toml via tomllib, anything else as JSON)."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read profiles file {p}: {e}") from None
    try:
        d = tomllib.loads(text) if p.suffix == ".toml" else json.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"profiles file {p} is not valid {'TOML' if p.suffix == '.toml' else 'JSON'}: {e}") from None
    return profile_set_from_dict(d)


def default_profile_set(spec_config: SpeculativeConfig | None) -> ProfileSet:
    """Without --profiles: `baseline`, plus `default` = --speculative-config (weight 1) when given."""
    profiles = {BASELINE: Profile(BASELINE, None)}
    if spec_config is None:
        return ProfileSet(profiles, {BASELINE: 1.0})
    profiles["default"] = Profile("default", spec_config)
    return ProfileSet(profiles, {BASELINE: 0.0, "default": 1.0})
