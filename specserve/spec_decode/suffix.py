"""Suffix proposer: SuffixDecoding (Oliaro et al., 2024, arXiv 2411.04975) in pure Python.

What it does: a depth-bounded suffix tree per running request over its prompt + output (extended
on each call by the tokens committed since the last one), and one global tree over the outputs of
the last `suffix_decoding_max_cached_requests` finished requests (added in `finish_request`, oldest
evicted first). To draft, it matches suffixes of the context (< `suffix_decoding_max_tree_depth`
tokens) in each tree and follows the most frequent child; a token's estimated probability is the
running product of count(child) / count(parent, continued occurrences only: the context's own newest
occurrence has no continuation yet and must not halve every estimate). A draft stops at k tokens, at
floor(`max_spec_factor` * match length) tokens, or before an estimate below `min_token_prob`.
Score = sum of the estimates (expected accepted tokens). All match lengths are scored and the best
kept (ties: longer match), as arctic-inference does: the longest match sits deepest, and a depth-
bounded tree leaves it little room to draft. The higher-scoring tree wins (ties: the request's own).
Drafts are deterministic: `Proposal.draft_probs` is None.

What it does not do: token trees (linear chains only), or share a request's own tree with another
request (B28): request A's tokens reach others only via the global tree, and only after A finished.

Two implementations of the tree with the same counts and the same drafts: `SuffixTree` here (pure
Python, the reference) and `NativeSuffixTree`, a C++ port (`suffix_tree.cpp`, built on first use like
the panel kernel, `specserve.native`): on a replay of 16 requests of real code a request-step of the
proposer (ingest + draft, wrappers included) took 6.7 us against 26.4 us on the 2-core Intel VM
(`benchmarks/suffix_speed.py`, `docs/benchmarks/suffix_speed_native_cpu.json`, same drafts), and its
nodes are not Python objects, so the garbage collector never walks them. The proposer uses the
C++ tree where it can be built; `SPECSERVE_SUFFIX_TREE` = `auto` (default: C++, else Python with a logged
warning saying why), `native` (C++ or an error) or `python`.

Why not arctic-inference (Snowflake): PyPI has only an sdist (0.3.0); building it needs a C++20
compiler, CMake, nanobind, grpcio-tools and torch >= 2.10 (an isolated build pulls a CUDA torch), it
registers a vLLM plugin, and the GPU machine has no network to build it. Its suffix-tree extension
alone did build in a throwaway venv, but that is not a clean CPU wheel, so this is a reimplementation.
On a replay of real code (word-level tokens of stdlib sources, k=8) both reach the same mean
acceptance length (1.58); its C++ speculate takes ~20 us, this whole propose call ~50 us.

Layout: a trie bounded at depth D whose count-1 chains are stored as `_Tail`s (a window into the
owning sequence), so a unique suffix costs O(1) memory, not O(D). The last D suffixes of a sequence
each keep a cursor (deepest real node); appending a token advances them, making one tail node real
when a second occurrence walks into it. There are no reference cycles: a dropped tree is freed at once.

Measured on this 2-core CPU (D=24, k=8): ingesting a 2000-token prompt 3-10 ms; a propose call
(ingesting the new tokens + both trees) ~25-70 us on 2-3k-token code contexts (speculate 5-30 us);
the global tree holds ~200-450 bytes per cached output token (10k cached 500-token outputs: ~2 GB,
so lower max_cached_requests on small machines).
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from specserve.config import SpeculativeConfig
from specserve.native import NativeExtension, native_cflags
from specserve.spec_decode.proposer import Proposal, ProposalInput

logger = logging.getLogger(__name__)

EXTENSION = NativeExtension("specserve_suffix_tree", Path(__file__).with_name("suffix_tree.cpp"),
                            native_cflags(openmp=False), "the C++ suffix tree")
TREE_IMPLS = ("auto", "native", "python")


class _Node:
    """A trie node: `count` suffixes pass through it; `cont` of them continue to a child."""

    __slots__ = ("count", "cont", "children", "best")

    def __init__(self, count: int) -> None:
        self.count = count
        self.cont = 0
        self.children: dict[int, _Node | _Tail] = {}
        self.best: int | None = None  # token of the most frequent child; None = recompute lazily


class _Tail:
    """A chain of count-1 nodes owned by one suffix: tokens seq[pos : min(len(seq), limit)]."""

    __slots__ = ("seq", "pos", "limit", "sid")

    def __init__(self, seq: list[int], pos: int, limit: int, sid: int) -> None:
        # owner = seq id `sid` (not its cursor object): no reference cycles in the tree
        self.seq, self.pos, self.limit, self.sid = seq, pos, limit, sid


def _count(child: _Node | _Tail) -> int:
    return child.count if type(child) is _Node else 1


def _best(node: _Node) -> int:
    if node.best is None:
        node.best = max(node.children, key=lambda t: _count(node.children[t]))
    return node.best


@dataclass
class SuffixDraft:
    """One speculation: tokens, their estimated probabilities, score = sum(probs), the context
    match length it came from and its source ("local", "global" or "" for none)."""

    token_ids: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    score: float = 0.0
    match_len: int = 0
    source: str = ""


class SuffixTree:
    """Depth-bounded suffix trie over one or more token sequences, with occurrence counts.

    Every suffix of every sequence is inserted, truncated to `max_depth` tokens, so a node at depth
    d counts the occurrences of its d-token string. `extend` appends to a sequence (its suffixes
    grow), `remove` deletes a sequence, `speculate` drafts a continuation of a context.
    """

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = _Node(0)
        self.seqs: dict[int, list[int]] = {}
        self._cursors: dict[int, deque] = {}  # seq id -> cursors [anchor node, depth, start] of growing suffixes

    def extend(self, seq_id: int, tokens: Sequence[int]) -> None:
        """Append `tokens` (ints) to sequence `seq_id` (created when new). O(len(tokens) * depth).

        Raises:
            ValueError: `seq_id` was sealed (its suffixes no longer have cursors to grow).
        """
        if seq_id in self.seqs and seq_id not in self._cursors:
            raise ValueError(f"suffix tree: sequence {seq_id} is sealed and cannot be extended")
        seq = self.seqs.setdefault(seq_id, [])
        curs = self._cursors.setdefault(seq_id, deque())
        D = self.max_depth
        for t in tokens:
            p = len(seq)
            seq.append(t)
            curs.append([self.root, 0, p])
            for c in curs:
                node, a, start = c
                if a != p - start:  # this suffix runs on in its own tail, which grew with `seq`
                    continue
                children = node.children
                child = children.get(t)
                node.cont += 1
                if child is None:
                    children[t] = _Tail(seq, p, start + D, seq_id)
                    if len(children) == 1:
                        node.best = t
                    continue
                if type(child) is _Tail:  # a second occurrence: make the tail's first node real
                    tail, child = child, _Node(1)
                    s, q = tail.seq, tail.pos + 1
                    if q < min(len(s), tail.limit):
                        child.children[s[q]] = _Tail(s, q, tail.limit, tail.sid)
                        child.cont, child.best = 1, s[q]
                    owners = self._cursors.get(tail.sid)  # the owner's anchor moves down one node
                    if owners:
                        j = tail.limit - D - owners[0][2]
                        if 0 <= j < len(owners):
                            owners[j][0], owners[j][1] = child, a + 1
                    children[t] = child
                child.count += 1
                b = node.best
                if b is not None and b != t:
                    bc = children[b]
                    if type(bc) is not _Node or child.count > bc.count:
                        node.best = t
                c[0], c[1] = child, a + 1
            if p - curs[0][2] + 1 >= D:
                curs.popleft()

    def seal(self, seq_id: int) -> None:
        """The sequence will not grow any more: drop its cursors."""
        self._cursors.pop(seq_id, None)

    def length(self, seq_id: int) -> int:
        """Tokens of sequence `seq_id` ingested so far (0 for an unknown id)."""
        return len(self.seqs.get(seq_id, ()))

    @property
    def seq_ids(self) -> list[int]:
        """Ids of the sequences in the tree, ascending."""
        return sorted(self.seqs)

    def token(self, seq_id: int, i: int) -> int:
        """Token i of sequence `seq_id`. Raises IndexError / KeyError where there is none."""
        return self.seqs[seq_id][i]

    def remove(self, seq_id: int) -> None:
        """Delete sequence `seq_id` and all its suffixes' counts (no-op for an unknown id)."""
        seq = self.seqs.pop(seq_id, None)
        self._cursors.pop(seq_id, None)
        if seq is None:
            return
        D = self.max_depth
        for start in range(len(seq)):
            node = self.root
            for q in range(start, min(len(seq), start + D)):
                t = seq[q]
                child = node.children[t]
                node.cont -= 1
                if node.best == t:
                    node.best = None
                if type(child) is _Tail:  # count 1: only this suffix runs through it
                    del node.children[t]
                    break
                child.count -= 1
                if child.count == 0:
                    del node.children[t]
                    break
                node = child

    def _match(self, tokens: Sequence[int]):
        """Where `tokens` ends in the trie: (node, None), (tail, next index into tail.seq) or None."""
        node = self.root
        i, n = 0, len(tokens)
        while i < n:
            child = node.children.get(tokens[i])
            i += 1
            if child is None:
                return None
            if type(child) is _Node:
                node = child
                continue
            s, q, end = child.seq, child.pos + 1, min(len(child.seq), child.limit)
            while i < n:
                if q >= end or s[q] != tokens[i]:
                    return None
                q, i = q + 1, i + 1
            return child, q
        return node, None

    @staticmethod
    def _draft(node, q: int | None, cap: int, min_prob: float) -> SuffixDraft:
        d = SuffixDraft()
        toks, probs, prob = d.token_ids, d.probs, 1.0
        while len(toks) < cap:
            if q is not None:  # inside a tail: count 1 all the way, the estimate stays
                s, end = node.seq, min(len(node.seq), node.limit)
                n = min(end - q, cap - len(toks))
                toks.extend(s[q : q + n])
                probs.extend([prob] * n)
                break
            if node.cont == 0:
                break
            t = _best(node)
            child = node.children[t]
            prob *= _count(child) / node.cont
            if prob < min_prob:
                break
            toks.append(t)
            probs.append(prob)
            node, q = (child, None) if type(child) is _Node else (child, child.pos + 1)
        score = 0.0  # summed left to right: Python 3.12's sum() compensates, so scores (and ties) would
        for p in probs:  # depend on the Python version; the C++ tree sums the same way
            score += p
        d.score = score
        return d

    def speculate(self, context: Sequence[int], k: int, max_spec_factor: float, min_token_prob: float) -> SuffixDraft:
        """Best draft (highest score, ties: longer match) over the context's suffix matches.

        Args:
            context: token ids whose continuation is drafted (only the last max_depth - 1 are used).
            k: most tokens. max_spec_factor: at most floor(factor * match length) tokens.
            min_token_prob: stop before a token whose estimated probability is below this.

        A suffix of length m that occurs with a continuation implies the same for every shorter one,
        so the longest such m is found by binary search; lengths are then tried downwards until
        their cap (an upper bound on the score) cannot beat the best draft so far.
        """
        ctx = list(context[-(self.max_depth - 1) :]) if self.max_depth > 1 else []
        n = len(ctx)
        lo, hi, found = 0, n, {}
        while lo < hi:
            mid = (lo + hi + 1) // 2
            pos = self._match(ctx[n - mid :])
            if pos is not None and (pos[0].cont > 0 if pos[1] is None else pos[1] < min(len(pos[0].seq), pos[0].limit)):
                lo, found[mid] = mid, pos
            else:
                hi = mid - 1
        best = SuffixDraft()
        for m in range(lo, 0, -1):
            cap = min(k, int(m * max_spec_factor + 1e-6))
            if cap <= best.score:
                break
            pos = found.get(m) or self._match(ctx[n - m :])
            d = self._draft(pos[0], pos[1], cap, min_token_prob)
            if d.score > best.score:
                d.match_len = m
                best = d
        return best


