"""The C++ suffix tree (suffix_tree.cpp) against the Python reference (SuffixTree): the same drafts, with
bit-identical probabilities and scores, on random workloads with growing, sealed and removed sequences;
the proposer on both; and how the implementation is chosen."""

from __future__ import annotations

import logging
import random

import pytest

from specserve.config import SpeculativeConfig
from specserve.sampling_params import SamplingParams
from specserve.spec_decode import suffix
from specserve.spec_decode.proposer import ProposalInput
from specserve.spec_decode.suffix import NativeSuffixTree, SuffixProposer, SuffixTree, tree_factory

needs_native = pytest.mark.skipif(not suffix.EXTENSION.available(), reason="the C++ suffix tree cannot be built here")


def same_drafts(py: SuffixTree, cc: NativeSuffixTree, contexts, rng):
    for ctx in contexts:
        k = rng.choice([1, 3, 8, 16])
        factor = rng.choice([0.5, 1.0, 2.0, 4.0])
        min_prob = rng.choice([0.0, 0.1, 0.3])
        a, b = py.speculate(ctx, k, factor, min_prob), cc.speculate(ctx, k, factor, min_prob)
        assert (b.token_ids, b.probs, b.score, b.match_len) == (a.token_ids, a.probs, a.score, a.match_len), ctx


@needs_native
@pytest.mark.parametrize("seed", range(8))
def test_native_tree_drafts_exactly_as_the_python_tree(seed):
    """Sequences grow in random chunks (self-overlapping runs from a small vocabulary make many tails turn
    into nodes), some are sealed and removed, ids are reused; after every change both trees give the
    same draft for contexts cut from the sequences and for random ones."""
    rng = random.Random(seed)
    depth = rng.choice([1, 2, 3, 5, 8, 24])
    vocab = rng.choice([2, 3, 5, 40, 5000])
    py, cc = SuffixTree(depth), NativeSuffixTree(depth)
    seqs: dict[int, list[int]] = {}
    sealed: set[int] = set()
    for _ in range(120):
        op = rng.random()
        if op < 0.6:  # grow a live sequence (or start one)
            live = [i for i in seqs if i not in sealed]
            sid = rng.choice(live) if live and rng.random() < 0.8 else rng.randrange(10)
            if sid in sealed:
                continue
            chunk = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
            if rng.random() < 0.3 and seqs.get(sid):  # repeat a piece of itself
                s = seqs[sid]
                i = rng.randrange(len(s))
                chunk = s[i : i + rng.randrange(1, 20)]
            py.extend(sid, chunk)
            cc.extend(sid, chunk)
            seqs.setdefault(sid, []).extend(chunk)
        elif op < 0.75 and seqs:
            sid = rng.choice(list(seqs))
            py.seal(sid)
            cc.seal(sid)
            sealed.add(sid)
        elif op < 0.9 and seqs:
            sid = rng.choice(list(seqs) + [99])
            py.remove(sid)
            cc.remove(sid)
            seqs.pop(sid, None)
            sealed.discard(sid)
        assert cc.seq_ids == py.seq_ids == sorted(seqs)
        for sid, s in seqs.items():
            assert cc.length(sid) == py.length(sid) == len(s)
        contexts = []
        for s in seqs.values():
            if s:
                i = rng.randrange(len(s) + 1)
                contexts.append(s[max(0, i - rng.randrange(1, 40)) : i])
        contexts += [[rng.randrange(vocab) for _ in range(rng.randrange(0, 12))] for _ in range(3)]
        same_drafts(py, cc, contexts, rng)


@needs_native
def test_native_tree_on_edge_cases():
    for depth in (1, 2, 24):
        py, cc = SuffixTree(depth), NativeSuffixTree(depth)
        rng = random.Random(depth)
        same_drafts(py, cc, [[], [1], [1, 2, 3]], rng)  # empty trees
        for seq in ([5] * 40, [1, 2] * 20, [1, 1, 2, 1, 1, 2, 1, 1] * 3, list(range(60))):
            py.extend(0, seq)
            cc.extend(0, seq)
            same_drafts(py, cc, [seq[:i] for i in range(0, len(seq) + 1, 3)], rng)
        py.remove(0)
        cc.remove(0)
        assert cc.seq_ids == [] and cc.length(0) == 0
        same_drafts(py, cc, [[5, 5], [1, 2]], rng)
    with pytest.raises(IndexError):
        cc.token(0, 0)
    cc.extend(7, [2**40, -3])  # token ids are 64-bit integers
    assert cc.token(7, 0) == 2**40 and cc.token(7, 1) == -3


