"""Benchmark metrics, exactly as docs/design.md section 5 defines them, over per-request records.

A record (see `client.RequestRecord`, or any dict with the same keys) holds `chunks`: one
`[t_ms, tokens]` pair per token-bearing chunk, `t_ms` measured from the moment the request was sent.
- TTFT = first chunk's t_ms; E2E = `last_chunk_ms`, the stream's last chunk that carried a choice,
  whatever its text (a stream that ends on EOS ends with an empty chunk); records without it (saved
  before it existed) use the last token-bearing chunk (ms).
- TPOT = (E2E - TTFT) / (output_tokens - 1) (ms); undefined (left out) for one-token outputs.
  `tpot_ms_agg` = sum(E2E - TTFT) / sum(output_tokens - 1): the token-weighted TPOT of a group.
- ITL per chunk: gaps between consecutive token-bearing chunks (ms).
  ITL per token: each gap divided by the tokens its chunk carries, weighted by those tokens (ms);
  a chunk counted as carrying 0 tokens passes its gap on to the next chunk that carries some. It is
  exact only when every record's `token_count_source` is an exact count (`itl_token_exact`); otherwise
  it is an ESTIMATE (tokens spread evenly over chunks) and every output says so.
- Output tokens = `usage.completion_tokens`; when the server sent no usage, the per-chunk counts
  (exact with logprobs; with neither, one token per chunk: an estimate, `output_tokens_exact` False).
- Percentiles P50/P90/P95/P99 over requests (TTFT, TPOT, E2E); ITL percentiles pool every gap of
  every request. Throughput = tokens (or successful requests) / wall time of the run (tokens/s, req/s).
- Acceptance rate = accepted / draft tokens; mean acceptance length = 1 + accepted / drafts;
  per-position rate_i = accepted at position i / drafts (docs/design.md section 2).
What it does not do: send requests or scrape servers; it only computes.
"""
from __future__ import annotations

import math
import statistics

import numpy as np

PCTS = (50, 90, 95, 99)
EXACT_SOURCES = ("usage", "logprobs")  # token_count_source values that are counts, not estimates
SPREAD_KEYS = ("output_tps", "request_tps", "goodput_rps", "ttft_ms_p50", "tpot_ms_p50", "itl_token_ms_p50",
               "e2e_ms_p50", "acceptance_rate", "mean_acceptance_length")


def _get(rec, key, default=None):
    return rec.get(key, default) if isinstance(rec, dict) else getattr(rec, key, default)


def ok(rec) -> bool:
    return not _get(rec, "error") and bool(_get(rec, "chunks"))


def ttft_ms(rec) -> float:
    return float(_get(rec, "chunks")[0][0])


def e2e_ms(rec) -> float:
    last = _get(rec, "last_chunk_ms")
    return float(last if last is not None else _get(rec, "chunks")[-1][0])


def output_tokens(rec) -> float:
    n = _get(rec, "output_tokens")
    return float(n) if n is not None else float(sum(c[1] for c in _get(rec, "chunks") or []))


def tpot_ms(rec) -> float | None:
    n = output_tokens(rec)
    return (e2e_ms(rec) - ttft_ms(rec)) / (n - 1) if n > 1 else None


def itl_per_chunk(rec) -> list[float]:
    t = [c[0] for c in _get(rec, "chunks")]
    return [b - a for a, b in zip(t, t[1:])]


def itl_per_token(rec) -> list[tuple[float, float]]:
    """(ms per token, weight in tokens) for every chunk after the first."""
    out, chunks = [], _get(rec, "chunks")
    last = chunks[0][0]
    for t, n in chunks[1:]:
        if n > 0:
            out.append(((t - last) / n, float(n)))
            last = t
    return out


def percentiles(values, weights=None, prefix: str = "") -> dict:
    """{prefix+'mean', prefix+'p50', ... 'p99'}; NaN-free: None when there are no values.

    With `weights`, the percentile is of the distribution where value i occurs weights[i] times
    (inverted weighted CDF, so integer weights give the same answer as repeating the values).
    """
    keys = ["mean"] + [f"p{p}" for p in PCTS]
    if not len(values):
        return {prefix + k: None for k in keys}
    v = np.asarray(values, dtype=float)
    if weights is None:
        res = [float(v.mean())] + [float(x) for x in np.percentile(v, PCTS)]
    else:
        w = np.asarray(weights, dtype=float)
        order = np.argsort(v, kind="stable")
        v, w = v[order], w[order]
        cum = np.cumsum(w)
        res = [float((v * w).sum() / w.sum())]
        for p in PCTS:  # nearest-rank on the weighted CDF, interpolated like numpy's "linear" on repeats
            rank = p / 100 * (cum[-1] - 1)
            lo = min(int(np.searchsorted(cum, math.floor(rank) + 1)), len(v) - 1)
            hi = min(int(np.searchsorted(cum, math.ceil(rank) + 1)), len(v) - 1)
            res.append(float(v[lo] + (v[hi] - v[lo]) * (rank - math.floor(rank))))
    return {prefix + k: r for k, r in zip(keys, res)}


def acceptance_from_responses(records) -> dict:
    """Acceptance summed over the per-response `specserve` numbers of successful records; {} if none."""
    d = n = a = 0
    pos: list[int] = []
    seen = False
    for rec in records:
        s = _get(rec, "specserve")
        if not ok(rec) or not s or s.get("num_drafts") is None:
            continue
        seen = True
        d += int(s["num_drafts"])
        n += int(s.get("num_draft_tokens") or 0)
        a += int(s.get("num_accepted_tokens") or 0)
        for i, x in enumerate(s.get("num_accepted_tokens_per_pos") or []):
            pos += [0] * (i + 1 - len(pos))
            pos[i] += int(x)
    return acceptance_from_counts(d, n, a, pos, "response") if seen else {}


