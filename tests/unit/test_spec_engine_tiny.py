"""Speculative decoding on tiny random-weight models: greedy equivalence for every method and k, alone
and in mixed batches; stats invariants; stop/length handling inside accepted blocks; rollback.
(docs/speculation-cases.md B01, B02, B06, B07, B08, B10, B25, B26 at small scale; the real-model versions live in
tests/e2e.)"""

import dataclasses

import pytest

from specserve import LLM, SamplingParams
from specserve.config import SpeculativeConfig
from tests.helpers.cases import Submission, assert_spec_invariants, pick_forced_token, run_engine
from tests.helpers.proposers import WrongProposer

REPEAT = "1: I will not skip any words.\n2: I will not skip any words.\n3:"
PROMPTS = [REPEAT, "def add(a, b):\n    return a + b\n\ndef add(a, b):", "The engine", "serving " * 12, "x"]
GREEDY = dict(temperature=0.0, max_tokens=32, ignore_eos=True)
K = [1, 3, 5, 8]


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), max_model_len=256, max_num_seqs=16)


@pytest.fixture(scope="module")
def base(llm):
    return {p: o.outputs[0] for p, o in zip(PROMPTS, llm.generate(PROMPTS, SamplingParams(**GREEDY), speculative_config=None))}


def spec_configs(tiny_model_dir, other_tiny_dir, k):
    return {
        "ngram": SpeculativeConfig("ngram", k, prompt_lookup_min=1, prompt_lookup_max=4),
        "suffix": SpeculativeConfig("suffix", k),
        "draft_self": SpeculativeConfig("draft_model", k, model=str(tiny_model_dir)),
        "draft_other": SpeculativeConfig("draft_model", k, model=str(other_tiny_dir)),
    }


@pytest.fixture(scope="module")
def other_tiny_dir(tmp_path_factory):
    from tests.helpers.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-other"), arch="qwen2", seed=1)


@pytest.mark.parametrize("k", K)
def test_greedy_equivalence_every_method_alone_and_batched(llm, base, tiny_model_dir, other_tiny_dir, k):
    cfgs = spec_configs(tiny_model_dir, other_tiny_dir, k)
    for name, cfg in cfgs.items():
        for p in PROMPTS[:2]:
            out = llm.generate(p, SamplingParams(**GREEDY), speculative_config=cfg)[0].outputs[0]
            assert out.token_ids == base[p].token_ids, (name, k, p)
    # one mixed batch: every method, and requests without speculation, side by side
    eng = llm.engine
    plan = [(p, cfg) for p in PROMPTS for cfg in list(cfgs.values()) + [None]]
    subs = [Submission(f"mix{k}-{i}", p, SamplingParams(**GREEDY), cfg) for i, (p, cfg) in enumerate(plan)]
    streams = run_engine(eng, subs)
    done = {rid: st.final for rid, st in streams.items()}
    for i, (p, cfg) in enumerate(plan):
        assert done[f"mix{k}-{i}"].token_ids == base[p].token_ids, (k, cfg, p)
    assert eng.stats()["num_kv_tokens"] == 0


def test_self_draft_accepts_everything(llm, base, tiny_model_dir):
    cfg = SpeculativeConfig("draft_model", 4, model=str(tiny_model_dir))
    out = llm.generate(PROMPTS[0], SamplingParams(**GREEDY), speculative_config=cfg)[0].outputs[0]
    assert out.token_ids == base[PROMPTS[0]].token_ids
    assert out.num_draft_tokens > 0 and out.num_accepted_tokens == out.num_draft_tokens


