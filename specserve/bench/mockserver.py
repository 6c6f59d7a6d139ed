"""A deterministic fake OpenAI-compatible server, for testing the benchmark client without a model.

What it does: serves /v1/models, streamed /v1/chat/completions and /v1/completions, and /metrics.
The output is a function of the prompt (word tokens `w0 w1 ...`, length 4 + hash % 24, capped by
max_tokens). Profile `baseline` sends one token per chunk; any other profile "speculates" with k=3
and a fixed acceptance pattern (0, 1, 2, 3 accepted, repeating), sending accepted + 1 tokens per
chunk, and reports exactly those numbers in the `specserve` field (unless `specserve=False`,
mimicking vLLM) and in Prometheus counters. A prompt containing `FAIL` gets HTTP 500.
What it does not do: generate text, batch, or honour sampling parameters.
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


def plan(prompt_key: str, max_tokens: int, speculate: bool) -> tuple[list[int], list[int]]:
    """(tokens per chunk, accepted per step) for a prompt; deterministic."""
    h = int(hashlib.sha256(prompt_key.encode()).hexdigest(), 16)
    n = min(max_tokens, 4 + h % 24)
    chunks, acc, step = [], [], 0
    while sum(chunks) < n:
        left = n - sum(chunks)
        if speculate:
            a = min(PATTERN[step % len(PATTERN)], left - 1)
            acc.append(a)
            chunks.append(a + 1)
        else:
            chunks.append(1)
        step += 1
    return chunks, acc


def make_app(specserve: bool = True, delay_s: float = 0.003, continuous_usage: bool = False,
             default_profile: str = "baseline") -> FastAPI:
    app = FastAPI()
    counters: dict = defaultdict(float)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "mock-model", "object": "model"}]}

    @app.get("/metrics")
    async def metrics():
        lines = ["# TYPE process_resident_memory_bytes gauge", "process_resident_memory_bytes 123456789.0"]
        for (name, labels), v in sorted(counters.items()):
            lab = ",".join(f'{k}="{x}"' for k, x in labels)
            lines.append(f"specserve:spec_decode_{name}_total{{{lab}}} {v}")
        return PlainTextResponse("\n".join(lines) + "\n")

    async def handle(req: Request, chat: bool):
        body = await req.json()
        profile = body.get("profile") or req.headers.get("x-specserve-profile") or default_profile
        key = json.dumps(body.get("messages") if chat else body.get("prompt"))
        if "FAIL" in key:
            return JSONResponse({"error": {"message": "injected failure", "type": "server_error"}}, status_code=500)
        speculative = profile != "baseline"
        chunks, acc = plan(key, int(body.get("max_tokens") or 16), speculative)
        total = sum(chunks)
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

        async def gen():
            done = 0
            for i, n in enumerate(chunks):
                await asyncio.sleep(delay_s)
                toks = [f" w{done + j}" for j in range(n)]
                done += n
                choice = {"index": 0, "finish_reason": "length" if i == len(chunks) - 1 else None}
                if chat:
                    choice["delta"] = {"content": "".join(toks)}
                    if want_lp:
                        choice["logprobs"] = {"content": [{"token": t, "logprob": -0.1} for t in toks]}
                else:
                    choice["text"] = "".join(toks)
                    if want_lp:
                        choice["logprobs"] = {"tokens": toks, "token_logprobs": [-0.1] * n}
                ev = {"id": "x", "object": obj, "created": int(time.time()), "model": "mock-model", "choices": [choice]}
                if cont:
                    ev["usage"] = {"prompt_tokens": 7, "completion_tokens": done, "total_tokens": 7 + done}
                if specserve and choice["finish_reason"]:
                    ev["specserve"] = stats
                yield f"data: {json.dumps(ev)}\n\n"
            last = {"id": "x", "object": obj, "model": "mock-model", "choices": [],
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
