"""The draft model's greedy chain (k forwards chained on the device, one host copy) drafts exactly the
tokens of the step-by-step path (one host copy per draft), over several propose calls with accepted,
rejected and capped drafts, for requests with different k in one call."""

import pytest
import torch

from specserve import SamplingParams
from specserve.config import SpeculativeConfig
from specserve.engine.loaded_model import LoadedModel
from specserve.spec_decode.draft_model import DraftModelProposer
from specserve.spec_decode.proposer import ProposalInput, ProposerContext


def _proposer(tiny_model_dir, draft_dir, chain: bool, device: str) -> DraftModelProposer:
    target = LoadedModel(str(tiny_model_dir), "float32", device, 128, 4)
    ctx = ProposerContext(device=torch.device(device), dtype="float32", max_model_len=128, num_slots=4,
                          vocab_size=target.config.vocab_size, tokenizer=target.tokenizer,
                          num_target_params=10**12)
    p = DraftModelProposer(SpeculativeConfig("draft_model", 6, model=str(draft_dir)), ctx)
    p.chain_greedy = chain
    return p


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_greedy_chain_equals_step_by_step(tiny_model_dir, tmp_path, device):
    from tests.helpers.tiny_model import make_tiny_model

    draft_dir = make_tiny_model(tmp_path, arch="qwen2", seed=3)
    chain, steps = (_proposer(tiny_model_dir, draft_dir, True, device),
                    _proposer(tiny_model_dir, draft_dir, False, device))
    greedy = SamplingParams(temperature=0.0, max_tokens=64)
    ctx = {"a": [1, 5, 9, 14, 3], "b": [7, 7, 2], "c": [4, 8, 15, 16, 23, 42, 8]}
    ks = {"a": 4, "b": 1, "c": 6}
    for rnd in range(4):
        inputs = [ProposalInput(r, list(t), 2, ks[r], greedy, 0) for r, t in ctx.items()]
        got = chain.propose(inputs)
        want = steps.propose(inputs)
        for r, g, w in zip(ctx, got, want):
            assert g.token_ids == w.token_ids, (rnd, r)
            assert len(g.token_ids) == ks[r] and g.draft_probs is None
        # commit: "a" accepts its first two drafts + one other token, "b" everything, "c" nothing
        ctx["a"] += got[0].token_ids[:2] + [11]
        ctx["b"] += got[1].token_ids + [12]
        ctx["c"] += [13]
        ks = {"a": 3, "b": 5, "c": 2 + rnd}
    for r in ctx:
        assert chain.draft.kv.lengths[chain.seqs[r].slot] == steps.draft.kv.lengths[steps.seqs[r].slot]


def test_pending_feed_is_what_the_next_propose_feeds(tiny_model_dir, tmp_path):
    """`pending_feed` (read-only) equals the tokens the next propose feeds a request in its first
    forward (`last_max_feed` for one request): its whole prompt before it drafted, 1 after a rejected
    draft, 2 when every draft was accepted (the last draft and the bonus token), and everything
    committed meanwhile after steps it did not draft in."""
    from tests.helpers.tiny_model import make_tiny_model

    p = _proposer(tiny_model_dir, make_tiny_model(tmp_path, arch="qwen2", seed=3), True, "cpu")
    greedy = SamplingParams(temperature=0.0, max_tokens=64)
    ids = [1, 5, 9, 14, 3, 8, 2]

    def step(k):
        feed = p.pending_feed("a", ids)
        (prop,) = p.propose([ProposalInput("a", list(ids), 3, k, greedy, 0)])
        assert p.last_max_feed == feed
        return feed, prop.token_ids

    assert p.pending_feed("a", ids) == len(ids) and "a" not in p.seqs  # read-only: no slot taken
    assert p.graph_max_feed is None  # no CUDA graphs on a CPU: the schedule gathers nothing
    feed, drafts = step(3)
    assert feed == len(ids)  # a request the draft has not seen: its prompt
    ids += drafts + [4]  # every draft accepted, then the bonus token
    feed, drafts = step(3)
    assert feed == 2
    ids += [drafts[0] + 1]  # the first draft rejected: its recovered token
    feed, drafts = step(3)
    assert feed == 1
    ids += [drafts[0] + 1, 6, 6]  # three plain steps (k = 0), the first unlike its cached draft
    feed, _ = step(2)
    assert feed == 3


class _GraphShapedRunner:
    """The CPU runner of a draft, with the graph interface of `CudaGraphRunner` for decode buckets of 2
    tokens per sequence and prefill buckets of up to `tokens`; it records each forward's per-sequence token
    counts and whether it would have replayed a graph."""

    def __init__(self, inner, tokens: int):
        from specserve.engine.step_buckets import BucketSet

        self.inner, self.kv = inner, inner.kv
        self.buckets = BucketSet(8, max_qlen=2, max_tokens=8, prefill_tokens=tokens, prefill_sizes=(tokens,))
        self.graph_max_qlen, self.graph_max_tokens = self.buckets.max_qlen, self.buckets.max_tokens_at_max_qlen
        self.calls: list[tuple[list[int], bool]] = []

    def fits_graph(self, qlens):
        return self.buckets.fits(qlens)

    def run(self, slots, starts, token_ids, num_logits, device_ids=None):
        qlens = [len(t) for t in token_ids]
        self.calls.append((qlens, self.fits_graph(qlens)))
        return self.inner.run(slots, starts, token_ids, num_logits, device_ids=device_ids)

    def forward(self, seqs):
        return self.run([s.slot for s in seqs], [s.start for s in seqs], [s.token_ids for s in seqs],
                        [s.num_logits for s in seqs])


