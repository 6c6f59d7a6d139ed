"""The sweep's numbers and its recommendation, from recorded runs (no server, no model).

What it does: `summarize_runs` turns the runs of a sweep (one per repeat x segment x concurrency x
profile, each with its metric dict) into one row per (segment, concurrency, profile): the TPOT speedup
over the baseline measured in the same repeat (baseline TPOT / profile TPOT, token-weighted), its
median over repeats and its spread (min, max), the same for output tokens/s, and medians of TPOT,
TTFT and acceptance. `recommend` picks per (segment, concurrency) the profile to serve:

1. best = the highest median speedup (the baseline counts, at exactly 1.0);
2. each profile is compared with the best *in the same repeat*: its speedup over the best's, per repeat
   both ran in (both speedups are over that repeat's baseline run, so the comparison of two profiles
   does not move with that run's noise); the noise of the (segment, concurrency) = the largest relative
   half-range (max - min) / 2 / median of those per-repeat ratios over the group's profiles (at least
   `min_noise`). The baseline's own ratio to the best is among them, so the band still holds the
   baseline runs' noise, as it must for "does anything beat the baseline". The machine's noise hits
   every profile measured side by side, and timing noise is multiplicative, so the band is a fraction;
3. every profile whose median ratio to the best is within the band (>= 1 - noise) is as good as the
   best (`within_noise`, what a re-run's pick is checked against);
4. among the profiles in the band's inner half (median ratio >= 1 - PICK_MARGIN x noise, PICK_MARGIN
   = 0.5) the one with the smallest k wins (the baseline has k = 0; an adaptive profile counts with
   its maximum k, and wins a tie of k against a constant one, since it can back off when acceptance
   falls); equal k: the higher median speedup over the baseline.

Why pooled: a rule that prefers the smaller k puts its pick at the edge of the band, so the band must
not depend on which two profiles are compared. With each pair's own half-ranges (two repeats each),
a re-run on the 2-core CPU picked another k in 2 of 6 cases; on those recorded runs the pooled,
relative band picks the same profile in 5 of 6, two new re-run pairs with it reproduced 5 of 6
each, both misses profiles that pruning had cut after one repeat (docs/benchmarks/sweep_cpu.json,
sweep_cpu_pooled_run1.json; docs/sweep-reproduction.md), and an unpruned pair on a quiet machine reproduced 6 of 6
(docs/benchmarks/sweep_cpu_unpruned.json).
Why paired with the best (session 20): up to then each profile's speedup over the baseline was compared
with the best's through their medians, and the band was the largest half-range of those speedups; on
the nine recorded re-run pairs (docs/benchmarks/sweep_cpu*.json, 54 (segment, concurrency) picks) that
rule reproduced 43 picks and the paired one 48 (3 pairs of 9 whole against 2), which is its fit to the
records it was chosen on; on a tenth pair (docs/benchmarks/sweep_cpu_s20.json), whose second sweep
finished after this rule was chosen, it reproduced 4 of 6 against 2 of 6, and on an eleventh, run
with it (sweep_cpu_s20b.json), 6 of 6 against 5 of 6, and on a twelfth, run with it
(sweep_cpu_s21.json), 4 of 6. Neither rule makes a 2-repeat sweep reproduce reliably on this 2-core
host: there the same request's TPOT through the server reads about 40-45 ms in some stretches and
60-67 ms in others (in-process 36-44 and 57-63 ms), and neighbouring k differ by about that noise
(docs/sweep-reproduction.md, which tables every recorded pair).

Why the inner half (session 22): a rule that takes the smallest k anywhere in the band puts its pick at
the band's edge, where a re-run's ratios, which move by about the band, more often leave it outside
the other sweep's band: on the 13 recorded pairs, with that rule, 28 of the 85 picks in their band's
outer half fell outside the other sweep's band (each sweep's pick checked against the other's band),
12 of the 71 in its inner half. Re-run picks within the first sweep's band: the smallest k in the
whole band 68 of 78 (5 pairs whole), the best median 76, and the smallest k in the inner half 75 (10
pairs whole), with picks a median 1.4% below the best's speedup instead of 7.8%; a wider band
(1.5-3x, or a floor of 10-15%) did not help (63-69 of 78), since it only moves the edge to a smaller k.
The margin was chosen on those records (margins 0, 0.25, 0.5, 0.75 and 1 of the band: 76, 76, 75, 71
and 68 picks; 0 is no preference for a smaller k at all, and 0.5 the widest margin that keeps 75), so
they are its fit; pairs run after it are its check (the first two, sweep_cpu_s22.json and
sweep_cpu_s22b.json: 6 of 6 each, the paired rule 4 and 6; docs/sweep-reproduction.md).

So speculation is recommended only where it beats the baseline by more than half the noise band, and a
deeper k only where it beats a shallower one by more than half the band. A band of 2 or more (possible
with three or more repeats and one wild one) puts every profile in the inner half, so the baseline is
recommended: such noise hides any gain. `consistent` checks a re-run against the first sweep's band.

`prune` is the sweep's successive-halving cut (Jamieson & Talwalkar 2016, one round): after the first
repeat of a (segment, concurrency), a profile whose speedup is more than a margin below the best one's
is not run again there; its row is marked `pruned` and it is never recommended (one repeat has no
spread to compare within).
What it does not do: run anything or draw anything (see `sweep.py`, `sweep_report.py`).
"""

