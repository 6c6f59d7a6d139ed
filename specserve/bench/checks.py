"""What could make a benchmark run mislead, found and worded once, for every output to show.

What it does: from a finished run (its runs, groups and per-request rows), lists **problems** (the
numbers are not what their labels say: `specserve bench` exits 1 unless the user allowed them) and
**warnings** (labels every output must carry), each `{"kind", "message"}`:
- `failed`: measured requests that failed (a problem unless `--allow-errors`); `warmup_failed`:
  warm-up requests that failed while `--allow-errors` let the run go on; `prime_failed` (a warning):
  requests that prime the prefix cache before a run (`client.prime_prompts`) failed; `suffix_replay`
  (a warning): a profile the server runs with a suffix tree ran the same prompts more than once, so
  its later runs may replay its earlier answers; `not_primed` (a warning): runs of several profiles
  without the priming (`--no-prime`), so the first profile to send a prompt paid its prefill;
  `implausible_speedup` (a warning): at concurrency 1, a TPOT speedup above IMPLAUSIBLE_MARGIN x what
  the candidate's accepted tokens allow (`_bound`: tokens per step, every step costing at least a
  decode), against a reference that drafted nothing: the reference's run was slowed by something else
  (other load on the machine, a colder cache);
- `profile_unverified`: `--profile` was given but no response named the profile that served it (vLLM
  answers 200 to a `profile` field and an `x-specserve-profile` header and ignores both), so runs
  labelled with different profiles may be the same configuration (a problem unless
  `--allow-unverified-profile`); `profile_mismatch`: a response named another profile (a problem);
- `itl_estimate` / `output_tokens_estimate`: per-chunk token counts (or output token counts) that
  are estimates, not counts (`client.py`);
- `acceptance_server_wide`: acceptance taken from the server's /metrics delta around a run, which
  includes every other client's traffic;
- `ignore_eos_not_honoured`: with `--ignore-eos`, outputs that ended before max_tokens;
  `max_tokens_exceeded`: outputs longer than the max_tokens sent (a server that ignores the field).
The console, summary.json and report.html show these same sentences.
What it does not do: compute metrics or print anything.
"""
from __future__ import annotations

from specserve.bench.metrics import ok

SERVER_WIDE = "server-wide, includes other traffic"
IMPLAUSIBLE_MARGIN = 1.2  # speedup / `_bound` above this: not speculation's doing (noise allowed for)
IMPLAUSIBLE_MIN_MS = 2000.0  # the reference's decode time (TPOT x tokens) below which timer jitter rules


def profile_check(records, profile: str | None) -> dict:
    """How far the responses confirm the requested profile: {"status", "named", "unnamed", "mismatched"}.

    status: None (no profile requested), "verified" (every successful response named it),
    "mismatch" (some named another), "unverified" (some named none, none named another).
    """
    good = [r for r in records if ok(r)]
    named = [r for r in good if _get(r, "served_profile")]
    mismatched = sum(1 for r in named if _get(r, "served_profile") != profile)
    out = {"status": None, "named": len(named), "unnamed": len(good) - len(named), "mismatched": mismatched}
    if profile:
        out["status"] = "mismatch" if mismatched else ("unverified" if len(named) < len(good) else "verified")
    return out


def worst_status(statuses) -> str | None:
    """The least trustworthy of several profile_check statuses."""
    for s in ("mismatch", "unverified", "verified"):
        if s in statuses:
            return s
    return None


def _get(rec, key):
    return rec.get(key) if isinstance(rec, dict) else getattr(rec, key, None)


def _names(groups, pred) -> str:
    return ", ".join(dict.fromkeys(f"{g['profile']} {g['load']}" for g in groups if pred(g)))


def _bound(m: dict) -> float | None:
    """The most a speculative group's TPOT can gain over plain decoding from its own acceptance, if
    every step cost what a plain decode step costs: output tokens after the first (D = output tokens -
    successful requests) over the steps that committed them (D - accepted tokens; every step commits 1
    plus its accepted drafts, whether it drafted or not). None without per-response acceptance."""
    if m.get("acceptance_source") == "metrics_delta":  # server-wide: other traffic's acceptance
        return None
    d = (m.get("output_tokens") or 0) - (m.get("num_ok") or 0)
    a = m.get("num_accepted_tokens")
    if a is None or d <= 0 or a >= d:
        return None
    return d / (d - a)


