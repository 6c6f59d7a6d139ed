"""GPU development check of the engine step (random-weight models of the real configs; docs/gpu-notes.md).

    python benchmarks/gpu/dev_step.py --config-0_5b C05.json --config-1_5b C15.json --tokenizer DIR --out OUTDIR

- where the host time of a step goes (schedule + propose / forward submit / batched verify and its one
  device-to-host copy / per-request commit), ms per step, for batch 1 and 16 concurrent, per profile;
- the draft-model step (1.5b target, 0.5b draft): ms per step with the greedy chain on the device and
  with one host copy per draft, k = 1 and 3; the draft's own graph forward alone;
- fp32 on CUDA: graph step time and the kernels of one eager fused step (issue 9's 81 tok/s).
Writes OUTDIR/dev_step.json and prints a short table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dev_check import cuda_time, profile_step, random_folder  # noqa: E402


PROMPT = "Write a Python function that sorts a list. "


class PhaseTimer:
    """Wall ms per phase of `LLMEngine.step`, by wrapping the engine's collaborators (no syncs added)."""

    def __init__(self, eng):
        import specserve.engine.llm_engine as le

        self.t = defaultdict(float)
        self.steps = 0
        self._undo = []

        def wrap(obj, name, key):
            f = getattr(obj, name)

            def g(*a, **k):
                t0 = time.perf_counter()
                try:
                    return f(*a, **k)
                finally:
                    self.t[key] += time.perf_counter() - t0
            setattr(obj, name, g)
            self._undo.append((obj, name, f))

        wrap(eng, "_propose", "propose")
        wrap(eng.scheduler, "schedule", "schedule_incl_propose")
        wrap(eng.target.runner, "execute", "forward_submit")
        wrap(le.SamplingBatch, "build", "sampling_batch")
        wrap(le, "verify", "verify_submit")
        wrap(le, "to_host", "to_host_wait")
        wrap(eng, "_commit", "commit")
        wrap(eng, "step", "step_total")

    def undo(self):
        for obj, name, f in reversed(self._undo):
            setattr(obj, name, f)

    def ms_per_step(self, steps: int) -> dict:
        return {k: 1e3 * v / max(1, steps) for k, v in self.t.items()}


def run_concurrent(eng, prompt, n, cfg, max_tokens=128):
    from specserve import SamplingParams

    for i in range(n):
        eng.add_request(f"r{time.perf_counter()}-{i}", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                          ignore_eos=True), speculative_config=cfg)
    steps = tokens = 0
    t0 = time.perf_counter()
    while eng.has_unfinished_requests():
        for o in eng.step():
            tokens += len(o.new_token_ids)
        steps += 1
    return steps, tokens, time.perf_counter() - t0


def engine_phases(folder: Path) -> dict:
    from specserve import LLM
    from specserve.config import SpeculativeConfig as SC

    llm = LLM(str(folder), dtype="bfloat16", device="cuda", max_model_len=4096, max_num_seqs=16)
    eng = llm.engine
    prompt = eng.encode_chat([{"role": "user", "content": PROMPT * 20}])
    profiles = {"baseline": None, "ngram_k3": SC("ngram", 3, prompt_lookup_min=2, prompt_lookup_max=4),
                "suffix_k8": SC("suffix", 8), "suffix_pbs0": SC("suffix", 8, num_speculative_tokens_per_batch_size=[[4, 8], [16, 0]])}
    out = {}
    for n in (1, 16):
        for name, cfg in profiles.items():
            run_concurrent(eng, prompt, n, cfg, 16)  # warm
            pt = PhaseTimer(eng)
            steps, tokens, sec = run_concurrent(eng, prompt, n, cfg)
            pt.undo()
            out[f"c{n}_{name}"] = {"steps": steps, "tok_s": tokens / sec, "ms_per_step": 1e3 * sec / steps,
                                   "phases_ms": pt.ms_per_step(steps)}
            print(f"c{n} {name}", json.dumps(out[f"c{n}_{name}"]), flush=True)
    del llm, eng
    torch.cuda.empty_cache()
    return out