class NativeSuffixTree:
    """The C++ `SuffixTree` (suffix_tree.cpp): the same methods, counts and drafts as `SuffixTree`.

    Raises:
        RuntimeError: the extension cannot be built here (`specserve.native.NativeExtension.load`).
    """

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self._tree = EXTENSION.load().SuffixTree(max_depth)
        self._keep = max_depth - 1

    def extend(self, seq_id: int, tokens: Sequence[int]) -> None:
        """Append `tokens` (ints) to sequence `seq_id` (created when new). Raises ValueError if it was sealed."""
        self._tree.extend(seq_id, tokens)

    def seal(self, seq_id: int) -> None:
        """The sequence will not grow any more: drop its cursors."""
        self._tree.seal(seq_id)

    def remove(self, seq_id: int) -> None:
        """Delete sequence `seq_id` and all its suffixes' counts (no-op for an unknown id)."""
        self._tree.remove(seq_id)

    def length(self, seq_id: int) -> int:
        """Tokens of sequence `seq_id` ingested so far (0 for an unknown id)."""
        return self._tree.length(seq_id)

    def token(self, seq_id: int, i: int) -> int:
        """Token i of sequence `seq_id`. Raises IndexError where there is none."""
        return self._tree.token(seq_id, i)

    @property
    def seq_ids(self) -> list[int]:
        """Ids of the sequences in the tree, ascending."""
        return self._tree.seq_ids()

    def speculate(self, context: Sequence[int], k: int, max_spec_factor: float, min_token_prob: float) -> SuffixDraft:
        """As `SuffixTree.speculate` (only the last max_depth - 1 tokens of `context` are passed to C++)."""
        ctx = context[-self._keep :] if self._keep > 0 else []
        toks, probs, score, match_len = self._tree.speculate(ctx, k, max_spec_factor, min_token_prob)
        return SuffixDraft(toks, probs, score, match_len)


