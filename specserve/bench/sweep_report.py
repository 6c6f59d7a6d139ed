"""The sweep's console table and self-contained HTML report (plotly.js inlined once, works offline).

What it does: `print_table` prints one table per segment: every profile's median TPOT speedup with its
spread over repeats, per concurrency, the recommended profile marked, then one line per (segment,
concurrency) with the pick, why, the noise band and the profiles as good as the best; `write_html` renders the
recommendations, the full table and three kinds of plots: TPOT speedup vs concurrency per segment,
acceptance by draft position per segment, and latency (TPOT) vs throughput with the Pareto front per
segment. What it does not do: run anything or choose anything (`sweep.py`, `sweep_select.py`).
"""

from __future__ import annotations

import html
import sys

import plotly.graph_objects as go

LAYOUT = dict(template="plotly_white", height=420, margin=dict(l=60, r=20, t=60, b=50))


def _f(v, fmt: str) -> str:
    return "-" if not isinstance(v, (int, float)) else fmt.format(v)


def _cell(row: dict) -> str:
    s = row["speedup"]
    if s["median"] is None:
        return "-"
    return (f"{s['median']:.2f}x [{s['min']:.2f}-{s['max']:.2f}]" + (" !" if row["errors"] else "")
            + (" pruned" if row.get("pruned") else ""))


def table_text(result: dict) -> str:
    """The table as plain text (also written to table.txt)."""
    from io import StringIO

    buf = StringIO()
    print_table(result, buf)
    return buf.getvalue()


def print_table(result: dict, file=None) -> None:
    """Per segment: profiles x concurrency, median TPOT speedup [min-max over repeats]; * = recommended;
    `pruned` = dropped after the first repeat (one value)."""
    from rich.console import Console
    from rich.table import Table

    file = file or sys.stdout
    con = Console(file=file, width=None if getattr(file, "isatty", lambda: False)() else 160, highlight=False)
    rows, recs = result["rows"], result["recommendations"]
    picks = {(r["segment"], r["concurrency"]): r["profile"] for r in recs}
    concs = list(dict.fromkeys(r["concurrency"] for r in rows))
    for seg in dict.fromkeys(r["segment"] for r in rows):
        t = Table(title=f"sweep | {seg} | TPOT speedup vs baseline, median [min-max] over "
                        f"{result['config']['repeats']} repeat(s); * = recommended", title_justify="left")
        t.add_column("profile")
        for c in concs:
            t.add_column(f"c={c}", justify="right")
        t.add_column("acc.len (c=%s)" % concs[0], justify="right")
        for prof in dict.fromkeys(r["profile"] for r in rows if r["segment"] == seg):
            cells = []
            first = None
            for c in concs:
                row = next((r for r in rows if (r["segment"], r["concurrency"], r["profile"]) == (seg, c, prof)), None)
                first = first or row
                cells.append("-" if row is None else _cell(row) + (" *" if picks.get((seg, c)) == prof else ""))
            t.add_row(prof, *cells, _f(first and first["mean_acceptance_length"], "{:.2f}"))
        con.print(t)
    for r in recs:
        con.print(f"recommended for {r['segment']} at c={r['concurrency']}: {r['profile']} "
                  f"({r['speedup']:.2f}x, spread {r['spread'][0]:.2f}-{r['spread'][1]:.2f}; {r['reason']}"
                  + (f"; noise band {r['noise']:.0%}, as good as the best: {', '.join(r['within_noise'])}"
                     if "within_noise" in r else "") + ")", soft_wrap=True)


