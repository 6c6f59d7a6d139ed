"""SuffixProposer / SuffixTree (SuffixDecoding) on hand-computed token arrays and a brute-force reference."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from specserve.config import SpeculativeConfig
from specserve.sampling_params import SamplingParams
from specserve.spec_decode.proposer import ProposalInput, Proposer
from specserve.spec_decode import suffix
from specserve.spec_decode.suffix import SuffixProposer, SuffixTree, _count, _Node


@pytest.fixture(autouse=True, params=["python", "native"])
def tree_impl(request, monkeypatch):
    """Every test runs with the Python tree and with the C++ tree (SuffixProposer reads the variable)."""
    if request.param == "native" and not suffix.EXTENSION.available():
        pytest.skip("the C++ suffix tree cannot be built here")
    monkeypatch.setenv("SPECSERVE_SUFFIX_TREE", request.param)
    return request.param


def cfg(**kw):
    kw.setdefault("suffix_decoding_max_tree_depth", 24)
    kw.setdefault("suffix_decoding_min_token_prob", 0.1)
    return SpeculativeConfig(method="suffix", **kw)


def inp(rid, tokens, k=8, n_prompt=None):
    return ProposalInput(rid, list(tokens), len(tokens) if n_prompt is None else n_prompt, k, SamplingParams())


def stats(tree: SuffixTree, s):
    """(count, {next token: count}) of string s in the tree, or None when absent."""
    pos = tree._match(list(s))
    if pos is None:
        return None
    obj, q = pos
    if q is None:
        return obj.count, {t: _count(c) for t, c in obj.children.items()}
    end = min(len(obj.seq), obj.limit)
    return 1, ({obj.seq[q]: 1} if q < end else {})


def brute_stats(seqs, s, depth):
    """Same from scratch: occurrences of s (len <= depth) and what follows them within depth."""
    m, count, nxt = len(s), 0, Counter()
    for seq in seqs:
        for i in range(len(seq) - m + 1):
            if seq[i : i + m] == list(s):
                count += 1
                if m < depth and i + m < len(seq):
                    nxt[seq[i + m]] += 1
    return (count, dict(nxt)) if count else None


def all_substrings(seqs, depth):
    return {tuple(seq[i : i + m]) for seq in seqs for i in range(len(seq)) for m in range(1, depth + 1) if i + m <= len(seq)}


def assert_same_as_brute_force(tree, seqs, depth, extra=()):
    for s in all_substrings(seqs, depth) | set(extra):
        assert stats(tree, s) == brute_stats(seqs, s, depth), s


# ---- the tree ---------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_tree_counts_equal_brute_force(seed):
    rng = random.Random(seed)
    depth = rng.choice([1, 2, 4, 7])
    seqs = [[rng.randrange(3 if seed % 2 else 6) for _ in range(rng.randrange(0, 50))] for _ in range(3)]
    tree = SuffixTree(depth)
    for i, s in enumerate(seqs):
        tree.extend(i, s)
    assert_same_as_brute_force(tree, seqs, depth, extra=[(9,), (0, 9)])


def test_self_overlapping_runs():
    for seq in ([5] * 12, [1, 2] * 9, [1, 1, 2, 1, 1, 2, 1, 1]):
        tree = SuffixTree(5)
        tree.extend(0, seq)
        assert_same_as_brute_force(tree, [seq], 5)


def test_incremental_ingestion_equals_building_from_scratch():
    rng = random.Random(7)
    seq = [rng.randrange(4) for _ in range(300)]
    whole, parts = SuffixTree(6), SuffixTree(6)
    whole.extend(0, seq)
    i = 0
    while i < len(seq):
        n = rng.randrange(1, 9)
        parts.extend(0, seq[i : i + n])
        i += n
        assert_same_as_brute_force(parts, [seq[:i]], 6) if i < 40 else None
    assert_same_as_brute_force(parts, [seq], 6)
    for cut in (10, 57, 123, 300):
        ctx = seq[:cut]
        assert whole.speculate(ctx, 8, 2.0, 0.0).score == pytest.approx(parts.speculate(ctx, 8, 2.0, 0.0).score)
    assert whole.speculate(seq, 8, 2.0, 0.0) == parts.speculate(seq, 8, 2.0, 0.0)


def test_remove_equals_never_added():
    rng = random.Random(3)
    seqs = [[rng.randrange(4) for _ in range(40)] for _ in range(4)]
    tree = SuffixTree(5)
    for i, s in enumerate(seqs):
        tree.extend(i, s)
        tree.seal(i)
    tree.remove(1)
    tree.remove(3)
    tree.remove(42)  # unknown: no-op
    assert_same_as_brute_force(tree, [seqs[0], seqs[2]], 5, extra=all_substrings([seqs[1], seqs[3]], 5))
    tree.remove(0)
    tree.remove(2)
    assert tree.root.children == {} and tree.root.cont == 0


def test_greedy_draft_follows_most_frequent_child_with_product_probabilities():
    rng = random.Random(11)
    seqs = [[rng.randrange(3) for _ in range(60)] for _ in range(3)]
    tree = SuffixTree(8)
    for i, s in enumerate(seqs):
        tree.extend(i, s)
    ctx = [rng.randrange(3) for _ in range(10)]
    d = tree.speculate(ctx, 6, 1.0, 0.05)
    assert d.token_ids and d.match_len >= len(d.token_ids)
    path, prob = list(ctx[-d.match_len :]), 1.0
    for tok, p in zip(d.token_ids, d.probs):
        count, nxt = brute_stats(seqs, path, 8)
        assert nxt[tok] == max(nxt.values())
        prob *= nxt[tok] / sum(nxt.values())
        assert p == pytest.approx(prob) and p >= 0.05
        path.append(tok)
    assert d.score == pytest.approx(sum(d.probs))


# ---- the proposer -----------------------------------------------------------------------------


def test_local_tree_drafts_what_followed():
    p = SuffixProposer(cfg(suffix_decoding_max_spec_factor=2.0))
    assert isinstance(p, Proposer)
    toks = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3]
    d = p.draft(inp("a", toks, k=8))
    # "1 2 3" (m=3) was followed by "4 5 9 9 1 2 3" once: probability 1 all along, cap 2*3 = 6
    assert (d.token_ids, d.match_len, d.source) == ([4, 5, 9, 9, 1, 2], 3, "local")
    assert d.probs == [1.0] * 6


def test_min_token_prob_cutoff():
    # "1 2" is followed by 3 twice and by 4 once: P(3) = 2/3; then "1 2 3" is always followed by 1.
    toks = [1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2]
    for min_prob, expect in [(0.5, [3, 1]), (0.7, []), (0.0, [3, 1])]:
        p = SuffixProposer(cfg(suffix_decoding_min_token_prob=min_prob))
        d = p.draft(inp("a", toks, k=8))
        assert d.token_ids == expect
        if expect:
            assert d.match_len == 2 and d.probs == pytest.approx([2 / 3, 2 / 3])


def test_spec_factor_caps_draft_length():
    toks = list(range(10, 30)) + list(range(10, 14))  # match of 4 tokens, 16 tokens follow it
    for factor, expect_len in [(0.5, 2), (1.0, 4), (1.5, 6), (3.0, 8)]:
        p = SuffixProposer(cfg(suffix_decoding_max_spec_factor=factor))
        d = p.draft(inp("a", toks, k=8))
        assert d.match_len == 4 and d.token_ids == list(range(14, 14 + expect_len))


@pytest.mark.parametrize("k", range(1, 9))
def test_k_is_a_hard_cap(k):
    toks = list(range(100, 130)) + list(range(100, 112))
    p = SuffixProposer(cfg(suffix_decoding_max_spec_factor=4.0))
    (prop,) = p.propose([inp("a", toks, k=k)])
    assert prop.token_ids == list(range(112, 112 + k)) and prop.draft_probs is None


def test_no_match_and_tiny_prompts():
    p = SuffixProposer(cfg())
    assert p.propose([inp("a", [1, 2, 3, 4])])[0].token_ids == []
    for i, toks in enumerate([[], [5], [5, 5], [5, 6]]):
        assert len(p.propose([inp(f"t{i}", toks, k=3)])[0].token_ids) <= 1
    assert p.propose([inp("z", [5, 5], k=3)])[0].token_ids == [5]  # "5" was followed by 5 (cap 1*1)


def test_requests_do_not_see_each_others_trees_b28():
    """docs/speculation-cases.md B28: A's own tree is never used for B; A's OUTPUT reaches B only via the global tree after A finished."""
    p = SuffixProposer(cfg())
    a_prompt = [50, 51, 52, 53, 54, 55]
    a_out = [60, 61, 62, 63, 64, 65]
    p.draft(inp("A", a_prompt + a_out, n_prompt=len(a_prompt)))
    b_prompt = [1, 2, 60, 61, 62]  # ends in a pattern of A's output
    d = p.draft(inp("B", b_prompt))
    assert d.token_ids == [] and p.active_requests == ["A", "B"]
    c = p.draft(inp("C", [9, 50, 51, 52]))  # A's prompt pattern
    assert c.token_ids == []
    p.finish_request("A", a_prompt + a_out)
    assert p.cached_requests == ["A"] and p.active_requests == ["B", "C"]
    d = p.draft(inp("D", [3, 4, 60, 61, 62]))
    assert d.source == "global" and d.token_ids == [63, 64, 65]
    assert p.draft(inp("B", b_prompt + [7], n_prompt=len(b_prompt))).token_ids == []
    assert p.draft(inp("E", [9, 50, 51, 52])).token_ids == []  # A's prompt is not cached; C's tree is C's
    for rid in ("B", "C", "D", "E"):
        p.finish_request(rid, [])
    assert p.active_requests == [] and p.cached_requests == ["A"]


def test_local_beats_global_on_ties_and_global_wins_when_better():
    p = SuffixProposer(cfg())
    p.draft(inp("A", [0, 7, 8, 9, 1], n_prompt=1))
    p.finish_request("A", [0, 7, 8, 9, 1])
    d = p.draft(inp("B", [7, 8, 9, 2, 7, 8]))
    assert d.token_ids == [9, 2] and d.source == "local"  # equal scores (1 + 1): own tree wins
    d = p.draft(inp("C", [3, 7, 8]))
    assert d.token_ids == [9, 1] and d.source == "global"


def test_global_cache_evicts_oldest():
    p = SuffixProposer(cfg(suffix_decoding_max_cached_requests=2))
    outs = {"A": [10, 11, 12, 13], "B": [20, 21, 22, 23], "C": [30, 31, 32, 33]}
    for rid, out in outs.items():
        p.draft(inp(rid, [0] + out[:1], n_prompt=1))
        p.finish_request(rid, [0] + out)
    assert p.cached_requests == ["B", "C"] and len(p.global_tree.seq_ids) == 2
    assert p.draft(inp("x", [5, 10, 11])).token_ids == []
    assert p.draft(inp("y", [5, 20, 21])).token_ids == [22, 23]
    if isinstance(p.global_tree, SuffixTree):  # the C++ tree's counts: test_suffix_native.py (same drafts)
        assert_same_as_brute_force(p.global_tree, [outs["B"], outs["C"]], 24, extra=[(10,), (10, 11)])
    p.draft(inp("B", [1, 2], n_prompt=1))  # the same id again: its old output is replaced
    p.finish_request("B", [1, 2, 40, 41])
    assert p.cached_requests == ["C", "B"] and p.draft(inp("z", [6, 20, 21])).token_ids == []
    off = SuffixProposer(cfg(suffix_decoding_max_cached_requests=0))
    off.draft(inp("A", [0, 10, 11], n_prompt=1))
    off.finish_request("A", [0, 10, 11, 12])
    assert off.cached_requests == [] and off.global_tree.seq_ids == []


def test_incremental_proposer_equals_fresh_and_restarts_on_foreign_tokens():
    rng = random.Random(5)
    toks = [rng.randrange(5) for _ in range(200)]
    inc = SuffixProposer(cfg())
    for n in range(20, 201, 7):
        inc.draft(inp("a", toks[:n], n_prompt=20))
    fresh = SuffixProposer(cfg())
    assert inc.draft(inp("a", toks, n_prompt=20)) == fresh.draft(inp("a", toks, n_prompt=20))
    other = [9, 9, 8, 9, 9]  # not a continuation of what "a" ingested: rebuilt, no stale counts
    assert inc.draft(inp("a", other, k=2)).token_ids == fresh.draft(inp("b", other, k=2)).token_ids == [8, 9]
    if isinstance(inc._requests["a"][0], SuffixTree):
        assert_same_as_brute_force(inc._requests["a"][0], [other], 24)


def test_finish_request_for_unknown_id_is_fine():
    p = SuffixProposer(cfg())
    p.finish_request("nobody", [1, 2, 3])
    p.finish_request("nobody", [])
    assert p.cached_requests == [] and p.active_requests == []


def test_dropped_trees_are_freed_without_the_cyclic_gc(tree_impl):
    import gc

    if tree_impl != "python":
        pytest.skip("the Python tree's object graph")
    gc.collect()
    gc.disable()
    try:
        p = SuffixProposer(cfg(suffix_decoding_max_cached_requests=1))
        for rid in ("a", "b"):
            p.draft(inp(rid, [1, 2, 3, 1, 2, 3, 1, 2] * 5, n_prompt=4))
            p.finish_request(rid, [1, 2, 3, 1, 2, 3, 1, 2] * 5)  # "a" is evicted again
        assert any(type(c) is _Node for c in p.global_tree.root.children.values())
        del p
        assert gc.collect() == 0  # nothing was left in reference cycles
    finally:
        gc.enable()


def test_prepare_changes_no_draft_and_defers_nothing_observable():
    """`prepare` (the engine runs it while the GPU computes) ingests prompts and flushes finished outputs
    into the global tree; every draft is the same whether and whenever it ran."""
    rng = random.Random(11)
    prompts = {f"r{i}": [rng.randrange(6) for _ in range(rng.randrange(5, 60))] for i in range(12)}
    outputs = {rid: [rng.randrange(6) for _ in range(30)] for rid in prompts}
    plain = SuffixProposer(cfg(suffix_decoding_max_cached_requests=4))
    prepared = SuffixProposer(cfg(suffix_decoding_max_cached_requests=4))
    live: list[str] = []
    steps: dict[str, int] = {}  # request id -> output tokens committed so far
    for rid in prompts:  # requests arrive, decode a few tokens each step, finish in arrival order
        live.append(rid)
        for _ in range(3):
            states = [inp(r, prompts[r] + outputs[r][: steps.setdefault(r, 0)], n_prompt=len(prompts[r])) for r in live]
            if rng.random() < 0.7:
                prepared.prepare(states)
            for s in states:
                assert plain.draft(s) == prepared.draft(s)
                steps[s.request_id] += 1
        if len(live) > 3:
            done = live.pop(0)
            full = prompts[done] + outputs[done][: steps[done]]
            plain.finish_request(done, full)
            prepared.finish_request(done, full)
            if rng.random() < 0.5:
                prepared.prepare([])
            assert plain.cached_requests == prepared.cached_requests
    assert plain.global_tree.seq_ids == prepared.global_tree.seq_ids



def test_prepare_ingests_without_drafting():
    p = SuffixProposer(cfg())
    p.prepare([inp("a", [1, 2, 3, 1, 2], k=8)])
    tree = p._requests["a"][0]
    assert p.active_requests == ["a"] and [tree.token(0, i) for i in range(tree.length(0))] == [1, 2, 3, 1, 2]
    p.draft(inp("a", [1, 2, 3, 1, 2], n_prompt=5))
    p.finish_request("a", [1, 2, 3, 1, 2, 3, 4])
    assert p._finished and p.cached_requests == ["a"] and not p._finished  # flushed when looked at
