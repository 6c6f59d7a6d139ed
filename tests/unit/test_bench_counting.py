"""Tokens per chunk, ITL and E2E against scripted SSE streams: exact values, per count source.

The script is one speculative stream (ms since send, chunk): a chat role chunk, chunks of 1, 3, 1 (its
token is held back: no text) and 2 tokens, and a last chunk with no text that carries the EOS token,
then the usage chunk. Its exact per-token ITL is known; the even spread the bench used to apply
silently differs from it, and is now labelled an estimate.
"""
from __future__ import annotations

import pytest

from specserve.bench import metrics
from specserve.bench.client import ChunkCounter

# (ms, text or None for the usage chunk, cumulative completion_tokens, logprob entries)
SCRIPT = [(5.0, "", 0, None), (100.0, "a", 1, 1), (150.0, "bcd", 4, 3), (170.0, "", 5, 1), (200.0, "ef", 7, 2),
          (230.0, "", 8, 1), (231.0, None, 8, None)]
TOTAL = 8


def _event(text, cum, n_lp, usage: bool, logprobs: bool, finish: bool) -> dict:
    if text is None:
        return {"id": "r1", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": cum}}
    choice = {"index": 0, "delta": {"content": text}, "finish_reason": "stop" if finish else None,
              "logprobs": {"content": [{"token": "t", "logprob": -0.1}] * n_lp} if logprobs and n_lp else None}
    return {"id": "r1", "choices": [choice], "usage": {"prompt_tokens": 3, "completion_tokens": cum} if usage else None}


def _count(usage=False, logprobs=False, script=SCRIPT):
    c = ChunkCounter()
    last_choice = max(i for i, s in enumerate(script) if s[1] is not None)
    for i, (ms, text, cum, n_lp) in enumerate(script):
        c.add(ms, _event(text, cum, n_lp, usage, logprobs, i == last_choice))
    chunks, src = c.chunks(TOTAL)
    return {"chunks": chunks, "token_count_source": src, "output_tokens": TOTAL, "last_chunk_ms": c.last_ms,
            "error": None, "send_time_s": 0.0, "text": c.text, "finish_reason": c.finish_reason}


EXACT = [[100.0, 1], [150.0, 3], [170.0, 1], [200.0, 2], [230.0, 1]]


@pytest.mark.parametrize("usage, logprobs", [(True, False), (False, True), (True, True)])
def test_exact_counts_give_exact_itl(usage, logprobs):
    r = _count(usage, logprobs)
    assert r["token_count_source"] == ("usage" if usage else "logprobs")
    assert r["chunks"] == EXACT and r["text"] == "abcdef" and r["finish_reason"] == "stop"
    assert metrics.ttft_ms(r) == 100 and metrics.e2e_ms(r) == 230  # the EOS chunk, although it has no text
    assert metrics.tpot_ms(r) == pytest.approx(130 / 7)
    assert metrics.itl_per_chunk(r) == [50, 20, 30, 30]
    assert metrics.itl_per_token(r) == [(pytest.approx(50 / 3), 3.0), (20.0, 1.0), (15.0, 2.0), (30.0, 1.0)]
    m = metrics.summarize([r], wall_s=1.0)
    assert m["itl_token_exact"] is True and m["output_tokens_exact"] is True
    # the 7 decode tokens' gaps, sorted: 15, 15, 16.7, 16.7, 16.7, 20, 30
    assert m["itl_token_ms_p50"] == pytest.approx(50 / 3) and m["itl_token_ms_mean"] == pytest.approx(130 / 7)
    assert m["e2e_ms_p50"] == 230


def test_without_counts_the_even_spread_is_an_estimate_and_says_so():
    r = _count()
    # chunks with text, plus the last chunk (no text: it carries the EOS token), 8 tokens spread evenly
    assert r["token_count_source"] == "estimate"
    assert r["chunks"] == [[100.0, 2], [150.0, 2], [200.0, 2], [230.0, 2]]
    assert metrics.e2e_ms(r) == 230 and metrics.tpot_ms(r) == pytest.approx(130 / 7)  # E2E and TPOT still exact
    m = metrics.summarize([r], wall_s=1.0)
    assert m["itl_token_exact"] is False and m["token_count_sources"] == ["estimate"]
    assert m["itl_token_ms_p50"] == 25.0 != pytest.approx(50 / 3)  # what the silent spread used to report


def test_usage_on_some_chunks_only_is_not_a_count():
    """A server that puts cumulative usage only on its last chunk would make every other chunk count
    0 tokens; usage counts only when every chunk with a choice carries it."""
    c = ChunkCounter()
    for i, (ms, text, cum, n_lp) in enumerate(SCRIPT[:-1]):
        c.add(ms, _event(text, cum, n_lp, usage=(i == 5), logprobs=False, finish=(i == 5)))
    chunks, src = c.chunks(TOTAL)
    assert src == "estimate" and [n for _, n in chunks] == [2, 2, 2, 2]


def test_logprobs_missing_on_a_text_chunk_is_not_a_count():
    c = ChunkCounter()
    for i, (ms, text, cum, n_lp) in enumerate(SCRIPT[:-1]):
        c.add(ms, _event(text, cum, n_lp if i != 2 else 0, usage=False, logprobs=True, finish=(i == 5)))
    assert c.chunks(TOTAL)[1] == "estimate"


def test_a_last_chunk_without_tokens_still_ends_e2e():
    """OpenAI sends finish_reason in a chunk of its own that carries no token: not token-bearing
    (no ITL gap), but E2E ends there."""
    script = SCRIPT[:5] + [(260.0, "", 7, 0), (261.0, None, 7, None)]
    c = ChunkCounter()
    for i, (ms, text, cum, n_lp) in enumerate(script):
        c.add(ms, _event(text, cum, n_lp, usage=True, logprobs=False, finish=(i == 5)))
    chunks, src = c.chunks(7)
    assert src == "usage" and chunks == EXACT[:4] and c.last_ms == 260.0
    r = {"chunks": chunks, "output_tokens": 7, "last_chunk_ms": c.last_ms}
    assert metrics.e2e_ms(r) == 260 and metrics.itl_per_chunk(r) == [50, 20, 30]


def test_only_choice_zero_is_counted():
    c = ChunkCounter()
    c.add(10.0, {"choices": [{"index": 1, "delta": {"content": "zz"}}], "usage": {"completion_tokens": 1}})
    c.add(20.0, {"choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": "length"}],
                 "usage": {"completion_tokens": 1}})
    assert c.chunks(1) == ([[20.0, 1]], "usage") and c.text == "a"


def test_old_records_without_last_chunk_use_the_last_token_bearing_chunk():
    assert metrics.e2e_ms({"chunks": [[10.0, 1], [30.0, 2]]}) == 30.0
