"""Draft-model proposer: a smaller model with the same tokenizer guesses the next k tokens.

What it does: keeps its own model, KV cache and per-request slot. Each step it rolls its cache back to
the longest common prefix of what it has cached and the request's committed tokens (the same
`KVCache.truncate` primitive the target uses), feeds the tokens it has not seen in one batched forward,
then drafts k tokens autoregressively, batched over requests. Greedy requests get the draft's argmax
(one-hot q; when every request of the call is greedy the k forwards are chained on the device, each
reading the previous argmax there, with one device-to-host copy at the end); sampled requests get a sample from the draft's own distribution under the request's
temperature/top-k/top-p/min-p, drawn with the request's uniform u(seed, output position, DRAFT)
(`specserve.sample.uniforms`), and that q is returned for the rejection sampler (Leviathan et al. 2023).
A request whose context does not fit the draft's shorter context gets fewer (or no) drafts. On CUDA a
long catch-up (a new request's prompt) is fed in graph-sized forwards ahead of the chain (`_feed_ahead`).
With the engine's prefix caching on (docs/prefix_caching.md) the draft's cache is a prefix cache too: a
new request starts in the draft slot holding the longest cached prefix of its tokens, and a finished
request's draft slot stays cached with the tokens its draft K/V were computed for that equal the
request's committed tokens (never a rejected draft's).
What it does not do: verification, or any change to the request.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from specserve.config import ConfigError, SpeculativeConfig
from specserve.engine.kv_cache import common_prefix_len
from specserve.engine.loaded_model import LoadedModel
from specserve.engine.model_runner import SeqInput
from specserve.sample.rejection import sample_from
from specserve.sample.sampler import logits_to_probs
from specserve.sample.uniforms import Purpose, seed_key, uniform
from specserve.spec_decode.proposer import Proposal, ProposalInput, ProposerContext

logger = logging.getLogger(__name__)

MAX_FEED_AHEAD = 4  # most graph forwards fed ahead of a chain; past it one eager forward costs about as much


@dataclass
class _DraftSeq:
    slot: int
    cached: list[int] = field(default_factory=list)  # tokens whose K/V are in the draft cache
    verified: int = 0  # leading tokens of `cached` known to be the request's own (committed tokens never change)


class DraftModelProposer:
    """Drafts with a second model (e.g. qwen2.5-coder-0.5b-instruct for the 1.5b target).

    Args:
        spec_config: the SpeculativeConfig (method "draft_model", model = the draft's name or path).
        context: the target's device, dtype, context length, slot count, vocabulary and tokenizer.

    Raises:
        ConfigError: the draft's tokenizer differs from the target's.
        ModelError, WeightLoadError: the draft model cannot be found or loaded.
    """

    method = "draft_model"
    chain_greedy = True  # all-greedy calls chain the k forwards on the device (False: one host copy per draft)

    def __init__(self, spec_config: SpeculativeConfig, context: ProposerContext):
        self.draft = LoadedModel(spec_config.model, context.dtype, str(context.device), context.max_model_len,
                                 context.num_slots)
        if self.draft.tokenizer.get_vocab() != context.tokenizer.get_vocab():
            raise ConfigError(
                f"draft model {spec_config.model!r} does not share the target's tokenizer; "
                "a draft must use the same vocabulary"
            )
        n_draft = sum(p.numel() for p in self.draft.model.parameters())
        if n_draft >= context.num_target_params:
            logger.warning("draft model %s (%.2fB parameters) is not smaller than the target (%.2fB): "
                           "drafting will cost more than it can save", spec_config.model, n_draft / 1e9,
                           context.num_target_params / 1e9)
        self.target_vocab = context.vocab_size
        self.prefix_caching = context.enable_prefix_caching
        self.prefix_cache_min_tokens = context.prefix_cache_min_tokens
        self.seqs: dict[str, _DraftSeq] = {}
        self._step_cost = None
        # the most tokens one request fed in the last `propose` call's first forward (1 or 2 for a request
        # that drafted in the step before: the draft keeps its own drafts; its prompt for a new one): the
        # adaptive schedule times only chains without a prompt or catch-up (`AdaptiveK.chain_scale`)
        self.last_max_feed = 0
        # the most tokens one request alone may feed with every forward of its chain replaying a CUDA graph:
        # up to MAX_FEED_AHEAD graph forwards fed ahead (`_feed_ahead`) and the chain's first, each of at most
        # the graphs' longest sequence (None: no graphs, e.g. on a CPU). Past it the chain's first forward
        # runs eagerly, which on a GPU is launch-bound (12-15 ms on the H200): about as dear for one
        # request's prompt as for several, so the adaptive schedule gathers such feeds
        # (`AdaptiveK._gather_feeds`); below it a feed costs what its tokens cost, and nothing is gathered
        qlen = getattr(self.draft.runner, "graph_max_qlen", None)
        self.graph_max_feed = None if qlen is None else (MAX_FEED_AHEAD + 1) * qlen

    def draft_step_cost(self):
        """The measured time of one draft forward (`StepCostModel`, cached per model and device; measured
        on first use). The adaptive schedule charges one such forward per drafted position."""
        if self._step_cost is None:
            from specserve.engine.step_cost import load_or_measure

            self._step_cost = load_or_measure(self.draft, max_tokens=16, max_seqs=min(self.draft.kv.num_slots, 16),
                                              role="draft")
        return self._step_cost

    def _seq(self, request_id: str, token_ids: list[int]) -> _DraftSeq:
        """The request's draft slot; a new one starts with the longest cached prefix of `token_ids` when
        prefix caching is on."""
        if request_id not in self.seqs:
            if self.prefix_caching:
                slot, n = self.draft.kv.allocate_for_prefix(token_ids, self.prefix_cache_min_tokens)
                self.seqs[request_id] = _DraftSeq(slot, list(token_ids[:n]), n)
            else:
                self.seqs[request_id] = _DraftSeq(self.draft.kv.allocate())
        return self.seqs[request_id]

    @staticmethod
    def _kept(seq: _DraftSeq, ids: list[int]) -> int:
        """How many of `ids` (a request's tokens) the draft keeps in its cache for the next forward: the
        common prefix with what it has cached, less at least the newest token (fed to get its logits).
        Only the tail past the verified prefix can differ (the last step's drafts), so only that is compared."""
        v = min(seq.verified, len(ids), len(seq.cached))
        return min(v + common_prefix_len(seq.cached[v:], ids[v:]), len(ids) - 1)

    def pending_feed(self, request_id: str, token_ids: list[int]) -> int:
        """Tokens the next `propose` for this request would feed in its first forward (read-only): its
        whole prompt and output for a request the draft has not seen (less a prefix-cache hit), what it
        missed for one that was given k = 0 meanwhile, 1 or 2 in the steady state. The adaptive schedule
        gathers those above `graph_max_feed` into one forward (`AdaptiveK._gather_feeds`)."""
        seq = self.seqs.get(request_id)
        if seq is not None:
            return len(token_ids) - self._kept(seq, token_ids)
        n = 0
        if self.prefix_caching:
            _, n = self.draft.kv.longest_prefix(token_ids)
            n = n if n >= self.prefix_cache_min_tokens else 0
        return len(token_ids) - n

    def _feed_ahead(self, seqs: list[_DraftSeq], feeds: list[list[int]]) -> list[list[int]]:
        """Feed the front of long catch-ups (a new request's prompt) in forwards that replay a CUDA graph,
        so that the chain's first forward, with every request's last tokens, replays one too.

        On the H200 an eager forward costs 12-15 ms of kernel launches whatever its size, a graph replay
        of a few hundred prompt tokens 1-3 ms. Each forward ahead takes, longest feed first, up to the
        graphs' longest sequence of each feed (never its last token, whose logits the chain needs), within
        the graphs' token count, until the rest fits a graph; past MAX_FEED_AHEAD forwards nothing is fed
        ahead and the chain's first forward runs eagerly. Without graphs (a CPU) nothing is fed ahead.

        Args:
            seqs: the requests' draft slots, their `cached` tokens equal to the slot's K/V (extended here).
            feeds: each request's tokens still to feed.

        Returns:
            The tokens each request still feeds in the chain's first forward (a suffix of its feed).
        """
        runner = self.draft.runner
        fits = getattr(runner, "fits_graph", None)
        if fits is None or runner.graph_max_qlen is None or fits([len(f) for f in feeds]):
            return feeds  # no graphs (a CPU, or CUDA with graphs off), or the chain's forward replays one
        cap_q, cap_t = runner.graph_max_qlen, runner.graph_max_tokens
        left = [len(f) for f in feeds]
        plan: list[list[tuple[int, int]]] = []  # per forward ahead: (request index, tokens)
        while not fits(left):
            budget, rows = cap_t, []
            for i in sorted(range(len(left)), key=lambda i: -left[i]):
                n = min(left[i] - 1, cap_q, budget)
                if n <= 0:
                    break
                rows.append((i, n))
                budget -= n
            if not rows or len(plan) == MAX_FEED_AHEAD:
                return feeds
            for i, n in rows:
                left[i] -= n
            plan.append(rows)
        for rows in plan:
            chunks = [feeds[i][:n] for i, n in rows]
            runner.run([seqs[i].slot for i, _ in rows], [len(seqs[i].cached) for i, _ in rows], chunks,
                       [1] * len(rows))
            for (i, n), chunk in zip(rows, chunks):
                seqs[i].cached += chunk
                feeds[i] = feeds[i][n:]
        return feeds

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits [R, Vd] -> [R, V_target]: extra draft ids dropped, missing ones never drafted."""
        V = self.target_vocab
        if logits.shape[1] >= V:
            return logits[:, :V]
        pad = logits.new_full((logits.shape[0], V - logits.shape[1]), float("-inf"))
        return torch.cat([logits, pad], dim=1)

    def propose(self, inputs: list[ProposalInput]) -> list[Proposal]:
        """Up to inp.num_speculative_tokens drafts per input; see the module docstring. Shapes: draft_probs [n, V_target]."""
        max_len = self.draft.max_model_len
        plans = []  # (input, seq, k)
        for inp in inputs:
            ids = inp.token_ids
            k = min(inp.num_speculative_tokens, max_len - len(ids))  # the draft writes positions up to len(ids) + k - 2
            if k <= 0:
                plans.append((inp, None, 0))
                continue
            seq = self._seq(inp.request_id, ids)
            n = self._kept(seq, ids)
            self.draft.kv.truncate(seq.slot, n)
            del seq.cached[n:]
            seq.verified = n
            plans.append((inp, seq, k))
        active = [(inp, seq, k) for inp, seq, k in plans if k > 0]
        self.last_max_feed = max((len(inp.token_ids) - len(seq.cached) for inp, seq, _ in active), default=0)
        for inp, seq, _ in active:  # every token fed now is the request's own
            seq.verified = len(inp.token_ids)
        if self.chain_greedy and active and all(inp.sampling_params.greedy for inp, _, _ in active):
            drafts = self._greedy_chain(active)
            return [Proposal(drafts.get(inp.request_id, []), None) for inp in inputs]
        drafts: dict[str, list[int]] = {inp.request_id: [] for inp in inputs}
        qs: dict[str, list[torch.Tensor]] = {inp.request_id: [] for inp in inputs}
        feeds = self._feed_ahead([seq for _, seq, _ in active],
                                 [list(inp.token_ids[len(seq.cached):]) for inp, seq, _ in active])
        step = 0
        while active:
            logits = self.draft.runner.forward(
                [SeqInput(seq.slot, len(seq.cached), feed, 1) for (_, seq, _), feed in zip(active, feeds)]
            )
            logits = self._fit_vocab(logits)
            greedy_rows = [i for i, (inp, _, _) in enumerate(active) if inp.sampling_params.greedy]
            argmax = logits[greedy_rows].argmax(-1).tolist() if greedy_rows else []
            gi = dict(zip(greedy_rows, argmax))
            next_active, next_feeds = [], []
            for i, ((inp, seq, k), feed) in enumerate(zip(active, feeds)):
                seq.cached += feed
                if i in gi:
                    tok = gi[i]
                else:
                    q = logits_to_probs(logits[i : i + 1], inp.sampling_params)[0]
                    pos = len(inp.token_ids) - inp.num_prompt_tokens + step  # the drafted token's output position
                    tok = sample_from(q, uniform(seed_key(inp.seed), pos, Purpose.DRAFT))
                    qs[inp.request_id].append(q)
                drafts[inp.request_id].append(tok)
                if step + 1 < k:
                    next_active.append((inp, seq, k))
                    next_feeds.append([tok])
            active, feeds = next_active, next_feeds
            step += 1
        out = []
        for inp in inputs:
            q = qs[inp.request_id]
            out.append(Proposal(drafts[inp.request_id], torch.stack(q) if q else None))
        return out

    def _greedy_chain(self, active: list) -> dict[str, list[int]]:
        """Greedy drafts for `active` [(input, seq, k)] with the tokens kept on the device: each draft
        forward reads the previous forward's argmax from the device (`runner.run(device_ids=...)`), so
        the k forwards are queued back to back and the host waits once, for all drafts, at the end
        (one device-to-host copy per propose call instead of one per draft position). The drafts are the
        same as the step-by-step argmax (the same forwards in the same order)."""
        runner = self.draft.runner
        V = min(self.target_vocab, self.draft.config.vocab_size)
        slots = [seq.slot for _, seq, _ in active]
        feeds = self._feed_ahead([seq for _, seq, _ in active],
                                 [list(inp.token_ids[len(seq.cached):]) for inp, seq, _ in active])
        pos = [len(seq.cached) for _, seq, _ in active]
        logits = runner.run(slots, pos, feeds, [1] * len(active))
        tok = logits[:, :V].argmax(-1)
        steps = [tok]  # steps[j][i]: draft j of the i-th request still drafting at step j
        idx = list(range(len(active)))  # requests still drafting, as indices into `active`
        members = [idx]
        pos = [p + len(f) for p, f in zip(pos, feeds)]
        for j in range(1, max(k for _, _, k in active)):
            keep = [n for n, i in enumerate(idx) if active[i][2] > j]  # positions within the previous step
            if len(keep) < len(idx):
                tok = tok[torch.tensor(keep, device=tok.device)]
            idx = [idx[n] for n in keep]
            logits = runner.run([slots[i] for i in idx], [pos[i] + j - 1 for i in idx], [[0]] * len(idx),
                                [1] * len(idx), device_ids=tok)
            tok = logits[:, :V].argmax(-1)
            steps.append(tok)
            members.append(idx)
        flat = torch.cat(steps).tolist()  # the one device-to-host copy
        drafts: dict[str, list[int]] = {}
        o = 0
        for idx in members:
            for i in idx:
                drafts.setdefault(active[i][0].request_id, []).append(flat[o])
                o += 1
        for (inp, seq, k), feed in zip(active, feeds):
            seq.cached += feed + drafts[inp.request_id][: k - 1]  # the last draft is not fed yet
        return drafts

    def finish_request(self, request_id: str, token_ids) -> None:
        """Free the request's draft KV slot; with prefix caching it stays cached with the draft's tokens
        up to the first one that differs from the request's committed `token_ids`."""
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            keep = None
            if self.prefix_caching:
                keep = seq.cached[: min(common_prefix_len(seq.cached, token_ids), self.draft.kv.lengths[seq.slot])]
            self.draft.kv.free(seq.slot, keep)

