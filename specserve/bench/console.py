"""Console tables (rich) for a benchmark summary and for comparisons.

What it does: one table per (profile, load) with a row per segment plus `all`, one table per
comparison (candidate vs baseline) with ratios and both error rates, and the demo's table of every
profile against the baseline per segment. Values are means over repeats. ITL is shown both per chunk
and per token, labelled; every label of `checks.py` is shown where its number is: a profile no
response confirmed is titled UNVERIFIED, an estimated per-token ITL column is headed ESTIMATE,
acceptance from a /metrics delta is starred as server-wide, a comparison that is not like for like
marks its speedup with (!), and the run's problems and warnings follow the tables as PROBLEM / WARNING
lines. What it does not do: write files or decide anything.
"""
from __future__ import annotations

import sys

from rich.console import Console
from rich.table import Table

from specserve.bench.checks import SERVER_WIDE

SERVER_WIDE_NOTE = f"* acceptance from the server's /metrics delta: {SERVER_WIDE}"


def cell(v, fmt="{:.1f}", scale=1.0) -> str:
    """A table cell: "-" for a missing value, else `fmt` of v * scale."""
    return "-" if v is None else fmt.format(v * scale)


def _console(file=None, width: int = 180) -> Console:
    file = file or sys.stdout
    return Console(file=file, width=None if file.isatty() else width, highlight=False)


def _mem(group_runs: list[dict]) -> str:
    vals = [r["server"].get("memory_bytes") for r in group_runs if r["server"].get("memory_bytes")]
    return f", server RSS {max(vals) / 2**20:.0f} MiB" if vals else ""


def profile_label(profile: str, check: str | None) -> str:
    """A profile's name with its check when the responses did not confirm it: "ngram (UNVERIFIED)"."""
    return f"{profile} ({check.upper()})" if check in ("unverified", "mismatch") else profile


def accept_cell(v, server_wide: bool) -> str:
    """An acceptance value, starred when it comes from a server-wide /metrics delta (SERVER_WIDE_NOTE)."""
    c = cell(v, "{:.2f}")
    return c + "*" if server_wide and c != "-" else c


def print_checks(summary: dict, file=None) -> None:
    """The run's problems (PROBLEM lines) and warnings (WARNING lines), as `checks.evaluate` wrote them."""
    con = _console(file)
    for p in summary.get("problems") or []:
        con.print(f"PROBLEM: {p['message']}", style="bold red", soft_wrap=True)
    for w in summary.get("warnings") or []:
        con.print(f"WARNING: {w['message']}", style="yellow", soft_wrap=True)


def print_summary(summary: dict, file=None) -> None:
    con = _console(file)
    starred = False
    for g in summary["groups"]:
        runs = [r for r in summary["runs"] if r["profile"] == g["profile"] and r["load"] == g["load"]]
        title = (f"profile {profile_label(g['profile'], g.get('profile_check'))} | {g['load']} | "
                 f"{g['overall'].get('num_repeats', 1)} repeat(s){_mem(runs)} | latencies in ms, P50/P99 over "
                 "requests; ITL pooled over gaps; "
                 + ("prompts not primed" if runs and not all(r.get("primed", True) for r in runs)
                    else "prompts primed (TTFT of cached prompts)"))
        t = Table(title=title, title_justify="left")
        itl = "ITL/token p50" + ("" if g["overall"].get("itl_token_exact", True) else " (ESTIMATE)")
        for col in ("segment", "req", "err%", "out tok/s", "req/s", "TTFT p50", "TTFT p99", "TPOT p50",
                    "ITL/chunk p50", itl, "E2E p50", "E2E p99", "tok/chunk", "accept", "acc.len"):
            t.add_column(col, justify="left" if col == "segment" else "right")
        if summary["config"].get("slo"):
            t.add_column("goodput req/s", justify="right")
        rows = list(g["segments"].items()) + [("all", g["overall"])]
        for name, m in rows:
            wide = m.get("acceptance_source") == "metrics_delta"
            starred |= wide
            cells = [name, cell(m.get("num_requests"), "{:.0f}"), cell(m.get("error_rate"), "{:.1f}", 100),
                     cell(m.get("output_tps")), cell(m.get("request_tps"), "{:.2f}"), cell(m.get("ttft_ms_p50")),
                     cell(m.get("ttft_ms_p99")), cell(m.get("tpot_ms_p50")), cell(m.get("itl_chunk_ms_p50")),
                     cell(m.get("itl_token_ms_p50")), cell(m.get("e2e_ms_p50"), "{:.0f}"),
                     cell(m.get("e2e_ms_p99"), "{:.0f}"),
                     cell(m.get("tokens_per_chunk"), "{:.2f}"), accept_cell(m.get("acceptance_rate"), wide),
                     accept_cell(m.get("mean_acceptance_length"), wide)]
            if summary["config"].get("slo"):
                cells.append(cell(m.get("goodput_rps"), "{:.2f}"))
            t.add_row(*cells, style="bold" if name == "all" else None)
        con.print(t)
    if starred:
        con.print(SERVER_WIDE_NOTE)
    if summary.get("comparisons"):  # the run's own checks follow: print only what is particular to a pair
        said = {c["kind"] for c in (summary.get("problems") or []) + (summary.get("warnings") or [])}
        skip = {"profile_unverified", "acceptance_server_wide"} & said
        print_comparisons(summary["comparisons"], file, skip_kinds=skip)
    print_checks(summary, file)


