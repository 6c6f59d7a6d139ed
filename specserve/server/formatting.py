"""OpenAI response shapes: bodies, stream chunks, logprobs, the `specserve` block and SSE framing.

What it does: turns engine results into exactly the JSON OpenAI clients parse:
- completions: `text_completion` objects; logprobs as {"tokens", "token_logprobs", "top_logprobs",
  "text_offset"};
- chat: `chat.completion` / `chat.completion.chunk`; logprobs as {"content": [{"token", "logprob",
  "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}], "refusal": null};
- streams with `stream_options.include_usage` end with a usage chunk (`choices: []`); with
  `continuous_usage_stats` too (vLLM's key) every chunk also carries `usage`, whose
  `completion_tokens` counts that chunk's choice's tokens so far (as vLLM does), so a client can count
  the tokens of each chunk exactly;
- every body (and, when streaming, the chunk carrying a finish_reason and the usage chunk) gets
  `"specserve": {"profile", "method", "num_speculative_tokens", "num_drafts", "num_draft_tokens",
  "num_accepted_tokens", "num_accepted_tokens_per_pos", "acceptance_rate", "mean_acceptance_length"}`,
  summed over all choices of the request so far (the last one seen is the request's total).
Token strings are `tokenizer.decode([id])` (a lone piece of a multi-byte character shows as U+FFFD;
`bytes` is its UTF-8 encoding). What it does not do: decide when to send a chunk (see `serving.py`).
"""

from __future__ import annotations

import json
from typing import Any

from specserve.outputs import SpecStats, TokenLogprob

SSE_DONE = "data: [DONE]\n\n"


# Characters that str.splitlines() treats as line ends but JSON leaves raw in strings (json.dumps with
# ensure_ascii=False escapes only those below U+0020): a client that splits an SSE stream into lines that
# way (httpx's `aiter_lines` does) would cut an event in two at a generated U+2028. Escaped, the JSON
# value is the same.
_LINE_END_ESCAPES = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(obj: dict) -> str:
    """One server-sent event carrying `obj` as JSON (UTF-8, compact), with the characters some line
    splitters take for line ends escaped (`_LINE_END_ESCAPES`), so the event is one line for any client."""
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':')).translate(_LINE_END_ESCAPES)}\n\n"


class TokenText:
    """Cached id -> display string for logprobs."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        s = self._cache.get(token_id)
        if s is None:
            try:
                s = self.tokenizer.decode([token_id], skip_special_tokens=False)
            except Exception:  # noqa: BLE001 - an id the tokenizer cannot render
                s = f"<{token_id}>"
            if len(self._cache) < 200_000:
                self._cache[token_id] = s
        return s


def specserve_block(profile: Any, stats: SpecStats) -> dict[str, Any]:
    """The per-response speculation summary the benchmark client reads (names are a contract)."""
    return {
        "profile": profile.name,
        "method": profile.method,
        "num_speculative_tokens": profile.num_speculative_tokens,
        "num_drafts": stats.num_drafts,
        "num_draft_tokens": stats.num_draft_tokens,
        "num_accepted_tokens": stats.num_accepted_tokens,
        "num_accepted_tokens_per_pos": list(stats.num_accepted_tokens_per_pos),
        "acceptance_rate": stats.acceptance_rate,
        "mean_acceptance_length": stats.mean_acceptance_length,
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


# ---- logprobs ----------------------------------------------------------------------------------

def completion_logprobs(lps: list[TokenLogprob], tok: TokenText, offset0: int = 0) -> dict[str, Any]:
    """Legacy completions shape. `offset0` is the text offset of the first token (for stream deltas)."""
    tokens, values, tops, offsets = [], [], [], []
    off = offset0
    for lp in lps:
        s = tok(lp.token_id)
        tokens.append(s)
        values.append(lp.logprob)
        tops.append({tok(t): v for t, v in lp.top})
        offsets.append(off)
        off += len(s)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def _chat_entry(token_id: int, logprob: float, tok: TokenText) -> dict[str, Any]:
    s = tok(token_id)
    return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}


def chat_logprobs(lps: list[TokenLogprob], tok: TokenText) -> dict[str, Any]:
    content = []
    for lp in lps:
        e = _chat_entry(lp.token_id, lp.logprob, tok)
        e["top_logprobs"] = [_chat_entry(t, v, tok) for t, v in lp.top]
        content.append(e)
    return {"content": content, "refusal": None}


# ---- bodies ------------------------------------------------------------------------------------

def completion_body(rid: str, created: int, model: str, choices: list[dict], use: dict, spec_block: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": use, "specserve": spec_block}


def completion_choice(index: int, text: str, logprobs: dict | None, finish_reason: str | None,
                      stop_reason: Any = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


def chat_body(rid: str, created: int, model: str, choices: list[dict], use: dict, spec_block: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": use, "specserve": spec_block}


def chat_choice(index: int, text: str | None, logprobs: dict | None, finish_reason: str | None,
                stop_reason: Any = None, tool_calls: list[dict] | None = None) -> dict:
    """A chat choice; `text` None (the output was only tool calls) is content null, as OpenAI sends it."""
    return {"index": index, "message": {"role": "assistant", "content": text, "tool_calls": tool_calls or []},
            "logprobs": logprobs, "finish_reason": finish_reason, "stop_reason": stop_reason}


def chunk(chat: bool, rid: str, created: int, model: str, index: int, *, text: str | None = None,
          role: str | None = None, logprobs: dict | None = None, finish_reason: str | None = None,
          include_usage: bool = False, chunk_usage: dict | None = None, spec_block: dict | None = None,
          tool_calls: list[dict] | None = None) -> dict:
    """One streamed chunk for one choice (chat: a `delta`, with `tool_calls` deltas when given;
    completions: `text`). With `include_usage` the chunk has a `usage` key: `chunk_usage` (continuous
    usage stats) or null."""
    if chat:
        delta: dict[str, Any] = {}
        if role is not None:
            delta["role"] = role
        if text is not None and (text or not tool_calls):
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "text_completion"
    out: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
    if include_usage:
        out["usage"] = chunk_usage
    if spec_block is not None:
        out["specserve"] = spec_block
    return out


def usage_chunk(chat: bool, rid: str, created: int, model: str, use: dict, spec_block: dict) -> dict:
    obj = "chat.completion.chunk" if chat else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": use,
            "specserve": spec_block}
