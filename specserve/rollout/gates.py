"""Rollout gates: pure functions from the two sides' figures over one window to a verdict.

Gates (thresholds from the plan, `plan.DEFAULT_GATES`; a gate set to None is off):
- `p95_e2e_ratio`: candidate P95 E2E latency / baseline P95 E2E; fails when above the threshold.
- `p95_ttft_ratio`: the same for TTFT.
- `median_tpot_ratio`: candidate median TPOT / baseline median TPOT; fails when above.
- `error_rate_diff`: candidate server-error rate - baseline's (fractions, 0..1); fails when above.
- `min_mean_acceptance_length`: candidate mean acceptance length = 1 + accepted / drafts (tokens
  committed per verify step that carried drafts, the standard definition); fails when below.
- `shadow` (only with a plan's `shadow` check): fails on any replayed greedy request whose candidate
  output differs from baseline's.
Percentiles are numpy's linear-interpolation percentiles over the requests in the window.
A gate without samples on a side is "no_data": it never fails, and it holds back promotion.

`decide()` turns one evaluation into an action: "revert" when a gate fails (once each side has the
step's minimum requests; a shadow mismatch reverts at once), "promote" when every gate passes, the
dwell time is served and both sides have the minimum requests, else "wait" with the reason.
What it does not do: collect the figures (`window.py`) or act on the decision (`controller.py`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class SideStats:
    """One profile's figures over a window. Latencies in seconds, one entry per successful request."""

    requests: int = 0  # answered: ok + server errors (HTTP >= 500)
    errors: int = 0  # server errors
    e2e_s: tuple[float, ...] = ()
    ttft_s: tuple[float, ...] = ()
    tpot_s: tuple[float, ...] = ()
    num_drafts: int = 0
    num_accepted_tokens: int = 0

    @property
    def error_rate(self) -> float | None:
        return self.errors / self.requests if self.requests else None

    @property
    def mean_acceptance_length(self) -> float | None:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    def summary(self) -> dict:
        """Counts and the gate figures, for status output (seconds)."""
        return {
            "requests": self.requests, "errors": self.errors, "error_rate": self.error_rate,
            "p95_e2e_s": percentile(self.e2e_s, 95), "p95_ttft_s": percentile(self.ttft_s, 95),
            "median_tpot_s": percentile(self.tpot_s, 50), "mean_acceptance_length": self.mean_acceptance_length,
            "num_drafts": self.num_drafts,
        }


@dataclass(frozen=True)
class ShadowStats:
    replays: int = 0
    mismatches: int = 0
    first_mismatch: str = ""


@dataclass(frozen=True)
class GateResult:
    """One gate's verdict: "pass" | "fail" | "no_data". `value` is what was compared with `threshold`."""

    name: str
    threshold: float
    verdict: str
    value: float | None = None
    candidate: float | None = None
    baseline: float | None = None
    detail: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Decision:
    action: str  # "promote" | "revert" | "wait"
    reason: str
    results: tuple[GateResult, ...] = ()


def percentile(values, q: float) -> float | None:
    """numpy's linear-interpolation percentile q (0..100) of `values`; None when empty. (numpy is imported
    here, at the first evaluation, not with the module: the gateway and the server import this module and
    use it only while a rollout runs, in the controller's worker thread.)"""
    if not len(values):
        return None
    import numpy as np

    return float(np.percentile(np.asarray(values, dtype=float), q))


def _ratio(name: str, threshold: float, cand: float | None, base: float | None, what: str) -> GateResult:
    if cand is None or base is None:
        side = "candidate" if cand is None else "baseline"
        return GateResult(name, threshold, "no_data", None, cand, base, f"no {what} samples on the {side} side")
    if base > 0:
        value = cand / base
    else:
        value = 1.0 if cand <= 0 else float("inf")
    verdict = "fail" if value > threshold else "pass"
    return GateResult(name, threshold, verdict, value, cand, base,
                      f"{what} candidate {_ms(cand)} / baseline {_ms(base)} = {value:.3f} "
                      f"({'>' if verdict == 'fail' else '<='} {threshold:g})")


def _ms(s: float) -> str:
    return f"{1000 * s:.1f} ms"