def _implausible(summary: dict) -> list[str]:
    """'profile load segment: speedup, bound' for every comparison at concurrency 1 (overall and per
    segment) whose TPOT speedup exceeds IMPLAUSIBLE_MARGIN x `_bound` of the candidate, when the
    reference drafted nothing, the prompts were primed and the reference decoded for at least
    IMPLAUSIBLE_MIN_MS there (a few tokens of a tiny model take ~1 ms each, and one scheduling hiccup
    then reads as a 40x speedup). Concurrency 1 only: with more requests in
    flight a candidate's requests can decode in smaller, cheaper batches than the reference's (its
    other requests finished sooner), which no acceptance figure bounds."""
    groups = {(g["profile"], g["load"]): g for g in summary.get("groups", [])}
    primed = all(r.get("primed", True) for r in summary.get("runs", []))
    out = []
    for c in summary.get("comparisons") or []:
        g, ref = groups.get((c["candidate"], c["load"])), groups.get((c["baseline"], c["load"]))
        if g is None or ref is None or g.get("concurrency", 1) != 1 or not primed or ref["overall"].get("num_drafts"):
            continue
        for seg, cm in [("all", c["overall"]), *c.get("segments", {}).items()]:
            m = g["overall"] if seg == "all" else g["segments"].get(seg, {})
            r = ref["overall"] if seg == "all" else ref["segments"].get(seg, {})
            decode_ms = (r.get("tpot_ms_agg") or 0.0) * ((r.get("output_tokens") or 0) - (r.get("num_ok") or 0))
            if decode_ms < IMPLAUSIBLE_MIN_MS:
                continue
            sp, bound = cm.get("speedup"), _bound(m)
            if sp is not None and bound is not None and sp > IMPLAUSIBLE_MARGIN * bound:
                out.append(f"{c['candidate']} {c['load']} {seg}: {sp:.2f}x where its acceptance allows at most "
                           f"{bound:.2f}x")
    return out