from __future__ import annotations

import statistics
from typing import Any

BASELINE = "baseline"
# the pick may lie at most this fraction of the noise band below the best (step 4 of the module docstring)
PICK_MARGIN = 0.5


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _ratio(a: Any, b: Any) -> float | None:
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def summarize_runs(runs: list[dict], baseline: str = BASELINE) -> list[dict]:
    """Rows per (segment, concurrency, profile), in first-seen order.

    Args:
        runs: dicts with keys repeat, segment, concurrency, profile, and metrics (a `bench.metrics.summarize`
            dict: tpot_ms_agg, output_tps, tpot_ms_p50, ttft_ms_p50, acceptance_rate, mean_acceptance_length,
            acceptance_per_pos, num_errors).
        baseline: the profile the speedups are relative to.

    Returns:
        dicts with segment, concurrency, profile, repeats, speedup {median, min, max, values, by_repeat
        (repeat -> speedup)},
        tps_ratio {median, min, max}, tpot_ms, ttft_ms_p50, tpot_ms_p50, output_tps (medians),
        acceptance_rate, mean_acceptance_length, acceptance_per_pos (medians), errors (sum).
    """
    base = {(r["repeat"], r["segment"], r["concurrency"]): r["metrics"] for r in runs if r["profile"] == baseline}
    keys = list(dict.fromkeys((r["segment"], r["concurrency"], r["profile"]) for r in runs))
    out = []
    for seg, conc, prof in keys:
        rs = [r for r in runs if (r["segment"], r["concurrency"], r["profile"]) == (seg, conc, prof)]
        sp, tps = [], []
        by_repeat: dict[Any, float] = {}  # repeat -> speedup, to pair profiles measured in the same repeat
        for r in rs:
            b = base.get((r["repeat"], seg, conc))
            if b is None:
                continue
            s = _ratio(b.get("tpot_ms_agg"), r["metrics"].get("tpot_ms_agg"))
            t = _ratio(r["metrics"].get("output_tps"), b.get("output_tps"))
            if s is not None:
                sp.append(s)
                by_repeat[r["repeat"]] = s
            if t is not None:
                tps.append(t)

        def med(key: str) -> float | None:
            return _median([r["metrics"][key] for r in rs if isinstance(r["metrics"].get(key), (int, float))])

        per_pos = [r["metrics"].get("acceptance_per_pos") or [] for r in rs]
        depth = max(map(len, per_pos), default=0)
        out.append({
            "segment": seg, "concurrency": conc, "profile": prof, "repeats": len(rs),
            "speedup": {"median": _median(sp), "min": min(sp, default=None), "max": max(sp, default=None), "values": sp,
                        "by_repeat": by_repeat},
            "tps_ratio": {"median": _median(tps), "min": min(tps, default=None), "max": max(tps, default=None)},
            "tpot_ms": med("tpot_ms_agg"), "tpot_ms_p50": med("tpot_ms_p50"), "ttft_ms_p50": med("ttft_ms_p50"),
            "output_tps": med("output_tps"), "acceptance_rate": med("acceptance_rate"),
            "mean_acceptance_length": med("mean_acceptance_length"),
            "acceptance_per_pos": [_median([p[j] for p in per_pos if j < len(p)]) for j in range(depth)],
            "errors": sum(int(r["metrics"].get("num_errors") or 0) for r in rs),
        })
    return out


