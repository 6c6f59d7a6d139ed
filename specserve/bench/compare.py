"""Baseline vs candidate comparisons, within one benchmark and across two summary files.

What it does: pairs groups (profile x load, averaged over repeats) with the baseline (the first
profile) at the same load and, per segment and overall, gives both values and the ratio
candidate / baseline of each key metric, a headline `speedup` = baseline `tpot_ms_agg` / candidate
`tpot_ms_agg` (decode time per output token, so > 1 means the candidate generates faster), and
`greedy_match` = [identical outputs, compared] over temperature-0 requests of the first repeat;
`profile_rows` flattens that into one row per (segment, profile) for the demo's table.
Every comparison carries `warnings` (sentences every output shows next to it) and `comparable`
(False when a warning says its speed ratios are not like for like): different error rates (a
candidate whose requests failed more often is never called faster without one), a profile no
response confirmed (UNVERIFIED) or contradicted, acceptance from a server-wide /metrics delta, and,
across two files, different workloads or request settings.
What it does not do: judge significance (look at `spread` over `--repeats` for that).
"""
from __future__ import annotations

import json
from pathlib import Path

from specserve.bench import metrics
from specserve.bench.checks import SERVER_WIDE

KEYS = ("output_tps", "request_tps", "ttft_ms_p50", "tpot_ms_p50", "tpot_ms_agg", "itl_token_ms_p50",
        "e2e_ms_p50", "e2e_ms_p99", "error_rate", "acceptance_rate", "mean_acceptance_length")


def ratio(c, b):
    """c / b, or None when either is missing or b is 0."""
    return c / b if isinstance(c, (int, float)) and isinstance(b, (int, float)) and b else None


def compare_metrics(base: dict, cand: dict) -> dict:
    """{'baseline': {k: v}, 'candidate': {k: v}, 'ratio': {k: cand/base}, 'speedup': float|None}."""
    b = {k: base.get(k) for k in KEYS}
    c = {k: cand.get(k) for k in KEYS}
    return {"baseline": b, "candidate": c, "ratio": {k: ratio(c[k], b[k]) for k in KEYS},
            "speedup": ratio(b["tpot_ms_agg"], c["tpot_ms_agg"])}


def greedy_match(rows: list[dict], base: str, cand: str, load: str) -> dict[str, list[int]]:
    """{segment: [identical, compared]} (plus '_overall') over temperature-0 requests of repeat 0."""
    def pick(p):
        return {r["sample_id"]: r for r in rows if r.get("profile") == p and r.get("load") == load
                and r.get("repeat", 0) == 0 and not r.get("error") and (r.get("temperature") or 0) == 0}
    bm, cm = pick(base), pick(cand)
    out: dict[str, list[int]] = {"_overall": [0, 0]}
    for sid in sorted(bm.keys() & cm.keys()):
        seg = bm[sid]["segment"]
        same = int(bm[sid].get("text") == cm[sid].get("text"))
        for key in (seg, "_overall"):
            out.setdefault(key, [0, 0])
            out[key][0] += same
            out[key][1] += 1
    return out


NOT_LIKE_FOR_LIKE = ("error_rate", "profile_unverified", "workload_differs")  # warning kinds that void a ratio
SAME_WORKLOAD_KEYS = ("dataset", "num_prompts", "seed", "max_tokens", "max_prompt_chars", "output_len", "ignore_eos")


def pair_warnings(bg: dict, cg: dict, base: str, cand: str) -> list[dict]:
    """What makes candidate group `cg` vs baseline group `bg` not like for like: [{"kind", "message"}]."""
    out = []
    eb, ec = bg["overall"].get("error_rate") or 0.0, cg["overall"].get("error_rate") or 0.0
    if ec > eb:
        out.append({"kind": "error_rate", "message": f"{cand} has more failed requests than {base} ({ec:.1%} vs "
                                                     f"{eb:.1%}): its speed is measured over fewer requests, so "
                                                     "it is not called faster"})
    elif eb > ec:
        out.append({"kind": "error_rate", "message": f"{base} has more failed requests than {cand} ({eb:.1%} vs "
                                                     f"{ec:.1%}): the speed ratios compare different sets of "
                                                     "requests"})
    unconfirmed = [f"{name} {g['profile_check'].upper()}" for name, g in ((base, bg), (cand, cg))
                   if g.get("profile_check") in ("unverified", "mismatch")]
    if unconfirmed:
        out.append({"kind": "profile_unverified",
                    "message": f"profile {', '.join(unconfirmed)} (the responses did not confirm the profile that "
                               "served them): the two sides may be the same configuration"})
    if any(g["overall"].get("acceptance_source") == "metrics_delta" and g["overall"].get("acceptance_rate") is not None
           for g in (bg, cg)):
        out.append({"kind": "acceptance_server_wide",
                    "message": f"acceptance from the server's /metrics delta: {SERVER_WIDE}"})
    return out


def workload_warnings(a: dict, b: dict) -> list[dict]:
    """Two summaries that did not send the same requests (model, dataset, seed, lengths...)."""
    ca, cb = a.get("config") or {}, b.get("config") or {}
    diff = [f"{k} ({ca.get(k)!r} vs {cb.get(k)!r})" for k in SAME_WORKLOAD_KEYS if ca.get(k) != cb.get(k)]
    if a.get("model") != b.get("model"):
        diff.insert(0, f"model ({a.get('model')!r} vs {b.get('model')!r})")
    if not diff:
        return []
    return [{"kind": "workload_differs", "message": "the two runs differ in " + ", ".join(diff)
             + ": they did not send the same requests, so their ratios are not like for like"}]


