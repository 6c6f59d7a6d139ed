"""Commit tokens to a request one by one, with every per-token check (docs/speculation-cases.md B02, B03, B06, B07).

What it does: for each token of a verified block, in order: append it (and its logprob), then check
EOS, stop token ids, stop strings (on incrementally detokenized text), max_tokens and the context
length; the first condition that holds finishes the request and the rest of the block is dropped.
Nothing after a stop reaches the text, the token ids, the logprobs or the usage counts.
What it does not do: touch the KV cache or the speculation counters (the engine does, using the
returned count of committed tokens).

Cost: a request without stop strings has its whole block detokenized in one incremental step (two
tokenizer calls per block instead of two per token: at 16 concurrent requests on a GPU that per-token
Python was a large part of the commit); with stop strings every token is detokenized on its own, since
the token that completes a stop string decides how many are committed.

Policy (the same with and without speculation): an EOS or stop token id that ends a request is kept in
`token_ids` (and counted in usage) but not in the text; a stop string is cut from the text, and the
token that completed it is the last token id returned.
"""

from __future__ import annotations

from specserve.outputs import TokenLogprob
from specserve.request import Request


def _decode(tokenizer, ids: list[int], skip_special: bool) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # a fast tokenizer: its decode without transformers' wrapper (~3x less per call)
        return backend.decode(ids, skip_special_tokens=skip_special)
    return tokenizer.decode(ids, skip_special_tokens=skip_special, clean_up_tokenization_spaces=False)


def detokenize_incrementally(tokenizer, req: Request, end: int | None = None) -> str:
    """Text added by the tokens of `req.all_token_ids[read_offset:end]` (vLLM's prefix/read offset
    scheme; `end` defaults to all of them, so a block of several new tokens is decoded at once).

    Returns "" while the newest bytes do not yet form a complete character (U+FFFD at the end); the
    offsets then stay where they were, so the next call decodes those tokens again.
    """
    ids = req.all_token_ids
    end = len(ids) if end is None else end
    skip = req.params.skip_special_tokens
    prefix_text = _decode(tokenizer, ids[req.prefix_offset : req.read_offset], skip)
    new_text = _decode(tokenizer, ids[req.prefix_offset : end], skip)
    if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
        req.prefix_offset, req.read_offset = req.read_offset, end
        return new_text[len(prefix_text) :]
    return ""


def _detokenize_block(tokenizer, req: Request, first_new: int) -> str:
    """All text the tokens after `req.read_offset` add, decoded in one step when the block ends on a
    complete character; otherwise token by token, so that the complete characters before an
    incomplete last one are emitted now, exactly as one-token-at-a-time commits emit them.

    `first_new`: index in `req.all_token_ids` of the block's first token. The token-by-token pass starts
    there, not at the read offset: ends before it were tried by earlier commits with the same offsets
    and gave nothing, and would again. Starting at the read offset made a request whose text stays
    incomplete (tokens that decode to nothing, or to a byte sequence that never completes a character)
    decode every pending token again at every step: ~72 tokenizer calls per token at 16 concurrent
    requests of a tiny random model."""
    text = detokenize_incrementally(tokenizer, req)
    start = max(req.read_offset, first_new) + 1
    if text or len(req.all_token_ids) - start < 1:
        return text
    return "".join(detokenize_incrementally(tokenizer, req, j) for j in range(start, len(req.all_token_ids) + 1))


def _check_stop_strings(req: Request, new_text_len: int) -> bool:
    """Cut req.text at the first stop string that the newest text completed. True if one did."""
    stops = req.params.stop
    if not stops or not new_text_len:
        return False
    longest = max(len(s) for s in stops)
    start = max(len(req.text) - new_text_len - longest + 1, 0)
    best = None
    for s in stops:
        i = req.text.find(s, start)
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    if best is None:
        return False
    req.text = req.text[: best[0]]
    req.finish_reason, req.stop_reason = "stop", best[1]
    return True


def commit_tokens(
    req: Request,
    token_ids: list[int],
    logprobs: list[TokenLogprob] | None,
    tokenizer,
    eos_token_ids: tuple[int, ...],
    max_model_len: int,
) -> int:
    """Append tokens to `req` until one finishes it.

    Args:
        token_ids: verified tokens in order (accepted drafts + recovered/bonus).
        logprobs: their logprobs, or None.
        eos_token_ids: the model's EOS ids (ignored when params.ignore_eos).

    Returns:
        How many of `token_ids` were committed (the rest are dropped). `req.finish_reason` is set when
        the request finished.
    """
    if not req.params.stop:
        return _commit_block(req, token_ids, logprobs, tokenizer, eos_token_ids, max_model_len)
    return _commit_each(req, token_ids, logprobs, tokenizer, eos_token_ids, max_model_len)


