"""Self-contained HTML report of a benchmark summary (plotly.js inlined once, no CDN, works offline).

What it does: renders the run's problems and warnings first (`checks.py`: failed requests, UNVERIFIED
profiles, ESTIMATE token counts, server-wide acceptance), then tables (data sources and licenses,
metrics per profile x load x segment, comparisons with both error rates and their warnings, server
numbers), each value carrying the same labels as the console, and plots: latency distributions
(TTFT, TPOT, ITL per token, E2E) per
segment, output tokens/s by load, acceptance rate by segment, acceptance by draft position, and
baseline vs each candidate side by side (TPOT per segment with the speedup printed on the bars).
A tiny script records JS errors and the number of rendered plots on <body> (`data-js-errors`,
`data-plots`) so a headless browser test can check them. `save_run` writes a run's files
(summary.json, requests.jsonl, report.html). What it does not do: run anything.
"""
from __future__ import annotations

import html
import json

import jinja2
import plotly.graph_objects as go

from specserve.bench import plots
from specserve.bench.checks import SERVER_WIDE
from specserve.bench.metrics import EXACT_SOURCES
from specserve.bench.console import profile_label

TEMPLATE = jinja2.Template("""<!doctype html>
<html><head><meta charset="utf-8"><title>specserve bench: {{ s.model|e }}</title>
<script>window.__errs=0;window.addEventListener('error',function(){window.__errs++;
document.body&&document.body.setAttribute('data-js-errors',window.__errs);});</script>
<style>body{font-family:system-ui,sans-serif;margin:24px;color:#222}table{border-collapse:collapse;margin:8px 0 20px}
td,th{border:1px solid #ccc;padding:3px 7px;font-size:13px;text-align:right}th{background:#f3f3f3}
td:first-child,th:first-child{text-align:left}.note{color:#555;font-size:13px}h2{margin-top:32px}
.problem{color:#b00020;font-weight:bold}.warning{color:#8a5a00}</style></head>
<body data-js-errors="0" data-plots="0">
<h1>specserve bench</h1>
<p>Model <b>{{ s.model|e }}</b> at <code>{{ s.base_url|e }}</code>, started {{ s.started }}.
{{ s.num_samples }} requests per run; profiles: {{ profiles|e }}; loads: {{ loads|e }}; repeats: {{ s.config.repeats }};
seed {{ s.config.seed }}; max_tokens cap {{ s.config.max_tokens }}{% if s.config.output_len %}; fixed output length
{{ s.config.output_len }}{% endif %}{% if s.config.ignore_eos %}; ignore_eos{% endif %};
{{ s.num_requests }} measured requests, {{ s.failed }} failed; warm-up: {{ s.warmup.per_profile }} per profile
({{ s.warmup.source|e }}), never a measured prompt.
{% if s.config.prime is sameas false %}Prompts were not primed (<code>--no-prime</code>): the first profile to send a
prompt paid its prefill.{% else %}Each run's prompts were sent once (max_tokens 1, untimed) before it: TTFT is that of
prompts already in the prefix cache.{% endif %}</p>
{% if s.problems or s.warnings %}<h2>Checks</h2><ul>
{% for p in s.problems %}<li class="problem">PROBLEM: {{ p.message|e }}</li>{% endfor %}
{% for w in s.warnings %}<li class="warning">WARNING: {{ w.message|e }}</li>{% endfor %}</ul>{% endif %}
<p class="note">Definitions (specserve README, "Benchmarking"): TTFT = send to first token-bearing chunk;
E2E = send to the stream's last chunk, whatever its text; TPOT = (E2E - TTFT) / (output tokens - 1);
ITL per chunk = gap between token-bearing chunks, ITL per token = that gap spread over the tokens the chunk carries (tokens per chunk counted
from: {{ sources_of_counts }}{% if estimated %}; <b>estimate</b> = spread evenly, so ITL per token is an ESTIMATE
there{% endif %});
output tokens = usage.completion_tokens; throughput = tokens / wall time; P50..P99 over requests, ITL pooled over gaps.
Speedup = baseline TPOT / candidate TPOT, token-weighted. Acceptance rate = accepted / draft tokens; mean
acceptance length = 1 + accepted / drafts; * = from the server's /metrics delta: {{ server_wide }}.
Values are means over repeats.</p>
<h2>Workload segments</h2>
<table><tr><th>segment</th><th>requests</th><th>source</th><th>license</th></tr>
{% for d in s.datasets %}<tr><td>{{ d.segment|e }}</td><td>{{ d.num_samples }}</td>
<td style="text-align:left">{{ d.source|e }}</td><td style="text-align:left">{{ d.license|e }}</td></tr>
{% endfor %}</table>
{% if comparisons %}<h2>Baseline vs candidates</h2>{{ comparisons }}{% endif %}
<h2>Metrics</h2>{{ tables }}
<h2>Plots</h2>
{% for f in figs %}<div class="fig">{{ f }}</div>{% endfor %}
<h2>Server</h2>{{ server }}
<script>document.body.setAttribute('data-plots', document.querySelectorAll('.js-plotly-plot .main-svg').length > 0 ?
document.querySelectorAll('.js-plotly-plot').length : 0);</script>
</body></html>""")

