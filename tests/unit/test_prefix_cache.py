"""Automatic prefix caching (docs/prefix_caching.md): the slot cache's cached entries, LRU eviction and
prefix copies; on tiny random-weight models, greedy tokens and logprobs with the cache equal those
without it (baseline, ngram, always-wrong drafts, a draft model), hit accounting, a prompt equal to a
cached one and a prompt that is a strict prefix of a cached sequence, slot pressure, and the flag off."""

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.cli import build_parser
from specserve.config import ConfigError, EngineConfig, SpeculativeConfig
from specserve.engine.kv_cache import KVCache, KVCacheFullError, common_prefix_len
from specserve.metrics.prometheus import ServerMetrics
from tests.helpers.proposers import WrongProposer

A = "The quick brown fox jumps over the lazy dog. " * 3  # ~80 tokens of the tiny tokenizer
PROMPTS = [A + "It was", A + "It was the best of times", A, "def add(a, b):\n    return a + b\n" * 3]
GREEDY = dict(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
NGRAM = SpeculativeConfig("ngram", 4, prompt_lookup_min=1, prompt_lookup_max=4)
LOGPROB_TOL = 1e-5  # see test_exact_cached_vs_uncached


def make_kv(slots=3, max_len=32):
    return KVCache(num_layers=2, num_slots=slots, num_kv_heads=2, head_dim=4, max_len=max_len,
                   dtype=torch.float32, device=torch.device("cpu"))


def fill(kv, slot, tokens):
    """Write a recognisable K/V per position (the token id) and mark the positions valid."""
    for t in kv.k + kv.v:
        t[slot, :, : len(tokens)] = torch.tensor(tokens, dtype=torch.float32)[None, :, None]
    kv.extend(slot, len(tokens))


# ---- the KV cache ---------------------------------------------------------------------------------


def test_common_prefix_len_equals_the_plain_loop():
    import random

    def naive(a, b):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    rng = random.Random(0)
    for _ in range(500):
        a = [rng.randrange(3) for _ in range(rng.randrange(0, 40))]
        b = a[: rng.randrange(0, len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(0, 10))]
        for x, y in ((a, b), (tuple(a), b), (b, tuple(a))):
            assert common_prefix_len(x, y) == naive(a, b)


def test_free_with_tokens_keeps_a_cached_entry_that_counts_as_free():
    kv = make_kv()
    a = kv.allocate()
    fill(kv, a, [5, 6, 7, 8, 9])
    kv.free(a, [5, 6, 7])  # e.g. two rejected-draft positions beyond the committed length are dropped
    assert kv.cached[a] == (5, 6, 7) and kv.lengths[a] == 3
    assert kv.num_free_slots == 3 and kv.num_used_tokens == 0 and kv.usage == 0 and kv.num_cached_tokens == 3
    with pytest.raises(ValueError, match="already free"):
        kv.free(a)
    b = kv.allocate()
    with pytest.raises(ValueError):
        kv.free(b, [1, 2])  # more tokens than the slot holds


def test_take_when_the_entry_is_a_prefix_copy_when_it_holds_more():
    kv = make_kv()
    a = kv.allocate()
    fill(kv, a, [1, 2, 3, 4])
    kv.free(a, [1, 2, 3, 4])
    slot, n = kv.allocate_for_prefix([1, 2, 3, 4, 5, 6], min_tokens=2)
    assert (slot, n) == (a, 4) and not kv.cached and kv.lengths[a] == 4  # taken: nothing of it is lost
    fill(kv, a, [1, 2, 3, 4, 5, 6])
    kv.free(a, [1, 2, 3, 4, 5, 6])
    slot, n = kv.allocate_for_prefix([1, 2, 3, 9], min_tokens=2)
    assert slot != a and n == 3 and kv.cached[a] == (1, 2, 3, 4, 5, 6)  # copied: the entry stays
    for t in kv.k + kv.v:
        assert torch.equal(t[slot, :, :3], t[a, :, :3])
    assert kv.lengths[slot] == 3


def test_longest_prefix_is_capped_below_the_whole_prompt_and_needs_min_tokens():
    kv = make_kv()
    a = kv.allocate()
    fill(kv, a, [1, 2, 3, 4])
    kv.free(a, [1, 2, 3, 4])
    assert kv.longest_prefix([1, 2, 3, 4]) == (a, 3)  # the last prompt token is always fed
    assert kv.longest_prefix([1, 2, 3, 4], min_tail=2) == (a, 2)
    assert kv.longest_prefix([1, 2, 3, 4, 5, 6], min_tail=2) == (a, 4)
    assert kv.longest_prefix([1, 2], min_tail=2) == (None, 0)
    assert kv.longest_prefix([9, 2]) == (None, 0)
    slot, n = kv.allocate_for_prefix([1, 2, 7], min_tokens=3)
    assert n == 0 and slot != a and a in kv.cached  # a 2-token match is below min_tokens: a miss
    with pytest.raises(ValueError):
        kv.allocate_for_prefix([1], min_tokens=0)


def test_lru_eviction_only_when_no_empty_slot_is_left():
    kv = make_kv(slots=3)
    s = [kv.allocate() for _ in range(3)]
    for i, slot in enumerate(s):
        fill(kv, slot, [10 * i + 1, 10 * i + 2])
        kv.free(slot, [10 * i + 1, 10 * i + 2])
    kv.allocate_for_prefix([1, 2, 3], min_tokens=1)  # uses s[0]'s entry (taken): s[1] is now the oldest
    assert list(kv.cached) == [s[1], s[2]]
    assert kv.allocate() == s[1]  # no empty slot: the least recently used entry is evicted
    assert list(kv.cached) == [s[2]]
    assert kv.allocate() == s[2] and not kv.cached
    with pytest.raises(KVCacheFullError):
        kv.allocate()
    kv.free(s[0], [1, 2])  # the slot taken above holds [1, 2]
    assert list(kv.cached) == [s[0]]
    kv.clear_cached()
    assert not kv.cached and kv.num_free_slots == 1 and kv.lengths[s[0]] == 0


def test_copy_only_into_an_empty_slot_else_take_the_source():
    kv = make_kv(slots=2)
    a, b = kv.allocate(), kv.allocate()
    fill(kv, a, [1, 2, 3, 4])
    fill(kv, b, [7, 8])
    kv.free(b, [7, 8])
    kv.free(a, [1, 2, 3, 4])
    slot, n = kv.allocate_for_prefix([1, 2, 5], min_tokens=1)
    assert (slot, n) == (a, 2) and list(kv.cached) == [b]  # no empty slot: b's entry is kept, a's cut
    assert kv.lengths[a] == 2


def test_no_duplicate_entries():
    kv = make_kv(slots=3)
    a, b, c = kv.allocate(), kv.allocate(), kv.allocate()
    for slot, toks in ((a, [1, 2, 3]), (b, [1, 2, 3, 4, 5]), (c, [1, 2])):
        fill(kv, slot, toks)
    kv.free(a, [1, 2, 3])
    kv.free(b, [1, 2, 3, 4, 5])  # covers a's entry: a becomes empty
    assert list(kv.cached) == [b] and kv.lengths[a] == 0 and kv.num_free_slots == 2  # c is in use
    kv.free(c, [1, 2])  # already covered by b's entry: c becomes empty, b the most recently used
    assert list(kv.cached) == [b] and kv.lengths[c] == 0
    d = kv.allocate()
    fill(kv, d, [1, 2, 3, 4, 5])
    kv.free(d, [1, 2, 3, 4, 5])  # the same tokens as b: one entry stays
    assert len(kv.cached) == 1


# ---- the engine -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair(tiny_model_dir):
    """Two engines over the same tiny model: prefix caching on (the default) and off."""
    on = LLM(str(tiny_model_dir), max_model_len=256, max_num_seqs=4)
    off = LLM(str(tiny_model_dir), max_model_len=256, max_num_seqs=4, enable_prefix_caching=False)
    assert on.engine.config.enable_prefix_caching and not off.engine.config.enable_prefix_caching
    return on, off


def counts(llm):
    s = llm.engine.stats()
    return s["prefix_cache_queries"], s["prefix_cache_hits"]


def gen(llm, prompt, spec=None, **kw):
    return llm.generate(prompt, SamplingParams(**{**GREEDY, **kw}), speculative_config=spec)[0].outputs[0]


def assert_same(a, b):
    """Greedy tokens identical; logprobs (chosen and top-2) equal within LOGPROB_TOL."""
    assert a.token_ids == b.token_ids
    assert len(a.logprobs) == len(b.logprobs) == len(a.token_ids)
    for x, y in zip(a.logprobs, b.logprobs):
        assert x.token_id == y.token_id and abs(x.logprob - y.logprob) <= LOGPROB_TOL
        assert [t for t, _ in x.top] == [t for t, _ in y.top]
        assert all(abs(u - v) <= LOGPROB_TOL for (_, u), (_, v) in zip(x.top, y.top))


@pytest.mark.parametrize("spec", [None, NGRAM], ids=["baseline", "ngram"])
def test_exact_cached_vs_uncached(pair, spec):
    """Every prompt twice, in an order that makes each kind of hit: a prompt extending a cached one, a
    strict prefix of a cached sequence, an unrelated one, and each of them equal to a cached one.

    Tokens are identical; logprobs are checked within 1e-5, not bit for bit: a reused position's K/V
    may come from a forward of another shape (a one-token decode step instead of one row of a prompt's
    GEMM), and MKL's fp32 GEMM rounds a row differently for some row counts. With the default 16-token
    recomputed tail they were bit-identical here on the development machine (docs/prefix_caching.md)."""
    on, off = pair
    for p in PROMPTS + PROMPTS:
        q0, h0 = counts(on)
        a, b = gen(on, p, spec), gen(off, p, spec)
        assert_same(a, b)
        q, h = counts(on)
        assert q - q0 == len(on.engine.encode_prompt(p)) and 0 <= h - h0 < q - q0
    assert counts(off)[1] == 0
    assert on.engine.stats()["num_kv_tokens"] == 0 and on.engine.stats()["num_cached_slots"] > 0


@pytest.mark.parametrize("recompute", [16, 1])
def test_hits_for_equal_prompt_strict_prefix_and_extension(tiny_model_dir, recompute):
    """Hit accounting (prompt tokens queried, tokens reused) for each kind of hit; `recompute` is the
    tail prefilled even when cached (`EngineConfig.prefix_cache_recompute_tokens`; 1 = only the last
    prompt token, for its logits)."""
    llm = LLM(str(tiny_model_dir), max_model_len=256, max_num_seqs=4, prefix_cache_recompute_tokens=recompute)
    off = LLM(str(tiny_model_dir), max_model_len=256, max_num_seqs=4, enable_prefix_caching=False)
    eng = llm.engine
    first = gen(llm, PROMPTS[0])
    ids0 = eng.encode_prompt(PROMPTS[0])
    assert counts(llm) == (len(ids0), 0)
    entry = list(eng.target.kv.cached.values())
    assert entry == [tuple(ids0 + first.token_ids[:-1])]  # the last output token has no K/V yet
    # the same prompt again: all but its last `recompute` tokens come from the cache
    assert_same(gen(llm, PROMPTS[0]), first)
    assert counts(llm) == (2 * len(ids0), len(ids0) - recompute)
    # a strict prefix of the cached sequence (prompt + output), given as token ids
    cont = ids0 + first.token_ids[:10]
    q0, h0 = counts(llm)
    out = llm.generate([cont], SamplingParams(**GREEDY))[0].outputs[0]
    assert counts(llm) == (q0 + len(cont), h0 + len(cont) - recompute)
    assert_same(out, off.generate([cont], SamplingParams(**GREEDY))[0].outputs[0])
    assert out.token_ids[:8] == first.token_ids[10:18]  # greedy continues the cached sequence
    # a prompt extending the cached prompt (a second chat turn)
    q0, h0 = counts(llm)
    assert_same(gen(llm, PROMPTS[1]), gen(off, PROMPTS[1]))
    assert counts(llm)[1] - h0 >= len(ids0) - recompute
    # below prefix_cache_min_tokens nothing is reused
    q0, h0 = counts(llm)
    gen(llm, A[:20])
    assert counts(llm)[1] == h0


def test_lru_eviction_under_slot_pressure(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), max_model_len=256, max_num_seqs=2)
    p = ["alpha beta gamma delta " * 6, "one two three four five " * 6, "def add(a, b):\n    return a + b\n" * 3]
    for x in p:
        gen(llm, x, max_tokens=4)
    assert counts(llm)[1] == 0 and llm.engine.stats()["num_cached_slots"] == 2
    h0 = counts(llm)[1]
    gen(llm, p[0], max_tokens=4)  # evicted (least recently used): a miss, which evicts p[1]
    assert counts(llm)[1] == h0
    gen(llm, p[2], max_tokens=4)  # still cached
    assert counts(llm)[1] == h0 + len(llm.engine.encode_prompt(p[2])) - 16
    # a batch of two new requests: both slots in use, every cached entry evicted, nothing wrong
    outs = llm.generate(p[:2], SamplingParams(**GREEDY))
    off = LLM(str(tiny_model_dir), max_model_len=256, max_num_seqs=2, enable_prefix_caching=False)
    for o, x in zip(outs, p[:2]):
        assert_same(o.outputs[0], gen(off, x))


