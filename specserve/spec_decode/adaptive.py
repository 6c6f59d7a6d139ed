"""Cost-aware draft length: choose k per request, each step, for the whole batch at once.

The model (Leviathan et al. 2023, section 3.1, with per-position acceptance): a request whose draft
positions are accepted with conditional probabilities a_1, a_2, ... (a_j = P(draft j accepted | drafts
before it accepted)) commits in expectation

    E(k) = 1 + sum_{j=1..k} prod_{l=1..j} a_l        tokens from a verify step with k drafts,

which is (1 - a^(k+1)) / (1 - a) when every a_l = a. The step costs C(T, B) + D: the target's forward
over T = (prefill tokens) + sum_i (1 + k_i) new tokens in B sequences (measured, `StepCostModel`), plus
the drafting time D of proposers whose cost grows with k (a draft model: one draft forward per
position, over the requests drafting that deep). Each request's speed is E_i(k_i) / (C + D) tokens per
ms, and every request in the step, speculating or not, waits for the same step.

Objective: "throughput" (the default, issue 10's definition) maximises the expected committed tokens
per ms of the step, (B_other + sum_i E_i(k_i)) / (C + D), where each of the B_other other sequences in
the step (plain decodes, fixed-k requests, prefill chunks) is counted as one committed token; "fair" maximises sum_i log(E_i(k_i) / (C + D)) over the
requests in the step (the geometric mean of the per-request token rates), which does not let one
request's long drafts slow down the others more than they gain. At batch size 1 both are exactly "most
expected tokens per ms". Where any drafting has a fixed host price (on a fast GPU at 16 concurrent
requests), fair charges it to every request in the step and drafts less (docs/adaptive-speculation.md).

How: E_i is concave in k (its increments prod a_l shrink), so for any total S of drafts the best
allocation takes the S largest increments over all requests (each request's increments in order);
the objective is evaluated for every S and the best S kept, the smallest on ties (k = 0 for everyone
included). Proposers with a drafting cost are handled by also trying each common depth cap m for
them. O(m_max * N log N) for N = sum of the requests' k caps; without drafting groups and past
NUMPY_MIN_INCREMENTS increments the same choice is computed with numpy (`_choose_free`).

What it does not do: estimate acceptance (see `acceptance.py`) or measure costs (`specserve.engine.step_cost`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

import numpy as np


NUMPY_MIN_INCREMENTS = 64  # above this many increments without drafting groups, numpy is faster than the loop


@dataclass
class DraftOption:
    """One decoding request's choice this step.

    Attributes:
        acceptance: a_1..a_K, conditional acceptance of each draft position; K = the most drafts this
            request may verify (the scheduler's cap, or fewer when its proposer offered fewer).
        draft_group: requests whose proposer spends time per drafted position share a group (e.g. one
            draft model); None = drafting is free once proposed (ngram, suffix).
        draft_cost_ms: for a group, ms of one draft forward over n sequences (`draft_cost_ms(n)`).
    """

    acceptance: Sequence[float]
    draft_group: Hashable | None = None
    draft_cost_ms: Callable[[int], float] | None = None


def expected_tokens(acceptance: Sequence[float], k: int) -> float:
    """E(k) = 1 + sum_{j<=k} prod_{l<=j} a_l: expected committed tokens of a verify step with k drafts."""
    e, p = 1.0, 1.0
    for a in acceptance[:k]:
        p *= a
        e += p
    return e


@dataclass
class Choice:
    """The chosen k per option (same order), the objective's value, and the step's expected cost (ms)
    and expected committed tokens."""

    ks: list[int]
    value: float
    step_ms: float
    expected_tokens: float


def choose_draft_lengths(
    options: Sequence[DraftOption],
    step_ms: Callable[[int, int], float],
    *,
    num_other_tokens: int = 0,
    num_other_seqs: int = 0,
    objective: str = "throughput",
    min_gain: float = 0.0,
    draft_token_ms: float = 0.0,
    speculate_ms: float = 0.0,
) -> Choice:
    """Choose k for every option (see the module docstring).

    Args:
        options: the decoding requests that may speculate this step.
        step_ms: the target's step time in ms for (new tokens, sequences) (`StepCostModel.step_ms`).
        num_other_tokens: tokens in the step from everything else: prefill chunks and the one token of
            each decoding request that does not speculate.
        num_other_seqs: sequences in the step besides `options` (they wait for the step too).
        objective: "fair" (sum of log per-request rates) or "throughput" (expected tokens per ms).
        min_gain: speculate only if the objective beats k = 0 for everyone by this relative margin
            (0.02 = 2%), a guard against noisy estimates.
        draft_token_ms: host time per verified draft token outside the forward (ms; sampling and
            committing its row), added to the step time (`StepCostModel.draft_overhead_ms`).
        speculate_ms: host time a step spends only because it may draft (proposing for every request,
            tracking and choosing: `AdaptiveK`'s measured decision time), added to the cost of every
            choice with drafts and not to k = 0 for everyone, whose steps can skip the decision.

    Returns:
        Choice; ks[i] in [0, len(options[i].acceptance)].

    Raises:
        ValueError: unknown objective, or a group without draft_cost_ms.
    """
    if objective not in ("fair", "throughput"):
        raise ValueError(f"objective must be 'fair' or 'throughput', got {objective!r}")
    n = len(options)
    if n == 0:
        return Choice([], 0.0, step_ms(num_other_tokens, num_other_seqs) if num_other_tokens else 0.0, 0.0)
    for o in options:
        if o.draft_group is not None and o.draft_cost_ms is None:
            raise ValueError("a DraftOption with a draft_group needs draft_cost_ms")
    base_tokens = num_other_tokens + n
    seqs = num_other_seqs + n
    fair = objective == "fair"
    if all(o.draft_group is None for o in options) and sum(len(o.acceptance) for o in options) > NUMPY_MIN_INCREMENTS:
        return _choose_free(options, step_ms, base_tokens, seqs, fair, min_gain, draft_token_ms, speculate_ms)

    # increments: (objective gain, expected-token gain, option index, depth j); both shrink with j per option
    incs: list[tuple[float, float, int, int]] = []
    for i, o in enumerate(options):
        e, p = 1.0, 1.0
        for j, a in enumerate(o.acceptance, start=1):
            p *= min(max(a, 0.0), 1.0)
            incs.append((math.log((e + p) / e) if fair else p, p, i, j))
            e += p
    incs.sort(key=lambda x: -x[0])  # stable: an option's depths stay in order on ties
    group_size: dict[Hashable, int] = defaultdict(int)
    for o in options:
        if o.draft_group is not None:
            group_size[o.draft_group] += 1
    # group -> ms of one draft forward over c sequences, c = 0..size (0.0 at c = 0), computed once
    group_cost = {g: [0.0] + [fn(c) for c in range(1, group_size[g] + 1)]
                  for g, fn in {o.draft_group: o.draft_cost_ms for o in options if o.draft_group is not None}.items()}
    max_group_depth = max((len(o.acceptance) for o in options if o.draft_group is not None), default=0)

    def value(gain_sum: float, cost: float) -> float:  # throughput: every sequence of the step commits ~1 token
        return gain_sum - seqs * math.log(cost) if fair else (seqs + gain_sum) / cost

    costs = [step_ms(base_tokens + t, seqs) + draft_token_ms * t + (speculate_ms if t else 0.0)
             for t in range(len(incs) + 1)]  # by total drafts
    base_cost = costs[0]
    best = Choice([0] * n, value(0.0, base_cost), base_cost, float(n))
    threshold = best.value + (seqs * math.log1p(min_gain) if fair else best.value * min_gain * n / seqs)
    for cap in range(1, max_group_depth + 1) if group_cost else [0]:
        ks = [0] * n
        gain_sum = tokens = 0.0
        total = 0
        depth_count: dict[tuple[Hashable, int], int] = {}
        draft_ms = 0.0
        for gain, p, i, j in incs:
            o = options[i]
            if o.draft_group is not None:
                if j > cap:
                    continue
                key = (o.draft_group, j)
                c = depth_count.get(key, 0)
                table = group_cost[o.draft_group]
                draft_ms += table[c + 1] - table[c]
                depth_count[key] = c + 1
            ks[i] = j
            total += 1
            gain_sum += gain
            tokens += p
            cost = costs[total] + draft_ms
            v = value(gain_sum, cost)
            if v > best.value + 1e-12 and v >= threshold:
                best = Choice(list(ks), v, cost, n + tokens)
    return best



def _choose_free(options: Sequence[DraftOption], step_ms: Callable[[int, int], float], base_tokens: int, seqs: int,
                 fair: bool, min_gain: float, draft_token_ms: float, speculate_ms: float) -> Choice:
    """`choose_draft_lengths` when no option has a drafting cost (ngram, suffix), in numpy: the same
    increments in the same order (a stable sort of each option's depths, row by row), the objective
    of the first S of them for every S at once, then the loop's rule over S: the last S that beats
    every smaller one (k = 0 for everyone included) by more than 1e-12 and the min_gain threshold."""
    n = len(options)
    lens = np.fromiter((len(o.acceptance) for o in options), dtype=np.int64, count=n)
    width = int(lens.max()) if n else 0
    acc = np.zeros((n, max(width, 1)))
    for i, o in enumerate(options):
        acc[i, : lens[i]] = o.acceptance
    np.clip(acc, 0.0, 1.0, out=acc)
    p = np.cumprod(acc, axis=1)  # p_j = a_1 ... a_j: the expected-token gain of depth j
    valid = np.arange(acc.shape[1]) < lens[:, None]
    gain = np.log1p(p / (1.0 + np.cumsum(p, axis=1) - p)) if fair else p  # log(E(j) / E(j - 1))
    rows = np.broadcast_to(np.arange(n)[:, None], acc.shape)[valid]
    gain, p = gain[valid], p[valid]
    order = np.argsort(-gain, kind="stable")
    total = len(order)
    costs = np.fromiter((step_ms(base_tokens + t, seqs) for t in range(total + 1)), dtype=np.float64, count=total + 1)
    costs += draft_token_ms * np.arange(total + 1)
    costs[1:] += speculate_ms
    g = np.concatenate(([0.0], np.cumsum(gain[order])))
    tok = np.concatenate(([0.0], np.cumsum(p[order])))
    v = g - seqs * np.log(costs) if fair else (seqs + tok) / costs
    base = float(v[0])
    threshold = base + (seqs * math.log1p(min_gain) if fair else base * min_gain * n / seqs)
    s, best = 0, base
    for t, x in enumerate(v.tolist()):  # the loop's rule: a later S must beat the best so far by 1e-12
        if t and x > best + 1e-12 and x >= threshold:
            s, best = t, x
    if not s:
        return Choice([0] * n, base, float(costs[0]), float(n))
    ks = np.bincount(rows[order[:s]], minlength=n).tolist()  # the first s increments
    return Choice(ks, float(v[s]), float(costs[s]), n + float(tok[s]))
