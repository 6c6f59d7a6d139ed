"""Speculative verification: which drafts the target accepts, and the recovered or bonus token.

The readable reference (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding"; Chen et al. 2023, "Accelerating LLM Decoding with Speculative Sampling"):

- n drafts d_1..d_n, target distributions p_0..p_n (row j is the target's distribution for the token
  after the last committed token and d_1..d_j), draft distributions q_1..q_n the drafts were sampled
  from (None = one-hot: the draft was deterministic, q(d_j) = 1).
- greedy: accept d_j while d_j == argmax p_{j-1}; the first mismatch is replaced by argmax p_{j-1}
  (the recovered token); if all n are accepted, argmax p_n is the bonus token.
- sampled: accept d_j with probability min(1, p_{j-1}(d_j) / q_j(d_j)); at the first rejection sample
  the recovered token from norm(max(0, p_{j-1} - q_j)) (for one-hot q: p_{j-1} with d_j removed); if all
  are accepted, sample the bonus token from p_n. Each committed token is then distributed exactly as
  the target's.

- sampled with one-hot drafts (n-gram, suffix, a greedy draft): `sample_and_match` draws the target's
  token at each row by inverse CDF from one uniform, and accepts the draft while it equals that token.
  The acceptance probability is p(d), the same as the rule above with q(d) = 1, but the committed
  tokens no longer depend on the drafts at all: with the same seed they are exactly the tokens the
  target alone would sample (the token at output position m always comes from u(m, SAMPLE)). So a
  seeded request gives the same text with or without n-gram/suffix speculation, whatever the drafts were.

Every random number comes from `uniform(j, purpose)`: row j's uniform for one `Purpose`, keyed by the
output position the row decides (`specserve.sample.uniforms`, docs/step-plan.md "Random numbers"), never
by how many numbers were drawn before. So a seeded request is reproducible alone or in any batch, and
the batched verifier (`specserve.sample.verifier`) draws exactly these numbers.
This module is the readable reference the batched verifier is tested against.
"""

from __future__ import annotations

from typing import Callable

import torch

from specserve.sample.inverse_cdf import inverse_cdf
from specserve.sample.uniforms import Purpose

Uniform = Callable[[int, int], float]
"""uniform(j, purpose) -> u in [0, 1): the uniform for verify row j (0..n) and a `Purpose`."""


def sample_from(probs: torch.Tensor, u: float) -> int:
    """Inverse-CDF sample from probs [V] (need not be normalized) with a uniform u in [0, 1): the token i
    with C(i - 1) <= u * C(V - 1) < C(i), C the float64 cumulative sum (`specserve.sample.inverse_cdf`,
    the same primitive the batched verifier uses). Never returns a token with zero probability.

    Raises:
        ValueError: all probabilities are zero (or NaN).
    """
    idx, bad = inverse_cdf(probs.float().unsqueeze(0), torch.tensor([u], dtype=torch.float64, device=probs.device))
    if bool(bad[0]):
        raise ValueError("cannot sample from an all-zero distribution")
    return int(idx[0])


def greedy_verify(draft_ids: list[int], target_argmax: list[int]) -> tuple[list[int], int]:
    """Greedy verification.

    Args:
        draft_ids: n drafts.
        target_argmax: n + 1 ints, argmax of the (processed) target logits per row.

    Returns:
        (tokens to commit = accepted drafts + recovered/bonus token, number of accepted drafts).
    """
    a = 0
    while a < len(draft_ids) and draft_ids[a] == target_argmax[a]:
        a += 1
    return draft_ids[:a] + [target_argmax[a]], a


def sample_and_match(draft_ids: list[int], target_probs: torch.Tensor, uniform: Uniform) -> tuple[list[int], int]:
    """Lossless verification of one-hot drafts by coupling (see the module docstring).

    Args:
        draft_ids: n deterministic drafts.
        target_probs: [n + 1, V] target distributions.
        uniform: the request's uniforms; row j's token is drawn with uniform(j, Purpose.SAMPLE).

    Returns:
        (tokens to commit, number of accepted drafts).
    """
    tokens: list[int] = []
    for j in range(len(draft_ids) + 1):
        t = sample_from(target_probs[j], uniform(j, Purpose.SAMPLE))
        tokens.append(t)
        if j == len(draft_ids) or t != draft_ids[j]:
            return tokens, j
    raise AssertionError("unreachable")


def rejection_sample(
    draft_ids: list[int],
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    uniform: Uniform,
) -> tuple[list[int], int]:
    """Lossless speculative sampling for one request.

    Args:
        draft_ids: n drafts.
        target_probs: [n + 1, V] target distributions (after temperature, top-k/top-p/min-p, penalties).
        draft_probs: [n, V] distributions the drafts were drawn from, or None for one-hot drafts.
        uniform: the request's uniforms: uniform(j, Purpose.ACCEPT) for the accept test of draft j + 1,
            uniform(j, Purpose.SAMPLE) for a recovered (j < n) or bonus (j = n) token at row j.

    Returns:
        (tokens to commit = accepted drafts + recovered/bonus token, number of accepted drafts).
    """
    n = len(draft_ids)
    if n:
        idx = torch.arange(n, device=target_probs.device)
        d = torch.tensor(draft_ids, device=target_probs.device)
        p_d = target_probs[idx, d].tolist()
        q_d = draft_probs[idx, d].tolist() if draft_probs is not None else [1.0] * n
    for j in range(n):
        if uniform(j, Purpose.ACCEPT) * q_d[j] < p_d[j]:  # accept with probability min(1, p/q)
            continue
        if draft_probs is None:
            residual = target_probs[j].clone()
            residual[draft_ids[j]] = 0.0
        else:
            residual = torch.clamp(target_probs[j] - draft_probs[j].to(target_probs.dtype), min=0.0)
        if not float(residual.sum()) > 0.0:
            # p <= q everywhere with equal mass means p == q: a rejection has probability 0 and only a
            # rounding edge gets here; p itself is then the right distribution.
            residual = target_probs[j]
        return draft_ids[:j] + [sample_from(residual, uniform(j, Purpose.SAMPLE))], j
    return list(draft_ids) + [sample_from(target_probs[n], uniform(n, Purpose.SAMPLE))], n