def replay(proposer: SuffixProposer, seed: int):
    """16 requests in flight over 48 random requests (prompt + output from a small vocabulary, with repeats),
    each step: maybe prepare, then propose for all, commit 1-3 tokens; finished ones go to the global tree."""
    rng = random.Random(seed)
    reqs = []
    for i in range(48):
        base = [rng.randrange(20) for _ in range(rng.randrange(5, 40))]
        full = (base * 4)[: rng.randrange(30, 150)]
        for j in range(len(full)):
            if rng.random() < 0.1:
                full[j] = rng.randrange(20)
        reqs.append((f"r{i}", full, rng.randrange(3, 25)))
    out, live, pos, nxt = [], [], {}, 0
    while live or nxt < len(reqs):
        while len(live) < 16 and nxt < len(reqs):
            live.append(reqs[nxt])
            pos[reqs[nxt][0]] = reqs[nxt][2]
            nxt += 1
        states = [ProposalInput(r, full[: pos[r]], n, rng.choice([0, 2, 5, 8]), SamplingParams())
                  for r, full, n in live]
        if rng.random() < 0.5:
            proposer.prepare(states)
        for p in proposer.propose(states):
            out.append((tuple(p.token_ids), p.match_len, tuple(p.confidence or ())))
        for r, full, n in list(live):
            pos[r] += rng.randrange(1, 4)
            if pos[r] >= len(full):
                proposer.finish_request(r, full)
                live.remove((r, full, n))
    return out, proposer.cached_requests


@needs_native
@pytest.mark.parametrize("seed", range(3))
def test_the_proposer_drafts_the_same_with_either_tree(seed):
    config = SpeculativeConfig(method="suffix", suffix_decoding_max_tree_depth=12, suffix_decoding_max_cached_requests=6,
                               suffix_decoding_min_token_prob=0.05)
    a = replay(SuffixProposer(config, tree_impl="python"), seed)
    b = replay(SuffixProposer(config, tree_impl="native"), seed)
    assert sum(1 for t, _, _ in a[0] if t) > 100  # the replay drafts
    assert a == b


def test_the_implementation_is_chosen_by_the_variable(monkeypatch, caplog):
    monkeypatch.setenv("SPECSERVE_SUFFIX_TREE", "python")
    assert tree_factory() is SuffixTree
    monkeypatch.setenv("SPECSERVE_SUFFIX_TREE", "fast")
    with pytest.raises(ValueError, match="SPECSERVE_SUFFIX_TREE must be one of auto, native, python, got 'fast'"):
        SuffixProposer(SpeculativeConfig(method="suffix"))
    monkeypatch.setattr(suffix.EXTENSION, "_module", None)
    monkeypatch.setattr(suffix.EXTENSION, "_error", "the C++ suffix tree could not be built: RuntimeError: no g++")
    with pytest.raises(RuntimeError, match="could not be built: RuntimeError: no g\\+\\+"):
        tree_factory("native")
    with caplog.at_level(logging.WARNING, logger="specserve.spec_decode.suffix"):
        assert tree_factory("auto") is SuffixTree
    assert "uses its Python tree" in caplog.text and "no g++" in caplog.text


@needs_native
def test_auto_uses_the_native_tree_where_it_builds(monkeypatch):
    monkeypatch.delenv("SPECSERVE_SUFFIX_TREE", raising=False)
    assert tree_factory() is NativeSuffixTree and SuffixProposer(SpeculativeConfig(method="suffix")).tree_class is NativeSuffixTree


@needs_native
@pytest.mark.parametrize("cls", [SuffixTree, NativeSuffixTree])
def test_a_sealed_sequence_cannot_be_extended(cls):
    tree = cls(5)
    tree.extend(0, [0, 0, 1])
    tree.seal(0)
    with pytest.raises(ValueError, match="sequence 0 is sealed"):
        tree.extend(0, [1, 1, 0])
    tree.extend(1, [1, 0, 0, 0])  # others are unaffected, and removal stays consistent
    tree.remove(0)
    tree.remove(1)
    assert tree.seq_ids == [] and tree.speculate([1, 0], 4, 4.0, 0.0).token_ids == []
    tree.extend(0, [3, 4])  # a removed id is a new sequence
    assert tree.length(0) == 2


def test_the_build_folder_depends_on_the_torch_install(monkeypatch, tmp_path):
    """Two virtual environments with the same torch version must not share a build folder: torch writes
    its include paths into build.ninja, so a shared folder is rebuilt on every alternate load."""
    from specserve import native

    ext = native.NativeExtension("specserve_probe", suffix.EXTENSION.source, ["-O2"], "a probe")
    here = ext.build_name()
    assert ext.build_name() == here  # stable for one install
    monkeypatch.setattr(native.torch, "__file__", str(tmp_path / "other-venv" / "torch" / "__init__.py"))
    assert ext.build_name() != here
