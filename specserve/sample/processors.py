"""Batched logits processors: every row of a step at once, each with its own parameters and history.

What it does: the batched form of `specserve.sample.sampler.process_logits` (repetition penalty
(CTRL, Keskar et al. 2019; prompt + output), frequency/presence penalties (OpenAI; output), logit_bias,
min_tokens), the grammar token masks of structured output (`apply_grammar`), and of `logits_to_probs` (temperature, top-k, top-p, min-p, softmax), over a
`SamplingBatch`. Every operation is the reference's, elementwise or per row, applied only to the rows
that use it, so each row's result is bit for bit the reference's (tests/unit/test_verifier.py).
What it does not do: verification or sampling (`specserve.sample.verifier`).
"""

from __future__ import annotations

import torch

from specserve.grammar import xgrammar
from specserve.sample.batch import SamplingBatch


def apply_processors(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Penalties, then logit_bias, then min_tokens masks.

    Args:
        logits: float32 [R, V] raw target logits (not modified).

    Returns:
        float32 [R, V]: `logits` itself when no row needs processing, else a processed copy.
    """
    if not batch.needs_processing:
        return logits
    x = logits.clone()
    pen = batch.penalties
    if pen is not None:
        xr = x[pen.rows]
        if pen.prompt_seen is not None:  # dividing or multiplying by a penalty of 1.0 is exact: rows without one keep their values
            seen = pen.prompt_seen | (pen.counts > 0)
            xr = torch.where(seen, torch.where(xr > 0, xr / pen.repetition, xr * pen.repetition), xr)
        xr -= pen.frequency * pen.counts + pen.presence * (pen.counts > 0).to(xr.dtype)
        x[pen.rows] = xr
    if batch.bias is not None:
        rows, toks, vals = batch.bias
        x.index_put_((rows, toks), vals, accumulate=True)
    if batch.min_tokens is not None:
        rows, toks = batch.min_tokens
        x[rows, toks] = float("-inf")
    return x


def apply_grammar(x: torch.Tensor, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Set the logits of tokens the grammar forbids to -inf on the rows of requests with structured
    output (after the processors, before temperature / top-k / top-p / softmax, so every later step sees
    the masked target distribution; docs/structured-output.md).

    Args:
        x: float32 [R, V] processed logits (`apply_processors`); logits: the raw logits (never modified:
            logprobs are the raw model's).

    Returns:
        float32 [R, V]: x, masked in place, or a masked copy when x is the raw logits.
    """
    if batch.grammar is None:
        return x
    rows, bitmask = batch.grammar
    if x is logits:
        x = logits.clone()
    xgrammar().apply_token_bitmask_inplace(x, bitmask, vocab_size=batch.vocab_size, indices=rows)
    return x


# top-p looks for its cut among the TOP_P_PROBE most likely tokens first (a partial top-k instead of a
# sort of the whole vocabulary, which costs ~30 ms per row of 152k on a CPU core); rows whose cut lies
# further out are redone with a full sort. On CUDA the full sort is cheap and needs no host check.
TOP_P_PROBE = 256


def sampling_probs(x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Temperature, top-k, top-p, softmax, min-p for the sampled rows (`sampler.logits_to_probs`).

    Args:
        x: float32 [Rs, V] processed logits of `batch.sampled_rows`, in that order.

    Returns:
        float32 [Rs, V] probabilities.
    """
    x = x / batch.temperature  # a new tensor: the in-place edits below never touch the caller's logits
    V = x.shape[-1]
    if batch.any_top_k:
        k = batch.top_k.unsqueeze(1)  # V where off
        top = torch.topk(x, int(batch.top_k_max), dim=-1).values
        kth = torch.where(k < V, top.gather(1, (k - 1).clamp(max=top.shape[1] - 1)), float("-inf"))
        x = x.masked_fill(x < kth, float("-inf"))
    if batch.top_p_rows is not None:
        rows = batch.top_p_rows
        xr = x[rows]
        x[rows] = xr.masked_fill(_below_top_p(torch.softmax(xr, dim=-1), batch.top_p[rows]), float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if batch.min_p_rows is not None:
        rows = batch.min_p_rows
        pr = probs[rows]
        pr = pr.masked_fill(pr < pr.max(dim=-1, keepdim=True).values * batch.min_p[rows], 0.0)
        probs[rows] = pr / pr.sum(-1, keepdim=True)
    return probs


def _below_top_p(p: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """bool [N, V], True for the tokens top-p drops (the rule of `sampler.logits_to_probs`); p [N, V]
    probabilities, top_p [N, 1]."""
    V = p.shape[-1]
    m = min(V, TOP_P_PROBE) if p.device.type == "cpu" else V
    t, found = _top_p_cut(p, top_p, m)
    if m < V and not bool(found.all()):
        far = torch.nonzero(~found).squeeze(1)
        t[far] = _top_p_cut(p[far], top_p[far], V)[0]
    return p < t


def _top_p_cut(p: torch.Tensor, top_p: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the least likely kept probability [N, 1], bool [N]: the cut lies within the m most likely).
    The m most likely values of a row are the first m of its descending sort, and a prefix sum over
    them equals the full prefix sum's first m entries, so a cut found within m is exact."""
    s = torch.topk(p, m, dim=-1).values if m < p.shape[-1] else torch.sort(p, dim=-1, descending=True).values
    kept = (torch.cumsum(s, dim=-1) - s) < top_p
    n_keep = torch.cumprod(kept, dim=-1).sum(-1, keepdim=True)  # >= 1: the first position has no mass before it
    return s.gather(-1, n_keep - 1), n_keep[:, 0] < m
