"""The batched verifier against the per-request reference (specserve.sample.sampler.sample_request):
identical tokens, accepted counts and logprobs for greedy, sampled (one-hot drafts: the coupled rule),
and draft-model q rows, with penalties, logit_bias, min_tokens, top-k/p, min-p, all mixed in one batch;
the counter-based uniforms against their scalar reference; chi-square on the batched sampler's output.
No model: random logits."""

import random

import pytest
import torch
from scipy.stats import chisquare

from specserve.engine.step_plan import ScheduledRequest, StepPlan
from specserve.request import Request
from specserve.sample.batch import SamplingBatch
from specserve.sample.processors import apply_processors, sampling_probs
from specserve.sample.sampler import logits_to_probs, needs_processing, process_logits, sample_request
from specserve.sample.uniforms import Purpose, seed_key, uniform
from specserve.sample.verifier import to_host, verify
from specserve.sampling_params import SamplingParams

EOS = (3,)
CPU = torch.device("cpu")


def decoding(rid, params, n_prompt, n_out, seed, rng, V):
    r = Request(rid, [rng.randrange(V) for _ in range(n_prompt)], params, None, seed)
    r.all_token_ids += [rng.randrange(V) for _ in range(n_out)]
    r.num_computed_tokens = len(r.all_token_ids) - 1
    return r


def random_params(rng, V):
    kind = rng.choice(["greedy", "sampled", "sampled", "filters", "processed", "greedy_processed"])
    kw = dict(max_tokens=64, seed=None)
    if kind.startswith("greedy"):
        kw["temperature"] = 0.0
    else:
        kw["temperature"] = rng.choice([0.3, 0.7, 1.0, 1.5])
    if kind == "filters":
        kw.update(top_k=rng.choice([0, 1, 5, 40]), top_p=rng.choice([1.0, 0.5, 0.9, 0.995]), min_p=rng.choice([0.0, 0.05, 0.2]))
    if kind.endswith("processed"):
        kw.update(repetition_penalty=rng.choice([1.0, 1.3, 0.8]), frequency_penalty=rng.choice([0.0, 0.5, -0.4]),
                  presence_penalty=rng.choice([0.0, 1.0]), min_tokens=rng.choice([0, 3, 40]),
                  logit_bias={rng.randrange(V): rng.uniform(-5, 5) for _ in range(3)} | {V + 7: 1.0},
                  stop_token_ids=[rng.randrange(V)], ignore_eos=rng.random() < 0.3)
    if rng.random() < 0.3:
        kw["logprobs"] = rng.choice([0, 2, 5])
    return SamplingParams(**kw)


def random_step(rng, V, B):
    """B scheduled requests (decodes with 0..5 drafts, some with q, some prefill last chunks) and logits."""
    scheduled = []
    for b in range(B):
        p = random_params(rng, V)
        seed = rng.getrandbits(63)
        if rng.random() < 0.2:  # a prompt's last chunk: one row, no drafts
            r = Request(f"r{b}", [rng.randrange(V) for _ in range(rng.randrange(1, 9))], p, None, seed)
            scheduled.append(ScheduledRequest.prefill(r, r.num_prompt_tokens))
            continue
        r = decoding(f"r{b}", p, rng.randrange(1, 9), rng.randrange(0, 12), seed, rng, V)
        n = rng.choice([0, 1, 2, 5])
        q = None
        if n and not p.greedy and rng.random() < 0.5:
            q = torch.softmax(torch.randn(n, V) * 2, -1)
        scheduled.append(ScheduledRequest.decode(r, [0] * n, q))  # drafts are set below, from the logits
    plan = StepPlan.build(scheduled)
    logits = torch.randn(plan.num_rows, V) * rng.choice([1.0, 4.0])
    for s in plan.sampled:  # drafts mostly equal to the row's argmax (so blocks get accepted), sometimes not
        rows = logits[s.row_offset : s.row_offset + s.num_rows]
        for j in range(s.num_drafts):
            s.draft_token_ids[j] = int(rows[j].argmax()) if rng.random() < 0.8 else rng.randrange(V)
        s.token_ids[1:] = s.draft_token_ids
    return plan, logits


def reference(plan, logits):
    out = []
    for s in plan.sampled:
        r, p = s.request, s.request.params
        stop_ids = ([] if p.ignore_eos else list(EOS)) + p.stop_token_ids
        rows = logits[s.row_offset : s.row_offset + s.num_rows]
        res = sample_request(rows, p, r.prompt_token_ids, r.output_token_ids, s.draft_token_ids, s.draft_probs,
                             stop_ids, r.rng_key)
        out.append(res)
    return out


def batched(plan, logits, V):
    batch = SamplingBatch.build(plan.sampled, V, EOS, CPU)
    return to_host(verify(logits, batch), batch)


