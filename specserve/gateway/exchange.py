"""One client request as the gateway saw it (`Exchange`), and its recording: Prometheus series, the
rollout window's `Outcome` and the request-log line (fields `GATEWAY_LOG_FIELDS`).
Recording happens once per request, after the answer's last byte was sent (`proxy.py`), so that none
of it lies on the client's latency path; E2E is measured to that last byte (`Exchange.t_end`).
What it does not do: forward anything (`proxy.py`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from specserve.gateway.backends import Backend
from specserve.rollout.window import Outcome

GATEWAY_LOG_FIELDS = (
    "id", "time", "endpoint", "profile", "profile_reason", "rollout_step", "backend", "config", "kind", "attempts",
    "model", "stream", "prompt_tokens", "completion_tokens", "ttft_s", "e2e_s", "num_drafts", "num_accepted_tokens",
    "mean_acceptance_length", "status", "http_status", "error",
)


@dataclass(slots=True)
class Exchange:
    """One client request as the gateway saw it. Times are `time.perf_counter()` seconds (`wall`: unix
    seconds at arrival); `t_end` is set when the answer's last byte went to the client (None before)."""

    rid: str
    path: str
    chat: bool
    raw: bytes
    body: dict
    profile: str
    reason: str
    step: str | None
    sticky: str | None
    auth: str | None = None  # the client's Authorization header (forwarded unless the backend has an api_key)
    t0: float = field(default_factory=time.perf_counter)
    wall: float = field(default_factory=time.time)
    t_end: float | None = None
    attempts: list[str] = field(default_factory=list)
    backend: Backend | None = None
    ttft_s: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    spec: dict | None = None
    capture: bool = False
    events: list[dict] = field(default_factory=list)
    recorded: bool = False


def record_exchange(gw: Any, ex: Exchange, status: str, code: int, error: str | None) -> None:
    """Once per request: Prometheus series, the rollout window's Outcome, the request-log line. E2E is
    `ex.t_end - ex.t0` (now, when the answer's end was not marked)."""
    if ex.recorded:
        return
    ex.recorded = True
    e2e = (ex.t_end if ex.t_end is not None else time.perf_counter()) - ex.t0
    spec = ex.spec or {}
    drafts = int(spec.get("num_drafts") or 0)
    accepted = int(spec.get("num_accepted_tokens") or 0)
    completion = int(ex.completion_tokens or 0)
    gw.metrics.finished(ex.profile, status, code, e2e, ex.ttft_s, int(ex.prompt_tokens or 0), completion)
    if status == "ok" and (ex.backend is None or ex.backend.cfg.kind != "vllm"):  # vLLM's: from its /metrics
        gw.metrics.spec(ex.profile, drafts, int(spec.get("num_draft_tokens") or 0), accepted)
    gw.window.add(Outcome(t=ex.wall + e2e, profile=ex.profile, status=status, code=code,
                          e2e_s=e2e if status == "ok" else None, ttft_s=ex.ttft_s,
                          completion_tokens=completion, num_drafts=drafts, num_accepted_tokens=accepted))
    if gw.request_log.enabled:
        b = ex.backend
        gw.request_log.write({
            "id": ex.rid, "time": ex.wall, "endpoint": "chat" if ex.chat else "completions",
            "profile": ex.profile, "profile_reason": ex.reason, "rollout_step": ex.step,
            "backend": b.name if b else None, "config": gw.cfg.profiles.get(ex.profile),
            "kind": b.cfg.kind if b else None, "attempts": ex.attempts, "model": ex.body.get("model"),
            "stream": bool(ex.body.get("stream")), "prompt_tokens": ex.prompt_tokens,
            "completion_tokens": ex.completion_tokens, "ttft_s": ex.ttft_s, "e2e_s": e2e,
            "num_drafts": drafts, "num_accepted_tokens": accepted,
            "mean_acceptance_length": spec.get("mean_acceptance_length"), "status": status, "http_status": code,
            "error": error,
        })
