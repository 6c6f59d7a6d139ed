"""Batched logits processors: every row of a step at once, each with its own parameters and history.

What it does: the batched form of `specserve.sample.sampler.process_logits` (repetition penalty
(CTRL, Keskar et al. 2019; prompt + output), frequency/presence penalties (OpenAI; output), logit_bias,
min_tokens) and of `logits_to_probs` (temperature, top-k, top-p, min-p, softmax), over a
`SamplingBatch`. Every operation is the reference's, elementwise or per row, applied only to the rows
that use it, so each row's result is bit for bit the reference's (tests/unit/test_verifier.py).
What it does not do: verification or sampling (`specserve.sample.verifier`).
"""

from __future__ import annotations

import torch

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


def sampling_probs(x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Temperature, top-k, top-p, softmax, min-p for the sampled rows.

    Args:
        x: float32 [Rs, V] processed logits of `batch.sampled_rows`, in that order.

    Returns:
        float32 [Rs, V] probabilities.
    """
    x = x / batch.temperature
    V = x.shape[-1]
    if batch.any_top_k:
        sorted_x = torch.sort(x, dim=-1, descending=True, stable=True).values
        kth = sorted_x.gather(1, (batch.top_k - 1).clamp(max=V - 1).unsqueeze(1))  # top_k = V: kth = min, no-op
        x = x.masked_fill(x < kth, float("-inf"))
    if batch.top_p_rows is not None:
        rows = batch.top_p_rows
        xr = x[rows]
        sorted_x, order = torch.sort(xr, dim=-1, descending=True, stable=True)
        sm = torch.softmax(sorted_x, dim=-1)
        drop_sorted = (sm.cumsum(-1) - sm) >= batch.top_p[rows]  # mass before this token
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x[rows] = xr.masked_fill(drop, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if batch.min_p_rows is not None:
        rows = batch.min_p_rows
        pr = probs[rows]
        pr = pr.masked_fill(pr < pr.max(dim=-1, keepdim=True).values * batch.min_p[rows], 0.0)
        probs[rows] = pr / pr.sum(-1, keepdim=True)
    return probs