def tree_factory(impl: str | None = None):
    """The tree class to use: `NativeSuffixTree` or `SuffixTree`.

    Args:
        impl: "auto", "native" or "python"; None reads `SPECSERVE_SUFFIX_TREE` (default "auto").

    Raises:
        ValueError: an unknown impl. RuntimeError: "native" and the C++ tree cannot be built here.
    """
    impl = impl if impl is not None else os.environ.get("SPECSERVE_SUFFIX_TREE", "auto")
    if impl not in TREE_IMPLS:
        raise ValueError(f"SPECSERVE_SUFFIX_TREE must be one of {', '.join(TREE_IMPLS)}, got {impl!r}")
    if impl == "python":
        return SuffixTree
    try:
        EXTENSION.load()
    except RuntimeError as e:
        if impl == "native":
            raise
        logger.warning("the suffix proposer uses its Python tree (slower, same drafts): %s", e)
        return SuffixTree
    return NativeSuffixTree


class SuffixProposer:
    """SuffixDecoding proposer (Oliaro et al. 2024), configured by the `suffix_decoding_*` keys.

    Per request: a SuffixTree over its prompt + output, built on its first `propose` and extended
    by the newly committed tokens on each later one; dropped in `finish_request`. Shared: a global
    SuffixTree over the outputs (token_ids after the prompt) of the last `max_cached_requests`
    finished requests that this proposer drafted for (0 disables it). Token ids are ints of any
    vocabulary; nothing is raised for unknown or reused request ids (a reused id whose tokens do not
    continue what it ingested gets a fresh tree).
    """

    method = "suffix"

    def __init__(self, config: SpeculativeConfig, tree_impl: str | None = None) -> None:
        self.tree_class = tree_factory(tree_impl)  # tree_impl: "auto" / "native" / "python", None = env
        self.max_depth = config.suffix_decoding_max_tree_depth
        self.max_cached_requests = config.suffix_decoding_max_cached_requests
        self.max_spec_factor = config.suffix_decoding_max_spec_factor
        self.min_token_prob = config.suffix_decoding_min_token_prob
        self._requests: dict[str, tuple[SuffixTree | NativeSuffixTree, int]] = {}  # running request id -> (tree, num prompt tokens)
        self._global = self.tree_class(self.max_depth)
        self._cached: OrderedDict[str, int] = OrderedDict()  # finished request id -> global seq id, oldest first
        self._next_seq_id = 0
        self._finished: list[tuple[str, list[int]]] = []  # outputs not yet in the global tree (`_flush`)

    active_requests = property(lambda self: list(self._requests), doc="ids with a per-request tree")

    @property
    def cached_requests(self) -> list[str]:
        """Ids in the global tree, oldest first."""
        self._flush()
        return list(self._cached)

    @property
    def global_tree(self) -> SuffixTree | NativeSuffixTree:
        """The tree over the cached outputs of finished requests."""
        self._flush()
        return self._global

    def draft(self, inp: ProposalInput) -> SuffixDraft:
        """Ingest the request's new tokens and return the better of its local and global drafts."""
        if self._finished:
            self._flush()
        toks, st = inp.token_ids, self._requests.get(inp.request_id)
        n = st[0].length(0) if st else 0
        if st is None or len(toks) < n or (n and toks[n - 1] != st[0].token(0, n - 1)):  # new, or not a continuation
            st = self._requests[inp.request_id] = (self.tree_class(self.max_depth), inp.num_prompt_tokens)
            n = 0
        if len(toks) > n:
            st[0].extend(0, [int(x) for x in toks[n:]])
        if inp.num_speculative_tokens <= 0:
            return SuffixDraft()
        args = (toks, inp.num_speculative_tokens, self.max_spec_factor, self.min_token_prob)
        best = st[0].speculate(*args)
        best.source = "local" if best.token_ids else ""
        if self._cached:
            g = self._global.speculate(*args)
            if g.score > best.score:
                g.source = "global"
                best = g
        return best

    def propose(self, inputs: list[ProposalInput]) -> list[Proposal]:
        """One Proposal per input, in order: 0..inp.num_speculative_tokens drafts each, draft_probs None (one-hot),
        match_len = the suffix match length, confidence = the branch frequency count(child) / count(parent)
        at each position (the ratio of consecutive probability estimates)."""
        out = []
        for inp in inputs:
            d = self.draft(inp)
            cond = [p / q for p, q in zip(d.probs, [1.0] + d.probs[:-1])]  # branch frequency at each position
            out.append(Proposal(d.token_ids, None, match_len=d.match_len or None, confidence=cond or None))
        return out

    def prepare(self, inputs: list[ProposalInput]) -> None:
        """Work that does not need the next step's tokens (the engine runs it while the GPU computes):
        cache the outputs of finished requests in the global tree, and ingest each input's tokens into
        its request's tree (a new prompt: O(prompt length x depth), ~7 ms for 360 tokens on the H200
        machine's host). Drafts nothing; `propose` gives the same drafts with or without it."""
        self._flush()
        for inp in inputs:
            self.draft(ProposalInput(inp.request_id, inp.token_ids, inp.num_prompt_tokens, 0, inp.sampling_params,
                                     inp.seed))

    def finish_request(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Drop the request's tree; cache its output in the global tree (FIFO-evicting the oldest).

        `token_ids` is prompt + output. A request never drafted for (unknown id) is ignored: its
        prompt length is unknown, so its output cannot be told apart. The global tree takes the
        output before the next draft (or in `prepare`, whichever comes first).
        """
        st = self._requests.pop(request_id, None)
        if st is None or self.max_cached_requests == 0:
            return
        self._finished.append((request_id, [int(x) for x in token_ids[st[1] :]]))

    def _flush(self) -> None:
        """Put the finished requests' outputs into the global tree, in finishing order."""
        finished, self._finished = self._finished, []
        for request_id, output in finished:
            old = self._cached.pop(request_id, None)
            if old is not None:
                self._global.remove(old)
            if not output:
                continue
            seq_id, self._next_seq_id = self._next_seq_id, self._next_seq_id + 1
            self._global.extend(seq_id, output)
            self._global.seal(seq_id)
            self._cached[request_id] = seq_id
            while len(self._cached) > self.max_cached_requests:
                _, oldest = self._cached.popitem(last=False)
                self._global.remove(oldest)
