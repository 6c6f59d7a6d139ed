"""The cost-aware k choice: known costs and acceptances give the known optimum (k = 0 included), the
greedy over increments equals brute force over every combination, draft-model costs, the guard."""

import itertools
import math
import random

import pytest

from specserve.spec_decode.adaptive import DraftOption, choose_draft_lengths, expected_tokens


def cpu_cost(tokens: int, seqs: int = 1) -> float:
    """The measured CPU shape (docs/benchmarks/verify_cost_*): flat for 1-3 tokens, +75% for 4-6, ..."""
    return 100.0 * (1 + 0.75 * ((tokens - 1) // 3)) + tokens


def flat_cost(tokens: int, seqs: int = 1) -> float:
    return 10.0 + 0.01 * tokens


def brute(options, cost, objective="fair", other_tokens=0, other_seqs=0):
    n = len(options)
    best, best_ks = None, None
    for ks in itertools.product(*[range(len(o.acceptance) + 1) for o in options]):
        c = cost(other_tokens + n + sum(ks), n + other_seqs)
        for g in {o.draft_group for o in options if o.draft_group is not None}:
            f = next(o.draft_cost_ms for o in options if o.draft_group == g)
            depth = max([k for o, k in zip(options, ks) if o.draft_group == g], default=0)
            c += sum(f(sum(1 for o, k in zip(options, ks) if o.draft_group == g and k >= j)) for j in range(1, depth + 1))
        es = [expected_tokens(o.acceptance, k) for o, k in zip(options, ks)]
        v = (sum(map(math.log, es)) - (n + other_seqs) * math.log(c) if objective == "fair"
             else (sum(es) + other_seqs) / c)  # throughput: each other sequence commits one token
        if best is None or v > best + 1e-12 or (abs(v - best) <= 1e-12 and sum(ks) < sum(best_ks)):
            best, best_ks = v, list(ks)
    return best_ks, best


def test_expected_tokens_is_leviathan():
    for a in (0.0, 0.3, 0.8):
        for k in range(6):
            assert expected_tokens([a] * k, k) == pytest.approx((1 - a ** (k + 1)) / (1 - a))
    assert expected_tokens([1.0, 0.5, 0.5], 3) == pytest.approx(1 + 1 + 0.5 + 0.25)


@pytest.mark.parametrize("a,k", [(0.0, 0), (0.2, 2), (0.9, 2), (0.95, 5), (0.97, 8)])
def test_single_request_on_the_cpu_curve(a, k):
    """Verify blocks of 1-3 tokens cost about a decode, 4-6 1.75x, 7-9 2.5x: drafts that are never
    accepted get k = 0, a low or even a high acceptance k = 2 (nearly free); only a very high one pays
    for the next block."""
    choice = choose_draft_lengths([DraftOption([a] * 8)], cpu_cost)
    assert choice.ks == [k]
    assert choice.ks == brute([DraftOption([a] * 8)], cpu_cost)[0]


def test_k0_when_drafts_cost_more_than_they_bring():
    expensive = lambda t, s=1: 100.0 * t  # every token pays full price: speculation never wins
    assert choose_draft_lengths([DraftOption([0.9] * 6)], expensive).ks == [0]
    # zero acceptance: nothing to gain even when drafts are free
    assert choose_draft_lengths([DraftOption([0.0] * 6)], flat_cost).ks == [0]
    # nearly free drafts and a high acceptance: all of them
    assert choose_draft_lengths([DraftOption([0.9] * 6)], flat_cost).ks == [6]


def test_per_position_estimates_are_used():
    # the first draft is almost surely accepted, the second almost never: stop after one
    assert choose_draft_lengths([DraftOption([0.95, 0.02, 0.9, 0.9])], lambda t, s=1: 100.0 + 30.0 * t).ks == [1]


@pytest.mark.parametrize("objective", ["fair", "throughput"])
@pytest.mark.parametrize("cost", [cpu_cost, flat_cost, lambda t, s: 50.0 + 7.0 * t + 3.0 * s + 40.0 * (t > 9)])
def test_greedy_equals_brute_force(objective, cost):
    rng = random.Random(7)
    for _ in range(25):
        options = [DraftOption([rng.random() ** 0.5 for _ in range(rng.randint(0, 4))]) for _ in range(rng.randint(1, 3))]
        other_tokens, other_seqs = rng.choice([(0, 0), (1, 1), (30, 2)])
        choice = choose_draft_lengths(options, cost, objective=objective, num_other_tokens=other_tokens,
                                      num_other_seqs=other_seqs)
        ks, value = brute(options, cost, objective, other_tokens, other_seqs)
        assert choice.value == pytest.approx(value)
        assert choice.ks == ks
        assert choice.expected_tokens == pytest.approx(sum(expected_tokens(o.acceptance, k) for o, k in zip(options, ks)))


def test_fair_objective_protects_the_requests_that_gain_nothing():
    """Batch of two on a curve where each extra token costs 5%: one request accepts 80%, the other
    never. Throughput lets the first draft deeper (its gain outweighs the other's loss); the fair
    objective stops where the other request's slowdown is not paid back."""
    cost = lambda t, s: 100.0 * (1 + 0.05 * (t - s))
    opts = [DraftOption([0.8] * 8), DraftOption([0.0] * 8)]
    thr = choose_draft_lengths(opts, cost, objective="throughput").ks
    fair = choose_draft_lengths(opts, cost, objective="fair").ks
    assert fair[1] == 0 and thr[1] == 0 and fair[0] < thr[0]
    assert fair == brute(opts, cost, "fair")[0] and thr == brute(opts, cost, "throughput")[0]


def test_prefill_in_the_step_makes_drafts_cheap():
    """With a 300-token prefill chunk in the step, a few draft rows add little: speculate more."""
    lin = lambda t, s=1: 20.0 + 10.0 * t
    alone = choose_draft_lengths([DraftOption([0.5] * 8)], lin).ks[0]
    with_prefill = choose_draft_lengths([DraftOption([0.5] * 8)], lin, num_other_tokens=300, num_other_seqs=1).ks[0]
    assert with_prefill > alone


def test_draft_model_costs():
    """A draft model pays one forward per drafted position: fewer drafts than when drafting is free."""
    step = lambda t, s=1: 100.0
    free = choose_draft_lengths([DraftOption([0.8] * 8)], step).ks
    draft = DraftOption([0.8] * 8, draft_group="d", draft_cost_ms=lambda n: 25.0)
    costly = choose_draft_lengths([draft], step).ks
    assert free == [8] and costly == brute([draft], step)[0] and 0 < costly[0] < 8
    # two draft-model requests share each draft forward (batched): compare with brute force
    shared = [DraftOption([0.8] * 4, "d", lambda n: 20.0 + 5.0 * n), DraftOption([0.5] * 4, "d", lambda n: 20.0 + 5.0 * n)]
    assert choose_draft_lengths(shared, step).ks == brute(shared, step)[0]
    with pytest.raises(ValueError):
        choose_draft_lengths([DraftOption([0.5], draft_group="d")], step)


def test_min_gain_guard_and_edge_cases():
    opts = [DraftOption([0.3] * 2)]  # on the flat part of the CPU curve: a gain of ~1.39x
    assert choose_draft_lengths(opts, cpu_cost).ks == [2]
    assert choose_draft_lengths(opts, cpu_cost, min_gain=0.5).ks == [0]
    assert choose_draft_lengths([], cpu_cost).ks == []
    assert choose_draft_lengths([DraftOption([])], cpu_cost).ks == [0]
    with pytest.raises(ValueError):
        choose_draft_lengths(opts, cpu_cost, objective="fastest")


def test_margin_speculates_only_for_a_gain_of_min_gain():
    """k = 1 costs 4% more than a decode: acceptance 0.08 gains 1.08 / 1.04 = +3.8% (below the 5% margin:
    k = 0), 0.10 gains +5.8% (k = 1); without a margin both speculate. Same for the throughput objective."""
    from specserve.engine.draft_length import MIN_GAIN

    cost = lambda t, s=1: 100.0 + 4.0 * (t - s)
    assert MIN_GAIN == 0.05
    for objective in ("fair", "throughput"):
        assert choose_draft_lengths([DraftOption([0.08])], cost, objective=objective).ks == [1]
        assert choose_draft_lengths([DraftOption([0.08])], cost, objective=objective, min_gain=MIN_GAIN).ks == [0]
        assert choose_draft_lengths([DraftOption([0.10])], cost, objective=objective, min_gain=MIN_GAIN).ks == [1]
    # the margin is against k = 0 only: once speculating pays, the best k is kept (here the deepest)
    assert choose_draft_lengths([DraftOption([0.9] * 4)], cost, min_gain=MIN_GAIN).ks == [4]


def test_host_cost_per_draft_token_shortens_or_removes_drafts():
    """Free verify tokens (flat forward), acceptance 0.6 per position: without host cost the longest draft
    wins; at 0.5 ms per draft token on a 2 ms step, k = 2 (expected 1.96 tokens in 3 ms = 0.653 per ms beats
    k = 1: 1.6 in 2.5 = 0.64, k = 3: 2.176 in 3.5 = 0.622, k = 0: 0.5); at 2 ms per draft token, k = 0."""
    opts = [DraftOption([0.6] * 6)]
    flat = lambda t, s: 2.0  # noqa: E731
    assert choose_draft_lengths(opts, flat, objective="throughput").ks == [6]
    assert choose_draft_lengths(opts, flat, objective="throughput", draft_token_ms=0.5).ks == [2]
    assert choose_draft_lengths(opts, flat, objective="throughput", draft_token_ms=2.0).ks == [0]


def test_speculate_ms_is_a_fixed_price_of_any_drafts():
    """The decision's own time (proposing for 16 requests on a GPU host: ~5 ms against a 1.5 ms step)
    is paid by every choice with drafts and not by k = 0 for everyone."""
    gpu = lambda t, s=1: 1.3 + 0.003 * t  # noqa: E731 - a graph step: drafts nearly free
    opts = [DraftOption([0.6] * 8) for _ in range(16)]
    assert sum(choose_draft_lengths(opts, gpu).ks) > 0
    choice = choose_draft_lengths(opts, gpu, speculate_ms=5.0)
    assert choice.ks == [0] * 16 and choice.step_ms == pytest.approx(gpu(16, 16))
    # a high acceptance still pays for it, and then the cost includes it
    rich = [DraftOption([0.95] * 8) for _ in range(16)]
    choice = choose_draft_lengths(rich, gpu, speculate_ms=1.0)
    t = sum(choice.ks)
    assert t > 0 and choice.step_ms == pytest.approx(gpu(16 + t, 16) + 1.0)
    # on a CPU step of 100+ ms a 1 ms decision changes nothing
    assert choose_draft_lengths([DraftOption([0.9] * 8)], cpu_cost, speculate_ms=1.0).ks == \
        choose_draft_lengths([DraftOption([0.9] * 8)], cpu_cost).ks


@pytest.mark.parametrize("objective", ["fair", "throughput"])
def test_numpy_path_chooses_as_the_loop(objective, monkeypatch):
    """Many increments without drafting groups go through numpy (`_choose_free`); it makes the loop's
    choice (same k per option, value, step cost and expected tokens) on random batches, also with
    acceptances of 0 and 1, a min_gain threshold and a drafting charge."""
    import random

    import specserve.spec_decode.adaptive as ad

    rng = random.Random(7)
    for trial in range(300):
        n = rng.randint(1, 16)
        opts = [ad.DraftOption([rng.choice([0.0, 1.0, rng.random(), rng.uniform(0.6, 1.0)])
                                for _ in range(rng.randint(1, 8))]) for _ in range(n)]
        base = rng.uniform(0.5, 2.0)

        def step(t, b, base=base):
            return base + 0.004 * t + 0.01 * b

        kw = dict(num_other_tokens=rng.randint(0, 8), num_other_seqs=rng.randint(0, 4), objective=objective,
                  min_gain=rng.choice([0.0, 0.05]), draft_token_ms=rng.choice([0.0, 0.02]),
                  speculate_ms=rng.choice([0.0, 0.3, 1.0]))
        monkeypatch.setattr(ad, "NUMPY_MIN_INCREMENTS", 0)
        fast = ad.choose_draft_lengths(opts, step, **kw)
        monkeypatch.setattr(ad, "NUMPY_MIN_INCREMENTS", 10**9)
        loop = ad.choose_draft_lengths(opts, step, **kw)
        assert fast.ks == loop.ks, trial
        assert fast.value == pytest.approx(loop.value, abs=1e-9)
        assert fast.step_ms == pytest.approx(loop.step_ms) and fast.expected_tokens == pytest.approx(loop.expected_tokens)


def test_throughput_counts_the_other_sequences_tokens():
    """Throughput is tokens per ms of the whole step: the 15 plain decodes beside one speculating
    request commit a token each too. On a CPU-like linear cost (60 ms + 6 ms per token) a request with
    acceptance 0.6 beside them must not draft (its 1.5 expected extra tokens cost 16 requests ~10%
    more time), while alone it does; the choice matches the brute force with the others counted."""
    cost = lambda t, b: 60.0 + 6.0 * t  # noqa: E731
    opt = [DraftOption([0.6] * 5)]
    beside = choose_draft_lengths(opt, cost, num_other_tokens=15, num_other_seqs=15, objective="throughput")
    assert beside.ks == [0]
    assert beside.ks == brute(opt, cost, "throughput", other_tokens=15, other_seqs=15)[0]
    alone = choose_draft_lengths(opt, cost, objective="throughput")
    assert alone.ks[0] > 0 and alone.ks == brute(opt, cost, "throughput")[0]
