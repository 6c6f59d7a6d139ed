"""Streaming load generator for any OpenAI-compatible server (ours, vLLM, SGLang), on httpx async.

What it does: sends each `Sample` as a streamed request (`/v1/chat/completions` for messages,
`/v1/completions` for a prompt), either closed-loop at a fixed concurrency or open-loop with gamma
arrivals (`request_rate` req/s, `burstiness` = gamma shape, 1.0 = Poisson, as vLLM's bench), and keeps
one `RequestRecord` per request: send time, each token-bearing chunk's time and token count, the
stream's last chunk's time, usage, errors, the response id, the profile the server named (header
`x-specserve-profile` or the body's `specserve.profile`; None when it named none), the generated text
and our server's `specserve` numbers when present.

Tokens per chunk (the `token_count_source` of a record), best source first:
- `usage` (exact): every chunk carries the choice's cumulative `usage.completion_tokens` (vLLM's
  `stream_options.continuous_usage_stats`, which we always ask for); count = the increase.
- `logprobs` (exact): every chunk with text carries logprobs (ask with `logprobs=True`); count = its
  logprob entries (one per token).
- `estimate`: otherwise `completion_tokens` is spread evenly over the token-bearing chunks. This is
  NOT a measurement (a speculative server sends several tokens in some chunks and one in others):
  every output that shows per-token ITL labels it an ESTIMATE.
A chunk is token-bearing when it carries text or, by the exact count, at least one token (a token may
detokenize to nothing yet, e.g. part of a UTF-8 character or a stop-string prefix); for the estimate,
the stream's last chunk counts too when it has no text (it usually carries the EOS token). Tokens in
the final usage that no chunk accounted for are added to the last token-bearing chunk, so counts sum
to `completion_tokens`. E2E ends at the stream's last chunk that carries a choice, whatever its text
(`last_chunk_ms`: a stream that ends on EOS has an empty last chunk).
Pieces: `sse_events` reads the stream (arrival time + parsed event), `ChunkCounter` counts tokens
per chunk, `send_one` ties them to one request's record, `run_load` runs the whole load.
What it does not do: compute percentiles (see `metrics.py`) or retry failed requests.
"""
from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import asdict, dataclass, field, replace

import httpx
import numpy as np

from specserve.bench.datasets import Sample


@dataclass
class RequestRecord:
    """One measured request (a row of requests.jsonl). Times in ms are measured from the send."""
    sample_id: str
    segment: str
    profile: str | None = None          # requested profile (None: the server chooses)
    served_profile: str | None = None   # what the server says it used (header or body); None: it did not say
    response_id: str | None = None      # the response's `id` (else the x-request-id header)
    send_time_s: float = 0.0            # seconds since the run started
    chunks: list = field(default_factory=list)  # [[ms since send, tokens], ...] token-bearing chunks only
    token_count_source: str | None = None  # usage | logprobs (exact) | estimate
    output_tokens: int | None = None    # usage.completion_tokens (None: the server sent no usage)
    input_tokens: int | None = None     # usage.prompt_tokens
    last_chunk_ms: float | None = None  # the stream's last chunk with a choice, whatever its text (E2E)
    stream_end_ms: float | None = None  # data: [DONE] (or the end of the body)
    finish_reason: str | None = None
    status: int | None = None
    error: str | None = None
    specserve: dict | None = None
    temperature: float = 0.0
    max_tokens: int = 0
    text: str = ""                      # the generated text (content, reasoning and tool-call pieces)

    def to_dict(self) -> dict:
        return asdict(self)


def request_body(sample: Sample, model: str, profile: str | None, logprobs: bool,
                 ignore_eos: bool = False) -> tuple[str, dict]:
    """(path, JSON body) of the streamed request for one sample; `ignore_eos` sends vLLM's `ignore_eos`
    (generate exactly max_tokens, for throughput runs)."""
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
    if ignore_eos:
        body["ignore_eos"] = True
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


_SSE_EOL = re.compile(r"\r\n|\r|\n")