def test_rejected_drafts_are_never_cached(pair):
    """Always-wrong drafts write K/V past the committed length every step; the cached entry holds the
    committed tokens only, and a request that extends it (prompt + output) gets the uncached result."""
    on, off = pair
    eng = on.engine
    base = gen(off, PROMPTS[3])
    ids = eng.encode_prompt(PROMPTS[3])
    cfg = SpeculativeConfig("ngram", 4, prompt_lookup_min=3, prompt_lookup_max=3)  # a proposer key of its own
    eng.target.kv.clear_cached()
    wrong = WrongProposer({tuple(ids): base.token_ids}, eng.target.config.vocab_size)
    with eng.using_proposer(cfg, wrong):
        out = gen(on, PROMPTS[3], cfg)
    assert out.token_ids == base.token_ids and out.num_draft_tokens > 0 and out.num_accepted_tokens == 0
    assert list(eng.target.kv.cached.values()) == [tuple(ids + base.token_ids[:-1])]
    turn2 = ids + base.token_ids + ids[:20]
    a = on.generate([turn2], SamplingParams(**GREEDY))[0].outputs[0]
    b = off.generate([turn2], SamplingParams(**GREEDY))[0].outputs[0]
    assert_same(a, b)


def test_draft_model_cache_is_reused_and_exact(tiny_model_dir):
    """The draft model's own KV cache is a prefix cache too; greedy tokens stay the baseline's."""
    cfg = SpeculativeConfig("draft_model", 3, model=str(tiny_model_dir))
    on = LLM(str(tiny_model_dir), max_model_len=256, max_num_seqs=4)
    off = LLM(str(tiny_model_dir), max_model_len=256, max_num_seqs=4, enable_prefix_caching=False)
    for p in PROMPTS[:3] + PROMPTS[:3]:
        a, b = gen(on, p, cfg), gen(off, p, cfg)
        assert_same(a, b)
        assert a.token_ids == gen(off, p, None).token_ids and a.num_accepted_tokens == a.num_draft_tokens > 0
    draft = on.engine.proposers()[0].draft
    assert draft.kv.num_cached_slots > 0 and draft.kv.num_used_tokens == 0
    assert off.engine.proposers()[0].draft.kv.num_cached_slots == 0