def speedup_cell(v, comparable: bool | None) -> str:
    """A speedup, marked (!) when the comparison's warnings say it is not like for like."""
    c = cell(v, "{:.2f}x")
    return c + " (!)" if c != "-" and comparable is False else c


def print_comparisons(comps: list[dict], file=None, skip_kinds=frozenset()) -> None:
    """Per-segment table of candidate vs baseline: speedup = baseline TPOT / candidate TPOT (token-weighted),
    both error rates side by side, then the comparison's warnings (but those of `skip_kinds`)."""
    con = _console(file)
    for c in comps:
        t = Table(title=f"{c['candidate']} vs {c['baseline']} | {c['load']} | ratio = candidate / baseline; "
                        "speedup = baseline TPOT / candidate TPOT", title_justify="left")
        for col in ("segment", "base err%", "cand err%", "base tok/s", "cand tok/s", "tok/s ratio", "speedup",
                    "TTFT p50 ratio", "E2E p50 ratio", "accept", "acc.len", "greedy same"):
            t.add_column(col, justify="left" if col == "segment" else "right")
        wide = any(w["kind"] == "acceptance_server_wide" for w in c.get("warnings") or [])
        for name, m in list(c["segments"].items()) + [("all", c["overall"])]:
            gm = m.get("greedy_match")
            t.add_row(name, cell(m["baseline"]["error_rate"], "{:.1f}", 100),
                      cell(m["candidate"]["error_rate"], "{:.1f}", 100), cell(m["baseline"]["output_tps"]),
                      cell(m["candidate"]["output_tps"]), cell(m["ratio"]["output_tps"], "{:.2f}x"),
                      speedup_cell(m.get("speedup"), c.get("comparable")),
                      cell(m["ratio"]["ttft_ms_p50"], "{:.2f}x"), cell(m["ratio"]["e2e_ms_p50"], "{:.2f}x"),
                      accept_cell(m["candidate"]["acceptance_rate"], wide),
                      accept_cell(m["candidate"]["mean_acceptance_length"], wide),
                      f"{gm[0]}/{gm[1]}" if gm else "-", style="bold" if name == "all" else None)
        con.print(t)
        for w in c.get("warnings") or []:  # the server-wide one explains the starred acceptance
            if w["kind"] not in skip_kinds:
                con.print(f"WARNING: {w['message']}", style="yellow", soft_wrap=True)


def print_profile_table(rows: list[dict], title: str, file=None) -> None:
    """One table per load, a row per (segment incl. `all`, profile): TPOT, speedup and tokens/s vs the
    baseline, acceptance, greedy matches (rows as `compare.profile_rows` builds them)."""
    con = _console(file, width=140)
    for load in dict.fromkeys(r["load"] for r in rows):
        t = Table(title=f"{title} | {load}", title_justify="left")
        for col in ("segment", "profile", "req", "TPOT ms", "speedup", "tok/s", "tok/s ratio", "acc.len",
                    "accept", "greedy same"):
            t.add_column(col, justify="left" if col in ("segment", "profile") else "right")
        lrows = [r for r in rows if r["load"] == load]
        for i, r in enumerate(lrows):
            gm = r["greedy_match"]
            last = i + 1 == len(lrows) or lrows[i + 1]["segment"] != r["segment"]
            wide = bool(r.get("acceptance_server_wide"))
            t.add_row(r["segment"], profile_label(r["profile"], r.get("profile_check")), cell(r["requests"], "{:.0f}"),
                      cell(r["tpot_ms"]), speedup_cell(r["speedup_tpot"], r.get("comparable")),
                      cell(r["tokens_per_s"], "{:.2f}"), cell(r["tokens_per_s_ratio"], "{:.2f}x"),
                      accept_cell(r["mean_acceptance_length"], wide), accept_cell(r["acceptance_rate"], wide),
                      f"{gm[0]}/{gm[1]}" if gm else "-",
                      style="bold" if r["segment"] == "all" else None, end_section=last)
        con.print(t)
        if any(r.get("acceptance_server_wide") for r in lrows):
            con.print(SERVER_WIDE_NOTE)
    con.print("speedup = baseline TPOT / profile TPOT (decode time per output token, token-weighted; > 1 = faster); "
              "tok/s = output tokens / summed request time (incl. TTFT), ratio vs baseline; acc.len = mean "
              "acceptance length = 1 + accepted / drafts; accept = accepted / drafted tokens; greedy same = "
              "outputs identical to baseline / compared.", soft_wrap=False)