COLS = [  # (header, metric key, format)
    ("req", "num_requests", "{:.0f}"), ("err %", "error_rate", "{:.1%}"), ("out tok/s", "output_tps", "{:.1f}"),
    ("req/s", "request_tps", "{:.2f}"), ("TTFT p50", "ttft_ms_p50", "{:.1f}"), ("TTFT p90", "ttft_ms_p90", "{:.1f}"),
    ("TTFT p99", "ttft_ms_p99", "{:.1f}"), ("TPOT p50", "tpot_ms_p50", "{:.1f}"), ("TPOT p99", "tpot_ms_p99", "{:.1f}"),
    ("ITL/chunk p50", "itl_chunk_ms_p50", "{:.1f}"), ("ITL/token p50", "itl_token_ms_p50", "{:.1f}"),
    ("ITL/token p99", "itl_token_ms_p99", "{:.1f}"), ("E2E p50", "e2e_ms_p50", "{:.0f}"),
    ("E2E p95", "e2e_ms_p95", "{:.0f}"), ("E2E p99", "e2e_ms_p99", "{:.0f}"),
    ("tok/chunk", "tokens_per_chunk", "{:.2f}"),
    ("goodput req/s", "goodput_rps", "{:.2f}"), ("accept", "acceptance_rate", "{:.3f}"),
    ("acc.len", "mean_acceptance_length", "{:.2f}"),
]
ACCEPT_KEYS = ("acceptance_rate", "mean_acceptance_length")


def _fmt(v, f):
    return "-" if not isinstance(v, (int, float)) else f.format(v)


def _accept(v, f: str, server_wide: bool) -> str:
    c = _fmt(v, f)
    return c + "*" if server_wide and c != "-" else c


def _metrics_tables(s: dict) -> str:
    out = []
    for g in s["groups"]:
        est = g["overall"].get("itl_token_exact") is False
        head = "".join(f"<th>{html.escape(c)}{' (ESTIMATE)' if est and k.startswith('itl_token') else ''}</th>"
                       for c, k, _ in COLS)
        body = ""
        for name, m in list(g["segments"].items()) + [("all", g["overall"])]:
            wide = m.get("acceptance_source") == "metrics_delta"
            cells = "".join(f"<td>{_accept(m.get(k), f, wide) if k in ACCEPT_KEYS else _fmt(m.get(k), f)}</td>"
                            for _, k, f in COLS)
            body += f"<tr><td>{'<b>all</b>' if name == 'all' else html.escape(name)}</td>{cells}</tr>"
        out.append(f"<h3>profile {html.escape(profile_label(g['profile'], g.get('profile_check')))}, "
                   f"{html.escape(g['load'])} (latencies in ms)</h3>"
                   f"<table><tr><th>segment</th>{head}</tr>{body}</table>")
    return "".join(out)


def _comparison_tables(s: dict) -> str:
    out = []
    for c in s.get("comparisons") or []:
        rows = ""
        mark = " (!)" if c.get("comparable") is False else ""
        wide = any(w["kind"] == "acceptance_server_wide" for w in c.get("warnings") or [])
        for name, m in list(c["segments"].items()) + [("all", c["overall"])]:
            gm = m.get("greedy_match")
            b, cd, r = m["baseline"], m["candidate"], m["ratio"]
            sp = _fmt(m.get("speedup"), "{:.2f}x")
            rows += (f"<tr><td>{html.escape(name)}</td><td>{_fmt(b.get('error_rate'), '{:.1%}')}</td>"
                     f"<td>{_fmt(cd.get('error_rate'), '{:.1%}')}</td><td>{_fmt(b['tpot_ms_agg'], '{:.1f}')}</td>"
                     f"<td>{_fmt(cd['tpot_ms_agg'], '{:.1f}')}</td><td><b>{sp}{mark if sp != '-' else ''}</b></td>"
                     f"<td>{_fmt(b['output_tps'], '{:.1f}')}</td><td>{_fmt(cd['output_tps'], '{:.1f}')}</td>"
                     f"<td>{_fmt(r['output_tps'], '{:.2f}x')}</td><td>{_fmt(r['ttft_ms_p50'], '{:.2f}x')}</td>"
                     f"<td>{_fmt(r['e2e_ms_p50'], '{:.2f}x')}</td>"
                     f"<td>{_accept(cd['acceptance_rate'], '{:.3f}', wide)}</td>"
                     f"<td>{_accept(cd['mean_acceptance_length'], '{:.2f}', wide)}</td>"
                     f"<td>{f'{gm[0]}/{gm[1]}' if gm else '-'}</td></tr>")
        warns = "".join(f'<li class="warning">WARNING: {html.escape(w["message"])}</li>'
                        for w in c.get("warnings") or [])
        out.append(f"<h3>{html.escape(c['candidate'])} vs {html.escape(c['baseline'])}, {html.escape(c['load'])}</h3>"
                   "<table><tr><th>segment</th><th>base err %</th><th>cand err %</th><th>base TPOT ms</th>"
                   "<th>cand TPOT ms</th><th>speedup</th><th>base tok/s</th><th>cand tok/s</th><th>tok/s ratio</th>"
                   "<th>TTFT p50 ratio</th><th>E2E p50 ratio</th><th>accept</th><th>acc.len</th>"
                   f"<th>greedy outputs same</th></tr>{rows}</table>" + (f"<ul>{warns}</ul>" if warns else ""))
    return "".join(out)


