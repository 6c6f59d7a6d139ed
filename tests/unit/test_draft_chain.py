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