def evaluate(summary: dict, rows: list[dict], *, allow_errors: bool = False, allow_unverified_profile: bool = False,
             ignore_eos: bool = False) -> tuple[list[dict], list[dict]]:
    """(problems, warnings) of a finished run; see the module docstring for the kinds."""
    problems: list[dict] = []
    warnings: list[dict] = []
    groups = summary["groups"]

    def add(kind: str, message: str, problem: bool) -> None:
        (problems if problem else warnings).append({"kind": kind, "message": message})

    failed = [r for r in rows if r.get("error")]
    if failed:
        add("failed", f"FAILED: {len(failed)} of {len(rows)} measured requests failed "
                      f"({len(failed) / len(rows):.1%}); first error: {failed[0]['error']}"
                      + ("" if allow_errors else " (pass --allow-errors to accept a run with failed requests)"),
            not allow_errors)
    warm_bad = {p: w["failed"] for p, w in (summary.get("warmup") or {}).get("profiles", {}).items() if w["failed"]}
    if warm_bad:
        add("warmup_failed", "warm-up requests failed (allowed by --allow-errors): "
                             + ", ".join(f"{n} for profile {p}" for p, n in warm_bad.items()), False)
    configs = summary.get("server_speculative_configs") or {}
    suffix = sorted(n for n, c in configs.items() if c and c.get("method") == "suffix")
    runs_per = {}
    for r in summary.get("runs", []):
        runs_per[r["profile"]] = runs_per.get(r["profile"], 0) + 1
    replayed = [p for p in runs_per if runs_per[p] > 1 and (p in suffix or (p == "default" and suffix))]
    if replayed:
        add("suffix_replay", f"SUFFIX REPLAY: {', '.join(replayed)} may use a suffix tree ({', '.join(suffix)}), "
                             "which keeps the outputs of finished requests: its later runs of the same prompts "
                             "(every load and repeat sends them again) can replay earlier answers and read "
                             "too fast; trust its first run, or use `specserve sweep` (fresh prompts per "
                             "repeat, its own tree per profile)", False)
    prime_bad = [r for r in summary.get("runs", []) if r.get("prime_failed")]
    if prime_bad:
        add("prime_failed", "priming requests failed before "
                            + ", ".join(f"{r['profile']} {r['load']} #{r['repeat']} ({r['prime_failed']})" for r in prime_bad)
                            + ": those runs may have met a colder prefix cache than the others", False)
    cold = [r for r in summary.get("runs", []) if r.get("primed") is False]
    if cold and len(summary.get("runs", [])) > 1:
        add("not_primed", "NOT PRIMED (--no-prime): the first run to send a prompt paid its prefill, in its "
                          "TTFT and, at concurrency > 1, in the other requests' TPOT; later runs (other profiles, "
                          "loads, repeats) met those prompts in the prefix cache", False)
    implausible = _implausible(summary)
    if implausible:
        add("implausible_speedup", f"IMPLAUSIBLE: TPOT speedup more than {IMPLAUSIBLE_MARGIN}x above what the "
                                   "accepted tokens allow (" + "; ".join(implausible) + "; each step commits 1 + its "
                                   "accepted tokens and costs at least a plain decode step), so the reference's run "
                                   "was slowed by something else (other load on the machine, a colder cache); rerun "
                                   "on a quiet machine (`specserve bench --repeats N` shows the spread)", False)
    mism = [g for g in groups if g.get("profile_check") == "mismatch"]
    if mism:
        add("profile_mismatch", f"PROFILE MISMATCH: responses named another profile than requested in "
                                f"{_names(mism, lambda g: True)}; see served_profile in requests.jsonl", True)
    unver = [g for g in groups if g.get("profile_check") == "unverified"]
    if unver:
        add("profile_unverified",
            f"UNVERIFIED: no response named the profile that served it ({_names(unver, lambda g: True)}): the "
            "server ignores or does not report profiles (vLLM answers 200 to a `profile` field and to the "
            "x-specserve-profile header and ignores both), so runs labelled with different profiles may be "
            "the same configuration" + ("" if allow_unverified_profile else
                                        " (pass --allow-unverified-profile if this server cannot report it)"),
            not allow_unverified_profile)
    est = _names(groups, lambda g: g["overall"].get("itl_token_exact") is False)
    if est:
        add("itl_estimate", f"ESTIMATE: per-token ITL of {est} is an estimate, not a measurement: the server sent "
                            "no per-chunk token counts (neither usage on every chunk, vLLM's "
                            "stream_options.continuous_usage_stats, nor logprobs), so each request's tokens were "
                            "spread evenly over its chunks; rerun with --logprobs for exact counts (TTFT, TPOT "
                            "and E2E do not depend on it)", False)
    est = _names(groups, lambda g: g["overall"].get("output_tokens_exact") is False)
    if est:
        add("output_tokens_estimate", f"ESTIMATE: output token counts of {est} are estimates: the server sent no "
                                      "usage, so each chunk counted as one token (tokens/s and TPOT follow)", False)
    wide = _names(groups, lambda g: g["overall"].get("acceptance_source") == "metrics_delta"
                  and g["overall"].get("acceptance_rate") is not None)
    if wide:
        add("acceptance_server_wide", f"acceptance of {wide} comes from the server's /metrics delta around each "
                                      f"run: {SERVER_WIDE} (other clients, and other profiles when the server "
                                      "does not label its counters by profile)", False)
    if ignore_eos:
        short = [r for r in rows if ok(r) and r.get("output_tokens") is not None
                 and r["output_tokens"] < r.get("max_tokens", 0)]
        if short:
            add("ignore_eos_not_honoured", f"--ignore-eos: {len(short)} of {sum(1 for r in rows if ok(r))} "
                                           "requests ended before max_tokens (finish_reason "
                                           f"{short[0].get('finish_reason')}): the server may not honour "
                                           "ignore_eos, so output lengths are not fixed", False)
    over = [r for r in rows if ok(r) and r.get("output_tokens") is not None and r.get("max_tokens")
            and r["output_tokens"] > r["max_tokens"]]
    if over:
        add("max_tokens_exceeded", f"{len(over)} requests returned more tokens than the max_tokens sent (e.g. "
                                   f"{over[0]['output_tokens']} > {over[0]['max_tokens']}): the server may ignore "
                                   "max_tokens, so these requests are not the workload asked for", False)
    return problems, warnings
