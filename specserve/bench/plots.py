"""Plotly figures for the benchmark report (one function per plot; `all_figures` returns them in order).

What it does: builds figures from a summary and its per-request rows, with the labels of
`checks.py` (a series of an unconfirmed profile is named "(UNVERIFIED)", the per-token ITL plot is
titled ESTIMATE when its counts were, acceptance from a /metrics delta is named "(server-wide)").
What it does not do: write HTML (see `report.py`); latency values are recomputed from rows with
`metrics.py`, in ms.
"""
from __future__ import annotations

import plotly.graph_objects as go

from specserve.bench import checks, metrics
from specserve.bench.console import profile_label

LAYOUT = dict(template="plotly_white", height=420, margin=dict(l=60, r=20, t=60, b=50))


def _series_name(g: dict, n_loads: int) -> str:
    name = profile_label(g["profile"], g.get("profile_check"))
    return name if n_loads == 1 else f"{name} {g['load']}"


def latency_figures(summary: dict, rows: list[dict]) -> list[go.Figure]:
    """Box plots per segment of TTFT, TPOT, ITL per token and E2E, one box series per profile x load."""
    loads = list(dict.fromkeys(g["load"] for g in summary["groups"]))
    specs = [("TTFT", lambda r: [metrics.ttft_ms(r)]),
             ("TPOT", lambda r: [x for x in [metrics.tpot_ms(r)] if x is not None]),
             ("ITL per token", lambda r: [v for v, _ in metrics.itl_per_token(r)]),
             ("E2E latency", lambda r: [metrics.e2e_ms(r)])]
    figs = []
    for title, fn in specs:
        fig = go.Figure()
        for g in summary["groups"]:
            xs, ys = [], []
            for r in rows:
                if r.get("profile") == g["profile"] and r.get("load") == g["load"] and metrics.ok(r):
                    vals = fn(r)
                    xs += [r["segment"]] * len(vals)
                    ys += vals
            fig.add_trace(go.Box(x=xs, y=ys, name=_series_name(g, len(loads)), boxpoints=False))
        est = title == "ITL per token" and any(g["overall"].get("itl_token_exact") is False for g in summary["groups"])
        fig.update_layout(title=f"{title} distribution by segment (ms)"
                                + (" - ESTIMATE: no per-chunk token counts, tokens spread evenly" if est else ""),
                          boxmode="group", yaxis_title="ms", **LAYOUT)
        fig.update_xaxes(categoryorder="array", categoryarray=sorted({r["segment"] for r in rows}))
        figs.append(fig)
    return figs


def throughput_figure(summary: dict) -> go.Figure:
    """Output tokens/s (overall, mean over repeats with min-max bars) by load, one line per profile."""
    fig = go.Figure()
    for profile in dict.fromkeys(g["profile"] for g in summary["groups"]):
        gs = [g for g in summary["groups"] if g["profile"] == profile]
        y = [g["overall"].get("output_tps") for g in gs]
        spread = [g["overall"].get("spread", {}).get("output_tps") for g in gs]
        plus = [(s[1] - v) if s and v is not None else 0 for s, v in zip(spread, y)]
        minus = [(v - s[0]) if s and v is not None else 0 for s, v in zip(spread, y)]
        fig.add_trace(go.Scatter(x=[g["load"] for g in gs], y=y, mode="lines+markers",
                                 name=profile_label(profile, checks.worst_status({g.get("profile_check") for g in gs})),
                                 error_y=dict(type="data", array=plus, arrayminus=minus, visible=True)))
    fig.update_layout(title="Output tokens/s by load (all segments; bars: min-max over repeats)",
                      xaxis_title="load (concurrency or request rate)", yaxis_title="tokens/s", **LAYOUT)
    return fig


def acceptance_figures(summary: dict) -> list[go.Figure]:
    """Acceptance rate and mean acceptance length by segment, and acceptance by draft position."""
    loads = list(dict.fromkeys(g["load"] for g in summary["groups"]))
    with_acc = [g for g in summary["groups"] if g["overall"].get("acceptance_rate") is not None]
    bars = go.Figure()
    lens = go.Figure()
    for g in with_acc:
        segs = [s for s, m in g["segments"].items() if m.get("acceptance_rate") is not None]
        wide = g["overall"].get("acceptance_source") == "metrics_delta"
        name = _series_name(g, len(loads)) + (" (server-wide)" if wide else "")
        bars.add_trace(go.Bar(x=segs + ["all"], y=[g["segments"][s]["acceptance_rate"] for s in segs]
                              + [g["overall"]["acceptance_rate"]], name=name))
        lens.add_trace(go.Bar(x=segs + ["all"], y=[g["segments"][s].get("mean_acceptance_length") for s in segs]
                              + [g["overall"].get("mean_acceptance_length")], name=name))
    bars.update_layout(title="Acceptance rate by segment (accepted / draft tokens)", barmode="group",
                       yaxis=dict(title="acceptance rate", range=[0, 1]), **LAYOUT)
    lens.update_layout(title="Mean acceptance length by segment (1 + accepted / drafts = tokens per target forward)",
                       barmode="group", yaxis_title="tokens per step", **LAYOUT)
    pos = go.Figure()
    for g in with_acc:
        if g["load"] != loads[0]:
            continue
        for seg, m in list(g["segments"].items()) + [("all", g["overall"])]:
            rates = m.get("acceptance_per_pos") or []
            if rates:
                wide = " (server-wide)" if m.get("acceptance_source") == "metrics_delta" else ""
                pos.add_trace(go.Scatter(x=list(range(1, len(rates) + 1)), y=rates, mode="lines+markers",
                                         name=f"{profile_label(g['profile'], g.get('profile_check'))} {seg}{wide}",
                                         line=dict(width=3 if seg == "all" else 1.5)))
    pos.update_layout(title=f"Acceptance by draft position ({loads[0] if loads else ''}; "
                            "share of drafts whose i-th token was accepted)",
                      xaxis=dict(title="draft position", dtick=1), yaxis=dict(title="rate", range=[0, 1]), **LAYOUT)
    return [bars, lens, pos]


def comparison_figures(summary: dict) -> list[go.Figure]:
    """Per comparison: baseline vs candidate TPOT (ms/token) per segment, speedup written on the bars."""
    figs = []
    for c in summary.get("comparisons") or []:
        names = list(c["segments"]) + ["all"]
        ms = [c["segments"][s] for s in c["segments"]] + [c["overall"]]
        fig = go.Figure()
        fig.add_trace(go.Bar(x=names, y=[m["baseline"]["tpot_ms_agg"] for m in ms], name=f"{c['baseline']} (baseline)"))
        fig.add_trace(go.Bar(x=names, y=[m["candidate"]["tpot_ms_agg"] for m in ms], name=c["candidate"],
                             text=[f"{m['speedup']:.2f}x" if m.get("speedup") else "" for m in ms],
                             textposition="outside"))
        fig.update_layout(title=f"{c['candidate']} vs {c['baseline']} ({c['load']}): TPOT per segment, "
                                "label = speedup (baseline TPOT / candidate TPOT)"
                                + (" - (!) not like for like, see the warnings"
                                   if c.get("comparable") is False else ""),
                          barmode="group", yaxis_title="ms per output token", **LAYOUT)
        figs.append(fig)
    return figs


def all_figures(summary: dict, rows: list[dict]) -> list[go.Figure]:
    figs = comparison_figures(summary) + latency_figures(summary, rows) + [throughput_figure(summary)]
    if any(g["overall"].get("acceptance_rate") is not None for g in summary["groups"]):
        figs += acceptance_figures(summary)
    return figs
