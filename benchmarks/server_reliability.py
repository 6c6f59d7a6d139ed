"""Reliability tier of issue 12 against a real `specserve serve` (child process, smollm2 by default).

Modes (each writes its section of docs/benchmarks/server_reliability_<model>.json):
- fuzz:    every catalogued bad request of `specserve.server.fuzz` and its variants (>= 2000 in all),
           plus random bodies: 0 x 5xx, 0 x 200-with-error, 0 malformed accepted, every error body
           OpenAI-shaped naming the expected `param`.
- soak:    N concurrent clients (16) for D seconds (900) over both endpoints, streamed and not, three
           profiles, with mid-stream disconnects: errors, server RSS growth (after a warm-up minute)
           and KV cache usage at the end.
- sigterm: 8 long streams, then SIGTERM: every client sees a clean end ([DONE]; the ones cut by the
           grace period an error event first), every request is in the request log, exit status 0.
- itl:     streaming clients' inter-token latency (per chunk, p99) idle vs while three near-limit
           prompts arrive (one just under the 4 MiB body limit, two just under the byte bound that
           the size check lets through to the tokenizer).

    python benchmarks/server_reliability.py fuzz soak sigterm itl [--model smollm2-135m-instruct]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specserve.bench.server_process import ServerProcess  # noqa: E402
from specserve.server import fuzz  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "docs" / "benchmarks"
PROFILES = {"profiles": {"baseline": None, "ngram": {"method": "ngram", "num_speculative_tokens": 4},
                         "suffix": {"method": "suffix", "num_speculative_tokens": 6}},
            "weights": {"baseline": 1, "ngram": 1, "suffix": 1}}
TOKEN = "reliability"


def _server(args, tmp: Path, *extra: str) -> ServerProcess:
    (tmp / "profiles.json").write_text(json.dumps(PROFILES))
    argv = ["--model", args.model, "--profiles", str(tmp / "profiles.json"), "--admin-token", TOKEN,
            "--max-model-len", "2048", "--request-log", str(tmp / "requests.jsonl"), *extra]
    return ServerProcess(argv, tmp / "server.log").start(300)


def _metric(base: str, name: str) -> float | None:
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{}"):
            return float(line.split()[-1])
    return None


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def run_fuzz(args, tmp: Path) -> dict:
    rng = random.Random(0)
    cat = fuzz.catalogue()
    cases = list(cat)
    for bad in cat:
        cases += fuzz.variants(bad, rng)
    failures, by_status, n_random = [], {}, 0
    with _server(args, tmp) as srv, httpx.Client(base_url=srv.base_url, timeout=120,
                                                 headers={"authorization": f"Bearer {TOKEN}"}) as c:
        for bad in cases:
            r = c.request(bad.method, bad.path, content=bad.body, headers={"content-type": "application/json"})
            by_status[r.status_code] = by_status.get(r.status_code, 0) + 1
            why = fuzz.check_answer(bad, r.status_code, r.text)
            if why:
                failures.append({"kind": bad.kind, "why": why, "status": r.status_code, "body": r.text[:300]})
        for _ in range(args.random_bodies):
            path, body = fuzz.random_body(rng)
            r = c.post(path, content=body, headers={"content-type": "application/json"})
            n_random += 1
            why = fuzz.check_answer(None, r.status_code, r.text, stream=b'"stream": true' in body)
            by_status[r.status_code] = by_status.get(r.status_code, 0) + 1
            if why:
                failures.append({"kind": "random", "why": why, "status": r.status_code, "body": body.decode()[:300]})
        healthy = c.get("/health").status_code == 200
    return {"catalogued_kinds": len({b.kind.split("+")[0] for b in cat}), "bad_requests_sent": len(cases),
            "random_bodies_sent": n_random, "by_status": {str(k): v for k, v in sorted(by_status.items())},
            "num_5xx": sum(v for k, v in by_status.items() if k >= 500), "failures": failures[:50],
            "num_failures": len(failures), "healthy_after": healthy}


def _client_loop(base: str, stop_at: float, rng: random.Random, stats: dict, lock: threading.Lock) -> None:
    with httpx.Client(base_url=base, timeout=300) as c:
        while time.monotonic() < stop_at:
            chat = rng.random() < 0.5
            stream = rng.random() < 0.6
            body = {"max_tokens": rng.randint(8, 64), "temperature": rng.choice([0, 0.8]), "stream": stream,
                    "user": f"u{rng.randrange(100)}"}
            text = rng.choice(["Write a Python function that reverses a list.", "Tell me about Paris.",
                               "def fib(n):", "Summarize: the quick brown fox jumps over the lazy dog. " * 5])
            body.update({"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text})
            path = "/v1/chat/completions" if chat else "/v1/completions"
            disconnect = stream and rng.random() < 0.25
            key = "ok"
            try:
                if stream:
                    with c.stream("POST", path, json=body) as r:
                        if r.status_code != 200:
                            key = f"status_{r.status_code}"
                        else:
                            n = 0
                            for line in r.iter_lines():
                                if not line.startswith("data: "):
                                    continue
                                n += 1
                                if '"error"' in line:
                                    key = "error_event"
                                if disconnect and n >= rng.randint(2, 6):
                                    key = "disconnected"
                                    break
                else:
                    r = c.post(path, json=body)
                    if r.status_code != 200 or "error" in r.json():
                        key = f"status_{r.status_code}"
            except httpx.HTTPError as e:
                key = f"transport_{type(e).__name__}"
            with lock:
                stats[key] = stats.get(key, 0) + 1


def run_soak(args, tmp: Path) -> dict:
    stats: dict[str, int] = {}
    lock = threading.Lock()
    with _server(args, tmp) as srv:
        pid = srv.proc.pid
        t0 = time.monotonic()
        stop_at = t0 + args.soak_s
        threads = [threading.Thread(target=_client_loop, args=(srv.base_url, stop_at, random.Random(i), stats, lock))
                   for i in range(args.clients)]
        for t in threads:
            t.start()
        time.sleep(min(60.0, args.soak_s / 5))
        rss_start = _rss_kib(pid)
        samples = []
        while any(t.is_alive() for t in threads):
            samples.append((round(time.monotonic() - t0), _rss_kib(pid)))
            time.sleep(30)
        for t in threads:
            t.join()
        time.sleep(2)
        rss_end = _rss_kib(pid)
        kv = _metric(srv.base_url, "specserve:kv_cache_usage_perc")
        running = _metric(srv.base_url, "specserve:num_requests_running")
        in_flight = _metric(srv.base_url, "specserve:num_requests_in_flight")
        healthy = httpx.get(srv.base_url + "/health").status_code == 200
    errors = sum(v for k, v in stats.items() if k not in ("ok", "disconnected"))
    return {"duration_s": args.soak_s, "clients": args.clients, "requests": sum(stats.values()), "outcomes": stats,
            "errors": errors, "disconnects": stats.get("disconnected", 0), "rss_kib_after_warmup": rss_start,
            "rss_kib_end": rss_end, "rss_growth_pct": round(100 * (rss_end - rss_start) / rss_start, 3),
            "rss_samples": samples, "kv_cache_usage_end": kv, "running_end": running, "in_flight_end": in_flight,
            "healthy_end": healthy}


def _stream_until_end(base: str, body: dict, out: list, first: threading.Event | None = None) -> None:
    lines = []
    try:
        with httpx.Client(base_url=base, timeout=300) as c, c.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
                    if first is not None and len(lines) == 3:
                        first.set()
    except httpx.HTTPError as e:
        lines.append(f"TRANSPORT {type(e).__name__}")
    out.append(lines)


def run_sigterm(args, tmp: Path) -> dict:
    srv = _server(args, tmp, "--graceful-shutdown-s", "3")
    results: list[list[str]] = []
    events = [threading.Event() for _ in range(8)]
    body = {"prompt": "Once upon a time", "max_tokens": 1800, "ignore_eos": True, "stream": True}
    threads = [threading.Thread(target=_stream_until_end, args=(srv.base_url, dict(body, seed=i), results, events[i]))
               for i in range(8)]
    for t in threads:
        t.start()
    for e in events:
        e.wait(120)
    t_sig = time.monotonic()
    os.kill(srv.proc.pid, signal.SIGTERM)
    time.sleep(0.5)
    during = httpx.post(srv.base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
    for t in threads:
        t.join(120)
    status = srv.proc.wait(60)
    exit_s = time.monotonic() - t_sig
    clean = [ls[-1] == "[DONE]" and (json.loads(ls[-2]).get("error", {}).get("code") == "server_shutting_down"
                                     or json.loads(ls[-2])["choices"][0]["finish_reason"] is not None)
             for ls in results]
    log = [json.loads(x) for x in (tmp / "requests.jsonl").read_text().splitlines()]
    streamed = [r for r in log if r.get("stream") and r["http_status"] in (200, 503)]
    return {"streams": 8, "clean_ends": sum(clean), "exit_status": status, "exit_after_signal_s": round(exit_s, 2),
            "new_request_during_drain": during.status_code, "retry_after": during.headers.get("retry-after"),
            "logged": len(streamed), "logged_finish_reasons": sorted({r["finish_reason"] for r in streamed}),
            "grace_s": 3}


def _itl_clients(base: str, n: int, stop: threading.Event, gaps: list, lock: threading.Lock) -> list[threading.Thread]:
    def loop(i: int) -> None:
        with httpx.Client(base_url=base, timeout=300) as c:
            while not stop.is_set():
                body = {"prompt": f"Story {i}:", "max_tokens": 200, "ignore_eos": True, "stream": True,
                        "temperature": 0}
                last = None
                with c.stream("POST", "/v1/completions", json=body) as r:
                    for line in r.iter_lines():
                        if not line.startswith("data: {"):
                            continue
                        now = time.monotonic()
                        if last is not None:
                            with lock:
                                gaps.append((now, now - last))
                        last = now
                        if stop.is_set():
                            break
    threads = [threading.Thread(target=loop, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def _p99(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=100)[98] if len(xs) >= 100 else max(xs)


def _send_near_limit(base: str, bound_tokens: int) -> list[dict]:
    """Three near-limit prompts at once: one just under the 4 MiB body limit (refused by the size check,
    never tokenized) and two just under the byte bound the size check lets through (tokenized on the
    low-priority thread, then refused as over the token limit)."""
    near_body = {"messages": [{"role": "user", "content": "word " * (4 * 1024 * 1024 // 5 - 200)}], "max_tokens": 5}
    bytes_per_token = 81  # smollm2's longest token (the server measures it itself)
    near_bound = {"prompt": "Paris is lovely. " * (bound_tokens * bytes_per_token // 17 - 10), "max_tokens": 5}
    answers: list[dict] = []

    def one(body: dict) -> None:
        t = time.monotonic()
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r = httpx.post(base + path, json=body, timeout=300)
        answers.append({"status": r.status_code, "code": r.json()["error"]["code"] if r.status_code >= 400 else None,
                        "body_bytes": len(json.dumps(body)), "answer_s": round(time.monotonic() - t, 3)})

    threads = [threading.Thread(target=one, args=(b,)) for b in (near_body, near_bound, near_bound)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return answers


def run_itl(args, tmp: Path) -> dict:
    rounds = []
    with _server(args, tmp) as srv:
        bound = httpx.get(srv.base_url + "/v1/models").json()["data"][0]["specserve"]["max_prompt_tokens"]
        gaps: list[tuple[float, float]] = []
        lock, stop = threading.Lock(), threading.Event()
        threads = _itl_clients(srv.base_url, 4, stop, gaps, lock)
        time.sleep(10)  # warm up
        for _ in range(args.itl_rounds):
            t_idle = time.monotonic()
            time.sleep(args.itl_window_s)
            t_load = time.monotonic()
            answers = _send_near_limit(srv.base_url, bound)
            t_end = time.monotonic() + 0.5
            time.sleep(1.0)
            with lock:
                idle = [g for ts, g in gaps if t_idle <= ts < t_load]
                loaded = [g for ts, g in gaps if t_load <= ts <= t_end]
            rounds.append({"idle_p99_ms": round(1000 * _p99(idle), 1), "loaded_p99_ms": round(1000 * _p99(loaded), 1),
                           "idle_p50_ms": round(1000 * statistics.median(idle), 1),
                           "loaded_p50_ms": round(1000 * statistics.median(loaded), 1),
                           "ratio_p99": round(_p99(loaded) / _p99(idle), 2), "idle_gaps": len(idle),
                           "loaded_gaps": len(loaded), "loaded_window_s": round(t_end - t_load, 2),
                           "near_limit_prompts": answers})
        stop.set()
        for t in threads:
            t.join(120)
    return {"streams": 4, "idle_window_s": args.itl_window_s, "rounds": rounds,
            "max_ratio_p99": max(r["ratio_p99"] for r in rounds),
            "median_ratio_p99": statistics.median(r["ratio_p99"] for r in rounds), "max_prompt_tokens": bound}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("modes", nargs="+", choices=["fuzz", "soak", "sigterm", "itl"])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--soak-s", type=float, default=900.0)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--random-bodies", type=int, default=300)
    ap.add_argument("--itl-window-s", type=float, default=10.0)
    ap.add_argument("--itl-rounds", type=int, default=3)
    ap.add_argument("--work-dir", default="/tmp/specserve_reliability")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = Path(args.out) if args.out else OUT / f"server_reliability_{args.model}.json"
    data = json.loads(out.read_text()) if out.exists() else {}
    for mode in args.modes:
        tmp = Path(args.work_dir) / mode
        tmp.mkdir(parents=True, exist_ok=True)
        t = time.time()
        result = {"fuzz": run_fuzz, "soak": run_soak, "sigterm": run_sigterm, "itl": run_itl}[mode](args, tmp)
        result.update(model=args.model, recorded=time.strftime("%Y-%m-%d %H:%M"), wall_s=round(time.time() - t, 1),
                      machine=f"{os.cpu_count()} CPUs, shared with other developers' work")
        data[mode] = result
        out.write_text(json.dumps(data, indent=1) + "\n")
        print(mode, json.dumps({k: v for k, v in result.items() if k not in ("failures", "rss_samples")}), flush=True)


if __name__ == "__main__":
    main()
