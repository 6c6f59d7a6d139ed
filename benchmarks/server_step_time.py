"""Is a server's step time steady? The same greedy streaming request, sent N times one after another to
one `specserve serve` (c=1), and each request's TPOT (ms between its first and last token-bearing chunks
over the chunks between them), with the steal time the kernel reported meanwhile. On the 2-core CPU of
session 20 it read mostly ~40-45 ms in some stretches and ~60-67 in others for the same request
(docs/benchmarks/server_step_time_cpu_s20.json), which is what makes a sweep's picks flip (README,
'specserve sweep'). The load average before and after is recorded: under other load the figures mean
nothing.

The server inherits this process's environment, so OpenMP settings can be tried, e.g.

    GOMP_SPINCOUNT=0 python benchmarks/server_step_time.py --requests 16 --out /tmp/step_time.json
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", help="model name or path to serve")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--requests", type=int, default=16, help="measured requests (after one warm-up)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    args = ap.parse_args()
    if args.requests < 1:
        raise SystemExit(f"--requests must be >= 1, got {args.requests}")

    import httpx

    from specserve.bench.server_process import ServerProcess
    from specserve.demo import prepare_model

    files = prepare_model(args.model, progress=True)
    log = Path(args.out or "/tmp/server_step_time.json").with_suffix(".server.log")
    server = ServerProcess(["--model", str(files.path), "--dtype", args.dtype, "--device", args.device,
                            "--max-num-seqs", "4", "--log-level", "warning"], log)
    server.start(900)
    load_before = os.getloadavg()[0]
    rows = []
    try:
        with httpx.Client(timeout=600) as client:
            model = client.get(server.base_url + "/v1/models").json()["data"][0]["id"]
            body = {"model": model, "prompt": PROMPT, "max_tokens": args.max_tokens, "temperature": 0, "stream": True}
            for i in range(args.requests + 1):
                steal0, stamps = steal_jiffies(), []
                with client.stream("POST", server.base_url + "/v1/completions", json=body) as r:
                    r.raise_for_status()
                    for line in r.iter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            stamps.append(time.perf_counter())
                if i and len(stamps) > 1:  # request 0 warms up
                    rows.append({"tpot_ms": round(1000 * (stamps[-1] - stamps[0]) / (len(stamps) - 1), 1),
                                 "steal_jiffies": steal_jiffies() - steal0})
    finally:
        server.stop()
    env = {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "GOMP_", "KMP_"))}
    result = {"benchmark": "server_step_time", "model": args.model, "device": args.device, "dtype": args.dtype,
              "cpus": os.cpu_count(), "openmp_env": env, "requests": rows,
              "loadavg_1min_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)]}
    print("TPOT ms per request:", [r["tpot_ms"] for r in rows], "| load average before/after:",
          result["loadavg_1min_before_after"])
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
