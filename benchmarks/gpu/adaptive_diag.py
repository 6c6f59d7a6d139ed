"""Where a step's time goes at 16 concurrent requests, per profile: the diagnosis behind the adaptive
schedule's GPU figures (issue 10), on the device, with the real model.

For each profile (bench_gpu.py's configs) it runs `--requests` greedy requests 16 at a time, after one
warm-up run, and records per step: wall ms, tokens and sequences in the plan, draft tokens verified,
and the host time of scheduling (proposing and the adaptive decision included), of the proposer calls,
of the adaptive decision (or of a step holding the last decision's k), of the wait for the GPU's result
(`to_host`) and of the commit. It prints per
profile: tok/s, steps, mean ms per step by part, the wall ms of steps by number of draft tokens, and
for adaptive profiles the step-cost model (modelled step ms at 16 sequences for 0..128 draft tokens,
fitted host overhead and per-draft-token cost), the decisions taken (with and without drafts), rest
steps and the profile's acceptance prior by position. With --profile NAME it also prints the top
functions of a cProfile of that profile's measured run.

    python benchmarks/gpu/adaptive_diag.py --prompts prompts.json --model qwen2.5-coder-0.5b-instruct \\
        --profiles baseline,ngram,ngram_adaptive,suffix,suffix_adaptive --out diag.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_gpu as bg  # noqa: E402


class StepLog:
    """Per-step timings collected through wrappers around the engine's parts (ms)."""

    def __init__(self):
        self.rows: list[dict] = []
        self.cur: dict = {}

    def add(self, key: str, ms: float) -> None:
        self.cur[key] = self.cur.get(key, 0.0) + ms


def chain_logger(prop, propose, log: StepLog):
    """Wrap a draft model's propose: per step, the chains' wall ms, the most tokens one request fed and
    the tokens fed in all (a prompt or catch-up makes the first forward leave the CUDA graphs)."""
    def wrapper(inputs):
        # inside the span AdaptiveK times as the chain: this read-only tail compare adds a little to the
        # chain scale of a diagnosis run
        feeds = [prop.pending_feed(i.request_id, i.token_ids) for i in inputs if i.num_speculative_tokens > 0]
        t0 = time.perf_counter()
        out = propose(inputs)
        log.add("chain_ms", 1e3 * (time.perf_counter() - t0))
        log.cur["chain_max_feed"] = max(log.cur.get("chain_max_feed", 0), max(feeds, default=0))
        log.cur["chain_feed_tokens"] = log.cur.get("chain_feed_tokens", 0) + sum(feeds)
        log.cur["chain_k"] = max(log.cur.get("chain_k", 0), max((i.num_speculative_tokens for i in inputs), default=0))
        return out
    return wrapper


def instrument_chains(eng, log: StepLog) -> None:
    """Wrap the propose of every draft model the engine has now (once each)."""
    for prop in {id(p): p for p in eng._proposers.values()}.values():
        if hasattr(prop, "pending_feed") and not getattr(prop, "_diag", False):
            prop._diag = True
            prop.propose = chain_logger(prop, prop.propose, log)