def test_flag_off_is_todays_behaviour(pair):
    _, off = pair
    eng = off.engine
    for p in PROMPTS[:2] * 2:
        gen(off, p)
    s = eng.stats()
    assert s["prefix_cache_hits"] == 0 and s["num_cached_slots"] == 0 and s["num_free_slots"] == 4
    assert eng.target.kv.num_free_slots == len(eng.target.kv._free) == 4


# ---- configuration, CLI, metrics ------------------------------------------------------------------


def test_config_and_cli_flags():
    assert EngineConfig(model="m").enable_prefix_caching is True
    for bad in (dict(enable_prefix_caching="yes"), dict(prefix_cache_min_tokens=0), dict(prefix_cache_recompute_tokens=0)):
        with pytest.raises(ConfigError):
            EngineConfig(model="m", **bad)
    parse = build_parser().parse_args
    assert parse(["serve", "--model", "m"]).enable_prefix_caching is True
    assert parse(["serve", "--model", "m", "--no-enable-prefix-caching"]).enable_prefix_caching is False
    assert parse(["serve", "--model", "m", "--enable-prefix-caching"]).enable_prefix_caching is True


def test_metrics_expose_prefix_cache_queries_and_hits():
    m = ServerMetrics()
    m.set_engine_stats({"prefix_cache_queries": 100, "prefix_cache_hits": 60}, 0)
    m.set_engine_stats({"prefix_cache_queries": 150, "prefix_cache_hits": 60}, 0)
    text = m.render().decode()
    assert "specserve:prefix_cache_queries_total 150.0" in text
    assert "specserve:prefix_cache_hits_total 60.0" in text
