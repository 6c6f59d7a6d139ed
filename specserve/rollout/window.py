"""Outcome windows: what each finished request of each profile measured, kept for the gates.

What it does: `OutcomeWindow` holds one `Outcome` per finished request (the server feeds it from its
request-log records, `outcome_from_record`; the gateway from what it measures itself), acceptance
counts scraped from a backend's /metrics (vLLM reports acceptance only there), and the results of
shadow replays. `side(profile, since, until)` returns the `SideStats` of one profile over a time
range, the input of `gates.evaluate_gates`. Entries older than `horizon_s` are dropped. Thread-safe.
Outcomes are kept as plain tuples of numbers and strings, which the garbage collector stops tracking: a
gateway at 100 requests/s holds 60000 of them over the default 600 s horizon, and as objects they would
add about 6 ms to each full collection (measured: 5.9 ms of CPU against 0.6 ms as tuples), a pause on
the event loop.
Which requests count: `requests` = answered requests (ok + server errors, HTTP >= 500); client
errors (4xx) and cancelled requests (499) are the client's doing and are left out of every figure.
Latencies come from successful requests only; TPOT = (E2E - TTFT) / (completion tokens - 1), for
requests with a TTFT and at least two tokens.
What it does not do: judge anything (see `gates.py`) or move traffic (`controller.py`).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from specserve.rollout.gates import ShadowStats, SideStats


@dataclass(frozen=True, slots=True)
class Outcome:
    """One finished request. Times in seconds; `t` is wall-clock time (time.time()) at the finish."""

    t: float
    profile: str
    status: str  # "ok" | "error" | "cancelled"
    code: int
    e2e_s: float | None = None
    ttft_s: float | None = None
    completion_tokens: int = 0
    num_drafts: int = 0
    num_accepted_tokens: int = 0

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or self.completion_tokens < 2:
            return None
        return max(0.0, self.e2e_s - self.ttft_s) / (self.completion_tokens - 1)


def outcome_from_record(rec: dict[str, Any], t: float) -> Outcome | None:
    """An Outcome from a server request-log record (see `request_log.FIELDS`); None when the record has
    no profile (refused before one was chosen) or is a shadow replay."""
    profile = rec.get("profile")
    if not profile or rec.get("profile_reason") == "shadow":
        return None
    return Outcome(
        t=t, profile=profile, status=str(rec.get("status")), code=int(rec.get("http_status") or 0),
        e2e_s=rec.get("e2e_s"), ttft_s=rec.get("ttft_s"), completion_tokens=int(rec.get("completion_tokens") or 0),
        num_drafts=int(rec.get("num_drafts") or 0), num_accepted_tokens=int(rec.get("num_accepted_tokens") or 0),
    )


class OutcomeWindow:
    """Recent outcomes, acceptance samples and shadow results (see the module docstring)."""

    def __init__(self, horizon_s: float = 600.0, clock: Callable[[], float] = time.time):
        self.horizon_s = horizon_s
        self.clock = clock
        self._lock = threading.Lock()
        self._outcomes: deque[tuple] = deque()  # tuple(Outcome): (t, profile, status, code, e2e_s, ttft_s, ...)
        self._acceptance: deque[tuple[float, str, int, int]] = deque()  # (t, profile, drafts, accepted)
        self._shadow: deque[tuple[float, bool, str]] = deque()  # (t, match, detail)

    def add(self, outcome: Outcome) -> None:
        row = (outcome.t, outcome.profile, outcome.status, outcome.code, outcome.e2e_s, outcome.ttft_s,
               outcome.completion_tokens, outcome.num_drafts, outcome.num_accepted_tokens)
        with self._lock:
            self._outcomes.append(row)
            self._prune(outcome.t)

    def add_record(self, rec: dict[str, Any]) -> None:
        """Feed one request-log record (the server's subscription to its request log)."""
        o = outcome_from_record(rec, self.clock())
        if o is not None:
            self.add(o)

    def add_acceptance(self, profile: str, num_drafts: int, num_accepted_tokens: int, t: float | None = None) -> None:
        """Acceptance counted outside the requests (a scraped counter delta of one backend)."""
        if num_drafts <= 0:
            return
        with self._lock:
            t = self.clock() if t is None else t
            self._acceptance.append((t, profile, num_drafts, num_accepted_tokens))
            self._prune(t)

    def add_shadow(self, match: bool, detail: str = "", t: float | None = None) -> None:
        with self._lock:
            t = self.clock() if t is None else t
            self._shadow.append((t, match, detail))
            self._prune(t)

    def _prune(self, now: float) -> None:
        cut = now - self.horizon_s
        while self._outcomes and self._outcomes[0][0] < cut:
            self._outcomes.popleft()
        for q in (self._acceptance, self._shadow):
            while q and q[0][0] < cut:
                q.popleft()

    def side(self, profile: str, since: float, until: float) -> SideStats:
        """The figures of one profile over finish times in [since, until]."""
        e2e: list[float] = []
        ttft: list[float] = []
        tpot: list[float] = []
        requests = errors = drafts = accepted = 0
        with self._lock:
            outcomes = [Outcome(*o) for o in self._outcomes if o[1] == profile and since <= o[0] <= until]
            scraped = [(d, a) for (t, p, d, a) in self._acceptance if p == profile and since <= t <= until]
        for o in outcomes:
            if o.status == "cancelled" or (o.status != "ok" and o.code < 500):
                continue
            requests += 1
            if o.status != "ok":
                errors += 1
                continue
            if o.e2e_s is not None:
                e2e.append(o.e2e_s)
            if o.ttft_s is not None:
                ttft.append(o.ttft_s)
            if (tp := o.tpot_s) is not None:
                tpot.append(tp)
            drafts += o.num_drafts
            accepted += o.num_accepted_tokens
        for d, a in scraped:
            drafts += d
            accepted += a
        return SideStats(requests=requests, errors=errors, e2e_s=tuple(e2e), ttft_s=tuple(ttft), tpot_s=tuple(tpot),
                         num_drafts=drafts, num_accepted_tokens=accepted)

    def shadow(self, since: float, until: float) -> ShadowStats:
        with self._lock:
            rows = [(m, d) for (t, m, d) in self._shadow if since <= t <= until]
        mismatches = [d for m, d in rows if not m]
        return ShadowStats(replays=len(rows), mismatches=len(mismatches),
                           first_mismatch=mismatches[0] if mismatches else "")