@pytest.mark.parametrize("first_right", [False, True])
def test_always_wrong_drafts_roll_back_exactly(llm, base, first_right):
    """B25: rejected drafts leave nothing behind; a follow-up request is unaffected; KV returns to 0."""
    eng = llm.engine
    cfg = SpeculativeConfig("ngram", 4, prompt_lookup_min=3, prompt_lookup_max=3)  # a key of its own
    truth = {tuple(eng.encode_prompt(p)): base[p].token_ids for p in PROMPTS}
    wrong = WrongProposer(truth, eng.target.config.vocab_size, first_right=first_right)
    with eng.using_proposer(cfg, wrong):
        outs = llm.generate(PROMPTS, SamplingParams(**GREEDY), speculative_config=cfg)
    for p, o in zip(PROMPTS, outs):
        c = o.outputs[0]
        assert c.token_ids == base[p].token_ids
        assert c.num_draft_tokens > 0
        if first_right:
            assert c.num_accepted_tokens == c.num_drafts
        else:
            assert c.num_accepted_tokens == 0
    assert eng.stats()["num_kv_tokens"] == 0
    again = llm.generate(PROMPTS[0], SamplingParams(**GREEDY), speculative_config=None)[0].outputs[0]
    assert again.token_ids == base[PROMPTS[0]].token_ids


@pytest.mark.parametrize("k", K)
def test_max_tokens_exact_inside_blocks(llm, base, tiny_model_dir, k):
    """B07: the step's k is capped by the tokens left; every max_tokens is exact, with streaming deltas."""
    cfg = SpeculativeConfig("draft_model", k, model=str(tiny_model_dir))  # accepts everything
    for m in range(1, 11):
        eng = llm.engine
        eng.add_request("m", PROMPTS[0], SamplingParams(temperature=0, max_tokens=m, ignore_eos=True), speculative_config=cfg)
        streamed, last = [], None
        while eng.has_unfinished_requests():
            for o in eng.step():
                streamed += o.new_token_ids
                last = o
        assert last.finish_reason == "length" and streamed == base[PROMPTS[0]].token_ids[:m]


def test_context_end_inside_block(tiny_model_dir, base):
    """B08: a draft block never passes max_model_len; the request ends with 'length' exactly there."""
    llm = LLM(str(tiny_model_dir), max_model_len=64)
    ids = llm.engine.encode_prompt(REPEAT * 4)[: 64 - 9]
    for k in (1, 3, 8):
        for P in (len(ids), 63, 64 - k):
            prompt = (ids * 2)[:P]
            cfg = SpeculativeConfig("draft_model", k, model=str(tiny_model_dir))
            spec = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), speculative_config=cfg)[0].outputs[0]
            ref = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), speculative_config=None)[0].outputs[0]
            assert len(spec.token_ids) == 64 - P and spec.finish_reason == "length" and spec.token_ids == ref.token_ids


@pytest.mark.parametrize("k", [2, 4, 8])
def test_stop_inside_accepted_block_and_stats(llm, base, tiny_model_dir, k):
    """B02/B06/B10: a stop id inside an accepted block ends the request there; nothing after it is
    returned or counted; the acceptance counters obey the invariants. The stops come from the forcing
    trick: tokens BASE first produced strictly inside a block that the target drafting for itself had
    accepted, one in each of three ranges; a range without one fails the test (LookupError), so the
    case cannot pass without a stop inside a block."""
    cfg = SpeculativeConfig("draft_model", k, model=str(tiny_model_dir))
    prompt = PROMPTS[2]  # its BASE output has tokens first produced at many positions
    ref = base[prompt].token_ids
    blocks = run_engine(llm.engine, [Submission(f"blocks-{k}", prompt, SamplingParams(**GREEDY), cfg)])[f"blocks-{k}"].blocks
    assert [i for b in blocks for i in b] == ref
    picks = [pick_forced_token(ref, lo, hi, blocks=blocks) for lo, hi in ((1, 10), (9, 20), (16, 32))]
    for p, t in picks:
        for max_tokens in (p + 1, p + 3, 32):
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, stop_token_ids=[t])
            st = run_engine(llm.engine, [Submission("stop", prompt, params, cfg)])["stop"]
            where = f"k={k} stop at {p}, max_tokens {max_tokens}"
            assert st.final.token_ids == ref[: p + 1] and st.final.finish_reason == "stop", where
            assert [i for b in st.blocks for i in b] == ref[: p + 1], where  # nothing after the stop in any chunk
            assert st.final.spec_stats.num_accepted_tokens > 0, where
            assert_spec_invariants(st, k, where)
    # control: a stop after the cap gives 'length' with exactly max_tokens tokens (B06)
    _, t = pick_forced_token(ref, 5, 32)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, stop_token_ids=[t]),
                       speculative_config=cfg)[0].outputs[0]
    assert out.finish_reason == "length" and out.token_ids == ref[:5]


