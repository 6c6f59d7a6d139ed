"""A deterministic fake OpenAI-compatible server, for testing the benchmark client without a model.

What it does: serves /v1/models, streamed /v1/chat/completions and /v1/completions, and /metrics.
The output is a function of the prompt (word tokens `w0 w1 ...`, length 4 + hash % 24, capped by
max_tokens; with `ignore_eos` in the body and `honour_ignore_eos`, exactly max_tokens). Profile
`baseline` sends one token per chunk; any other profile "speculates" with k=3 and a fixed acceptance
pattern (0, 1, 2, 3 accepted, repeating), sending accepted + 1 tokens per chunk, and reports exactly
those numbers in the `specserve` field and the `x-specserve-profile` header (unless
`specserve=False`, mimicking vLLM, which names no profile) and in Prometheus counters. With `eos`, a
stream that ends before max_tokens ends as real servers' do: one more chunk, `eos_delay_s` later,
with no text, the EOS token (in usage and logprobs) and finish_reason "stop". Every response has
its own id (`mock-<n>`); the bodies received are kept in `app.state.bodies`. HTTP 500 for: a prompt
containing `FAIL`, the first `fail_first` requests, and requests for a profile in `fail_profiles`
whose prompt hashes to an even number (about half, the same ones every run). With
`speculative_configs`, /v1/models carries them as a specserve server does (`specserve.speculative_configs`).
What it does not do: generate text, batch, or honour other sampling parameters.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import threading
import time
from collections import defaultdict

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

K = 3
PATTERN = (0, 1, 2, 3)


def plan_exact(n: int, speculate: bool) -> tuple[list[int], list[int]]:
    """(tokens per chunk, accepted per step) of an output of exactly n tokens (`ignore_eos` honoured)."""
    chunks, acc, step = [], [], 0
    while sum(chunks) < n:
        a = min(PATTERN[step % len(PATTERN)], n - sum(chunks) - 1) if speculate else 0
        if speculate:
            acc.append(a)
        chunks.append(a + 1)
        step += 1
    return chunks, acc


def plan(prompt_key: str, max_tokens: int, speculate: bool) -> tuple[list[int], list[int]]:
    """(tokens per chunk, accepted per step) for a prompt; deterministic."""
    h = int(hashlib.sha256(prompt_key.encode()).hexdigest(), 16)
    return plan_exact(min(max_tokens, 4 + h % 24), speculate)


def make_app(specserve: bool = True, delay_s: float = 0.003, continuous_usage: bool = False,
             default_profile: str = "baseline", eos: bool = False, eos_delay_s: float = 0.0,
             honour_ignore_eos: bool = True, fail_first: int = 0, fail_profiles: tuple = (),
             speculative_configs: dict | None = None) -> FastAPI:
    app = FastAPI()
    app.state.bodies = []
    counters: dict = defaultdict(float)

    @app.get("/v1/models")
    async def models():
        entry = {"id": "mock-model", "object": "model"}
        if speculative_configs is not None:  # as a specserve server lists its profiles' effective configs
            entry["specserve"] = {"profiles": list(speculative_configs), "speculative_configs": speculative_configs}
        return {"object": "list", "data": [entry]}

    @app.get("/metrics")
    async def metrics():
        lines = ["# TYPE process_resident_memory_bytes gauge", "process_resident_memory_bytes 123456789.0"]
        for (name, labels), v in sorted(counters.items()):
            lab = ",".join(f'{k}="{x}"' for k, x in labels)
            lines.append(f"specserve:spec_decode_{name}_total{{{lab}}} {v}")
        return PlainTextResponse("\n".join(lines) + "\n")

    async def handle(req: Request, chat: bool):
        body = await req.json()
        app.state.bodies.append(body)
        rid = f"mock-{len(app.state.bodies)}"
        profile = body.get("profile") or req.headers.get("x-specserve-profile") or default_profile
        key = json.dumps(body.get("messages") if chat else body.get("prompt"))
        even = int(hashlib.sha256(key.encode()).hexdigest(), 16) % 2 == 0
        if "FAIL" in key or len(app.state.bodies) <= fail_first or (profile in fail_profiles and even):
            return JSONResponse({"error": {"message": "injected failure", "type": "server_error"}}, status_code=500)
        speculative = profile != "baseline"
        max_tokens = int(body.get("max_tokens") or 16)
        fixed = bool(body.get("ignore_eos")) and honour_ignore_eos
        chunks, acc = plan_exact(max_tokens, speculative) if fixed else plan(key, max_tokens, speculative)
        with_eos = eos and not fixed and sum(chunks) < max_tokens
        total = sum(chunks) + with_eos
        stats = {"profile": profile, "method": "ngram" if speculative else None, "num_speculative_tokens": K if speculative else None,
                 "num_drafts": len(acc), "num_draft_tokens": K * len(acc), "num_accepted_tokens": sum(acc),
                 "num_accepted_tokens_per_pos": [sum(a > i for a in acc) for i in range(K)] if speculative else [],
                 "acceptance_rate": sum(acc) / (K * len(acc)) if acc else None,
                 "mean_acceptance_length": 1 + sum(acc) / len(acc) if acc else None}
        pl = (("profile", profile),)
        counters[("num_drafts", pl)] += stats["num_drafts"]
        counters[("num_draft_tokens", pl)] += stats["num_draft_tokens"]
        counters[("num_accepted_tokens", pl)] += stats["num_accepted_tokens"]
        for i, x in enumerate(stats["num_accepted_tokens_per_pos"]):
            counters[("num_accepted_tokens_per_pos", (("position", str(i)), ("profile", profile)))] += x
        want_lp = bool(body.get("logprobs")) or body.get("logprobs") == 0
        cont = continuous_usage and (body.get("stream_options") or {}).get("continuous_usage_stats")
        obj = "chat.completion.chunk" if chat else "text_completion"

        sends = [(delay_s, [f" w{sum(chunks[:i]) + j}" for j in range(n)], None) for i, n in enumerate(chunks)]
        if with_eos:
            sends.append((eos_delay_s or delay_s, ["</s>"], "stop"))
        else:
            sends[-1] = (*sends[-1][:2], "length")

        async def gen():
            done = 0
            for delay, toks, finish in sends:
                await asyncio.sleep(delay)
                n, text = len(toks), "".join(t for t in toks if t != "</s>")
                done += n
                choice = {"index": 0, "finish_reason": finish}
                if chat:
                    choice["delta"] = {"content": text}
                    if want_lp:
                        choice["logprobs"] = {"content": [{"token": t, "logprob": -0.1} for t in toks]}
                else:
                    choice["text"] = text
                    if want_lp:
                        choice["logprobs"] = {"tokens": toks, "token_logprobs": [-0.1] * n}
                ev = {"id": rid, "object": obj, "created": int(time.time()), "model": "mock-model", "choices": [choice]}
                if cont:
                    ev["usage"] = {"prompt_tokens": 7, "completion_tokens": done, "total_tokens": 7 + done}
                if specserve and choice["finish_reason"]:
                    ev["specserve"] = stats
                yield f"data: {json.dumps(ev)}\n\n"
            last = {"id": rid, "object": obj, "model": "mock-model", "choices": [],
                    "usage": {"prompt_tokens": 7, "completion_tokens": total, "total_tokens": 7 + total}}
            if specserve:
                last["specserve"] = stats
            yield f"data: {json.dumps(last)}\n\ndata: [DONE]\n\n"
        headers = {"x-specserve-profile": profile} if specserve else {}
        return StreamingResponse(gen(), media_type="text/event-stream", headers=headers)

    @app.post("/v1/chat/completions")
    async def chat(req: Request):
        return await handle(req, True)

    @app.post("/v1/completions")
    async def completions(req: Request):
        return await handle(req, False)

    return app


class MockServer:
    """Run `make_app(**kw)` with uvicorn in a background thread: `with MockServer() as url: ...`."""

    def __init__(self, port: int = 0, **kw):
        self.config = uvicorn.Config(make_app(**kw), host="127.0.0.1", port=port, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(self.config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/v1"

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=10)