@pytest.mark.parametrize("trial", range(40))
def test_batched_equals_reference_mixed_batches(trial):
    rng = random.Random(trial)
    V = rng.choice([37, 300, 1000, 3000])
    plan, logits = random_step(rng, V, B=rng.randrange(1, 10))
    ref = reference(plan, logits)
    got = batched(plan, logits, V)
    for b, (s, res) in enumerate(zip(plan.sampled, ref)):
        toks, a, lps = got.committed(b, s.row_offset, s.request.params.logprobs)
        assert (toks, a) == (res.token_ids, res.num_accepted), (trial, b, s.request.params)
        assert lps == res.logprobs
        assert not got.failed[b]


@pytest.mark.parametrize("trial", range(20))
def test_processed_logits_and_probs_equal_reference_bitwise(trial):
    """Each row's processed logits and sampling probabilities are the reference's, bit for bit."""
    rng = random.Random(100 + trial)
    V = rng.choice([37, 300, 1000, 3000])
    plan, logits = random_step(rng, V, B=rng.randrange(1, 10))
    batch = SamplingBatch.build(plan.sampled, V, EOS, CPU)
    x = apply_processors(logits, batch)
    probs = sampling_probs(x[batch.sampled_rows], batch) if batch.sampled_rows is not None else None
    s_row = {r: i for i, r in enumerate(batch.sampled_rows.tolist())} if probs is not None else {}
    for s in plan.sampled:
        r, p = s.request, s.request.params
        rows = slice(s.row_offset, s.row_offset + s.num_rows)
        ref = logits[rows]
        if needs_processing(p, r.num_output_tokens):
            stop_ids = ([] if p.ignore_eos else list(EOS)) + p.stop_token_ids
            ref = process_logits(ref, p, r.prompt_token_ids, r.output_token_ids, s.draft_token_ids, stop_ids)
        assert torch.equal(x[rows], ref), (trial, p)
        if not p.greedy:
            got = probs[[s_row[i] for i in range(rows.start, rows.stop)]]
            assert torch.equal(got, logits_to_probs(ref, p)), (trial, p)


def test_every_path_is_exercised():
    """The random batches above cover accepted and rejected drafts on greedy, coupled and q rows."""
    seen = set()
    for trial in range(40):
        rng = random.Random(trial)
        V = rng.choice([37, 300, 1000, 3000])
        plan, logits = random_step(rng, V, B=rng.randrange(1, 10))
        for s, res in zip(plan.sampled, reference(plan, logits)):
            p = s.request.params
            kind = "greedy" if p.greedy else ("q" if s.draft_probs is not None else "coupled")
            if s.num_drafts:
                seen.add((kind, "accepted" if res.num_accepted else "rejected"))
                seen.add((kind, "all") if res.num_accepted == s.num_drafts else (kind, "partial"))
    assert {(k, x) for k in ("greedy", "coupled", "q") for x in ("accepted", "rejected", "all", "partial")} <= seen


def test_seeded_tokens_do_not_depend_on_the_batch():
    """A seeded request's committed tokens are the same alone and at any place in any batch."""
    rng = random.Random(5)
    V = 300
    plan, logits = random_step(rng, V, B=8)
    got = batched(plan, logits, V)
    for b, s in enumerate(plan.sampled):
        alone = StepPlan.build([ScheduledRequest(s.request, s.is_prefill, s.start, s.token_ids, s.num_rows,
                                                 s.draft_token_ids, s.draft_probs)])
        rows = logits[s.row_offset : s.row_offset + s.num_rows]
        one = batched(alone, rows, V)
        assert one.committed(0, 0, None)[:2] == got.committed(b, s.row_offset, None)[:2]


def test_nan_rows_fail_only_their_request():
    rng = random.Random(1)
    V = 50
    p = SamplingParams(temperature=1.0)
    a, b = decoding("a", p, 3, 2, 1, rng, V), decoding("b", p, 3, 2, 2, rng, V)
    plan = StepPlan.build([ScheduledRequest.decode(a, [1, 2], None), ScheduledRequest.decode(b, [], None)])
    logits = torch.randn(4, V)
    logits[1] = float("nan")
    got = batched(plan, logits, V)
    assert got.failed == [True, False]


