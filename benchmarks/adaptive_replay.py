"""Replay the 16-concurrent GPU benchmark offline with the real adaptive schedule and n-gram proposer.

The real `AdaptiveK` and n-gram proposer run over requests whose greedy outputs are known, with the device's step time modelled from its
measurements. For trying a change to the schedule in seconds on a CPU before it costs device time.

How: greedy output does not depend on speculation, so each request's output is fixed (generated once
with the real model on the CPU, `--outputs` caches it). The replay admits `--requests` of them 16 at a
time like `benchmarks/gpu/c16_reps.py`, and every step asks the schedule (or a static k) for drafts,
accepts each draft up to its first mismatch with the known output, commits, and charges the step

    wall = forward(T, B) + host_fixed + host_per_seq x B + host_per_draft x drafts
           + host_per_token x (committed - B) + py_scale x (measured drafting / decision time) + prefills,

with forward(T, B) interpolated from the H200's measured CUDA-graph forwards of the 0.5b (session 13,
`docs/benchmarks/gpu_h200_c16_ngram_copy.json`: 1.26 ms at 16 x 1 tokens, 1.39 ms at 16 x 5). The
schedule's own clock is scaled by `--py-scale` too (the H200 machine's host ran the decision ~2.5x
slower than the 2-core VM), so its measured decision costs are what it would measure there; the host
defaults reproduce the device's plain steps (~1.8 ms) and its drafting-step costs. It prints one JSON
line: tok/s, steps, draft tokens, the k histogram and, for an adaptive profile, its steps at 16
sequences (rests, no-draft decisions, drafting steps and the median decision ms). With `--py-scale
2.5` (session 14, an idle VM): static ngram 1.33x of the baseline (the device: 1.2-1.3x); the schedule
as it was before session 14, 0.99x with 640 rest steps of 696 (the device: 0.97-1.04x, rest-dominated);
the committed one 1.15-1.20x (throughput) and 1.15-1.18x (fair), not measured on the device (an
earlier version measured 1.10-1.16x there and replayed at 1.22x). The decision times are real Python
time on this host, so a loaded machine moves the results. What it does not model: the suffix proposer's between-step ingestion,
prefill chunks mixed into decode steps (a constant per admitted request), the device's noise.

    python benchmarks/adaptive_replay.py --profile baseline
    python benchmarks/adaptive_replay.py --profile ngram_adaptive --py-scale 2.5 [--set HOLD_SHARE=0.05] [--objective fair]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import types
from pathlib import Path

# forward ms of the 0.5b on the H200 at 16 sequences, by new tokens (CUDA graphs, bf16; session 13)
FORWARD_16 = {16: 1.26, 32: 1.256, 48: 1.315, 80: 1.392, 144: 1.63}
PROFILES = {
    "baseline": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
    "ngram_adaptive": {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2, "prompt_lookup_max": 4,
                       "num_speculative_tokens_schedule": "adaptive"},
}


def forward_ms(tokens: int, seqs: int) -> float:
    """Modelled forward ms for `tokens` new tokens over `seqs` sequences: the 16-sequence curve at the
    same tokens per sequence, scaled for fewer sequences (0.9 ms + 0.36 ms x seqs / 16 at one token)."""
    xs = sorted(FORWARD_16)
    t16 = 16 * tokens / seqs
    y = FORWARD_16[xs[-1]] + (t16 - xs[-1]) * 0.004
    for a, b in zip(xs, xs[1:]):
        if t16 <= b:
            y = FORWARD_16[a] + (FORWARD_16[b] - FORWARD_16[a]) * (max(t16, a) - a) / (b - a)
            break
    return (0.9 + 0.36 * seqs / 16) * y / FORWARD_16[16]


def cost_model():
    """A StepCostModel measured on the modelled forward (the uniform-batch grid, as on CUDA)."""
    from specserve.engine.step_cost import StepCostModel

    seqs, qlens, tokens = [2, 4, 8, 16], [1, 2, 3, 4, 5, 6, 8, 9], list(range(1, 17))
    return StepCostModel(tokens, [forward_ms(t, 1) for t in tokens], [1], [0.0], batch_seqs=seqs, batch_qlens=qlens,
                         batch_ms=[[forward_ms(b * q, b) for q in qlens] for b in seqs])


def generate_outputs(prompts: Path, model: str, out: Path) -> None:
    """Greedy outputs of every prompt of `prompts` (bench_gpu.py's prompts.json) with the real model on
    the CPU (ngram drafts, which do not change greedy output), written to `out`."""
    from specserve import LLM, SamplingParams
    from specserve.config import SpeculativeConfig

    samples = json.loads(prompts.read_text())["samples"]
    llm = LLM(model, dtype="float32", device="cpu", max_model_len=4096, max_num_seqs=16)
    eng = llm.engine
    cfg = SpeculativeConfig.from_dict(PROFILES["ngram"])
    for i, s in enumerate(samples):
        eng.add_request(str(i), s["token_ids"], SamplingParams(temperature=0.0, max_tokens=s["max_tokens"]),
                        speculative_config=cfg)
    outs: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    out.write_text(json.dumps({"model": model, "samples": [{**s, "output": outs[str(i)]} for i, s in enumerate(samples)]}))


def replay(samples: list[dict], args) -> dict:
    from specserve.config import SpeculativeConfig
    from specserve.engine import draft_length
    from specserve.request import Request
    from specserve.sampling_params import SamplingParams
    from specserve.spec_decode import make_proposer
    from specserve.spec_decode.proposer import Proposal, ProposalInput

    for kv in args.set:
        name, value = kv.split("=")
        setattr(draft_length, name, type(getattr(draft_length, name))(float(value)))
    draft_length.time = types.SimpleNamespace(perf_counter=lambda: time.perf_counter() * args.py_scale)
    cfg = SpeculativeConfig.from_dict(PROFILES[args.profile])
    prop = make_proposer(cfg) if cfg else None
    cm = cost_model()
    ad = draft_length.AdaptiveK(cm, lambda c: prop)
    if args.objective:
        ad.objective = args.objective
    waiting = []
    for i in range(args.requests):
        s = samples[i % len(samples)]
        r = Request(f"r{i}", list(s["token_ids"]), SamplingParams(temperature=0.0, max_tokens=s["max_tokens"]), cfg, 0)
        r.all_token_ids = list(s["token_ids"])
        waiting.append((r, s["output"]))
    running: list = []
    truth: dict[str, list[int]] = {}

    def propose(asks):
        return prop.propose([ProposalInput(r.request_id, r.all_token_ids, r.num_prompt_tokens, k, r.params, 0)
                             for r, k in asks])

    sim_ms = 0.0
    tokens = steps = drafts_total = 0
    ks = [0] * (max(cfg.num_speculative_tokens if cfg else 0, 1) + 1)
    at16 = []  # (decision ms, any drafts) of steps with 16 sequences
    while waiting or running:
        admitted = 0
        while waiting and len(running) < 16:
            r, out = waiting.pop(0)
            truth[r.request_id] = out
            running.append(r)
            admitted += 1
            if cfg is not None and cfg.adaptive:
                ad.add_request(r)
        B = len(running)
        t0 = time.perf_counter()
        props = [Proposal([])] * B
        if cfg is not None:
            asks = [(r, min(cfg.num_speculative_tokens, len(truth[r.request_id]) - r.num_output_tokens - 1)) for r in running]
            live = [(i, a) for i, a in enumerate(asks) if a[1] > 0]
            got = (ad.draft([a for _, a in live], propose, num_other_tokens=B - len(live), num_other_seqs=B - len(live))
                   if cfg.adaptive else propose([a for _, a in live])) if live else []
            for (i, (_, k)), p in zip(live, got):
                props[i] = Proposal(list(p.token_ids[:k]))
        host_py = 1000 * (time.perf_counter() - t0) * args.py_scale
        decide = ad.take_drafting_ms() if cfg is not None and cfg.adaptive else 0.0
        drafts = sum(len(p.token_ids) for p in props)
        committed = 0
        for r, p in zip(list(running), props):
            rest = truth[r.request_id][r.num_output_tokens:]
            acc = 0
            for d, t in zip(p.token_ids, rest):
                if d != t:
                    break
                acc += 1
            r.all_token_ids.extend(rest[: acc + 1])
            committed += min(acc + 1, len(rest))
            ks[len(p.token_ids)] += 1
            if cfg is not None and cfg.adaptive:
                ad.observe(r, len(p.token_ids), acc)
            if r.num_output_tokens >= len(truth[r.request_id]):
                running.remove(r)
                if cfg is not None:
                    prop.finish_request(r.request_id, r.all_token_ids)
                    if cfg.adaptive:
                        ad.finish_request(r)
        host = (args.host_fixed + args.host_per_seq * B + args.host_per_draft * drafts
                + args.host_per_token * (committed - B))
        wall = forward_ms(B + drafts, B) + host + host_py + args.prefill_ms * admitted
        if cfg is not None and cfg.adaptive:  # as the engine does: the decision is not a per-draft cost
            cm.observe_overhead(max(wall - args.prefill_ms * admitted - cm.forward_ms(B + drafts, B) - decide, 0.0), drafts)
        if B == 16:
            at16.append((decide, drafts > 0))
        sim_ms += wall
        tokens += committed
        steps += 1
        drafts_total += drafts
    return {"profile": args.profile, "objective": ad.objective if cfg is not None and cfg.adaptive else None,
            "py_scale": args.py_scale, "set": args.set, "tok_s": round(1000 * tokens / sim_ms), "steps": steps,
            "tokens": tokens, "draft_tokens": drafts_total, "ks": ks,
            "at_16_seqs": {"rest": sum(1 for d, _ in at16 if d == 0), "no_drafts": sum(1 for d, x in at16 if d and not x),
                           "drafting": sum(1 for _, x in at16 if x),
                           "decision_ms_median": round(statistics.median([d for d, _ in at16 if d] or [0.0]), 3)}
            if cfg is not None and cfg.adaptive else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--outputs", default="out/replay_outputs.json", help="known outputs (generated when absent)")
    ap.add_argument("--prompts", default=None, help="bench_gpu.py's prompts.json, to generate the outputs")
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--profile", default="ngram_adaptive", choices=sorted(PROFILES))
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--py-scale", type=float, default=2.5, help="device host's Python time over this host's")
    ap.add_argument("--host-fixed", type=float, default=0.1, help="ms per step")
    ap.add_argument("--host-per-seq", type=float, default=0.035, help="ms per sequence")
    ap.add_argument("--host-per-draft", type=float, default=0.012, help="ms per draft token verified")
    ap.add_argument("--host-per-token", type=float, default=0.01, help="ms per extra committed token")
    ap.add_argument("--prefill-ms", type=float, default=0.5, help="ms per admitted request")
    ap.add_argument("--objective", default=None, choices=["throughput", "fair"])
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="a module constant of specserve.engine.draft_length (e.g. HOLD_SHARE=0.05)")
    args = ap.parse_args()
    out = Path(args.outputs)
    if not out.exists():
        if not args.prompts:
            raise SystemExit(f"{out} does not exist: pass --prompts (bench_gpu.py prepare's prompts.json) to generate it")
        out.parent.mkdir(parents=True, exist_ok=True)
        generate_outputs(Path(args.prompts), args.model, out)
    print(json.dumps(replay(json.loads(out.read_text())["samples"], args)))


if __name__ == "__main__":
    main()
