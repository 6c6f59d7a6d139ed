"""Rollout policy: which speculation profile serves a request, changeable at run time.

What it does:
- `choose(sticky_key=..., requested=...)` returns a `Choice` (profile + why). An explicit request
  (`profile` field or `x-specserve-profile` header) is honoured only when the server allows overrides
  (else `ProfileForbidden`, a 403); an unknown name is `UnknownProfile` (400). Otherwise the profile
  is drawn by weight. With a sticky key (the `user` field or `x-session-id` header) the draw is a
  stable hash (blake2b of the key -> a point u in [0, 1), walked over the cumulative weights in profile
  order), so a user stays on one profile while the weights stay the same; raising the weight of the
  first listed profiles only moves users onto them. Without a key the draw is random.
- `set_weights()` and `revert_to_baseline()` change the weights for the NEXT request; a request that
  already chose keeps its profile (the choice is an immutable snapshot). `revert_to_baseline()` is the
  one way a rollout is undone: all traffic, explicit overrides included, goes to `baseline` (or the
  baseline a rollout plan names) until weights are set again. (The HTTP endpoint keeps the operator's
  word: POST /admin/rollback.) `set_weights(..., step=label)` tags every later choice with the staged
  rollout's step (`Choice.step`, written to the request log) until weights change again.
Thread-safe (one lock). What it does not do: HTTP (see `admin.py`), metric gates (`controller.py`).
"""

from __future__ import annotations

import hashlib
import random
import threading
import time
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from specserve.config import ConfigError
from specserve.rollout.profiles import BASELINE, Profile, ProfileSet, check_weights


# Set only by the server's own shadow replays (`shadow.replay_in_process`): forces the candidate for that
# one in-process request. A context variable, so no HTTP client can set it.
SHADOW_PROFILE: ContextVar[str | None] = ContextVar("specserve_shadow_profile", default=None)


class UnknownProfile(ValueError):
    """The request named a profile this server does not have (HTTP 400)."""


class ProfileForbidden(PermissionError):
    """The request named a profile but the server does not allow overrides (HTTP 403)."""


@dataclass(frozen=True)
class Choice:
    profile: Profile
    reason: str  # "override" | "sticky" | "weighted" | "rollback" (reverted to baseline) | "shadow"
    step: str | None = None  # the staged rollout's step when the choice was made, e.g. "ngram_4@5%"


def stable_unit(key: str) -> float:
    """A point in [0, 1) from a string, identical across processes and Python versions."""
    h = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(h, "big") / 2.0**64


def pick_by_point(weights: dict[str, float], u: float) -> str:
    """The name whose cumulative-weight interval (in dict order) holds u * total."""
    total = sum(weights.values())
    x = u * total
    acc = 0.0
    last = None
    for name, w in weights.items():
        if w <= 0:
            continue
        acc += w
        last = name
        if x < acc:
            return name
    assert last is not None, "weights must have a positive entry"
    return last


class RolloutPolicy:
    def __init__(self, profile_set: ProfileSet, *, allow_override: bool = False, seed: int | None = None):
        self.profiles: dict[str, Profile] = dict(profile_set.profiles)
        self.allow_override = allow_override
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._weights = {n: profile_set.weights.get(n, 0.0) for n in self.profiles}
        self._reverted = False
        self._revert_target = BASELINE
        self._step: str | None = None
        self._version = 1
        self._updated_at = time.time()

    # ---- per request -------------------------------------------------------------------------

    def choose(self, *, sticky_key: str | None = None, requested: str | None = None) -> Choice:
        """The profile for one new request. Raises UnknownProfile / ProfileForbidden for `requested`."""
        with self._lock:
            if (shadow := SHADOW_PROFILE.get()) is not None and shadow in self.profiles:
                return Choice(self.profiles[shadow], "shadow", self._step)
            if requested is not None:
                if not self.allow_override:
                    raise ProfileForbidden(
                        "choosing a profile per request is disabled on this server "
                        "(start it with --allow-profile-override)"
                    )
                if requested not in self.profiles:
                    shown = requested if len(requested) <= 64 else requested[:61] + "..."
                    raise UnknownProfile(f"unknown profile {shown!r}; profiles: {list(self.profiles)}")
            if self._reverted:
                return Choice(self.profiles[self._revert_target], "rollback", self._step)
            if requested is not None:
                return Choice(self.profiles[requested], "override", self._step)
            if sticky_key:
                return Choice(self.profiles[pick_by_point(self._weights, stable_unit(sticky_key))], "sticky",
                              self._step)
            return Choice(self.profiles[pick_by_point(self._weights, self._rng.random())], "weighted", self._step)

    # ---- admin -------------------------------------------------------------------------------

    def set_weights(self, weights: dict[str, Any], *, step: str | None = None) -> dict[str, Any]:
        """Replace all weights (names not given get 0) and end a revert to baseline; `step` labels later
        choices (a staged rollout's step, None otherwise). Raises ConfigError."""
        clean = check_weights(weights, self.profiles)
        with self._lock:
            self._weights = {n: clean.get(n, 0.0) for n in self.profiles}
            self._reverted = False
            self._step = step
            self._bump()
        return self.state()

    def revert_to_baseline(self, baseline: str = BASELINE) -> dict[str, Any]:
        """Revert to baseline: every new request goes to `baseline` until set_weights(). Raises
        UnknownProfile for a name this policy does not have."""
        if baseline not in self.profiles:
            raise UnknownProfile(f"unknown profile {baseline!r}; profiles: {list(self.profiles)}")
        with self._lock:
            self._weights = {n: (1.0 if n == baseline else 0.0) for n in self.profiles}
            self._reverted = True
            self._revert_target = baseline
            self._step = None
            self._bump()
        return self.state()

    def _bump(self) -> None:
        self._version += 1
        self._updated_at = time.time()

    def state(self) -> dict[str, Any]:
        with self._lock:
            total = sum(self._weights.values())
            return {
                "profiles": {n: p.describe() for n, p in self.profiles.items()},
                "weights": dict(self._weights),
                "fractions": {n: (w / total if total else 0.0) for n, w in self._weights.items()},
                "rolled_back": self._reverted,
                "reverted_to": self._revert_target if self._reverted else None,
                "rollout_step": self._step,
                "allow_profile_override": self.allow_override,
                "version": self._version,
                "updated_at": self._updated_at,
            }

    @property
    def weights(self) -> dict[str, float]:
        with self._lock:
            return dict(self._weights)


__all__ = [
    "Choice", "ConfigError", "ProfileForbidden", "RolloutPolicy", "UnknownProfile", "pick_by_point", "stable_unit",
]