def test_uniforms_are_uniform_and_keyed():
    rng = random.Random(0)
    seeds = [rng.getrandbits(63) for _ in range(50)] + [0, 1, -1, 2**64 + 5, -(2**70)]
    assert len({seed_key(s) for s in seeds}) == len(seeds) - 1  # 2**64 + 5 and 5 are the same seed mod 2^64
    assert seed_key(5) == seed_key(2**64 + 5)
    assert uniform(seed_key(5), 0, 0) != uniform(seed_key(5), 0, 1) != uniform(seed_key(5), 1, 0)
    u = [uniform(seed_key(7), m, Purpose.SAMPLE) for m in range(20000)]
    assert all(0.0 <= x < 1.0 for x in u)
    counts = torch.histc(torch.tensor(u), bins=20, min=0, max=1).tolist()
    assert chisquare(counts).pvalue > 0.001
    t = torch.tensor(u)
    assert abs(float(torch.corrcoef(torch.stack([t[:-1], t[1:]]))[0, 1])) < 0.03
    across = torch.tensor([uniform(seed_key(s), 3, Purpose.ACCEPT) for s in range(20000)])  # across seeds
    assert chisquare(torch.histc(across, bins=20, min=0, max=1).tolist()).pvalue > 0.001


def _one_row_batch(logits, params, drafts_per_request, q):
    """One request per draft list, the same rows and q, each with its own seed: one batched step."""
    V = logits.shape[1]
    scheduled = []
    for i, drafts in enumerate(drafts_per_request):
        r = Request(f"r{i}", [1, 2], params, None, i)
        r.all_token_ids.append(4)
        r.num_computed_tokens = 2
        scheduled.append(ScheduledRequest.decode(r, list(drafts), q))
    plan = StepPlan.build(scheduled)
    return plan, batched(plan, logits.repeat(len(scheduled), 1), V)


@pytest.mark.parametrize("draft", ["q", "one_hot"])
def test_batched_sampling_distribution_chi_square(draft):
    """First committed token ~ p whatever the drafts (drafts drawn from q, or a fixed one-hot draft);
    acceptance rate = sum_x min(p(x), q(x)) for q drafts, p(d) for a one-hot draft d."""
    rng = random.Random(0)
    V, N = 5, 6000
    p = torch.softmax(torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0]), -1)
    logits = torch.log(p).repeat(2, 1)  # the verify row of the draft, and the bonus row
    if draft == "q":
        q = torch.tensor([[0.7, 0.1, 0.1, 0.05, 0.05]])
        drafts = [rng.choices(range(V), weights=q[0].tolist())[:1] for _ in range(N)]
        expect = float(torch.minimum(p, q[0]).sum())
    else:
        q, drafts, expect = None, [[0]] * N, float(p[0])
    plan, got = _one_row_batch(logits, SamplingParams(temperature=1.0), drafts, q)
    first = [got.committed(b, s.row_offset, None)[0][0] for b, s in enumerate(plan.sampled)]
    counts = [first.count(t) for t in range(V)]
    assert chisquare(counts, (p * N).tolist()).pvalue > 0.01, counts
    assert abs(sum(got.num_accepted) / N - expect) < 0.025


def test_top_p_cut_beyond_the_probe_falls_back_exactly():
    """A flat row whose top-p cut lies past processors.TOP_P_PROBE tokens gives the reference's result."""
    from specserve.sample import processors

    V = 4 * processors.TOP_P_PROBE
    logits = torch.randn(3, V) * 0.1
    params = SamplingParams(temperature=1.0, top_p=0.97)
    r = Request("r", [1], params, None, 0)
    plan = StepPlan.build([ScheduledRequest.decode(r, [0, 0], None)])
    batch = SamplingBatch.build(plan.sampled, V, EOS, CPU)
    probs = sampling_probs(logits, batch)
    ref = logits_to_probs(logits, params)
    assert torch.equal(probs, ref) and (ref > 0).sum(-1).min() > processors.TOP_P_PROBE


def test_inverse_cdf_blocks_row_independent_and_never_zero_mass():
    """Several 1024-token blocks and a tail: a row's token is the same alone and in a batch, has
    weight, and the draws follow the weights."""
    from specserve.sample.inverse_cdf import inverse_cdf

    g = torch.Generator().manual_seed(0)
    V, N = 2 * 1024 + 300, 4000
    p = torch.rand(8, V, generator=g) * (torch.rand(8, V, generator=g) < 0.3)
    u = torch.tensor([uniform(seed_key(1), m, 0) for m in range(8)], dtype=torch.float64)
    tok, bad = inverse_cdf(p, u)
    assert not bad.any() and (p[torch.arange(8), tok] > 0).all()
    assert [int(inverse_cdf(p[i : i + 1], u[i : i + 1])[0]) for i in range(8)] == tok.tolist()
    w = torch.zeros(V)
    w[[5, 1500, V - 1]] = torch.tensor([0.5, 0.3, 0.2])
    u = torch.tensor([uniform(seed_key(2), m, 0) for m in range(N)], dtype=torch.float64)
    draws = inverse_cdf(w.repeat(N, 1), u)[0].tolist()
    counts = [draws.count(t) for t in (5, 1500, V - 1)]
    assert sum(counts) == N and chisquare(counts, [0.5 * N, 0.3 * N, 0.2 * N]).pvalue > 0.01
