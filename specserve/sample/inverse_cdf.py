"""Inverse-CDF sampling, row-wise: one uniform per row picks a token, the same alone or in a batch.

What it does: for each row of non-negative weights p [N, V] (need not be normalized) and a uniform u,
returns the token i with C(i - 1) <= u * C(V - 1) < C(i), where C is the cumulative sum in float64.
C is computed in two levels so that a row costs one read of its weights instead of a full-length
float64 prefix sum: float32 sums of blocks of BLOCK tokens (as exact as the float32 weights
themselves), a float64 prefix sum over the blocks to find the block, then a float64 prefix sum
inside that block only. A token with zero weight is never returned. Both the
per-request reference (`specserve.sample.rejection.sample_from`) and the batched verifier call this
function, and a row's result does not depend on the other rows (tests/unit/test_verifier.py), so the
two give the same tokens.
What it does not do: draw the uniforms (`specserve.sample.uniforms`) or decide what to sample from.
"""

from __future__ import annotations

import torch

BLOCK = 1024


def inverse_cdf(p: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise inverse-CDF samples.

    Args:
        p: float32 [N, V] non-negative weights.
        u: float64 [N] uniforms in [0, 1 - 2^-52] (so u * total < total).

    Returns:
        (int64 [N] token ids, bool [N] rows whose total weight is not > 0, e.g. NaN or all zero; their
        token is meaningless).
    """
    N, V = p.shape
    full = V // BLOCK
    sums = []
    if full:
        sums.append(p[:, : full * BLOCK].unflatten(-1, (full, BLOCK)).sum(-1))
    if V % BLOCK:
        sums.append(p[:, full * BLOCK :].sum(-1, keepdim=True))
    cb = torch.cumsum(torch.cat(sums, dim=1) if len(sums) > 1 else sums[0], dim=-1, dtype=torch.float64)  # [N, nb]
    total = cb[:, -1:]
    x = u.unsqueeze(1) * total
    blk = torch.searchsorted(cb, x, right=True).clamp_(max=cb.shape[1] - 1)  # [N, 1]
    base = torch.where(blk > 0, cb.gather(1, (blk - 1).clamp(min=0)), 0.0)
    width = min(BLOCK, V)
    idx = blk * BLOCK + torch.arange(width, device=p.device)  # [N, width]
    w = torch.where(idx < V, p.gather(1, idx.clamp(max=V - 1)), 0.0)
    c = base + torch.cumsum(w, dim=-1, dtype=torch.float64)
    i = torch.searchsorted(c, x, right=True)
    # x < cb[blk], but the in-block float64 sum can end below the float32 block sum: then take the
    # block's last token with weight (c[i] > c[i - 1] guarantees w[i] > 0 everywhere else)
    last = torch.where(w > 0, torch.arange(width, device=p.device), -1).amax(-1, keepdim=True)
    i = torch.minimum(i, last).clamp_(min=0)
    return (blk * BLOCK + i).squeeze(1), ~(total.squeeze(1) > 0.0)
