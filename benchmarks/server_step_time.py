"""Is a server's (or, with --in-process, the engine's) step time steady? The same greedy streaming
request, sent N times one after another to one `specserve serve` (c=1), and each request's TPOT (ms
between its first and last token-bearing chunks over the chunks between them), with the steal time the
kernel reported meanwhile and two probes of the machine taken just before it (mem_probe_ms, a
one-thread 64 MiB copy; cpu_probe_ms, a pure-Python loop). Steady means the same TPOT within a few
percent from request to request (the first measured one may still be slower); on the 2-core CPU of
session 20 it read mostly ~40-45 ms in some stretches and ~60-67 in others for the same request
(docs/benchmarks/server_step_time_cpu_s20.json), one of the two reasons a sweep's picks flip
(docs/sweep-reproduction.md). The load average before and after is recorded: under other load the
figures mean nothing.

The server inherits this process's environment, so OpenMP settings can be tried, e.g.

    GOMP_SPINCOUNT=0 python benchmarks/server_step_time.py --requests 16 --out /tmp/step_time.json

`--in-process` runs the same request through `LLM.generate` in this process instead (no server, no
HTTP; TPOT from the completion's first-token and finished engine timestamps, so without the HTTP,
detokenization and streaming the server's figure includes), to tell the server's variance from the
machine's. Just before every request two probes run in this process while the engine is idle,
each single-threaded: `mem_probe_ms`, copying a 64 MiB array (memory bandwidth), and `cpu_probe_ms`,
a pure-Python loop (one core's speed); they show whether a slow stretch is the machine's memory, its
cores, or neither. In session 21 the in-process TPOT was bimodal too (~36-44 ms, and stretches of
~57-63 ms; docs/benchmarks/server_step_time_cpu_s21.json); the CPU probe did not follow the state, the
memory probe did in one run and not in the other.
The load average "before" is read before the server starts (session 20's runs read it after).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'


def steal_jiffies() -> int:
    """The machine's steal time so far (/proc/stat, in clock ticks); 0 where it is not reported."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) if len(fields) > 8 else 0
    except OSError:
        return 0


def cpu_probe_ms() -> float:
    """Milliseconds for a fixed pure-Python loop (one core, no memory traffic): ~9 ms on the 2-core host."""
    t0 = time.perf_counter()
    total = 0
    for i in range(200_000):
        total += i * i
    return round(1000 * (time.perf_counter() - t0), 2)


class MemProbe:
    """Milliseconds to copy a 64 MiB float64 array (one thread): memory bandwidth, ~5 ms on the 2-core host."""

    def __init__(self) -> None:
        import numpy as np

        self.src = np.ones(64 * 1024 * 1024 // 8)
        self.dst = np.empty_like(self.src)
        self._copy = np.copyto

    def __call__(self) -> float:
        t0 = time.perf_counter()
        self._copy(self.dst, self.src)
        return round(1000 * (time.perf_counter() - t0), 2)


def in_process_tpots(args, path: str, mem_probe: MemProbe) -> list[dict]:
    """The request run `args.requests` + 1 times through `LLM.generate` here (the first warms up)."""
    from specserve.llm import LLM
    from specserve.sampling_params import SamplingParams

    llm = LLM(model=path, dtype=args.dtype, device=args.device)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    rows = []
    for i in range(args.requests + 1):
        steal0, mem0, cpu0 = steal_jiffies(), mem_probe(), cpu_probe_ms()
        out = llm.generate([PROMPT], params)[0].outputs[0]
        n, m = len(out.token_ids), out.metrics
        if i and n > 1 and m.get("first_token") is not None and m.get("finished") is not None:
            rows.append({"tpot_ms": round(1000 * (m["finished"] - m["first_token"]) / (n - 1), 1),
                         "steal_jiffies": steal_jiffies() - steal0, "mem_probe_ms": mem0, "cpu_probe_ms": cpu0})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", help="model name or path to serve")
    ap.add_argument("--device", default="cpu", help="the engine's device (cpu or cuda)")
    ap.add_argument("--dtype", default="float32", help="the engine's dtype")
    ap.add_argument("--requests", type=int, default=16, help="measured requests (after one warm-up)")
    ap.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (greedy)")
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    ap.add_argument("--in-process", action="store_true",
                    help="run the request through LLM.generate in this process instead of a server")
    args = ap.parse_args()
    if args.requests < 1:
        raise SystemExit(f"--requests must be >= 1, got {args.requests}")

    from specserve.demo import prepare_model

    files = prepare_model(args.model, progress=True)
    mem_probe = MemProbe()
    load_before = os.getloadavg()[0]
    if args.in_process:
        rows = in_process_tpots(args, str(files.path), mem_probe)
    else:
        rows = server_tpots(args, str(files.path), mem_probe)
    env = {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "GOMP_", "KMP_"))}
    result = {"benchmark": "server_step_time", "mode": "in-process" if args.in_process else "server",
              "model": args.model, "device": args.device, "dtype": args.dtype,
              "cpus": os.cpu_count(), "openmp_env": env, "requests": rows,
              "loadavg_1min_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)]}
    print(f"{result['mode']}: TPOT ms per request:", [r["tpot_ms"] for r in rows],
          "| memory probe ms:", [r["mem_probe_ms"] for r in rows], "| CPU probe ms:", [r["cpu_probe_ms"] for r in rows],
          "| steal jiffies:", sum(r["steal_jiffies"] for r in rows),
          "| load average before/after:", result["loadavg_1min_before_after"])
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


def server_tpots(args, path: str, mem_probe: MemProbe) -> list[dict]:
    """The request sent `args.requests` + 1 times to one `specserve serve` (the first warms up)."""
    import httpx

    from specserve.bench.server_process import ServerProcess

    log = Path(args.out or "/tmp/server_step_time.json").with_suffix(".server.log")
    server = ServerProcess(["--model", path, "--dtype", args.dtype, "--device", args.device,
                            "--max-num-seqs", "4", "--log-level", "warning"], log)
    server.start(900)
    rows = []
    try:
        with httpx.Client(timeout=600) as client:
            model = client.get(server.base_url + "/v1/models").json()["data"][0]["id"]
            body = {"model": model, "prompt": PROMPT, "max_tokens": args.max_tokens, "temperature": 0, "stream": True}
            for i in range(args.requests + 1):
                steal0, mem0, cpu0, stamps = steal_jiffies(), mem_probe(), cpu_probe_ms(), []
                with client.stream("POST", server.base_url + "/v1/completions", json=body) as r:
                    r.raise_for_status()
                    for line in r.iter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            stamps.append(time.perf_counter())
                if i and len(stamps) > 1:  # request 0 warms up
                    rows.append({"tpot_ms": round(1000 * (stamps[-1] - stamps[0]) / (len(stamps) - 1), 1),
                                 "steal_jiffies": steal_jiffies() - steal0, "mem_probe_ms": mem0,
                                 "cpu_probe_ms": cpu0})
    finally:
        server.stop()
    return rows


if __name__ == "__main__":
    main()
