"""`specserve rollout start|status|pause|resume|promote|rollback`: a thin client of the admin API.

Works against `specserve serve` and `specserve gateway` alike. The bearer token comes from the
environment (SPECSERVE_ADMIN_TOKEN). `start --plan FILE` reads the plan (JSON or YAML) here, checks it
(the same validation as the server, so a bad key is named before anything is sent) and posts it.
Every command prints the rollout status as a table (`--json` prints the raw status instead); an HTTP
error is one line, `specserve: error: ...` (exit status 2).
What it does not do: evaluate anything itself; the server or gateway runs the rollout.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

ACTIONS = ("start", "status", "pause", "resume", "promote", "rollback")


class AdminError(ValueError):
    """The admin API refused or could not be reached (printed as one line by the CLI)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=ACTIONS, help="what to do")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server or gateway root URL")
    p.add_argument("--plan", metavar="FILE", help="rollout plan, JSON or YAML (start only)")
    p.add_argument("--json", action="store_true", help="print the raw status JSON")
    p.add_argument("--timeout", type=float, default=10.0, help="HTTP timeout in seconds")


def _request(args: argparse.Namespace, method: str, path: str, body: Any = None) -> dict:
    import httpx

    token = os.environ.get("SPECSERVE_ADMIN_TOKEN")
    if not token:
        raise AdminError("set SPECSERVE_ADMIN_TOKEN to the server's admin token")
    root = args.url.rstrip("/")
    root = root[:-3] if root.endswith("/v1") else root
    try:
        r = httpx.request(method, root + path, json=body, timeout=args.timeout,
                          headers={"authorization": f"Bearer {token}"})
    except httpx.HTTPError as e:
        raise AdminError(f"cannot reach {root}: {e}") from None
    try:
        data = r.json()
    except ValueError:
        data = None
    if r.status_code != 200:
        msg = (data or {}).get("error", {}).get("message") if isinstance(data, dict) else None
        raise AdminError(f"{method} {path}: HTTP {r.status_code}: {msg or r.text[:200]}")
    return data


def run(args: argparse.Namespace) -> int:
    if args.action == "start":
        if not args.plan:
            raise AdminError("rollout start needs --plan FILE")
        from specserve.rollout.plan import load_plan

        plan = load_plan(args.plan)
        status = _request(args, "POST", "/admin/rollout", {"plan": plan.to_dict()})
    elif args.action == "status":
        status = _request(args, "GET", "/admin/rollout")
    else:
        if args.plan:
            raise AdminError(f"--plan is only for `rollout start`, not {args.action}")
        status = _request(args, "POST", f"/admin/rollout/{args.action}")
    print(json.dumps(status, indent=1) if args.json else format_status(status))
    return 0


def _clock(t: float | None) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) if t else "-"


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{1000 * s:.1f} ms"


def _num(x: float | None, fmt: str = "{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)


def _table(rows: list[tuple]) -> list[str]:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def format_status(st: dict) -> str:
    """The status of GET /admin/rollout as readable lines: headline, weights, gates, sides, history."""
    lines = []
    weights = ", ".join(f"{n} {100 * f:.4g}%" for n, f in st["fractions"].items() if f > 0)
    if st["reverted_to_baseline"]:
        weights += " (reverted to baseline)"
    plan = st.get("plan")
    if not plan:
        lines.append(f"no staged rollout; traffic: {weights}")
    else:
        head = (f"rollout of {plan['candidate']} vs {plan['baseline']}: {st['state']}, step {st['step'] + 1}/"
                f"{st['num_steps']} ({st['percent']:g}%)")
        if st.get("dwell_s") is not None:
            step = plan["steps"][st["step"]]
            head += f", dwell {st['dwell_s']:.0f} s of {step['min_dwell_s']:g} s"
        if st.get("next_evaluation_at"):
            head += f", next evaluation in {max(0.0, st['next_evaluation_at'] - time.time()):.0f} s"
        lines += [head, f"traffic: {weights}"]
        if st.get("reason"):
            lines.append(f"reason: {st['reason']}")
    if st.get("persisted_to"):
        lines.append(f"state file: {st['persisted_to']}")
    ev = st.get("last_evaluation")
    if ev:
        lines += ["", f"last evaluation {_clock(ev['time'])} (window {_clock(ev['window'][0])}-"
                      f"{_clock(ev['window'][1])}): {ev['action']}: {ev['reason']}"]
        if ev["gates"]:
            rows = [("GATE", "THRESHOLD", "CANDIDATE", "BASELINE", "VALUE", "VERDICT")]
            for g in ev["gates"]:
                is_time = g["name"].endswith("_ratio")
                fmt = _ms if is_time else _num
                rows.append((g["name"], f"{g['threshold']:g}", fmt(g["candidate"]), fmt(g["baseline"]),
                             _num(g["value"]), g["verdict"].upper() if g["verdict"] == "fail" else g["verdict"]))
            lines += _table(rows)
        if ev.get("candidate"):
            rows = [("SIDE", "REQUESTS", "ERRORS", "P95 E2E", "P95 TTFT", "MEDIAN TPOT", "MEAN ACCEPTANCE LENGTH")]
            for side in ("candidate", "baseline"):
                s = ev[side]
                rows.append((side, s["requests"], s["errors"], _ms(s["p95_e2e_s"]), _ms(s["p95_ttft_s"]),
                             _ms(s["median_tpot_s"]), _num(s["mean_acceptance_length"], "{:.2f}")))
            lines += [""] + _table(rows)
    if st.get("history"):
        rows = [("TIME", "EVENT", "BY", "STEP", "REASON")]
        for e in st["history"][-12:]:
            pct = f"{e['percent']:g}%" if e.get("percent") is not None else "-"
            reason = e.get("reason") or ""
            rows.append((_clock(e["time"]), e["event"], e["by"], pct, reason if len(reason) < 160 else
                         reason[:157] + "..."))
        lines += ["", "history (latest last):"] + _table(rows)
    return "\n".join(lines)