def test_seeded_sampling_reproducible_under_spec(llm, tiny_model_dir, other_tiny_dir):
    """B19: with each method a seed gives the same tokens, alone and among unseeded requests."""
    p = SamplingParams(temperature=1.0, seed=42, max_tokens=12, ignore_eos=True)
    for cfg in spec_configs(tiny_model_dir, other_tiny_dir, 4).values():
        alone = llm.generate(PROMPTS[0], p, speculative_config=cfg)[0].outputs[0].token_ids
        mixed = llm.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]],
                             [SamplingParams(temperature=1.0, max_tokens=9), p, SamplingParams(temperature=0.5, max_tokens=7)],
                             speculative_config=cfg)[1].outputs[0].token_ids
        assert alone == mixed
        assert llm.generate(PROMPTS[0], p.clone(seed=43), speculative_config=cfg)[0].outputs[0].token_ids != alone
        if cfg.method in ("ngram", "suffix"):  # one-hot drafts: the same tokens as without speculation
            assert alone == llm.generate(PROMPTS[0], p, speculative_config=None)[0].outputs[0].token_ids


def adaptive(cfg: SpeculativeConfig) -> SpeculativeConfig:
    return dataclasses.replace(cfg, num_speculative_tokens_schedule="adaptive")


def test_adaptive_schedule_is_lossless(llm, base, tiny_model_dir, other_tiny_dir):
    """The adaptive schedule changes k step by step; greedy output stays the target's, alone and in a
    batch mixing adaptive, constant and no speculation, for every method."""
    eng = llm.engine
    cfgs = {n: adaptive(c) for n, c in spec_configs(tiny_model_dir, other_tiny_dir, 8).items()}
    for name, cfg in cfgs.items():
        out = llm.generate(PROMPTS[0], SamplingParams(**GREEDY), speculative_config=cfg)[0].outputs[0]
        assert out.token_ids == base[PROMPTS[0]].token_ids, name
    plan = [(p, cfg) for p in PROMPTS for cfg in list(cfgs.values()) + [SpeculativeConfig("ngram", 3), None]]
    subs = [Submission(f"ad-{i}", p, SamplingParams(**GREEDY), cfg) for i, (p, cfg) in enumerate(plan)]
    done = {rid: st.final for rid, st in run_engine(eng, subs).items()}
    for i, (p, cfg) in enumerate(plan):
        assert done[f"ad-{i}"].token_ids == base[p].token_ids, (cfg, p)
    assert eng.stats()["num_kv_tokens"] == 0 and eng.adaptive.tracker.num_requests == 0
    chosen = eng.adaptive.chosen_k[cfgs["ngram"]]
    assert sum(chosen) > 0 and len([k for k, n in enumerate(chosen) if n]) > 1  # k did change


@pytest.fixture
def random_k(monkeypatch):
    """Replace the adaptive choice with a random k per request and step (0 included), made in every
    step whatever the measured step costs on this machine: no rest after a "no drafts" choice, and
    drafting counts as cheap, so no request is retired (a test of retiring forces it itself)."""
    import random

    from specserve.engine import draft_length
    from specserve.spec_decode.adaptive import Choice

    rng = random.Random(3)
    monkeypatch.setattr(draft_length, "REST_SHARE", 1e9)
    monkeypatch.setattr(draft_length, "HOLD_SHARE", 1e9)  # and no holds
    monkeypatch.setattr(draft_length, "COSTLY_SHARE", float("inf"))

    def choose(options, step_ms, **kw):
        return Choice([rng.randint(0, len(o.acceptance)) for o in options], 0.0, 0.0, 0.0)

    monkeypatch.setattr(draft_length, "choose_draft_lengths", choose)


