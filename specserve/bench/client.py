"""Streaming load generator for any OpenAI-compatible server (ours, vLLM, SGLang), on httpx async.

What it does: sends each `Sample` as a streamed request (`/v1/chat/completions` for messages,
`/v1/completions` for a prompt), either closed-loop at a fixed concurrency or open-loop with gamma
arrivals (`request_rate` req/s, `burstiness` = gamma shape, 1.0 = Poisson, as vLLM's bench), and keeps
one `RequestRecord` per request: send time, each token-bearing chunk's time and token count, usage,
errors, the served profile and our server's `specserve` numbers when present.

Tokens per chunk (the `token_count_source` of a record), best source first:
- `usage`: the chunk carries cumulative `usage.completion_tokens` (vLLM with
  `stream_options.continuous_usage_stats`, which we always ask for); count = increase since the last
  token-bearing chunk.
- `logprobs`: with `logprobs=True`, the number of logprob entries in the chunk (one per token).
- `chunks`: otherwise each token-bearing chunk counts as `completion_tokens / #chunks` (an even spread,
  approximate when a server sends several tokens in some chunks and one in others).
A chunk is token-bearing when it carries text or, by usage or logprobs, at least one token (a token
may detokenize to nothing yet, e.g. part of a UTF-8 character); tokens in the final usage that no
chunk accounted for are added to the last one, so counts sum to `completion_tokens`. A stream with
tokens but no text and no counts gets one token-bearing chunk at its `finish_reason` chunk.
Pieces: `sse_events` reads the stream (arrival time + parsed event), `ChunkCounter` counts tokens
per chunk, `send_one` ties them to one request's record, `run_load` runs the whole load.
What it does not do: compute percentiles (see `metrics.py`) or retry failed requests.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import asdict, dataclass, field

import httpx
import numpy as np

from specserve.bench.datasets import Sample


@dataclass
class RequestRecord:
    sample_id: str
    segment: str
    profile: str | None = None          # requested profile (None: the server chooses)
    served_profile: str | None = None   # what the server says it used (header or body)
    send_time_s: float = 0.0            # seconds since the run started
    chunks: list = field(default_factory=list)  # [[ms since send, tokens], ...] token-bearing chunks only
    token_count_source: str | None = None
    output_tokens: int | None = None    # usage.completion_tokens
    input_tokens: int | None = None     # usage.prompt_tokens
    stream_end_ms: float | None = None
    finish_reason: str | None = None
    status: int | None = None
    error: str | None = None
    specserve: dict | None = None
    temperature: float = 0.0
    max_tokens: int = 0
    text: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def request_body(sample: Sample, model: str, profile: str | None, logprobs: bool) -> tuple[str, dict]:
    """(path, JSON body) of the streamed request for one sample."""
    body: dict = {"model": model, "max_tokens": sample.max_tokens, "temperature": sample.temperature,
                  "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if sample.messages is not None:
        path, body["messages"] = "/chat/completions", sample.messages
        if sample.tools:
            body["tools"] = sample.tools
        if logprobs:
            body["logprobs"] = True
    else:
        path, body["prompt"] = "/completions", sample.prompt
        if logprobs:
            body["logprobs"] = 0
    if profile:
        body["profile"] = profile
    body.update(sample.extra)
    return path, body


def _chunk_text(choice: dict) -> str:
    if "text" in choice:  # completions
        return choice.get("text") or ""
    d = choice.get("delta") or {}
    parts = [d.get("content") or "", d.get("reasoning_content") or d.get("reasoning") or ""]
    for tc in d.get("tool_calls") or []:
        fn = tc.get("function") or {}
        parts += [fn.get("name") or "", fn.get("arguments") or ""]
    return "".join(parts)


def _n_logprobs(choice: dict) -> int | None:
    lp = choice.get("logprobs")
    if not lp:
        return None
    if isinstance(lp.get("content"), list):  # chat
        return len(lp["content"])
    if isinstance(lp.get("tokens"), list):  # completions
        return len(lp["tokens"])
    return None


def _counts(snaps: list, usage_mode: bool, lp_mode: bool, total: int | None) -> tuple[list, str]:
    """Token counts per token-bearing chunk from (t, cum_usage, cum_logprobs) snapshots."""
    if usage_mode or lp_mode:
        idx, src = (1, "usage") if usage_mode else (2, "logprobs")
        cum = [s[idx] for s in snaps]
        counts = [b - a for a, b in zip([0] + cum[:-1], cum)]
        if total is not None and total > cum[-1]:
            counts[-1] += total - cum[-1]
        return counts, src
    n = len(snaps)
    if total is None or total == n:
        return [1] * n, "chunks"
    return [round(total / n, 6)] * n, "chunks"


async def sse_events(resp: httpx.Response, t0: float) -> AsyncIterator[tuple[float, dict]]:
    """The SSE reader: (ms since `t0`, parsed JSON) for each `data:` event of a streamed response,
    until `data: [DONE]`; other lines (comments, blank separators) are skipped.

    Raises:
        ValueError: an event is not valid JSON.
    """
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield (time.perf_counter() - t0) * 1000, json.loads(data)


@dataclass
class ChunkCounter:
    """The counter: the text, finish reason and tokens of each token-bearing chunk of one stream.

    `add(ms, event)` takes the stream's events in order; `chunks(completion_tokens)` then gives the
    `[[ms, tokens], ...]` of the token-bearing chunks and the count's source (module docstring).
    """

    snaps: list = field(default_factory=list)  # (ms, cum usage tokens, cum logprob tokens) per token-bearing chunk
    cum_usage: int = 0
    cum_lp: int = 0
    usage_mode: bool = False
    lp_mode: bool = False
    pieces: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    finish_ms: float | None = None

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def add(self, ms: float, ev: dict) -> None:
        """Count one event that arrived `ms` after the request was sent."""
        usage, choices = ev.get("usage"), ev.get("choices") or []
        if not choices:
            return
        if usage and usage.get("completion_tokens") is not None:
            self.usage_mode, self.cum_usage = True, usage["completion_tokens"]
        ch = choices[0]
        n_lp = _n_logprobs(ch)
        if n_lp is not None:
            self.lp_mode, self.cum_lp = True, self.cum_lp + n_lp
        piece = _chunk_text(ch)
        self.pieces.append(piece)
        last = self.snaps[-1] if self.snaps else (0, 0, 0)
        if piece or self.cum_usage > last[1] or self.cum_lp > last[2]:  # text, or tokens the text holds back
            self.snaps.append((ms, self.cum_usage, self.cum_lp))
        if ch.get("finish_reason"):
            self.finish_reason, self.finish_ms = ch["finish_reason"], ms

    def chunks(self, total: int | None) -> tuple[list, str | None]:
        """([[ms, tokens], ...], token count source), or ([], None) when no chunk bore a token.
        `total` = usage.completion_tokens (None when the server sent no usage)."""
        snaps = self.snaps
        if not snaps and self.finish_ms is not None and (total or 0) > 0:
            snaps = [(self.finish_ms, self.cum_usage, self.cum_lp)]  # tokens with no text at all (partial UTF-8)
        if not snaps:
            return [], None
        counts, source = _counts(snaps, self.usage_mode, self.lp_mode, total)
        return [[round(s[0], 3), c] for s, c in zip(snaps, counts)], source


async def _http_error(resp: httpx.Response) -> str:
    raw = (await resp.aread()).decode(errors="replace")
    try:
        raw = json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        pass
    return f"HTTP {resp.status_code}: {str(raw)[:300]}"


def _record_event(rec: RequestRecord, ev: dict) -> str | None:
    """Copy what an event says about the whole request (usage, the `specserve` block) into `rec`;
    returns the error message of an error event, else None."""
    if "error" in ev and "choices" not in ev:
        err = ev["error"]
        return f"stream error: {err.get('message', err) if isinstance(err, dict) else err}"
    if ev.get("specserve"):
        rec.specserve = ev["specserve"]
        rec.served_profile = rec.specserve.get("profile") or rec.served_profile
    if usage := ev.get("usage"):
        rec.output_tokens = usage.get("completion_tokens", rec.output_tokens)
        rec.input_tokens = usage.get("prompt_tokens", rec.input_tokens)
    return None


async def send_one(client: httpx.AsyncClient, base_url: str, sample: Sample, model: str, t_run0: float,
                   profile: str | None = None, logprobs: bool = False, profile_header: bool = False) -> RequestRecord:
    """Send one streamed request and time it; never raises (errors go into the record)."""
    path, body = request_body(sample, model, None if profile_header else profile, logprobs)
    headers = {"x-specserve-profile": profile} if (profile and profile_header) else {}
    rec = RequestRecord(sample.id, sample.segment, profile=profile, temperature=sample.temperature,
                        max_tokens=sample.max_tokens)
    counter = ChunkCounter()
    t0 = time.perf_counter()
    rec.send_time_s = t0 - t_run0
    try:
        async with client.stream("POST", base_url.rstrip("/") + path, json=body, headers=headers) as resp:
            rec.status = resp.status_code
            rec.served_profile = resp.headers.get("x-specserve-profile")
            if resp.status_code != 200:
                rec.error = await _http_error(resp)
                return rec
            async with aclosing(sse_events(resp, t0)) as events:
                async for ms, ev in events:
                    rec.error = _record_event(rec, ev)
                    if rec.error is not None:
                        break
                    counter.add(ms, ev)
            rec.stream_end_ms = (time.perf_counter() - t0) * 1000
    except (httpx.HTTPError, ValueError, OSError) as e:
        rec.error = f"{type(e).__name__}: {e}"[:300]
    rec.text, rec.finish_reason = counter.text, counter.finish_reason
    rec.chunks, rec.token_count_source = counter.chunks(rec.output_tokens)
    if not rec.chunks and not rec.error:
        rec.error = "empty response: no token-bearing chunk"
    if not rec.error and rec.finish_reason is None:
        rec.error = "stream ended without a finish_reason"
    return rec


def arrival_offsets(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send offsets (s) of n requests: gamma gaps with mean 1/request_rate and shape `burstiness`."""
    if request_rate == float("inf"):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)
    gaps[0] = 0.0
    return list(np.cumsum(gaps))


