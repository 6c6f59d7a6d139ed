"""A stub OpenAI-compatible backend for the gateway's tests and its overhead benchmark.

What it does: /v1/completions and /v1/chat/completions, streamed or not, answering with a fixed
function of the prompt (so greedy replays compare equal) after `delay_s`; /health (503 when
`healthy` is False), /v1/models, /metrics (vLLM-style speculation counters when `vllm_counters`).
Behaviour is set on its `StubState` (in-process) or by command-line flags (as a process, for kill tests
and the benchmark): fail with `fail_status`, stream `n_chunks` events `chunk_delay_s` apart, report a
`specserve` block with `acceptance` (num_drafts, num_accepted_tokens), change its text (`lossy`). It
records the requests it got and counts streams the client abandoned (`disconnects`).
What it does not do: generate text. Never use it to serve.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import json
import time
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse


@dataclass
class StubState:
    name: str = "stub"
    healthy: bool = True
    delay_s: float = 0.0
    fail_status: int | None = None
    n_chunks: int = 4
    chunk_delay_s: float = 0.0
    acceptance: tuple[int, int] | None = None  # (num_drafts, num_accepted_tokens) per response
    lossy: bool = False
    vllm_counters: bool = False
    model: str = "stub-model"
    record: bool = True  # keep each request in `requests` (off for the benchmark: no growing list)
    requests: list[dict] = field(default_factory=list)
    disconnects: int = 0
    finished_streams: int = 0
    drafts_total: int = 0
    accepted_total: int = 0


def words(prompt: str, n: int, lossy: bool = False) -> list[str]:
    h = hashlib.sha256(prompt.encode()).hexdigest()
    out = [f"w{h[i % 60:i % 60 + 2]}" for i in range(n)]
    if lossy and n > 1:
        out[1] = "zz"
    return out


def make_stub_app(state: StubState) -> FastAPI:
    app = FastAPI()
    app.state.stub = state

    @app.get("/health")
    async def health():
        return Response(status_code=200 if state.healthy else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.model, "object": "model"}]}

    @app.get("/metrics")
    async def metrics():
        lines = []
        if state.vllm_counters:
            lines = [f'vllm:spec_decode_num_drafts_total{{model_name="{state.model}"}} {state.drafts_total}',
                     f'vllm:spec_decode_num_draft_tokens_total{{model_name="{state.model}"}} {4 * state.drafts_total}',
                     f'vllm:spec_decode_num_accepted_tokens_total{{model_name="{state.model}"}} '
                     f'{state.accepted_total}']
        return PlainTextResponse("\n".join(lines) + "\n")

    async def handle(request: Request, chat: bool):
        raw = await request.body()
        body = json.loads(raw)
        if state.record:
            state.requests.append({"body": body, "headers": dict(request.headers), "t": time.time()})
        if state.delay_s:
            await asyncio.sleep(state.delay_s)
        if state.fail_status:
            return JSONResponse({"error": {"message": f"{state.name} fails on purpose", "type": "server_error",
                                           "param": None, "code": str(state.fail_status)}},
                                status_code=state.fail_status, headers={"Retry-After": "1"})
        prompt = json.dumps(body.get("messages") if chat else body.get("prompt"))
        n = min(int(body.get("max_tokens") or 8), max(1, state.n_chunks))
        toks = words(prompt, n, state.lossy)
        spec = None
        if state.acceptance:
            d, a = state.acceptance
            spec = {"profile": state.name, "num_drafts": d, "num_draft_tokens": 4 * d, "num_accepted_tokens": a,
                    "mean_acceptance_length": 1 + a / d if d else None}
            state.drafts_total += d
            state.accepted_total += a
        usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": n,
                 "total_tokens": len(prompt.split()) + n}
        rid = "cmpl-stub"
        if not body.get("stream"):
            text = " ".join(toks)
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                      if chat else {"index": 0, "text": text, "finish_reason": "length"})
            out = {"id": rid, "object": "chat.completion" if chat else "text_completion", "model": state.model,
                   "choices": [choice], "usage": usage}
            if spec:
                out["specserve"] = spec
            return JSONResponse(out)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        async def events():
            done = False
            try:
                if chat:
                    yield _sse({"id": rid, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
                for i, t in enumerate(toks):
                    if state.chunk_delay_s:
                        await asyncio.sleep(state.chunk_delay_s)
                    last = i == len(toks) - 1
                    piece = t if i == 0 else " " + t
                    c = ({"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece})
                    c["finish_reason"] = "length" if last else None
                    ev = {"id": rid, "choices": [c]}
                    if last and spec:
                        ev["specserve"] = spec
                    yield _sse(ev)
                if include_usage:
                    yield _sse({"id": rid, "choices": [], "usage": usage})
                yield b"data: [DONE]\n\n"
                done = True
                state.finished_streams += 1
            finally:
                if not done:
                    state.disconnects += 1

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


def _sse(ev: dict) -> bytes:
    return b"data: " + json.dumps(ev).encode() + b"\n\n"


def main() -> None:
    import uvicorn

    p = argparse.ArgumentParser(description="stub OpenAI-compatible backend (tests and benchmarks only)")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--name", default="stub")
    p.add_argument("--delay-s", type=float, default=0.0)
    p.add_argument("--n-chunks", type=int, default=4)
    p.add_argument("--chunk-delay-s", type=float, default=0.0)
    p.add_argument("--no-record", action="store_true", help="do not keep the requests (long benchmark runs)")
    a = p.parse_args()
    state = StubState(name=a.name, delay_s=a.delay_s, n_chunks=a.n_chunks, chunk_delay_s=a.chunk_delay_s,
                      record=not a.no_record)
    app = make_stub_app(state)
    # as a process (the overhead benchmark's backend): the start-up heap (FastAPI, pydantic) out of the
    # collector's full passes, which otherwise take ~25 ms of CPU and stall answers in both arms
    gc.collect()
    gc.freeze()
    uvicorn.run(app, host="127.0.0.1", port=a.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