def prune(runs: list[dict], margin: float, baseline: str = BASELINE) -> dict[tuple[str, int], dict[str, float]]:
    """The profiles to drop after one repeat, per (segment, concurrency).

    Args:
        runs: the runs of one repeat (as `summarize_runs` takes them), the baseline's among them.
        margin: a fraction in [0, 1): a profile is dropped when its TPOT speedup is below
            (1 - margin) x the best speedup of its (segment, concurrency); the baseline counts at 1.0.
        baseline: the reference profile, never dropped.

    Returns:
        {(segment, concurrency): {dropped profile: its speedup}}; a group without a baseline run, and a
        profile without a speedup (no TPOT), drops nothing.

    Raises:
        ValueError: margin outside [0, 1).
    """
    if not 0 <= margin < 1:
        raise ValueError(f"the prune margin must be in [0, 1), got {margin}")
    out: dict[tuple[str, int], dict[str, float]] = {}
    for row in summarize_runs(runs, baseline):
        s = row["speedup"]["median"]
        if s is not None:
            out.setdefault((row["segment"], row["concurrency"]), {})[row["profile"]] = s
    cut = {}
    for key, speedups in out.items():
        if baseline not in speedups:
            continue
        best = max(speedups.values())
        dropped = {p: s for p, s in speedups.items() if p != baseline and s < (1 - margin) * best}
        if dropped:
            cut[key] = dropped
    return cut


def _relative_to(row: dict, best: dict) -> list[float]:
    """The row's speedup over the best's, per repeat both were measured in (both speedups are over the
    same baseline run, which therefore drops out of this comparison); the ratio of their medians when
    they share no repeat. Rows recorded before `by_repeat` existed pair their `values` by position
    (the repeat order, where no repeat lacked a speedup)."""
    def per_repeat(r: dict) -> dict:
        s = r["speedup"]
        return s["by_repeat"] if "by_repeat" in s else dict(enumerate(s["values"]))

    mine, theirs = per_repeat(row), per_repeat(best)
    pairs = [mine[k] / theirs[k] for k in mine if k in theirs and theirs[k]]
    if pairs:
        return pairs
    return [row["speedup"]["median"] / best["speedup"]["median"]] if best["speedup"]["median"] else [1.0]


def _band(row: dict, ratios: list[float]) -> float:
    """The row's contribution to the group's noise band: the relative half-range of its per-repeat
    ratios to the best; where it shares fewer than two repeats with the best (a run of the best that
    has no TPOT), that of its own speedups over repeats, so the band does not fall to the floor."""
    if len(ratios) >= 2:
        return _relative_half_range(ratios)
    return _relative_half_range([v for v in row["speedup"]["values"] if v is not None])


def _relative_half_range(values: list[float]) -> float:
    """(max - min) / 2 / median of `values`; 0 with fewer than two."""
    if len(values) < 2 or not statistics.median(values):
        return 0.0
    return (max(values) - min(values)) / 2 / statistics.median(values)


