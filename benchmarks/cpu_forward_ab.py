"""Side-by-side cost of one target forward on the CPU for several versions of specserve, in one process.

Each version (a git ref of this repository, exported with `git archive`, or a source folder) is
imported under its own package name and loads its own copy of the model; the forwards of every step
shape then alternate between the versions (order reversed every repeat), so that the noise of a shared
machine hits every version alike. Step shapes, each with 300-480 tokens of context already cached:
`dec1` one decode, `ver1` one verify block of 1 + 4 tokens, `dec4` four decodes, `ver4` four verify
blocks, `pre300` a 300-token prompt. The versions run on the main thread. With --pool-ab (one version)
the forwards run on a second thread, as the server's engine thread, and the variants are instead "the
main thread's OpenMP pool released" (what the loader does) and "alive" (what it did before; see
specserve/engine/cpu_threads.py), alternating. Reports the median and minimum milliseconds
per forward and, per variant, the median over repeats of the paired ratio to the first (< 1 = faster).

Load order can bias the result: on the 2-core Intel host (2026-12-03) the same two commits read 1.03x
with the older one loaded first and 0.93x with the newer one first for one decode, back to back (not
recorded; a suspect, not measured: a second model's weights may not get the huge pages the first one's
got); the recorded run right after, each order in its own process, read 0.91x and 0.92x (its
`load_order_effect`, 0.99-1.00, shows no bias then). So with two refs, `--both-load-orders` runs the
comparison twice, each in its own child process, once in each load order, and reports per shape the
ratio of the second ref over the first from each run and their geometric mean, in which a bias of the
load order cancels.

    python benchmarks/cpu_forward_ab.py --refs main,HEAD --threads 2 --tag versions --out docs/benchmarks
    python benchmarks/cpu_forward_ab.py --refs HEAD --pool-ab --tag openmp_pool --out docs/benchmarks
    python benchmarks/cpu_forward_ab.py --refs main,HEAD --both-load-orders --tag layer_kernels --out docs/benchmarks
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SHAPES = {"dec1": (1, 1), "ver1": (1, 5), "dec4": (4, 1), "ver4": (4, 5), "pre300": (1, 300)}
CONTEXT = [300, 360, 420, 480]


def export(ref: str, dest: Path) -> Path:
    """The `specserve` package of git ref `ref` (or of the folder `ref`) copied under `dest`."""
    if Path(ref, "specserve").is_dir():
        shutil.copytree(Path(ref, "specserve"), dest / "specserve")
        return dest
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", ref, "specserve"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def import_as(src: Path, name: str, root: Path):
    """Copy src/specserve to root/name with its own imports renamed, and import it."""
    dst = root / name
    shutil.copytree(src / "specserve", dst)
    pattern = re.compile(r"^(\s*)(from|import) specserve\b", re.M)
    for p in dst.rglob("*.py"):
        p.write_text(pattern.sub(rf"\1\2 {name}", p.read_text()))
    return importlib.import_module(f"{name}.llm"), importlib.import_module(f"{name}.engine.model_runner")


class Version:
    """One version's engine, KV slots with cached context, and its forward for each shape."""

    def __init__(self, label: str, llm_mod, runner_mod, model: str, threads: int):
        import torch

        self.label = label
        self.llm = llm_mod.LLM(model, max_model_len=1024, max_num_seqs=4, device="cpu", **(
            {"cpu_threads": threads} if "cpu_threads" in llm_mod.EngineConfig.__dataclass_fields__ else {}))
        torch.set_num_threads(threads)
        self.t, self.SeqInput = self.llm.engine.target, runner_mod.SeqInput
        self.slots = [self.t.kv.allocate() for _ in CONTEXT]
        for s, c in zip(self.slots, CONTEXT):
            self.t.runner.forward([self.SeqInput(s, 0, [(1000 + 7 * i + s) % 150000 for i in range(c)], 1)])

    def forward(self, shape: str) -> float:
        B, n = SHAPES[shape]
        if shape == "pre300":
            self.t.kv.truncate(self.slots[0], 0)
            seqs = [self.SeqInput(self.slots[0], 0, [(1000 + 7 * i) % 150000 for i in range(n)], 1)]
        else:
            for s, c in zip(self.slots[:B], CONTEXT[:B]):
                self.t.kv.truncate(s, c)
            seqs = [self.SeqInput(s, c, [11] * n, n) for s, c in zip(self.slots[:B], CONTEXT[:B])]
        t0 = time.perf_counter()
        self.t.runner.forward(seqs)
        return time.perf_counter() - t0  # after pre300, slot 0 again holds CONTEXT[0] = 300 tokens