def evaluate_gates(gates: dict, cand: SideStats, base: SideStats, shadow: ShadowStats | None = None
                   ) -> list[GateResult]:
    """Every enabled gate of `gates` (name -> threshold or None) on the two sides' figures."""
    out: list[GateResult] = []
    if (t := gates.get("p95_e2e_ratio")) is not None:
        out.append(_ratio("p95_e2e_ratio", t, percentile(cand.e2e_s, 95), percentile(base.e2e_s, 95), "P95 E2E"))
    if (t := gates.get("p95_ttft_ratio")) is not None:
        out.append(_ratio("p95_ttft_ratio", t, percentile(cand.ttft_s, 95), percentile(base.ttft_s, 95), "P95 TTFT"))
    if (t := gates.get("median_tpot_ratio")) is not None:
        out.append(_ratio("median_tpot_ratio", t, percentile(cand.tpot_s, 50), percentile(base.tpot_s, 50),
                          "median TPOT"))
    if (t := gates.get("error_rate_diff")) is not None:
        c, b = cand.error_rate, base.error_rate
        if c is None or b is None:
            out.append(GateResult("error_rate_diff", t, "no_data", None, c, b,
                                  f"no answered requests on the {'candidate' if c is None else 'baseline'} side"))
        else:
            v = c - b
            verdict = "fail" if v > t else "pass"
            out.append(GateResult("error_rate_diff", t, verdict, v, c, b,
                                  f"error rate candidate {c:.4f} ({cand.errors}/{cand.requests}) - baseline {b:.4f} "
                                  f"({base.errors}/{base.requests}) = {v:+.4f} ({'>' if verdict == 'fail' else '<='} "
                                  f"{t:g})"))
    if (t := gates.get("min_mean_acceptance_length")) is not None:
        m = cand.mean_acceptance_length
        if m is None:
            out.append(GateResult("min_mean_acceptance_length", t, "no_data", None, None, None,
                                  "no draft steps counted on the candidate side"))
        else:
            verdict = "fail" if m < t else "pass"
            out.append(GateResult("min_mean_acceptance_length", t, verdict, m, m, base.mean_acceptance_length,
                                  f"candidate mean acceptance length {m:.3f} over {cand.num_drafts} draft steps "
                                  f"({'<' if verdict == 'fail' else '>='} {t:g})"))
    if shadow is not None:
        if shadow.mismatches:
            out.append(GateResult("shadow", 0, "fail", float(shadow.mismatches), None, None,
                                  f"{shadow.mismatches} of {shadow.replays} replayed greedy requests differ on the "
                                  f"candidate; first: {shadow.first_mismatch}"))
        else:
            out.append(GateResult("shadow", 0, "pass", 0.0, None, None,
                                  f"{shadow.replays} replayed greedy requests identical"))
    return out


def decide(results: list[GateResult], cand: SideStats, base: SideStats, *, min_requests: int,
           dwell_s: float, min_dwell_s: float) -> Decision:
    """The action for one evaluation (see the module docstring); the reason names gate and figures."""
    res = tuple(results)
    shadow_fail = [r for r in res if r.name == "shadow" and r.verdict == "fail"]
    if shadow_fail:
        return Decision("revert", f"gate shadow failed: {shadow_fail[0].detail}", res)
    if cand.requests < min_requests or base.requests < min_requests:
        return Decision("wait", f"waiting for {min_requests} answered requests on each side in the window "
                                f"(candidate {cand.requests}, baseline {base.requests})", res)
    failed = [r for r in res if r.verdict == "fail"]
    if failed:
        return Decision("revert", "; ".join(f"gate {r.name} failed: {r.detail}" for r in failed), res)
    if dwell_s < min_dwell_s:
        return Decision("wait", f"gates pass; dwell {dwell_s:.0f} s of {min_dwell_s:.0f} s", res)
    missing = [r for r in res if r.verdict == "no_data"]
    if missing:
        return Decision("wait", "; ".join(f"gate {r.name}: {r.detail}" for r in missing), res)
    return Decision("promote", "all gates pass: " + "; ".join(r.detail for r in res) if res else "no gates set", res)
