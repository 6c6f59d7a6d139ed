"""NgramProposer (prompt lookup) on hand-computed token arrays, plus the proposer registry."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specserve.config import ConfigError, SpeculativeConfig
from specserve.sampling_params import SamplingParams
from specserve.spec_decode import (
    NgramProposer,
    Proposer,
    SuffixProposer,
    make_proposer,
    proposer_key,
    register_proposer_factory,
)
from specserve.spec_decode.ngram import ngram_lookup
from specserve.spec_decode.proposer import ProposalInput


def inp(tokens, k, rid="r", n_prompt=None):
    return ProposalInput(rid, tokens, len(tokens) if n_prompt is None else n_prompt, k, SamplingParams())


def test_longest_match_wins():
    # last 3 tokens "1 2 3": the 3-gram occurs once (followed by 9); the 2-gram "2 3" occurs more
    # recently (followed by 7). The longest n-gram decides.
    toks = [1, 2, 3, 9, 4, 5, 2, 3, 7, 8, 1, 2, 3]
    assert ngram_lookup(toks, 2, 1, 4) == ([9, 4], 3)
    # with n capped at 2, the most recent "2 3" wins
    assert ngram_lookup(toks, 2, 1, 2) == ([7, 8], 2)


def test_most_recent_occurrence_is_used():
    # "5 6" occurs twice before the end: followed by 1 (earliest) and 2 (most recent).
    toks = [5, 6, 1, 7, 5, 6, 2, 8, 5, 6]
    drafts, n = ngram_lookup(toks, 3, 2, 2)
    assert n == 2 and drafts == [2, 8, 5]


def test_recent_match_near_the_end_continues_periodically():
    # period-2 loop: the most recent earlier "1 2 1 2" ends 2 tokens before the end; the copy
    # overlaps itself, so all k drafts are the loop's continuation.
    toks = [7, 1, 2, 1, 2, 1, 2]
    assert ngram_lookup(toks, 5, 1, 4) == ([1, 2, 1, 2, 1], 4)
    assert ngram_lookup([3, 3, 3], 4, 1, 1) == ([3, 3, 3, 3], 1)


@pytest.mark.parametrize("k", range(1, 9))
def test_k_is_a_hard_cap(k):
    toks = list(range(20)) + list(range(5))  # "0..4" repeats; 15 tokens follow the match
    drafts, _ = ngram_lookup(toks, k, 1, 4)
    assert drafts == list(range(5, 5 + k))
    p = NgramProposer(1, 4)
    (prop,) = p.propose([inp(toks, k)])
    assert prop.token_ids == list(range(5, 5 + k)) and prop.draft_probs is None


def test_no_match_gives_no_drafts():
    assert ngram_lookup([1, 2, 3, 4, 5], 4, 1, 4) == ([], 0)
    # a match shorter than prompt_lookup_min does not count
    assert ngram_lookup([1, 2, 9, 2], 4, 2, 4) == ([], 0)
    assert ngram_lookup([1, 2, 9, 2], 4, 1, 4) == ([9, 2, 9, 2], 1)
    assert ngram_lookup([1, 1, 1], 0, 1, 4) == ([], 0)


@pytest.mark.parametrize("n_min,n_max", [(1, 4), (4, 4), (8, 8)])
@pytest.mark.parametrize("toks", [[], [5], [5, 5], [5, 6, 5], list(range(8)), [1] * 8])
def test_prompt_shorter_than_n(n_min, n_max, toks):
    drafts, n = ngram_lookup(toks, 5, n_min, n_max)
    assert len(drafts) <= 5
    if len(toks) <= n_min:  # no room for an earlier occurrence of an n_min-gram
        assert drafts == [] and n == 0
    else:
        assert n == 0 or n_min <= n <= n_max


def test_stateless_no_cross_request_leakage():
    """docs/speculation-cases.md B28: request B's drafts come from B's tokens only, whatever ran before."""
    a = [100, 101, 102, 103, 104, 100, 101, 102] * 10
    b = [7, 8, 9, 100, 7, 8]
    p = NgramProposer(1, 4)
    fresh = NgramProposer(1, 4).propose([inp(b, 4, "B")])
    p.propose([inp(a, 4, "A")])
    p.finish_request("A", a)
    after = p.propose([inp(b, 4, "B")])
    assert after[0].token_ids == fresh[0].token_ids == [9, 100, 7, 8]
    assert set(after[0].token_ids) <= set(b)
    p.finish_request("B", b)
    assert len(p._contexts) == 0  # the per-request context copies are gone once their requests finish
    p.finish_request("never-seen", [1, 2])  # unknown id is fine


def test_the_context_copy_follows_growth_and_is_rebuilt_when_it_no_longer_mirrors_the_list():
    """Drafts from the per-request copy equal a fresh lookup over the list at every step: while the
    context grows by committed tokens (1 or several per step, past the buffer's capacity), and when an
    id comes back with another context (reused without finish_request, or shorter)."""
    rng = np.random.default_rng(0)
    p, fresh = NgramProposer(1, 4), NgramProposer(1, 4)
    ctx = rng.integers(0, 12, size=40).tolist()
    for step in range(300):
        ctx += rng.integers(0, 12, size=int(rng.integers(1, 6))).tolist()
        got = p.propose([inp(ctx, 5, "r")])[0].token_ids
        assert got == fresh.propose([inp(list(ctx), 5, f"fresh{step}")])[0].token_ids, step
    other = rng.integers(20, 30, size=500).tolist()  # the same id, another context, longer: first token differs
    assert p.propose([inp(other, 5, "r")])[0].token_ids == ngram_lookup(other, 5, 1, 4)[0]
    shorter = other[:100]  # shorter than the copy
    assert p.propose([inp(shorter, 5, "r")])[0].token_ids == ngram_lookup(shorter, 5, 1, 4)[0]
    edited = list(shorter) + [3]
    edited[99] = 29 if edited[99] != 29 else 28  # same first token, same length + 1, last copied token differs
    assert p.propose([inp(edited, 5, "r")])[0].token_ids == ngram_lookup(edited, 5, 1, 4)[0]


def test_batch_order_and_input_types():
    toks = [4, 5, 6, 4, 5]
    p = NgramProposer(1, 3)
    out = p.propose([inp(toks, 2, "a"), inp([1, 2], 3, "b"), inp(tuple(toks), 1, "c")])
    assert [o.token_ids for o in out] == [[6, 4], [], [6]]
    assert ngram_lookup(np.array(toks, dtype=np.int32), 2, 1, 3)[0] == [6, 4]
    assert ngram_lookup(torch.tensor(toks), 2, 1, 3)[0] == [6, 4]
    assert isinstance(p, Proposer)


def test_long_context_matches_reference():
    """Vectorized search == a plain Python reference (longest n, most recent), L = 3000."""
    rng = np.random.default_rng(0)
    for trial in range(20):
        toks = rng.integers(0, 6 if trial % 2 else 40, size=3000).tolist()
        for n_min, n_max in [(1, 4), (2, 3)]:
            expect = []
            for n in range(n_max, n_min - 1, -1):
                pat = toks[-n:]
                ends = [e for e in range(n - 1, len(toks) - 1) if toks[e - n + 1 : e + 1] == pat]
                if ends:
                    ext = toks + []
                    for i in range(5):
                        ext.append(ext[ends[-1] + 1 + i])
                    expect = ext[len(toks) :]
                    break
            assert ngram_lookup(toks, 5, n_min, n_max)[0] == expect


def test_bad_sizes_are_config_errors():
    with pytest.raises(ConfigError):
        NgramProposer(0, 4)
    with pytest.raises(ConfigError):
        NgramProposer(5, 4)


# ---- registry ---------------------------------------------------------------------------------


def test_make_proposer_builds_ngram_and_suffix():
    ng = make_proposer(SpeculativeConfig(method="ngram", prompt_lookup_min=2, prompt_lookup_max=5))
    assert isinstance(ng, NgramProposer) and (ng.prompt_lookup_min, ng.prompt_lookup_max) == (2, 5)
    sf = make_proposer(SpeculativeConfig(method="suffix", suffix_decoding_max_tree_depth=8), context=None)
    assert isinstance(sf, SuffixProposer) and sf.max_depth == 8 and sf.method == "suffix"


def test_draft_model_needs_a_registered_factory():
    cfg = SpeculativeConfig(method="draft_model", model="tiny-draft")
    with pytest.raises(ConfigError, match="ProposerContext"):
        make_proposer(cfg)  # the built-in factory needs the engine's context
    saved = register_proposer_factory("draft_model", None)
    try:
        with pytest.raises(ConfigError, match="no proposer is available.*draft_model"):
            make_proposer(cfg)
        made = {}

        def factory(config, context):
            made.update(context=context, config=config)
            return NgramProposer()

        assert register_proposer_factory("draft_model", factory) is None
        assert isinstance(make_proposer(cfg, "CTX"), NgramProposer)
        assert made == {"context": "CTX", "config": cfg}
    finally:
        register_proposer_factory("draft_model", saved)


def test_proposer_key_ignores_k_only():
    a = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    b = SpeculativeConfig(method="ngram", num_speculative_tokens=8, num_speculative_tokens_per_batch_size=[[1, 4, 8]], num_speculative_tokens_schedule="adaptive")
    c = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=6)
    d = SpeculativeConfig(method="ngram", num_speculative_tokens=3, suffix_decoding_max_tree_depth=9)
    assert proposer_key(a) == proposer_key(b) == proposer_key(d)
    assert proposer_key(a) != proposer_key(c)
    s1 = SpeculativeConfig(method="suffix", num_speculative_tokens=2)
    s2 = SpeculativeConfig(method="suffix", num_speculative_tokens=16, prompt_lookup_max=7)
    s3 = SpeculativeConfig(method="suffix", suffix_decoding_min_token_prob=0.3)
    assert proposer_key(s1) == proposer_key(s2) != proposer_key(s3) != proposer_key(a)
    assert len({proposer_key(x) for x in (a, b, c, s1, s2, s3)}) == 4
    m1 = SpeculativeConfig(method="draft_model", model="x", num_speculative_tokens=1)
    m2 = SpeculativeConfig(method="draft_model", model="y", num_speculative_tokens=1)
    assert proposer_key(m1) != proposer_key(m2)
    assert proposer_key(None) is None


def test_config_to_dict_round_trips_the_ngram_sizes():
    """`to_dict` writes both n-gram sizes when either differs from the default: a lone size stands for
    both, so (2, 4) written as {min: 2} read back as (2, 2) (seen in the demo's demo.json)."""

    for lo, hi in ((2, 4), (1, 4), (1, 3), (3, 3), (2, 6)):
        cfg = SpeculativeConfig("ngram", 8, prompt_lookup_min=lo, prompt_lookup_max=hi,
                                num_speculative_tokens_schedule="adaptive")
        assert SpeculativeConfig(**cfg.to_dict()) == cfg, (lo, hi, cfg.to_dict())
    assert "prompt_lookup_min" not in SpeculativeConfig("ngram", 4).to_dict()  # the defaults stay out