async def run_load(client: httpx.AsyncClient, base_url: str, samples: list[Sample], model: str, *,
                   concurrency: int | None = None, request_rate: float | None = None, burstiness: float = 1.0,
                   max_concurrency: int | None = None, seed: int = 0, on_done=None,
                   **send_kw) -> tuple[list[RequestRecord], float]:
    """Run all samples once; returns (records in sample order, wall time in s from first send to last end).

    Closed loop when `concurrency` is set (that many requests always in flight), otherwise open loop
    at `request_rate` req/s (optionally capped at `max_concurrency` in flight). `on_done(record)` is
    called as each request finishes (progress bars).
    """
    records: list = [None] * len(samples)
    t0 = time.perf_counter()

    async def one(i: int):
        records[i] = await send_one(client, base_url, samples[i], model, t0, **send_kw)
        if on_done:
            on_done(records[i])

    if concurrency:
        queue = iter(range(len(samples)))

        async def worker():
            for i in queue:
                await one(i)
        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(samples)))))
    else:
        sem = asyncio.Semaphore(max_concurrency or len(samples) or 1)

        async def timed(i: int, at: float):
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
            async with sem:
                await one(i)
        offs = arrival_offsets(len(samples), request_rate or float("inf"), burstiness, seed)
        await asyncio.gather(*(timed(i, at) for i, at in enumerate(offs)))
    return records, time.perf_counter() - t0