def draft_steps(target: Path, draft: Path) -> dict:
    from specserve import LLM, SamplingParams
    from specserve.config import SpeculativeConfig
    from specserve.engine.model_runner import SeqInput

    llm = LLM(str(target), dtype="bfloat16", device="cuda", max_model_len=4096, max_num_seqs=16)
    eng = llm.engine
    prompt = eng.encode_chat([{"role": "user", "content": PROMPT * 20}])
    p = SamplingParams(temperature=0.0, max_tokens=192, ignore_eos=True)
    out = {}
    o = llm.generate([prompt], p, speculative_config=None)[0].outputs[0]
    out["baseline_ms_per_token"] = 1e3 * (o.metrics["finished"] - o.metrics["first_token"]) / (len(o.token_ids) - 1)
    for k in (1, 3):
        cfg = SpeculativeConfig("draft_model", k, model=str(draft))
        prop = eng.prepare_speculative_config(cfg)
        for chain in (True, False):
            prop.chain_greedy = chain
            llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8), speculative_config=cfg)
            pt = PhaseTimer(eng)
            o = llm.generate([prompt], p, speculative_config=cfg)[0].outputs[0]
            steps = max(1, o.num_drafts)
            pt.undo()
            out[f"k{k}_{'chain' if chain else 'steps'}"] = {
                "ms_per_step": 1e3 * (o.metrics["finished"] - o.metrics["first_token"]) / steps,
                "acc_len": o.mean_acceptance_length, "phases_ms": pt.ms_per_step(steps)}
            print(f"draft k{k} chain={chain}", json.dumps(out[f"k{k}_{'chain' if chain else 'steps'}"]), flush=True)
        prop.chain_greedy = True
    # one graph forward of each model alone, batch 1, q=1 and q=4, context 500
    for name, runner in (("draft", prop.draft.runner), ("target", eng.target.runner)):
        kv = runner.kv
        slot = kv.allocate()
        runner.forward([SeqInput(slot, 0, list(range(500)), 1)])
        for q in (1, 4):
            def f():
                runner.forward([SeqInput(slot, 500, [5] * q, 1)])
                kv.truncate(slot, 500)
            out[f"{name}_graph_q{q}_ms"] = cuda_time(f, iters=30)
        kv.free(slot)
    print("graph forwards", {k: v for k, v in out.items() if k.endswith("_ms")}, flush=True)
    return out


def fp32_check(folder: Path) -> dict:
    from specserve import LLM, SamplingParams
    from specserve.engine.cuda_graph_runner import CudaGraphRunner
    from specserve.engine.model_runner import SeqInput

    out = {"tf32_matmul": torch.backends.cuda.matmul.allow_tf32, "float32_matmul_precision":
           torch.get_float32_matmul_precision()}
    llm = LLM(str(folder), dtype="float32", device="cuda", max_model_len=4096, max_num_seqs=16)
    eng = llm.engine
    prompt = eng.encode_chat([{"role": "user", "content": PROMPT * 20}])
    o = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))[0].outputs[0]
    out["b1_tok_s"] = (len(o.token_ids) - 1) / (o.metrics["finished"] - o.metrics["first_token"])
    r = eng.target.runner
    out["graphs"], out["graph_steps"], out["eager_steps"] = len(r._graphs), r.num_graph_steps, r.num_eager_steps
    kv = r.kv
    slot = kv.allocate()
    r.forward([SeqInput(slot, 0, list(range(500)), 1)])

    def f():
        r.forward([SeqInput(slot, 500, [5], 1)])
        kv.truncate(slot, 500)
    out["graph_q1_ms"] = cuda_time(f, iters=20)
    eager = CudaGraphRunner(r.model, kv, torch.device("cuda"), 16, cuda_graphs=False)
    out["profile_B1_q1"] = profile_step(eager, [SeqInput(slot, 500, [7], 1)], lambda: kv.truncate(slot, 500), steps=3)
    print("fp32", json.dumps(out), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config-0_5b", required=True)
    ap.add_argument("--config-1_5b", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--work", default="/tmp/devcheck")
    ap.add_argument("--out", required=True)
    ap.add_argument("--parts", default="phases,draft,fp32")
    args = ap.parse_args()
    parts = args.parts.split(",")
    f05 = random_folder(json.loads(Path(args.config_0_5b).read_text()), Path(args.tokenizer), Path(args.work) / "0.5b")
    res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    save = lambda: (Path(args.out).mkdir(parents=True, exist_ok=True),  # noqa: E731
                    (Path(args.out) / "dev_step.json").write_text(json.dumps(res, indent=1)))
    if "fp32" in parts:
        res["fp32"] = fp32_check(f05)
        save()
    if "phases" in parts:
        res["phases_0.5b"] = engine_phases(f05)
        save()
    if "draft" in parts:
        f15 = random_folder(json.loads(Path(args.config_1_5b).read_text()), Path(args.tokenizer),
                            Path(args.work) / "1.5b")
        res["draft_1.5b_0.5b"] = draft_steps(f15, f05)
        save()
    print("\n== summary")
    for k, v in res.get("phases_0.5b", {}).items():
        ph = ", ".join(f"{a} {b:.3f}" for a, b in v["phases_ms"].items())
        print(f"{k}: {v['tok_s']:.0f} tok/s, {v['ms_per_step']:.3f} ms/step ({ph})")
    for k, v in res.get("draft_1.5b_0.5b", {}).items():
        print(k, v if not isinstance(v, dict) else f"{v['ms_per_step']:.3f} ms/step, " + ", ".join(
            f"{a} {b:.3f}" for a, b in v["phases_ms"].items()))
    if "fp32" in res:
        fp = res["fp32"]
        print(f"fp32: {fp['b1_tok_s']:.0f} tok/s, graph q1 {fp['graph_q1_ms']:.3f} ms, graphs {fp['graphs']}, "
              f"steps graph/eager {fp['graph_steps']}/{fp['eager_steps']}, tf32 {fp['tf32_matmul']}; profile "
              f"{fp['profile_B1_q1']['kernels_per_step']:.0f} kernels {fp['profile_B1_q1']['gpu_us_per_step']:.0f} us: "
              + "; ".join(f"{n} {v:.0f}" for n, v in list(fp['profile_B1_q1']['top_us'].items())[:8]))


if __name__ == "__main__":
    main()