def test_any_k_sequence_gives_the_same_tokens(llm, base, tiny_model_dir, random_k):
    """Losslessness does not depend on the choice: random k every step (0 included) gives the greedy
    tokens of the target, and seeded sampled tokens equal to those without speculation (one-hot drafts:
    ngram, suffix, a greedy draft model)."""
    eng = llm.engine
    for cfg in (SpeculativeConfig("ngram", 6, prompt_lookup_min=1, prompt_lookup_max=4), SpeculativeConfig("suffix", 6),
                SpeculativeConfig("draft_model", 6, model=str(tiny_model_dir))):
        cfg = adaptive(cfg)
        outs = llm.generate(PROMPTS, SamplingParams(**GREEDY), speculative_config=cfg)
        for p, o in zip(PROMPTS, outs):
            assert o.outputs[0].token_ids == base[p].token_ids, (cfg.method, p)
        assert len([n for n in eng.adaptive.chosen_k[cfg] if n]) > 2
        if cfg.method == "draft_model":
            continue
        for seed in (1, 2):
            p = SamplingParams(temperature=0.8, top_p=0.95, seed=seed, max_tokens=24, ignore_eos=True)
            ref = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, p, speculative_config=None)]
            got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, p, speculative_config=cfg)]
            assert got == ref, (cfg.method, seed)



def test_retiring_and_catching_up_is_lossless(llm, base, random_k, monkeypatch):
    """Where drafting counts as costly (forced here, as on a fast GPU with a slow proposer), the adaptive
    schedule retires requests (no suffix-tree work, `prepare` included, which runs between steps as on
    CUDA) and un-retires them (their next draft ingests what they missed); with random choices every
    step, both happen many times. Greedy tokens stay the target's and seeded sampled tokens those
    without speculation, and nothing is left retired or tracked."""
    from specserve.engine import draft_length
    from specserve.spec_decode import proposer_key

    monkeypatch.setattr(draft_length.AdaptiveK, "_costly", lambda self, *args: True)
    monkeypatch.setattr(draft_length, "REST_SHARE", 1e9)  # every step decides: the call sequence is fixed
    monkeypatch.setattr(draft_length, "HOLD_SHARE", 1e9)  # and no holds
    eng = llm.engine
    monkeypatch.setattr(eng, "overlap_host_work", True)
    cfg = adaptive(SpeculativeConfig("suffix", 6, suffix_decoding_max_cached_requests=7))
    eng.prepare_speculative_config(cfg)
    verdicts, refused = [], set()
    wants = eng.adaptive.wants_prepare

    def spy(req, n, num_tokens=None):
        verdicts.append(wants(req, n, num_tokens))
        if not verdicts[-1]:
            refused.add(req.request_id)
        return verdicts[-1]

    prop = eng._proposers[proposer_key(cfg)]
    prepare = prop.prepare

    def checked_prepare(inputs):  # a request refused in this step's verdicts gets no proposer work
        assert not refused & {i.request_id for i in inputs}
        refused.clear()
        return prepare(inputs)

    monkeypatch.setattr(eng.adaptive, "wants_prepare", spy)
    monkeypatch.setattr(prop, "prepare", checked_prepare)
    outs = llm.generate(PROMPTS, SamplingParams(**GREEDY), speculative_config=cfg)
    for p, o in zip(PROMPTS, outs):
        assert o.outputs[0].token_ids == base[p].token_ids, p
    p = SamplingParams(temperature=0.8, top_p=0.95, seed=5, max_tokens=24, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, p, speculative_config=None)]
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, p, speculative_config=cfg)] == ref
    assert True in verdicts and False in verdicts  # prepared and skipped requests both
    assert eng.adaptive.num_retired == 0 and eng.adaptive.tracker.num_requests == 0


class RandomK:
    """A KPolicy (the step plan's hook) that wants a random k per request and step, 0 included; the
    scheduler's caps still apply after it."""

    def __init__(self, seed: int):
        import random

        self.rng, self.verified = random.Random(seed), []

    def choose(self, requests, max_draft_tokens):
        return [self.rng.randint(0, 8) for _ in requests]

    def observe(self, request, num_draft_tokens, num_accepted):
        self.verified.append(num_draft_tokens)