def _server_table(s: dict) -> str:
    rows = ""
    for r in s["runs"]:
        mem = r["server"].get("memory_bytes")
        am = r["server"].get("acceptance_from_metrics") or {}
        check = r.get("profile_check")
        checked = {"verified": f"verified, {r.get('profile_mismatches', 0)} mismatches", None: "-"}.get(
            check, f"{(check or '').upper()}: {r.get('profile_unnamed', 0)} unnamed, "
                   f"{r.get('profile_mismatches', 0)} mismatched")
        rows += (f"<tr><td>{html.escape(r['profile'])}</td><td>{html.escape(r['load'])}</td><td>{r['repeat']}</td>"
                 f"<td>{r['wall_s']:.2f}</td><td>{'-' if mem is None else f'{mem / 2**20:.0f}'}</td>"
                 f"<td>{'yes' if r['server'].get('metrics_available') else 'no'}</td>"
                 f"<td>{_fmt(am.get('acceptance_rate'), '{:.3f}')}</td>"
                 f"<td>{_fmt(r['overall'].get('acceptance_rate'), '{:.3f}')} "
                 f"({r['overall'].get('acceptance_source', '-')})</td>"
                 f"<td>{html.escape(', '.join(r.get('served_profiles') or []))}</td>"
                 f"<td>{html.escape(checked)}</td></tr>")
    return ("<table><tr><th>profile</th><th>load</th><th>repeat</th><th>wall s</th><th>RSS MiB</th>"
            f"<th>/metrics</th><th>accept (/metrics delta: {SERVER_WIDE})</th><th>accept (used)</th>"
            "<th>served profiles (as responses named them)</th><th>profile check</th></tr>"
            f"{rows}</table>")


def render(summary: dict, rows: list[dict]) -> str:
    """The report as one HTML string."""
    figs: list[go.Figure] = plots.all_figures(summary, rows)
    parts = [f.to_html(full_html=False, include_plotlyjs=(i == 0), config={"displaylogo": False})
             for i, f in enumerate(figs)]
    counts = sorted({c for g in summary["runs"] for c in g["overall"].get("token_count_sources", [])})
    summary = {"problems": [], "warnings": [], "failed": "?", "num_requests": "?",
               "warmup": {"per_profile": "?", "source": "not recorded"}, **summary}  # older summaries
    return TEMPLATE.render(
        s=summary, figs=parts, tables=_metrics_tables(summary), comparisons=_comparison_tables(summary),
        server=_server_table(summary), server_wide=SERVER_WIDE,
        profiles=", ".join(dict.fromkeys(profile_label(g["profile"], g.get("profile_check"))
                                         for g in summary["groups"])),
        loads=", ".join(dict.fromkeys(g["load"] for g in summary["groups"])),
        sources_of_counts=", ".join(counts) or "-", estimated=any(c not in EXACT_SOURCES for c in counts))


def write(path, summary: dict, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(render(summary, rows))


def save_run(out_dir, summary: dict, rows: list[dict], html: bool = True) -> None:
    """Write a run's files into `out_dir` (created): summary.json, requests.jsonl (one row per request)
    and, with `html`, report.html."""
    from pathlib import Path
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    with open(out / "requests.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    if html:
        write(out / "report.html", summary, rows)


def load_and_write(summary_path, out_path) -> None:
    """Re-render a report from a saved summary.json (and the requests.jsonl next to it)."""
    from pathlib import Path
    p = Path(summary_path)
    rows_p = p.with_name("requests.jsonl")
    rows = [json.loads(x) for x in rows_p.read_text().splitlines() if x.strip()] if rows_p.exists() else []
    write(out_path, json.loads(p.read_text()), rows)
