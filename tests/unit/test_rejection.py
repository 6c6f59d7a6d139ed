"""Verification rules on hand-computed tables (greedy) and edge cases (sampled)."""

import random

import pytest
import torch

from specserve.sample.rejection import greedy_verify, rejection_sample, sample_from


@pytest.mark.parametrize(
    "drafts, argmax, tokens, accepted",
    [
        ([], [7], [7], 0),  # no drafts: plain decode
        ([5, 6, 7], [5, 6, 7, 8], [5, 6, 7, 8], 3),  # all accepted + bonus
        ([5, 6, 7], [5, 9, 7, 8], [5, 9], 1),  # first mismatch recovered with the target token
        ([5, 6, 7], [1, 6, 7, 8], [1], 0),  # first draft rejected
        ([5, 5], [5, 5, 5], [5, 5, 5], 2),
    ],
)
def test_greedy_table(drafts, argmax, tokens, accepted):
    assert greedy_verify(drafts, argmax) == (tokens, accepted)


def test_sample_from_never_picks_zero_mass():
    p = torch.tensor([0.0, 0.5, 0.0, 0.5, 0.0])
    for u in [0.0, 1e-12, 0.25, 0.4999999, 0.5, 0.75, 0.999999999]:
        assert sample_from(p, u) in (1, 3)
    with pytest.raises(ValueError):
        sample_from(torch.zeros(3), 0.5)


def test_disjoint_support_accepts_nothing_and_identical_accepts_all():
    rng = random.Random(0)

    def u(j, purpose):
        return rng.random()

    p = torch.tensor([[0.0, 0.0, 0.5, 0.5]] * 4)
    q = torch.tensor([[0.5, 0.5, 0.0, 0.0]] * 3)
    for _ in range(200):
        toks, a = rejection_sample([0, 1, 0], p, q, u)
        assert a == 0 and toks[0] in (2, 3)
    for _ in range(200):
        toks, a = rejection_sample([2, 3, 2], p, p[:3], u)
        assert a == 3 and len(toks) == 4
    # one-hot drafts (ngram): a token with zero target mass is always rejected
    toks, a = rejection_sample([0], p[:2], None, u)
    assert a == 0 and toks[0] in (2, 3)