@pytest.mark.parametrize("chain", [True, False])
def test_long_catch_ups_are_fed_ahead_in_graph_sized_forwards(tiny_model_dir, tmp_path, chain):
    """With graphs of at most 24 tokens, new prompts of 40 and 30 tokens are fed ahead of the chain in
    graph-sized forwards (longest first, never a feed's last token), so that every
    forward replays a graph; the drafts and the draft's K/V are those of a drafter without graphs. Past
    MAX_FEED_AHEAD forwards ahead, nothing is fed ahead (one eager forward)."""
    from specserve.spec_decode import draft_model
    from tests.helpers.tiny_model import make_tiny_model

    draft_dir = make_tiny_model(tmp_path, arch="qwen2", seed=3)
    plain, graphs = (_proposer(tiny_model_dir, draft_dir, chain, "cpu") for _ in range(2))
    runner = _GraphShapedRunner(graphs.draft.runner, tokens=24)
    graphs.draft.runner = runner
    greedy = SamplingParams(temperature=0.0, max_tokens=64)
    g = torch.Generator().manual_seed(0)
    ctx = {"a": torch.randint(0, 200, (40,), generator=g).tolist(), "b": [7, 7, 2],
           "c": torch.randint(0, 200, (30,), generator=g).tolist()}
    for rnd in range(2):
        inputs = [ProposalInput(r, list(t), len(t), 3, greedy, 0) for r, t in ctx.items()]
        got, want = graphs.propose(inputs), plain.propose(inputs)
        assert [p.token_ids for p in got] == [p.token_ids for p in want]
        for r, p in zip(ctx, got):
            ctx[r] += p.token_ids[:1] + [5]
    assert all(fit for _, fit in runner.calls)
    # the forwards ahead: a's 24, c's 24, then the rest but each one's last token (the chain feeds those)
    assert [q for q, _ in runner.calls if max(q) > 1] == [[24], [24], [15, 5, 2]]
    for r in ctx:
        s1, s2 = graphs.seqs[r], plain.seqs[r]
        assert s1.cached == s2.cached
        n = graphs.draft.kv.lengths[s1.slot]
        assert n == plain.draft.kv.lengths[s2.slot]
        assert torch.allclose(graphs.draft.kv.k[0][s1.slot, :, :n], plain.draft.kv.k[0][s2.slot, :, :n], atol=1e-5)

    runner.calls.clear()
    draft_model.MAX_FEED_AHEAD, saved = 1, draft_model.MAX_FEED_AHEAD
    try:
        long = torch.randint(0, 200, (60,), generator=g).tolist()
        graphs.propose([ProposalInput("d", long, 60, 2, greedy, 0)])
    finally:
        draft_model.MAX_FEED_AHEAD = saved
    assert runner.calls[0] == ([60], False)  # 60 tokens need 3 forwards ahead: one eager forward instead


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_feed_ahead_on_cuda_graphs_drafts_what_eager_drafts(tiny_model_dir, tmp_path):
    """On CUDA with prefill graphs of at most 32 tokens, prompts of 70 and 45 tokens are fed ahead in graph
    replays and the drafts equal those of an eager draft runner; no forward runs eagerly."""
    from specserve.engine.cuda_graph_runner import CudaGraphRunner
    from tests.helpers.tiny_model import make_tiny_model

    draft_dir = make_tiny_model(tmp_path, arch="qwen2", seed=3)
    props = [_proposer(tiny_model_dir, draft_dir, True, "cuda") for _ in range(2)]
    for p, graphs in zip(props, (True, False)):
        d = p.draft
        d.runner = CudaGraphRunner(d.model, d.kv, d.device, 4, cuda_graphs=graphs, prefill_tokens=32)
    greedy = SamplingParams(temperature=0.0, max_tokens=64)
    g = torch.Generator().manual_seed(0)
    ctx = {"a": torch.randint(0, 200, (70,), generator=g).tolist(),
           "b": torch.randint(0, 200, (45,), generator=g).tolist()}
    for _ in range(3):
        inputs = [ProposalInput(r, list(t), len(t), 3, greedy, 0) for r, t in ctx.items()]
        got, want = (p.propose(inputs) for p in props)
        assert [p.token_ids for p in got] == [p.token_ids for p in want]
        for r, p in zip(ctx, got):
            ctx[r] += p.token_ids[:2] + [5]
    assert props[0].draft.runner.num_eager_steps == 0 and props[0].draft.runner.num_graph_steps > 9