def instrument(eng, log: StepLog) -> None:
    """Wrap step, schedule, _propose, _commit and to_host of one engine (once)."""
    import specserve.engine.llm_engine as le

    sched, propose, commit, step, host = eng.scheduler.schedule, eng._propose, eng._commit, eng.step, le.to_host

    def timed(key, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                log.add(key, 1e3 * (time.perf_counter() - t0))
        return wrapper

    def schedule(propose_fn):
        t0 = time.perf_counter()
        plan = sched(propose_fn)
        log.add("schedule_ms", 1e3 * (time.perf_counter() - t0))
        if plan:
            log.cur.update(tokens=plan.num_tokens, seqs=len(plan.scheduled), drafts=plan.num_draft_tokens,
                           prefills=sum(1 for s in plan.scheduled if s.is_prefill))
        return plan

    def one_step():
        log.cur = {}
        t0 = time.perf_counter()
        out = step()
        log.cur["wall_ms"] = 1e3 * (time.perf_counter() - t0)
        log.cur["committed"] = sum(len(o.new_token_ids) for o in out)
        if "seqs" in log.cur:
            log.rows.append(log.cur)
        return out

    eng.scheduler.schedule = schedule
    eng._propose = timed("propose_ms", propose)
    eng._commit = timed("commit_ms", commit)
    eng._prepare_proposers = timed("prepare_ms", eng._prepare_proposers)  # inside outside_parts_ms
    le.to_host = timed("to_host_ms", host)
    eng.step = one_step


def instrument_adaptive(ad, log: StepLog) -> None:
    if getattr(ad, "_diag", False):
        return
    ad._diag = True
    draft = ad.draft
    from specserve.spec_decode import proposer_key

    def wrapped(asks, propose, **kw):
        resting, holding = ad.rest_steps > 0, getattr(ad, "hold_steps", 0) > 0
        t0 = time.perf_counter()
        ad.last_choice = None
        out = draft(asks, propose, **kw)
        log.add("adaptive_ms", 1e3 * (time.perf_counter() - t0))
        n_adaptive = sum(1 for r, _ in asks if r.spec_config.adaptive)
        if n_adaptive:
            log.cur["decision"] = ("rest" if resting else "hold" if holding
                                   else "drafts" if any(p.token_ids for p in out) else "none")
        keys = {proposer_key(r.spec_config) for r, _ in asks if r.spec_config.adaptive}
        for key in [k for k in ad._chain_ratios if k in keys][:1]:  # this profile's draft model (timeline)
            log.cur["chain_scale"] = ad.chain_scale(key)
            log.cur["probe_every"] = ad._probe_every[key]
        if ad.last_choice is not None:  # this step chose: what the choice expected (ms of the step, tokens)
            # the choice counts its options' tokens; every other sequence of the step commits one (its
            # accepted drafts, for a configured k, are not in the expectation)
            others = kw.get("num_other_seqs", 0) + n_adaptive - len(ad.last_choice.ks)
            log.cur["pred_ms"] = ad.last_choice.step_ms
            log.cur["fit_overhead_ms"] = ad.step_cost.overhead_ms  # the fitted per-step overhead it used
            log.cur["pred_tokens"] = ad.last_choice.expected_tokens + others
        return out

    ad.draft = wrapped
    wants = ad.wants_prepare

    def wants_prepare(req, n, num_tokens=None):
        kept = wants(req, n, num_tokens)
        log.add("prepare_kept" if kept else "prepare_retired", 1)
        return kept

    ad.wants_prepare = wants_prepare


def expected_vs_realised(rows: list[dict]) -> dict:
    """Steps that drafted: [expected, realised] medians of the step ms and committed tokens, and the
    tokens per ms over all of them."""
    med = lambda key: round(statistics.median(r[key] for r in rows), 3)  # noqa: E731
    return {"steps": len(rows), "step_ms": [med("pred_ms"), med("wall_ms")],
            "tokens": [round(med("pred_tokens"), 2), round(med("committed"), 2)],
            "tokens_per_ms": [round(sum(r["pred_tokens"] for r in rows) / sum(r["pred_ms"] for r in rows), 3),
                              round(sum(r["committed"] for r in rows) / sum(r["wall_ms"] for r in rows), 3)]}


def timeline(rows: list[dict], parts: int = 8) -> list[dict]:
    """The run in `parts` spans of equal step counts: steps, their wall s, draft tokens per decode step,
    and a draft model's chain scale (median) and probe interval (max) at its decisions in the span."""
    out = []
    n = len(rows)
    for i in range(parts):
        span = rows[i * n // parts:(i + 1) * n // parts]
        if not span:
            continue
        dec = [r for r in span if not r.get("prefills")]
        sc = [r["chain_scale"] for r in span if "chain_scale" in r]
        out.append({"steps": len(span), "wall_s": round(sum(r["wall_ms"] for r in span) / 1e3, 3),
                    "drafts_per_decode_step": round(statistics.mean(r["drafts"] for r in dec), 1) if dec else None,
                    "chain_scale": round(statistics.median(sc), 2) if sc else None,
                    "probe_every": max((r["probe_every"] for r in span if "probe_every" in r), default=None)})
    return out


def summarize(rows: list[dict], tok_s: float, seconds: float) -> dict:
    dec = [r for r in rows if not r.get("prefills")]
    parts = ["wall_ms", "schedule_ms", "propose_ms", "adaptive_ms", "to_host_ms", "commit_ms", "prepare_ms"]
    out = {"tok_s": round(tok_s), "seconds": round(seconds, 3), "steps": len(rows),
           "decode_steps": len(dec), "mean_ms_decode_steps": {
               p: round(statistics.mean(r.get(p, 0.0) for r in dec), 3) for p in parts} if dec else {}}
    pre = [r for r in rows if r.get("prefills")]
    if pre:  # steps with a prompt chunk: the same parts, and where the run's wall time went
        out["mean_ms_prefill_steps"] = {p: round(statistics.mean(r.get(p, 0.0) for r in pre), 3) for p in parts}
        out["max_ms_prefill_steps"] = {p: round(max(r.get(p, 0.0) for r in pre), 3) for p in parts}
    out["steps_wall_s"] = {"decode": round(sum(r["wall_ms"] for r in dec) / 1e3, 3),
                           "prefill": round(sum(r["wall_ms"] for r in pre) / 1e3, 3)}
    if dec:
        out["mean_ms_decode_steps"]["outside_parts_ms"] = round(statistics.mean(
            r["wall_ms"] - r.get("schedule_ms", 0) - r.get("to_host_ms", 0) - r.get("commit_ms", 0) for r in dec), 3)
    by = defaultdict(list)
    for r in dec:
        if r["seqs"] >= 12:
            by[(r["drafts"] + 15) // 16 * 16].append(r["wall_ms"])
    out["wall_ms_by_drafts_at_12plus_seqs"] = {f"<={d}": [len(v), round(statistics.median(v), 3)]
                                               for d, v in sorted(by.items())}
    # decisions that drafted, with nothing but decodes in the step: the choice's expected step ms and
    # committed tokens against the realised ones (a cost model or acceptance estimate that is off shows here)
    chose = [r for r in dec if "pred_ms" in r and r.get("drafts")]
    if chose:
        out["drafting_decisions_expected_vs_realised"] = expected_vs_realised(chose)
    chose16 = [r for r in chose if r["seqs"] >= 12]
    if chose16:
        out["drafting_decisions_expected_vs_realised_12plus_seqs"] = expected_vs_realised(chose16)
    if chose:  # the step-cost model's fitted per-step overhead when those decisions were made (median, max)
        fit = [r["fit_overhead_ms"] for r in chose]
        out["fit_overhead_ms_at_drafting_decisions"] = [round(statistics.median(fit), 3), round(max(fit), 3)]
    chains = [r for r in rows if "chain_ms" in r]
    if chains:  # a draft model's chains: steady (no request fed more than 2 tokens) or feeding a prompt/catch-up
        def part(rs):
            return {"chains": len(rs), "median_ms": round(statistics.median(r["chain_ms"] for r in rs), 3),
                    "total_ms": round(sum(r["chain_ms"] for r in rs), 1),
                    "median_feed_tokens": statistics.median(r["chain_feed_tokens"] for r in rs),
                    "steps_with_prefill": sum(1 for r in rs if r.get("prefills"))} if rs else {"chains": 0}
        out["draft_chains"] = {"steady": part([r for r in chains if r["chain_max_feed"] <= 2]),
                               "feeding": part([r for r in chains if r["chain_max_feed"] > 2]),
                               "steady_12plus_seqs_k5": part([r for r in chains if r["chain_max_feed"] <= 2
                                                              and r["seqs"] >= 12 and r.get("chain_k") == 5])}
    plain = [r for r in dec if not r.get("drafts") and r["seqs"] >= 12]
    if plain:
        out["plain_steps_12plus_seqs_tokens_per_ms"] = round(
            sum(r["committed"] for r in plain) / sum(r["wall_ms"] for r in plain), 3)
    verdicts = {k: int(sum(r.get(f"prepare_{k}", 0) for r in rows)) for k in ("kept", "retired")}
    if any(verdicts.values()):  # request-steps whose proposer state was kept up to date / not (retired)
        out["prepare_request_steps"] = verdicts
    decisions = defaultdict(int)
    for r in rows:
        if "decision" in r:
            decisions[r["decision"]] += 1
    if decisions:
        out["decisions"] = dict(decisions)
        for kind in ("drafts", "none", "hold"):
            ms = [r["adaptive_ms"] for r in rows if r.get("decision") == kind]
            if ms:
                out[f"adaptive_ms_{kind}"] = round(statistics.median(ms), 3)
    return out


def main() -> None:
    from specserve import LLM
    from specserve.spec_decode import make_proposer, proposer_key

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--model", required=True, help="TARGET[:DRAFT] (a draft enables the draft_model profiles)")
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--profiles", default="baseline,ngram,ngram_adaptive,suffix,suffix_adaptive")
    ap.add_argument("--profile", default=None, help="cProfile this profile's measured run")
    ap.add_argument("--reps", type=int, default=1, help="measured runs per profile (the figures are of the last)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda", help="cuda (default); cpu for a smoke test of the script")
    ap.add_argument("--max-tokens", type=int, default=None, help="cap each prompt's max_tokens (smoke tests)")
    ap.add_argument("--feed-batch", type=int, default=None, help="set the adaptive schedule's FEED_BATCH (A/B)")
    args = ap.parse_args()
    if args.feed_batch is not None:
        from specserve.engine import draft_length

        draft_length.FEED_BATCH = args.feed_batch
    samples = json.loads(Path(args.prompts).read_text())["samples"]
    if args.max_tokens:
        samples = [{**s, "max_tokens": min(s["max_tokens"], args.max_tokens)} for s in samples]
    target, _, draft = args.model.partition(":")
    llm = LLM(target, dtype="bfloat16" if args.device == "cuda" else "float32", device=args.device,
              max_model_len=4096, max_num_seqs=16)
    eng = llm.engine
    cfgs = bg.method_configs(draft or None, {m: bg.METHODS[m] for m in bg.C16_PROFILES if m in bg.METHODS})
    cfgs.update(bg.method_configs(draft or None, bg.C16_EXTRA))
    names = args.profiles.split(",")
    log = StepLog()
    instrument(eng, log)
    res = {"model": args.model, "requests": args.requests, "profiles": {}}
    for n in names:
        c = cfgs[n]
        for rep in range(1 + args.reps):
            if c is not None and c.method == "suffix":  # an empty global tree for every run
                eng.set_proposer(c, make_proposer(c, eng.proposer_context))
            if eng.adaptive is not None:
                instrument_adaptive(eng.adaptive, log)
            instrument_chains(eng, log)
            log.rows = []
            prof = cProfile.Profile() if (n == args.profile and rep == args.reps) else None
            if prof:
                prof.enable()
            r = bg.concurrent(llm, samples, c, args.requests)
            if prof:
                prof.disable()
            print(f"{n} run {rep} ({'warm-up' if rep == 0 else 'measured'}): {r['total_tok_s']:.0f} tok/s, "
                  f"{r['seconds']:.3f} s, steps {len(log.rows)}, prefill steps "
                  f"{round(sum(x['wall_ms'] for x in log.rows if x.get('prefills')))} ms, chosen_k so far "
                  f"{list(eng.adaptive.chosen_k.get(c, [])) if eng.adaptive is not None and c is not None else None}",
                  flush=True)
            print(f"  timeline: {json.dumps(timeline(log.rows))}", flush=True)
        s = summarize(log.rows, r["total_tok_s"], r["seconds"])
        if c is not None and c.adaptive and eng.adaptive is not None:
            ad, cm = eng.adaptive, eng.adaptive.step_cost
            s["cost_model"] = {"step_ms_16seqs_by_drafts": {d: round(cm.step_ms(16 + d, 16, d), 3)
                                                            for d in (0, 16, 32, 48, 64, 96, 128)},
                               "forward_ms_16seqs_by_drafts": {d: round(cm.forward_ms(16 + d, 16), 3)
                                                               for d in (0, 16, 32, 64, 128)},
                               "overhead_ms": round(cm.overhead_ms, 4), "draft_overhead_ms": round(cm.draft_overhead_ms, 4)}
            s["chosen_k"] = list(ad.chosen_k.get(c, []))
            s["decide_ms_ema"] = round(ad.decide_ms, 3)
            s["drafting_step_ms"] = round(getattr(ad, "drafting_step_ms", ad.draft_decide_ms), 3)
            s["check_ms_per_request"] = {str(k[0]): round(v, 4) for k, v in getattr(ad, "check_ms", {}).items()}
            s["prior"] = [round(x, 3) for x in ad.tracker.config_summary(c, proposer_key(c), c.num_speculative_tokens)]
            s["propose_ms_per_request"] = {str(k[0]): round(v, 4) for k, v in ad.propose_ms.items()}
            if hasattr(eng._proposers.get(proposer_key(c)), "draft_step_cost"):  # a draft model's chain scale
                s["draft_chain_scale"] = round(ad.chain_scale(proposer_key(c)), 3)
                dcm = eng._proposers[proposer_key(c)].draft_step_cost()
                s["draft_forward_ms"] = {f"{n}seqs": round(dcm.forward_ms(n, n), 3) for n in (1, 4, 16)}
        res["profiles"][n] = s
        print(n, json.dumps(s), flush=True)
        if prof:
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(28)
            print(buf.getvalue()[-6000:], flush=True)
        Path(args.out).write_text(json.dumps(res, indent=1))
    base = res["profiles"].get("baseline", {}).get("tok_s")
    if base:
        print("over baseline: " + ", ".join(f"{n} {p['tok_s'] / base:.2f}x" for n, p in res["profiles"].items()))


if __name__ == "__main__":
    main()