def speedup_figures(result: dict) -> list[go.Figure]:
    """Per segment: median TPOT speedup vs concurrency, one line per profile, bars = min-max over repeats."""
    rows, figs = result["rows"], []
    for seg in dict.fromkeys(r["segment"] for r in rows):
        fig = go.Figure()
        for prof in dict.fromkeys(r["profile"] for r in rows if r["segment"] == seg):
            rs = [r for r in rows if r["segment"] == seg and r["profile"] == prof and r["speedup"]["median"] is not None]
            y = [r["speedup"]["median"] for r in rs]
            fig.add_trace(go.Scatter(
                x=[str(r["concurrency"]) for r in rs], y=y, mode="lines+markers", name=prof,
                error_y=dict(type="data", array=[r["speedup"]["max"] - v for r, v in zip(rs, y)],
                             arrayminus=[v - r["speedup"]["min"] for r, v in zip(rs, y)], visible=True)))
        fig.add_hline(y=1.0, line_dash="dot", line_color="#888")
        fig.update_layout(title=f"{seg}: TPOT speedup vs concurrency (baseline TPOT / profile TPOT; bars: min-max)",
                          xaxis_title="concurrency", yaxis_title="speedup", **LAYOUT)
        figs.append(fig)
    return figs


def acceptance_figures(result: dict) -> list[go.Figure]:
    """Per segment (lowest concurrency): share of drafts whose i-th token was accepted, per profile."""
    rows, figs = result["rows"], []
    for seg in dict.fromkeys(r["segment"] for r in rows):
        c0 = min(r["concurrency"] for r in rows if r["segment"] == seg)
        fig = go.Figure()
        for r in rows:
            if r["segment"] == seg and r["concurrency"] == c0 and r["acceptance_per_pos"]:
                fig.add_trace(go.Scatter(x=list(range(1, len(r["acceptance_per_pos"]) + 1)), y=r["acceptance_per_pos"],
                                         mode="lines+markers", name=r["profile"]))
        fig.update_layout(title=f"{seg}: acceptance by draft position (c={c0}; share of drafts whose i-th token "
                                "was accepted)", xaxis=dict(title="draft position", dtick=1),
                          yaxis=dict(title="rate", range=[0, 1]), **LAYOUT)
        figs.append(fig)
    return figs


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points (throughput, latency) no other point beats on both (higher throughput and
    lower latency), in order of throughput."""
    idx = sorted(range(len(points)), key=lambda i: (-points[i][0], points[i][1]))
    front, best_lat = [], float("inf")
    for i in idx:
        if points[i][1] < best_lat:
            front.append(i)
            best_lat = points[i][1]
    return sorted(front, key=lambda i: points[i][0])


def pareto_figures(result: dict) -> list[go.Figure]:
    """Per segment: TPOT (ms, median) vs output tokens/s (median), one point per (profile, concurrency),
    the Pareto front drawn as a line."""
    rows, figs = result["rows"], []
    for seg in dict.fromkeys(r["segment"] for r in rows):
        rs = [r for r in rows if r["segment"] == seg and r["output_tps"] is not None and r["tpot_ms"] is not None]
        pts = [(r["output_tps"], r["tpot_ms"]) for r in rs]
        fig = go.Figure()
        fig.add_trace(go.Scatter(x=[p[0] for p in pts], y=[p[1] for p in pts], mode="markers+text",
                                 text=[f"{r['profile']} c={r['concurrency']}" for r in rs], textposition="top center",
                                 textfont=dict(size=9), name="runs"))
        front = pareto_front(pts)
        fig.add_trace(go.Scatter(x=[pts[i][0] for i in front], y=[pts[i][1] for i in front], mode="lines",
                                 name="Pareto front", line=dict(dash="dash")))
        fig.update_layout(title=f"{seg}: latency vs throughput (TPOT ms vs output tokens/s, medians over repeats)",
                          xaxis_title="output tokens/s", yaxis_title="TPOT ms", **LAYOUT)
        figs.append(fig)
    return figs


def _rec_table(result: dict) -> str:
    body = "".join(
        f"<tr><td>{html.escape(r['segment'])}</td><td>{r['concurrency']}</td><td><b>{html.escape(r['profile'])}</b></td>"
        f"<td>{r['speedup']:.2f}x</td><td>{r['spread'][0]:.2f}-{r['spread'][1]:.2f}</td>"
        f"<td>{html.escape(r['best'])} ({r['best_speedup']:.2f}x)</td><td>{_f(r.get('noise'), '{:.0%}')}</td>"
        f"<td style='text-align:left'>{html.escape(r['reason'])}</td></tr>" for r in result["recommendations"])
    return ("<table><tr><th>segment</th><th>concurrency</th><th>recommended</th><th>speedup</th><th>spread</th>"
            f"<th>best median</th><th>noise band</th><th>why</th></tr>{body}</table>")


def _rows_table(result: dict) -> str:
    body = "".join(
        f"<tr><td>{html.escape(r['segment'])}</td><td>{r['concurrency']}</td><td>{html.escape(r['profile'])}</td>"
        f"<td>{_cell(r)}</td><td>{_f(r['tps_ratio']['median'], '{:.2f}x')}</td><td>{_f(r['tpot_ms'], '{:.1f}')}</td>"
        f"<td>{_f(r['ttft_ms_p50'], '{:.0f}')}</td><td>{_f(r['output_tps'], '{:.2f}')}</td>"
        f"<td>{_f(r['acceptance_rate'], '{:.2f}')}</td><td>{_f(r['mean_acceptance_length'], '{:.2f}')}</td>"
        f"<td>{r['errors']}</td></tr>" for r in result["rows"])
    return ("<table><tr><th>segment</th><th>c</th><th>profile</th><th>TPOT speedup</th><th>tok/s ratio</th>"
            "<th>TPOT ms</th><th>TTFT p50 ms</th><th>out tok/s</th><th>accept</th><th>acc.len</th><th>errors</th></tr>"
            f"{body}</table>")


def render_html(result: dict) -> str:
    """The report as one HTML string."""
    figs = speedup_figures(result) + acceptance_figures(result) + pareto_figures(result)
    parts = "".join(f'<div class="fig">{f.to_html(full_html=False, include_plotlyjs=(i == 0), config={"displaylogo": False})}</div>'
                    for i, f in enumerate(figs))
    c = result["config"]
    where = html.escape(c.get("base_url") or f"servers from: {c.get('server_cmd')}")
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>specserve sweep</title>
<style>body{{font-family:system-ui,sans-serif;margin:24px;color:#222}}table{{border-collapse:collapse;margin:8px 0 20px}}
td,th{{border:1px solid #ccc;padding:3px 7px;font-size:13px;text-align:right}}th{{background:#f3f3f3}}
td:first-child,th:first-child{{text-align:left}}.note{{color:#555;font-size:13px}}</style></head>
<body><h1>specserve sweep</h1>
<p>{where}, started {html.escape(result['started'])}, {result['wall_s']:.0f} s. Methods {html.escape(', '.join(c['methods']))},
k {html.escape(', '.join(map(str, c['ks'])))}{' and adaptive' if c['adaptive'] else ''}; concurrency
{html.escape(', '.join(map(str, c['concurrency'])))}; segments {html.escape(', '.join(c['segments']))};
{c['num_prompts']} greedy requests per run, at least {c.get('min_waves', 1)} per concurrent stream (max_tokens
{c['max_tokens']}), {c['repeats']} repeat(s), profile order rotated.</p>
<p class="note">Speedup = baseline TPOT / profile TPOT, token-weighted, each against the baseline of the same repeat;
median over repeats, [min-max] = spread. Each profile is compared with the best median through its speedup over the
best's in the same repeat; noise band = the largest relative half-range (max - min) / 2 / median of those ratios over
the (segment, concurrency)'s profiles, the baseline's included, at least {c['min_noise']}; a profile is as good as the
best when its median ratio is at least 1 - band. Recommended = the smallest k among the profiles whose median ratio
is at least 1 - band / 2 (the band's inner half: a pick at its edge more often falls outside a re-run's band). The
baseline has k = 0.</p>
<h2>Recommendations</h2>{_rec_table(result)}
<h2>All runs</h2>{_rows_table(result)}
<h2>Plots</h2>{parts}
</body></html>"""


def write_html(path, result: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(render_html(result))