def recommend(rows: list[dict], profiles: dict[str, dict | None], min_noise: float = 0.0) -> list[dict]:
    """Per (segment, concurrency), the profile to serve (see the module docstring).

    Args:
        rows: `summarize_runs` output; rows with a true `pruned` are left out (see `prune`).
        profiles: name -> speculative config dict (None = no speculation), for k and the schedule.
        min_noise: smallest noise band, a fraction of the best's median (0.02 = 2%).

    Returns:
        dicts: segment, concurrency, profile, speedup (its median), spread [min, max], best (the
        profile with the highest median), best_speedup, noise (the pooled relative band used),
        pick_margin (PICK_MARGIN x noise: how far below the best the pick may lie), within_noise
        (profiles as good as the best), reason (one line), pruned (profiles left out after the first
        repeat).
    """
    def k_key(name: str) -> tuple[int, int]:
        cfg = profiles.get(name)
        if not cfg:
            return (0, 0)
        adaptive = cfg.get("num_speculative_tokens_schedule") == "adaptive"
        return (int(cfg.get("num_speculative_tokens", 0)), 0 if adaptive else 1)

    out = []
    for seg, conc in dict.fromkeys((r["segment"], r["concurrency"]) for r in rows):
        mine = [r for r in rows if (r["segment"], r["concurrency"]) == (seg, conc)]
        group = [r for r in mine if r["speedup"]["median"] is not None and not r["errors"] and not r.get("pruned")]
        if not group:
            continue
        best = max(group, key=lambda r: r["speedup"]["median"])
        rel = {r["profile"]: _relative_to(r, best) for r in group}
        ratio = {p: statistics.median(v) for p, v in rel.items()}  # median ratio to the best
        noise = max([min_noise] + [_band(r, rel[r["profile"]]) for r in group])
        close = [r for r in group if ratio[r["profile"]] >= 1 - noise]
        margin = PICK_MARGIN * noise
        inner = [r for r in close if ratio[r["profile"]] >= 1 - margin]
        pick = min(inner, key=lambda r: (k_key(r["profile"]), -r["speedup"]["median"]))
        if pick is best:
            why = "highest median TPOT speedup"
        elif pick["profile"] == BASELINE:
            why = f"no profile beats the baseline by more than half the noise band (best {best['profile']})"
        else:
            why = f"within half the noise band of the best ({best['profile']}) with a smaller k"
        out.append({"segment": seg, "concurrency": conc, "profile": pick["profile"],
                    "speedup": pick["speedup"]["median"], "spread": [pick["speedup"]["min"], pick["speedup"]["max"]],
                    "best": best["profile"], "best_speedup": best["speedup"]["median"], "noise": noise,
                    "pick_margin": margin, "within_noise": [r["profile"] for r in close], "reason": why,
                    "pruned": [r["profile"] for r in mine if r.get("pruned")]})
    return out


def consistent(first: list[dict], again: list[dict]) -> dict:
    """Does a re-run's recommendation reproduce the first one within its reported spread? Per (segment,
    concurrency): yes when the re-run picks a profile the first run found as good as its best
    (`within_noise`). Returns {"all": bool, "by_key": {"segment c=N": {first, again, ok}}}."""
    by_key = {}
    picks = {(r["segment"], r["concurrency"]): r for r in again}
    for r in first:
        a = picks.get((r["segment"], r["concurrency"]))
        ok = a is not None and a["profile"] in r["within_noise"]
        by_key[f"{r['segment']} c={r['concurrency']}"] = {"first": r["profile"], "again": a and a["profile"], "ok": ok}
    return {"all": bool(by_key) and all(v["ok"] for v in by_key.values()), "by_key": by_key}


def recommended_profiles(recs: list[dict], profiles: dict[str, dict | None]) -> dict:
    """A `serve --profiles` file: baseline (weight 1) plus every recommended speculative profile (weight 0,
    to be routed by an operator or raised with PUT /admin/weights)."""
    names = [BASELINE] + [n for n in dict.fromkeys(r["profile"] for r in recs) if n != BASELINE]
    return {"profiles": {n: profiles.get(n) for n in names}, "weights": {BASELINE: 1.0}}