def test_k_policy_never_changes_committed_tokens(llm, base, tiny_model_dir, monkeypatch):
    """On the step plan: whatever k the scheduler's k policy chooses per request and step (0 included),
    in one batch of greedy and seeded sampled requests over ngram, suffix and a greedy draft model, the
    greedy tokens are the target's and the seeded ones those drawn without speculation."""
    eng = llm.engine
    sampled = [SamplingParams(temperature=0.8, top_p=0.95, seed=s, max_tokens=24, ignore_eos=True) for s in (5, 6)]
    ref = {(p, sp.seed): o.outputs[0].token_ids for sp in sampled
           for p, o in zip(PROMPTS, llm.generate(PROMPTS, sp, speculative_config=None))}
    policy = RandomK(7)
    monkeypatch.setattr(eng.scheduler, "k_policy", policy)
    cfgs = [SpeculativeConfig("ngram", 8, prompt_lookup_min=1, prompt_lookup_max=4), SpeculativeConfig("suffix", 8),
            SpeculativeConfig("draft_model", 8, model=str(tiny_model_dir))]
    plan = [(p, cfg, sp) for p in PROMPTS for cfg in cfgs for sp in [SamplingParams(**GREEDY)] + sampled
            if sp.temperature == 0 or cfg.method != "draft_model"]  # a sampling draft model: seeded per k only
    subs = [Submission(f"rk-{i}", p, sp, cfg) for i, (p, cfg, sp) in enumerate(plan)]
    done = {rid: st.final for rid, st in run_engine(eng, subs).items()}
    for i, (p, cfg, sp) in enumerate(plan):
        want = base[p].token_ids if sp.temperature == 0 else ref[(p, sp.seed)]
        assert done[f"rk-{i}"].token_ids == want, (cfg.method, sp.seed, p)
    assert 0 in policy.verified and len(set(policy.verified)) > 3  # k = 0 steps and several block sizes
    assert eng.stats()["num_kv_tokens"] == 0


def test_prepare_in_the_gpu_window_changes_no_output(tiny_model_dir, monkeypatch):
    """The suffix proposer's `prepare` (run on CUDA while the device computes) gives the same greedy
    tokens; it gets the requests that may draft at the step's batch size, not those a batch-size table
    gives k = 0."""
    from specserve.spec_decode.suffix import SuffixProposer

    llm = LLM(str(tiny_model_dir), max_model_len=256, max_num_seqs=16)
    eng = llm.engine
    suffix = SpeculativeConfig("suffix", 4)
    never = SpeculativeConfig("suffix", 4, num_speculative_tokens_per_batch_size=[[1, 16, 0]],
                              suffix_decoding_max_cached_requests=9)
    want = {c: llm.generate(PROMPTS, SamplingParams(**GREEDY), speculative_config=c) for c in (suffix, never)}
    seen: list[str] = []
    real = SuffixProposer.prepare

    def spy(self, inputs):
        seen.extend(i.request_id for i in inputs)
        return real(self, inputs)

    monkeypatch.setattr(SuffixProposer, "prepare", spy)
    eng.overlap_host_work = True
    for c in (suffix, never):
        seen.clear()
        got = llm.generate(PROMPTS, SamplingParams(**GREEDY), speculative_config=c)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want[c]]
        assert bool(seen) == (c is suffix)


def test_adaptive_objective_reaches_the_schedule(tiny_model_dir):
    """`EngineConfig.adaptive_objective` (serve's --adaptive-objective) is what the adaptive schedule
    maximises: throughput by default, fair when asked; anything else is a ConfigError naming it."""
    from specserve.config import ConfigError, EngineConfig

    for objective in (None, "fair"):
        kw = {} if objective is None else {"adaptive_objective": objective}
        llm = LLM(str(tiny_model_dir), max_model_len=64, max_num_seqs=2, **kw)
        llm.engine.prepare_speculative_config(adaptive(SpeculativeConfig("ngram", 4)))
        assert llm.engine.adaptive.objective == (objective or "throughput")
    with pytest.raises(ConfigError, match="adaptive_objective"):
        EngineConfig(model="x", adaptive_objective="latency")