async def sse_lines(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """The lines of a text stream as the SSE spec (WHATWG HTML, "Parsing an event stream") ends them: at
    CRLF, LF or CR only. Not `str.splitlines()`, which httpx's `aiter_lines` uses: it also ends lines at
    U+2028, U+2029, U+0085 and a few control characters, which a server may send raw inside a JSON string
    (vLLM and specserve before session 16 did), and would cut an event in two."""
    buf = ""
    async for text in chunks:
        buf += text
        lines = _SSE_EOL.split(buf)
        buf = lines.pop()  # the unterminated rest (a CR at the end may be half a CRLF: the next LF is then a blank line)
        for line in lines:
            yield line
    if buf:
        yield buf


async def sse_events(resp: httpx.Response, t0: float) -> AsyncIterator[tuple[float, dict]]:
    """The SSE reader: (ms since `t0`, parsed JSON) for each `data:` event of a streamed response,
    until `data: [DONE]`; other lines (comments, blank separators) are skipped. Lines end only where the
    SSE spec ends them (`sse_lines`).

    Raises:
        ValueError: an event is not valid JSON.
    """
    async for line in sse_lines(resp.aiter_text()):
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield (time.perf_counter() - t0) * 1000, json.loads(data)


@dataclass
class ChunkCounter:
    """The counter: text, finish reason and tokens of each chunk of one stream (module docstring).

    `add(ms, event)` takes the stream's events in order; `chunks(completion_tokens)` then gives the
    `[[ms, tokens], ...]` of the token-bearing chunks and the count's source.
    """

    # (ms, text piece, cumulative usage.completion_tokens or None, logprob entries or None) per chunk with a choice
    events: list = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def last_ms(self) -> float | None:
        """Arrival (ms) of the stream's last chunk that carried a choice, whatever its text."""
        return self.events[-1][0] if self.events else None

    def add(self, ms: float, ev: dict) -> None:
        """Count one event that arrived `ms` after the request was sent (events without choices,
        such as the final usage chunk, carry no tokens of their own)."""
        ch = next((c for c in ev.get("choices") or [] if c.get("index", 0) == 0), None)
        if ch is None:  # the usage chunk, or another choice of an n > 1 request (only choice 0 is measured)
            return
        usage = ev.get("usage")
        cum = usage.get("completion_tokens") if isinstance(usage, dict) else None
        piece = _chunk_text(ch)
        self.pieces.append(piece)
        self.events.append((ms, piece, cum, _n_logprobs(ch)))
        if ch.get("finish_reason"):
            self.finish_reason = ch["finish_reason"]

    def source(self) -> str:
        """`usage` when every chunk carried cumulative usage, else `logprobs` when every chunk with
        text carried logprobs, else `estimate`."""
        ev = self.events
        if ev and all(e[2] is not None for e in ev):
            return "usage"
        if any(e[3] is not None for e in ev) and all(e[3] is not None for e in ev if e[1]):
            return "logprobs"
        return "estimate"

    def chunks(self, total: int | None) -> tuple[list, str | None]:
        """([[ms, tokens], ...], token count source), or ([], None) when no chunk bore a token.
        `total` = usage.completion_tokens (None when the server sent no usage)."""
        src = self.source()
        if src == "estimate":
            last = len(self.events) - 1
            bearing = [e for i, e in enumerate(self.events) if e[1] or (i == last and (total or 0) > 0)]
            if not bearing:
                return [], None
            n = len(bearing)
            each = 1 if total is None else (total // n if total % n == 0 else round(total / n, 6))
            return [[round(e[0], 3), each] for e in bearing], src
        out, prev = [], 0
        for ms, piece, cum, n_lp in self.events:
            if src == "usage":
                n, prev = cum - prev, cum
            else:
                n = n_lp or 0
            if piece or n > 0:
                out.append([round(ms, 3), n])
        if not out:
            return [], None
        counted = sum(c[1] for c in out)
        if total is not None and total > counted:
            out[-1][1] += total - counted
        return out, src


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
    if rec.response_id is None and isinstance(ev.get("id"), str):
        rec.response_id = ev["id"]
    if ev.get("specserve"):
        rec.specserve = ev["specserve"]
        rec.served_profile = rec.specserve.get("profile") or rec.served_profile
    if usage := ev.get("usage"):
        rec.output_tokens = usage.get("completion_tokens", rec.output_tokens)
        rec.input_tokens = usage.get("prompt_tokens", rec.input_tokens)
    return None


async def send_one(client: httpx.AsyncClient, base_url: str, sample: Sample, model: str, t_run0: float,
                   profile: str | None = None, logprobs: bool = False, profile_header: bool = False,
                   ignore_eos: bool = False) -> RequestRecord:
    """Send one streamed request and time it; never raises (errors go into the record)."""
    path, body = request_body(sample, model, None if profile_header else profile, logprobs, ignore_eos)
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
                rec.response_id = resp.headers.get("x-request-id")
                return rec
            async with aclosing(sse_events(resp, t0)) as events:
                async for ms, ev in events:
                    rec.error = _record_event(rec, ev)
                    if rec.error is not None:
                        break
                    counter.add(ms, ev)
            rec.stream_end_ms = (time.perf_counter() - t0) * 1000
            rec.response_id = rec.response_id or resp.headers.get("x-request-id")
    except (httpx.HTTPError, ValueError, OSError) as e:
        rec.error = f"{type(e).__name__}: {e}"[:300]
    rec.text, rec.finish_reason = counter.text, counter.finish_reason
    rec.chunks, rec.token_count_source = counter.chunks(rec.output_tokens)
    rec.last_chunk_ms = None if counter.last_ms is None else round(counter.last_ms, 3)
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


LENGTH_FIELDS = ("max_tokens", "max_completion_tokens", "min_tokens", "n", "best_of")  # dropped when priming


async def prime_prompts(client: httpx.AsyncClient, base_url: str, samples: list[Sample], model: str, *,
                        concurrency: int, **send_kw) -> int:
    """Send every sample once with max_tokens 1 (untimed) before a measured run of the same samples, so
    that every profile of a comparison meets the server's prefix cache in the same state: the prompts'
    keys/values cached. Without it the first profile to send a prompt pays its whole prefill, and at
    concurrency > 1 that prefill also slows the steps of the requests decoding beside it (on the 2-core
    CPU, 4 tool-call requests of ~770 prompt tokens at concurrency 4 took 14.4 s for the profile that
    sent them first against 5.4 s for the baseline after it: 0.66x of the baseline's TPOT, from the
    order alone). A prefix cache, not a response cache: every output token is still computed. The
    cache holds what the server's slots hold (specserve: one prompt per KV slot, `--max-num-seqs`), so
    only a run of at most that many prompts meets all of them cached; a longer run meets the same
    partly cached state for every profile, which keeps the comparison fair but its TTFT not that of
    cached prompts. Length fields of a sample's `extra` (LENGTH_FIELDS) are dropped for the priming
    request. Returns the number of priming requests that failed (their prompts may be cold)."""
    ones = [replace(s, max_tokens=1, extra={k: v for k, v in s.extra.items() if k not in LENGTH_FIELDS})
            for s in samples]
    records, _ = await run_load(client, base_url, ones, model, concurrency=max(1, min(concurrency, len(ones))), **send_kw)
    return sum(1 for r in records if r.error)