def _compare_pair(bg: dict, cg: dict, rows: list[dict] | None, base_name=None, cand_name=None,
                  extra_warnings=()) -> dict:
    segs = [s for s in bg["segments"] if s in cg["segments"]]
    gm = greedy_match(rows, bg["profile"], cg["profile"], bg["load"]) if rows else {}
    base, cand = base_name or bg["profile"], cand_name or cg["profile"]
    warnings = pair_warnings(bg, cg, base, cand) + list(extra_warnings)
    out = {"baseline": base, "candidate": cand, "load": bg["load"],
           "comparable": not any(w["kind"] in NOT_LIKE_FOR_LIKE for w in warnings),
           "warnings": warnings, "overall": compare_metrics(bg["overall"], cg["overall"]),
           "segments": {s: compare_metrics(bg["segments"][s], cg["segments"][s]) for s in segs}}
    out["overall"]["greedy_match"] = gm.get("_overall")
    for s in segs:
        out["segments"][s]["greedy_match"] = gm.get(s)
    return out


def compare_groups(groups: list[dict], rows: list[dict] | None = None) -> list[dict]:
    """Every non-baseline profile against the first profile, load by load."""
    if not groups:
        return []
    base_profile = groups[0]["profile"]
    out = []
    for cg in groups:
        if cg["profile"] == base_profile:
            continue
        bg = next((g for g in groups if g["profile"] == base_profile and g["load"] == cg["load"]), None)
        if bg:
            out.append(_compare_pair(bg, cg, rows))
    return out


def _load_rows(summary_path: Path) -> list[dict]:
    p = summary_path.with_name("requests.jsonl")
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()] if p.exists() else []


def compare_files(path_a: str, path_b: str) -> list[dict]:
    """Compare summary B against summary A (the baseline), pairing groups by load.

    When A and B hold the same profiles, each profile is compared with itself (e.g. two server
    versions); otherwise A's first profile is the baseline for every profile of B. Greedy matches
    are counted when `requests.jsonl` sits next to both summaries.
    """
    pa, pb = Path(path_a), Path(path_b)
    a, b = json.loads(pa.read_text()), json.loads(pb.read_text())
    ra, rb = _load_rows(pa), _load_rows(pb)
    same_profiles = {g["profile"] for g in a["groups"]} == {g["profile"] for g in b["groups"]}
    base_profile = a["groups"][0]["profile"] if a["groups"] else None
    out = []
    for cg in b["groups"]:
        want = cg["profile"] if same_profiles else base_profile
        bg = next((g for g in a["groups"] if g["profile"] == want and g["load"] == cg["load"]), None)
        if not bg:
            continue
        rows = [{**r, "profile": "A"} for r in ra if r.get("profile") == want] + \
               [{**r, "profile": "B"} for r in rb if r.get("profile") == cg["profile"]]
        comp = _compare_pair({**bg, "profile": "A"}, {**cg, "profile": "B"}, rows,
                             f"{pa.parent.name or pa.name}:{want}", f"{pb.parent.name or pb.name}:{cg['profile']}",
                             workload_warnings(a, b))
        out.append(comp)
    return out


def _request_rate(rows: list[dict]) -> float | None:
    """Output tokens / summed request time (send to last token), over successful requests: the speed one
    request sees (equals throughput at concurrency 1, and is not diluted by other segments' requests)."""
    ok = [r for r in rows if metrics.ok(r)]
    secs = sum(metrics.e2e_ms(r) for r in ok) / 1000
    toks = sum(r.get("output_tokens") or 0 for r in ok)
    return toks / secs if secs > 0 else None


def _int(x):
    return int(x) if isinstance(x, float) and x.is_integer() else x


def profile_rows(summary: dict, rows: list[dict]) -> list[dict]:
    """One row per (load, segment incl. 'all', profile) of a run's summary and requests: TPOT, tokens/s
    (output tokens / summed request time, repeat 0) and their ratios to the baseline (the speedup and
    greedy matches are those of `compare_groups`; `comparable` False when its warnings void them),
    acceptance (`acceptance_server_wide` when from a /metrics delta), the profile check. The demo's table."""
    groups = summary["groups"]
    base = groups[0]["profile"]
    comps = {(c["candidate"], c["load"]): c for c in summary.get("comparisons") or []}
    out = []
    for load in dict.fromkeys(g["load"] for g in groups):
        gs = [g for g in groups if g["load"] == load]
        for seg in list(dict.fromkeys(s for g in gs for s in g["segments"])) + ["all"]:
            def rate(profile):
                return _request_rate([r for r in rows if r["profile"] == profile and r["load"] == load
                                      and r.get("repeat", 0) == 0 and (seg == "all" or r["segment"] == seg)])
            base_rate = rate(base)
            for g in gs:
                m = g["overall"] if seg == "all" else g["segments"].get(seg)
                if m is None:
                    continue
                c = comps.get((g["profile"], load))
                cm = (c["overall"] if seg == "all" else c["segments"].get(seg, {})) if c else {}
                tps = rate(g["profile"])
                out.append({
                    "load": load, "segment": seg, "profile": g["profile"], "requests": _int(m.get("num_requests")),
                    "errors": _int(m.get("num_errors")), "output_tokens": _int(m.get("output_tokens")),
                    "tpot_ms": m.get("tpot_ms_agg"), "tokens_per_s": tps, "speedup_tpot": cm.get("speedup"),
                    "tokens_per_s_ratio": None if g["profile"] == base else ratio(tps, base_rate),
                    "acceptance_rate": m.get("acceptance_rate"),
                    "mean_acceptance_length": m.get("mean_acceptance_length"),
                    "acceptance_server_wide": m.get("acceptance_source") == "metrics_delta",
                    "greedy_match": cm.get("greedy_match"), "profile_check": g.get("profile_check"),
                    "comparable": c["comparable"] if c else None,
                })
    return out
