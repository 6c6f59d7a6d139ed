"""docs/speculation-cases.md B22 (1): speculative sampling preserves the target distribution (no model).

Target p = [0.6, 0.4], draft q = [0.8, 0.2], k = 1..3 fixed rows, 20,000 trials per case, chi-square
on the first committed token and on every committed position against p, p-value > 0.01. The trials
run through the engine's batched verifier (`specserve.sample.verifier`), all in one batch, one request
(one seed) per trial; the per-request reference gives the same tokens (tests/unit/test_verifier.py).
"""

import random

import pytest
import torch
from scipy.stats import chisquare

from specserve.engine.step_plan import ScheduledRequest, StepPlan
from specserve.request import Request
from specserve.sample.batch import SamplingBatch
from specserve.sample.rejection import rejection_sample
from specserve.sample.verifier import to_host, verify
from specserve.sampling_params import SamplingParams

P = torch.tensor([0.6, 0.4])
Q = torch.tensor([0.8, 0.2])
N = 20_000


def verify_trials(drafts_and_q, k, target=P):
    """One batch of len(drafts_and_q) requests, each verifying its drafts against k + 1 rows of `target`;
    returns [(committed tokens, accepted)]."""
    params = SamplingParams(temperature=1.0)
    scheduled = []
    for i, (drafts, q) in enumerate(drafts_and_q):
        r = Request(f"t{i}", [0], params, None, i)
        r.all_token_ids.append(0)
        r.num_computed_tokens = 1
        scheduled.append(ScheduledRequest.decode(r, drafts, q))
    plan = StepPlan.build(scheduled)
    logits = torch.log(target).repeat(plan.num_rows, 1)
    batch = SamplingBatch.build(plan.sampled, 2, (), torch.device("cpu"))
    res = to_host(verify(logits, batch), batch)
    return [res.committed(b, s.row_offset, None)[:2] for b, s in enumerate(plan.sampled)]


def draft_sampled(rng, k):  # (a) draft sampled from q, q reported
    return [int(rng.random() >= Q[0]) for _ in range(k)], Q.repeat(k, 1)


def draft_argmax_point_mass(rng, k):  # (b) deterministic argmax, q declared as a point mass (one-hot)
    return [0] * k, None


def draft_topk1_raw_q_reported(rng, k):
    # (c) a draft that applies top-k = 1 must report the q it really sampled from: the point mass.
    # Reporting the raw q here would be the transformers#47932 bug; the engine's draft model always
    # returns the processed q it sampled from.
    return [0] * k, torch.tensor([[1.0, 0.0]] * k)


@pytest.mark.parametrize("make_draft", [draft_sampled, draft_argmax_point_mass, draft_topk1_raw_q_reported])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_output_distribution_matches_target(make_draft, k):
    rng = random.Random(1234 + k)
    counts = [[0, 0] for _ in range(k + 1)]
    for toks, _ in verify_trials([make_draft(rng, k) for _ in range(N)], k):
        for pos, t in enumerate(toks):
            counts[pos][t] += 1
    # Every position is distributed as p (rows are independent and identical here). Position 0 always
    # has N samples; later positions are conditioned on the earlier ones being accepted, which does not
    # change their law when the rows are identical.
    for pos, c in enumerate(counts):
        n = sum(c)
        if n < 500:
            continue
        stat = chisquare(c, [n * 0.6, n * 0.4])
        assert stat.pvalue > 0.01, (pos, c)


def test_wrong_q_is_detected():
    """Sanity: the test has power. Using the draft's raw q (0.8) while the draft was argmax (point mass)
    biases the output, as in transformers#32867 ([0.6, 0.4] -> [0.75, 0.25])."""
    c = [0, 0]
    for toks, _ in verify_trials([([0], Q.repeat(1, 1))] * N, 1):
        c[toks[0]] += 1
    assert chisquare(c, [N * 0.6, N * 0.4]).pvalue < 1e-6


@pytest.mark.parametrize("k", [1, 3])
def test_one_hot_coupled_distribution_and_acceptance(k):
    """One-hot drafts verified by coupling: output ~ p at every position; acceptance rate = p(draft)."""
    c0, accepted = [0, 0], 0
    for toks, a in verify_trials([([0] * k, None)] * N, k):
        c0[toks[0]] += 1
        accepted += a > 0
    assert chisquare(c0, [N * 0.6, N * 0.4]).pvalue > 0.01
    assert abs(accepted / N - 0.6) < 0.02


def test_reference_one_hot_residual_rule():
    """The reference's rejection rule with one-hot q (accept with p(d), else sample p without d) is
    lossless too (the engine uses the coupled rule for one-hot drafts; this one is reference only)."""
    rng = random.Random(5)
    c = [0, 0]
    for _ in range(4000):
        toks, _ = rejection_sample([0], P.repeat(2, 1), None, lambda j, purpose: rng.random())
        c[toks[0]] += 1
    assert chisquare(c, [4000 * 0.6, 4000 * 0.4]).pvalue > 0.01
