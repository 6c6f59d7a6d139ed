"""16 concurrent, repeated: total output tok/s per profile (bench_gpu.py's c16 profiles), with the time the
Python garbage collector paused the engine, with and without `gc.freeze()` after start-up.

    python benchmarks/gpu/c16_reps.py --prompts prompts.json --out c16_reps.json \
        --model qwen2.5-coder-0.5b-instruct --model qwen2.5-coder-1.5b-instruct:qwen2.5-coder-0.5b-instruct

A profile given as NAME@fbN runs NAME with the adaptive schedule's FEED_BATCH set to N (N = 1: every
prompt or catch-up fed to a draft model at once, as before the feed batching), for a paired A/B. Both
arms share one SpeculativeConfig, so their acceptance prior, their `chosen_k` counts (cumulative in the
results) and the engine's adaptive state are shared; the rotated order gives each arm the same neighbours.
Per model: every profile once to warm up, then `--reps` runs per mode in a rotating order; each suffix
run gets a fresh proposer (an empty global tree: no replay of an earlier run's outputs of the same
prompts). Mode "default" leaves the collector as it is; mode "gc_freeze" calls gc.collect(); gc.freeze()
first (as vLLM does after start-up). Writes every run's tok/s and GC pause
ms (by generation) and prints the medians over baseline.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_gpu as bg  # noqa: E402


class GcPauses:
    """Milliseconds spent in collections, by generation, while installed (gc.callbacks)."""

    def __init__(self):
        self.ms = [0.0, 0.0, 0.0]
        self._t0 = 0.0

    def __call__(self, phase, info):
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.ms[info["generation"]] += 1e3 * (time.perf_counter() - self._t0)


def _adaptive_state(eng) -> dict | None:
    """The adaptive schedule's carried state: the fitted step overheads (ms), and per draft model its
    chain scale and probe interval (decisions)."""
    a = eng.adaptive
    if a is None:
        return None
    return {"overhead_ms": round(a.step_cost.overhead_ms, 3), "draft_overhead_ms": round(a.step_cost.draft_overhead_ms, 4),
            "chain_scale": [round(a.chain_scale(k), 3) for k in list(a._chain_ratios)],
            "probe_every": [a._probe_every[k] for k in list(a._probe_every)]}


def main() -> None:
    from specserve import LLM
    from specserve.engine import draft_length
    from specserve.spec_decode import make_proposer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--model", action="append", required=True, help="TARGET[:DRAFT]")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--out", required=True)
    ap.add_argument("--modes", default="default,gc_freeze", help="comma list of default, gc_freeze")
    ap.add_argument("--profiles", default=None, help="comma list of profile names (default: all)")
    args = ap.parse_args()
    samples = json.loads(Path(args.prompts).read_text())["samples"]
    res = {"conditions": {"requests": args.requests, "reps": args.reps, "profiles": bg.C16_EXTRA}, "models": {}}
    for spec in args.model:
        target, _, draft = spec.partition(":")
        llm = LLM(target, dtype="bfloat16", device="cuda", max_model_len=4096, max_num_seqs=16)
        eng = llm.engine
        cfgs = bg.method_configs(draft or None, {m: bg.METHODS[m] for m in bg.C16_PROFILES})
        cfgs.update(bg.method_configs(draft or None, bg.C16_EXTRA))
        if args.profiles:  # NAME@fbN: profile NAME with draft_length.FEED_BATCH = N (an A/B of the feed batching)
            cfgs = {n: cfgs[n.partition("@")[0]] for n in args.profiles.split(",") if n.partition("@")[0] in cfgs}
        names = list(cfgs)

        def run(n):
            c = cfgs[n]
            if c is not None and c.method == "suffix":
                eng.set_proposer(c, make_proposer(c, eng.proposer_context))
            start = _adaptive_state(eng)  # what the schedule starts this run from (the runs before shaped it)
            pauses = GcPauses()
            gc.callbacks.append(pauses)
            feed_batch = draft_length.FEED_BATCH
            if "@fb" in n:
                draft_length.FEED_BATCH = int(n.partition("@fb")[2])
            try:
                r = bg.concurrent(llm, samples, c, args.requests)
            finally:
                gc.callbacks.remove(pauses)
                draft_length.FEED_BATCH = feed_batch
            out = {"tok_s": r["total_tok_s"], "seconds": r["seconds"], "gc_ms": pauses.ms}
            if c is not None and c.adaptive and eng.adaptive is not None:  # what the schedule chose, cumulative
                cm = eng.adaptive.step_cost
                out["adaptive"] = {"chosen_k": list(eng.adaptive.chosen_k.get(c, [])),
                                   "overhead_ms": round(cm.overhead_ms, 3),
                                   "draft_overhead_ms": round(cm.draft_overhead_ms, 4),
                                   "at_start": start, "at_end": _adaptive_state(eng)}
            return out

        out = res["models"][target] = {}
        for n in list(names):  # warm-up; a profile that fails is dropped and its error kept, not the whole run
            try:
                run(n)
            except Exception as e:  # noqa: BLE001 - recorded in the results, printed
                names.remove(n)
                out.setdefault("failed", {})[n] = f"{type(e).__name__}: {e}"
                print(f"{target} {n} failed in its warm-up run: {type(e).__name__}: {e}", flush=True)
                for rid in list(eng.requests):  # its requests must not run in the next profile's runs
                    eng.abort_request(rid)
                while eng.has_unfinished_requests():
                    eng.step()
                if n == "baseline":
                    raise SystemExit(f"{target}: the baseline failed, nothing to compare with") from e
        for mode in args.modes.split(","):
            if mode == "gc_freeze":
                gc.collect()
                gc.freeze()
            rows = out[mode] = {n: [] for n in names}
            for rep in range(args.reps):
                for n in names[rep % len(names):] + names[: rep % len(names)]:
                    rows[n].append(run(n))
                Path(args.out).write_text(json.dumps(res, indent=1))  # a timeout keeps the finished reps
                print(f"rep {rep}: " + ", ".join(f"{n} {v[-1]['tok_s']:.0f}" for n, v in rows.items()), flush=True)
            base = statistics.median(x["tok_s"] for x in rows["baseline"])
            print(f"{target} {mode}: " + ", ".join(
                f"{n} {statistics.median(x['tok_s'] for x in v) / base:.2f}x "
                f"(gc {statistics.median(sum(x['gc_ms']) for x in v):.0f} ms)" for n, v in rows.items())
                + f"; baseline {base:.0f} tok/s", flush=True)
            Path(args.out).write_text(json.dumps(res, indent=1))
        gc.unfreeze()
        del llm, eng
        gc.collect()


if __name__ == "__main__":
    main()