def both_load_orders(args) -> None:
    """Run the A/B of two refs in each load order, each in a child process; write the combined record."""
    refs = args.refs.split(",")
    if len(refs) != 2 or args.pool_ab:
        raise SystemExit("--both-load-orders compares two refs (and not with --pool-ab)")
    runs = []
    for order in (refs, refs[::-1]):
        cmd = [sys.executable, __file__, "--refs", ",".join(order), "--model", args.model, "--threads", str(args.threads),
               "--shapes", args.shapes, "--repeats", str(args.repeats)]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-2000:]}")
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    a, b = refs
    rows = []
    for shape in args.shapes.split(","):
        first = {r["variant"]: r for r in runs[0]["rows"] if r["shape"] == shape}
        second = {r["variant"]: r for r in runs[1]["rows"] if r["shape"] == shape}
        r1 = first[b]["paired_ratio_to_first"]  # b loaded second
        r2 = 1.0 / second[a]["paired_ratio_to_first"]  # b loaded first
        rows.append({"shape": shape, f"{b}_over_{a}_loaded_{a}_first": r1, f"{b}_over_{a}_loaded_{b}_first": r2,
                     f"{b}_over_{a}_geomean": (r1 * r2) ** 0.5, "load_order_effect": (r1 / r2) ** 0.5,
                     "median_ms": {a: [first[a]["median_ms"], second[a]["median_ms"]],
                                   b: [first[b]["median_ms"], second[b]["median_ms"]]}})
        print(f"{shape:7s} {b} / {a}: {r1:.3f} ({a} loaded first), {r2:.3f} ({b} loaded first), "
              f"geometric mean {rows[-1][f'{b}_over_{a}_geomean']:.3f}")
    res = {"benchmark": "cpu_forward_ab", "mode": "both load orders", "model": args.model, "versions": refs,
           "commits": runs[0]["commits"], "threads": args.threads, "repeats": args.repeats,
           "context_tokens": CONTEXT, "shapes": runs[0]["shapes"],
           "direction": f"ratios are {b}'s time over {a}'s (< 1: {b} is faster); the geometric mean of the two "
                        "load orders cancels the advantage of the version loaded first",
           "conditions": [r["conditions"] for r in runs], "rows": rows, "runs": runs}
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"cpu_forward_ab{'_' + args.tag if args.tag else ''}.json").write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--refs", required=True, help="comma-separated git refs or source folders; the first is the reference")
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--pool-ab", action="store_true",
                    help="one version on an engine thread, with the main thread's OpenMP pool released vs alive")
    ap.add_argument("--both-load-orders", action="store_true",
                    help="two refs: run once in each load order (child processes), report both and their geometric mean")
    ap.add_argument("--tag", default=None, help="suffix of the output file name")
    ap.add_argument("--out", default=None, help="folder for cpu_forward_ab[_TAG].json")
    args = ap.parse_args()
    if args.both_load_orders:
        both_load_orders(args)
        return

    import torch

    torch.set_num_threads(args.threads)
    shapes = args.shapes.split(",")
    refs = args.refs.split(",")
    with tempfile.TemporaryDirectory(prefix="cpu_forward_ab-") as tmp:
        root = Path(tmp)
        sys.path.insert(0, str(root))
        versions = []
        for i, ref in enumerate(refs):
            src = export(ref, root / f"src{i}")
            llm_mod, runner_mod = import_as(src, f"specserve_v{i}", root)
            versions.append(Version(ref, llm_mod, runner_mod, args.model, args.threads))
        labels = ["pool released", "pool alive"] if args.pool_ab else [v.label for v in versions]
        if args.pool_ab and len(versions) != 1:
            raise SystemExit("--pool-ab measures one version: give one ref")
        times = {(i, s): [] for i in range(len(labels)) for s in shapes}
        loads = []

        def run(i: int, record: bool) -> None:
            torch.set_num_threads(args.threads)
            v = versions[0 if args.pool_ab else i]
            for s in shapes:
                dt = v.forward(s)
                if record:
                    times[(i, s)].append(dt)

        def on_engine_thread(i: int, record: bool) -> None:
            if args.pool_ab:  # the main thread lets its pool go, or makes one again
                from specserve_v0.engine.cpu_threads import release_openmp_pool

                release_openmp_pool() if i == 0 else torch.add(torch.randn(2_000_000), 1.0)
            if args.pool_ab:
                th = threading.Thread(target=run, args=(i, record), name="engine")
                th.start()
                th.join()
            else:
                run(i, record)

        for i in range(len(labels)):
            on_engine_thread(i, False)  # warm-up
        for rep in range(args.repeats):
            loads.append(os.getloadavg()[0])
            for i in list(range(len(labels)))[:: 1 if rep % 2 == 0 else -1]:
                on_engine_thread(i, True)
    rows = []
    for s in shapes:
        for i, label in enumerate(labels):
            xs = times[(i, s)]
            paired = [b / a for a, b in zip(times[(0, s)], xs)]
            rows.append({"shape": s, "variant": label, "median_ms": 1000 * statistics.median(xs),
                         "min_ms": 1000 * min(xs), "paired_ratio_to_first": statistics.median(paired)})
            print(f"{s:7s} {label:>14s}  median {rows[-1]['median_ms']:8.1f} ms  min {rows[-1]['min_ms']:8.1f} ms"
                  f"  x{rows[-1]['paired_ratio_to_first']:.2f}")
    commits = {}
    for ref in refs:  # a ref like HEAD moves: record the commit it named (folders stay as given)
        out = subprocess.run(["git", "rev-parse", "--short", ref], capture_output=True, text=True)
        commits[ref] = None if Path(ref, "specserve").is_dir() or out.returncode else out.stdout.strip()
    res = {"benchmark": "cpu_forward_ab", "model": args.model, "versions": refs, "commits": commits, "variants": labels,
           "threads": args.threads, "engine_thread": args.pool_ab, "repeats": args.repeats, "context_tokens": CONTEXT,
           "shapes": {s: {"sequences": SHAPES[s][0], "new_tokens_each": SHAPES[s][1]} for s in shapes},
           "conditions": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, fp32, loadavg 1 min "
                         f"{min(loads):.2f}-{max(loads):.2f} during the run",
           "rows": rows}
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"cpu_forward_ab{'_' + args.tag if args.tag else ''}.json").write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