def _commit_each(req: Request, token_ids: list[int], logprobs: list[TokenLogprob] | None, tokenizer,
                 eos_token_ids: tuple[int, ...], max_model_len: int) -> int:
    """`commit_tokens` one token at a time, detokenizing each (needed for stop strings)."""
    p = req.params
    for i, t in enumerate(token_ids):
        req.all_token_ids.append(t)
        if req.logprobs is not None and logprobs is not None:
            req.logprobs.append(logprobs[i])
        n_out = req.num_output_tokens
        if _stops_by_id(req, t, n_out, eos_token_ids):
            # the stop token is kept in token_ids but produces no text
            req.prefix_offset = req.read_offset = len(req.all_token_ids)
            return i + 1
        delta = detokenize_incrementally(tokenizer, req)
        req.text += delta
        if n_out >= p.min_tokens and _check_stop_strings(req, len(delta)):
            return i + 1
        if _stops_by_length(req, n_out, len(req.all_token_ids), max_model_len):
            return i + 1
    return len(token_ids)


def _stops_by_id(req: Request, t: int, n_out: int, eos_token_ids: tuple[int, ...]) -> bool:
    """Token `t`, the request's `n_out`-th output token, is EOS or a stop token id past min_tokens (the
    sampler masks them below min_tokens; this is a guard): finish with "stop"."""
    p = req.params
    if ((t in eos_token_ids and not p.ignore_eos) or t in p.stop_token_ids) and n_out > p.min_tokens:
        req.finish_reason = "stop"
        req.stop_reason = t if t in p.stop_token_ids else None
        return True
    return False


def _stops_by_length(req: Request, n_out: int, n_ids: int, max_model_len: int) -> bool:
    """`n_out` output tokens reach max_tokens, or `n_ids` tokens the context length: finish with "length"."""
    if (req.params.max_tokens is not None and n_out >= req.params.max_tokens) or n_ids >= max_model_len:
        req.finish_reason = "length"
        return True
    return False


def _commit_block(req: Request, token_ids: list[int], logprobs: list[TokenLogprob] | None, tokenizer,
                  eos_token_ids: tuple[int, ...], max_model_len: int) -> int:
    """`commit_tokens` for a request without stop strings: the same checks in the same order, with
    the text of the committed tokens decoded once for the block."""
    n_out0, n_ids0 = req.num_output_tokens, len(req.all_token_ids)
    n, stop_token = len(token_ids), False
    for i, t in enumerate(token_ids):
        n_out = n_out0 + i + 1
        if _stops_by_id(req, t, n_out, eos_token_ids):
            n, stop_token = i + 1, True
            break
        if _stops_by_length(req, n_out, n_ids0 + i + 1, max_model_len):
            n = i + 1
            break
    text_n = n - 1 if stop_token else n  # an EOS / stop token id produces no text
    req.all_token_ids.extend(token_ids[:text_n])
    if text_n:
        req.text += _detokenize_block(tokenizer, req, n_ids0)
    if stop_token:
        req.all_token_ids.append(token_ids[n - 1])
        req.prefix_offset = req.read_offset = len(req.all_token_ids)
    if req.logprobs is not None and logprobs is not None:
        req.logprobs.extend(logprobs[:n])
    return n


def visible_text_len(req: Request) -> int:
    """How much of req.text may be streamed now: all of it once finished, otherwise all but the
    longest tail that could still grow into a stop string (so no stop-string prefix is sent early).

    Cost per call: for each stop string s, a scan of the last len(s) - 1 characters (stop strings are
    capped at 512 characters by SamplingParams), independent of the text's length.
    """
    text = req.text
    if req.finish_reason is not None or not req.params.stop or not text:
        return len(text)
    hold = 0
    for s in req.params.stop:
        tail = text[-(len(s) - 1):] if len(s) > 1 else ""
        i = tail.find(s[0])
        while i != -1 and len(tail) - i > hold:
            if s.startswith(tail[i:]):
                hold = len(tail) - i
                break
            i = tail.find(s[0], i + 1)
    return len(text) - hold