def acceptance_from_counts(drafts: float, draft_tokens: float, accepted: float, per_pos, source: str) -> dict:
    """Acceptance metrics from raw counters (drafts, draft tokens, accepted tokens, accepted per position)."""
    return {
        "acceptance_source": source, "num_drafts": drafts, "num_draft_tokens": draft_tokens,
        "num_accepted_tokens": accepted, "num_accepted_tokens_per_pos": list(per_pos),
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "acceptance_per_pos": [x / drafts for x in per_pos] if drafts else [],
    }


def meets_slo(rec, slo: dict) -> bool:
    """True when a successful request meets every SLO in `slo` ({'ttft'|'tpot'|'e2e'|'itl': ms})."""
    if not ok(rec):
        return False
    vals = {"ttft": ttft_ms(rec), "e2e": e2e_ms(rec), "tpot": tpot_ms(rec),
            "itl": max(itl_per_chunk(rec), default=None)}
    return all(vals[k] is None or vals[k] <= lim for k, lim in slo.items())


def wall_of(records) -> float:
    """Seconds from the first send to the last token-bearing chunk of these records."""
    rs = [r for r in records if _get(r, "chunks")]
    if not rs:
        return 0.0
    start = min(_get(r, "send_time_s") for r in records)
    return max(_get(r, "send_time_s") + e2e_ms(r) / 1000 for r in rs) - start


def busy_time_of(records) -> float:
    """Seconds during which at least one of these records was in flight (the union of their
    [send, last token-bearing chunk] intervals). A segment's throughput in a mixed run is its tokens
    over this time, so other segments' requests interleaved with it do not count against it; at
    concurrency 1 it is the sum of its requests' E2E latencies."""
    spans = sorted((_get(r, "send_time_s"), _get(r, "send_time_s") + e2e_ms(r) / 1000)
                   for r in records if _get(r, "chunks"))
    total, cur_start, cur_end = 0.0, None, None
    for a, b in spans:
        if cur_end is None or a > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = a, b
        else:
            cur_end = max(cur_end, b)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def summarize(records, wall_s: float | None = None, slo: dict | None = None) -> dict:
    """Flat metric dict for a group of records; `wall_s` defaults to `wall_of(records)` (s)."""
    records = list(records)
    good = [r for r in records if ok(r)]
    wall = wall_s if wall_s is not None else wall_of(records)
    out_tok = sum(output_tokens(r) for r in good)
    n_chunks = sum(len(_get(r, "chunks")) for r in good)
    m = {
        "num_requests": len(records), "num_ok": len(good), "num_errors": len(records) - len(good),
        "error_rate": (len(records) - len(good)) / len(records) if records else None,
        "output_tokens": out_tok, "input_tokens": sum(_get(r, "input_tokens") or 0 for r in good),
        "wall_s": wall, "output_tps": out_tok / wall if wall > 0 else None,
        "request_tps": len(good) / wall if wall > 0 else None,
        "tokens_per_chunk": out_tok / n_chunks if n_chunks else None,
        "token_count_sources": sorted({_get(r, "token_count_source") or "?" for r in good}),
        "itl_token_exact": all(_get(r, "token_count_source") in EXACT_SOURCES for r in good),
        "output_tokens_exact": all(_get(r, "output_tokens") is not None
                                   or _get(r, "token_count_source") in EXACT_SOURCES for r in good),
    }
    m.update(percentiles([ttft_ms(r) for r in good], prefix="ttft_ms_"))
    m.update(percentiles([x for x in map(tpot_ms, good) if x is not None], prefix="tpot_ms_"))
    multi = [r for r in good if output_tokens(r) > 1]
    dec_tok = sum(output_tokens(r) - 1 for r in multi)
    m["tpot_ms_agg"] = sum(e2e_ms(r) - ttft_ms(r) for r in multi) / dec_tok if dec_tok else None
    m.update(percentiles([g for r in good for g in itl_per_chunk(r)], prefix="itl_chunk_ms_"))
    pt = [vw for r in good for vw in itl_per_token(r)]
    m.update(percentiles([v for v, _ in pt], [w for _, w in pt], prefix="itl_token_ms_"))
    m.update(percentiles([e2e_ms(r) for r in good], prefix="e2e_ms_"))
    if slo:
        n_good = sum(meets_slo(r, slo) for r in records)
        m["slo"] = dict(slo)
        m["goodput_rps"] = n_good / wall if wall > 0 else None
        m["slo_attainment"] = n_good / len(records) if records else None
    m.update(acceptance_from_responses(records))
    return m


def aggregate(runs: list[dict]) -> dict:
    """Mean over repeats of each numeric metric (lists element-wise), flags true only when true in every
    repeat, other values from the first repeat, plus `spread` {key: [min, max, stdev]}."""
    if not runs:
        return {}
    out: dict = {"num_repeats": len(runs)}
    for k, v in runs[0].items():
        vals = [r.get(k) for r in runs]
        if all(isinstance(x, bool) for x in vals):
            out[k] = all(vals)  # e.g. itl_token_exact: exact only when every repeat was
        elif all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in vals):
            out[k] = statistics.fmean(vals)
        elif all(isinstance(x, list) and x and all(isinstance(y, (int, float)) for y in x) for x in vals):
            n = max(map(len, vals))
            out[k] = [statistics.fmean([x[i] if i < len(x) else 0.0 for x in vals]) for i in range(n)]
        else:
            out[k] = v
    out["spread"] = {}
    for k in SPREAD_KEYS:
        vals = [r[k] for r in runs if isinstance(r.get(k), (int, float))]
        if vals:
            out["spread"][k] = [min(vals), max(vals), statistics.stdev(vals) if len(vals) > 1 else 0.0]
    return out
