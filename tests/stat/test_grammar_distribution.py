"""Speculation under a grammar is lossless with respect to the MASKED target distribution
(docs/structured-output.md).

Vocabulary a, b, c, EOS; target p = [0.4, 0.3, 0.2, 0.1] on every row; grammar `(a|c)+`: position 0
allows a, c (masked p = [2/3, 0, 1/3, 0]), later positions a, c, EOS (p = [4/7, 0, 2/7, 1/7]). Drafts
come from a uniform q over all four tokens (so a third of them are forbidden: p = 0, always rejected)
or are one-hot (n-gram style: forbidden drafts included); k = 3, 20,000 requests in one batch through
the batched verifier; chi-square per committed position against the masked p, p-value > 0.01. A
sanity case checks the test's power: a masked p off by 10% is rejected.
"""

import random

import pytest
import torch
from scipy.stats import chisquare

from specserve.engine.step_plan import ScheduledRequest, StepPlan
from specserve.grammar.compiler import GrammarCompiler
from specserve.grammar.matcher import GrammarState
from specserve.request import Request
from specserve.sample.batch import SamplingBatch
from specserve.sample.verifier import to_host, verify
from specserve.sampling_params import SamplingParams, StructuredOutputsParams

P = torch.tensor([0.4, 0.3, 0.2, 0.1])
MASKED = {0: [2 / 3, 0, 1 / 3, 0], 1: [4 / 7, 0, 2 / 7, 1 / 7]}
Q = torch.full((4,), 0.25)
N = 20_000
K = 3


class _Bytes:
    def grammar_vocab(self):
        return [b"a", b"b", b"c", b""]


def _trials(make_drafts, seed0: int):
    comp = GrammarCompiler(_Bytes(), 4, [3])
    spec = StructuredOutputsParams(regex="(a|c)+")
    compiled = comp.compile(spec)
    params = SamplingParams(temperature=1.0, structured_outputs=spec)
    rng = random.Random(seed0)
    scheduled = []
    for i in range(N):
        r = Request(f"t{i}", [0], params, None, seed0 * N + i, grammar=GrammarState(compiled))
        r.all_token_ids.append(0)  # a prompt token; the output starts after it
        r.num_computed_tokens = 1
        drafts, q = make_drafts(rng)
        scheduled.append(ScheduledRequest.decode(r, drafts, q))
    plan = StepPlan.build(scheduled)
    batch = SamplingBatch.build(plan.sampled, 4, (3,), torch.device("cpu"))
    res = to_host(verify(torch.log(P).repeat(plan.num_rows, 1), batch), batch)
    return [res.committed(b, s.row_offset, None)[0] for b, s in enumerate(plan.sampled)]


def sampled_q(rng):
    return [rng.randrange(4) for _ in range(K)], Q.repeat(K, 1)


def one_hot(rng):
    return [rng.choice([0, 1, 2, 3]) for _ in range(K)], None


def _counts(outputs):
    counts = [[0] * 4 for _ in range(K + 1)]
    for toks in outputs:
        for pos, t in enumerate(toks):
            counts[pos][t] += 1
            if t == 3:  # EOS ends the output: nothing after it is a sample of the grammar's next position
                break
    return counts


@pytest.mark.parametrize("make_drafts", [sampled_q, one_hot])
def test_committed_tokens_follow_the_masked_target(make_drafts):
    outputs = _trials(make_drafts, 7)
    counts = _counts(outputs)
    for pos, c in enumerate(counts):
        n = sum(c)
        if n < 500:
            continue
        exp = MASKED[min(pos, 1)]
        assert all(c[t] == 0 for t in range(4) if exp[t] == 0), (pos, c)  # a forbidden token never comes out
        keep = [t for t in range(4) if exp[t] > 0]
        stat = chisquare([c[t] for t in keep], [n * exp[t] for t in keep])
        assert stat.pvalue > 0.01, (pos, c)
    assert sum(counts[1]) > 0.2 * N  # verify rows beyond the first are covered (expected: 1/4 one-hot, 1/2 with q)


def test_power_a_ten_percent_error_is_caught():
    """Sanity: the test has power. Position 0 against a masked p off by 10% (a: 0.6 instead of 2/3, as a
    verifier that renormalized over the wrong set would give) is rejected."""
    c = _counts(_trials(one_hot, 8))[0]
    assert chisquare([c[0], c[2]], [N * 0.6, N * 0.4]).pvalue < 0.01
