"""The adaptive schedule inside the engine step: drafts for every request whose config says
`"num_speculative_tokens_schedule": "adaptive"`, cut to the k chosen for the whole batch.

What it does, per step, for the decoding requests of adaptive configs (each with its k cap from the
scheduler: max_tokens, context end, batch-size table, token budget):
1. proposers that draft for free (ngram, suffix) propose up to the cap; every draft is recorded in the
   `AcceptanceTracker` at full length (its outcome is read from the committed tokens later);
2. `choose_draft_lengths` picks k per request from the acceptance estimates (with the proposer's own
   confidence), the target's measured step cost (`StepCostModel`) over the whole step (the other
   requests' tokens and the prefill chunks included) and, for a draft model, its own measured forward
   time per drafted position;
3. free drafts are cut to k; a draft model drafts exactly k.
After each commit the tracker matches pending drafts against the committed tokens.
What it does not do: change which tokens are committed (verification does not depend on k for one-hot
drafts, and is lossless for any k), schedule, or run the target.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable

from specserve.engine.step_cost import StepCostModel
from specserve.request import Request
from specserve.spec_decode import proposer_key
from specserve.spec_decode.acceptance import AcceptanceTracker
from specserve.spec_decode.adaptive import Choice, DraftOption, choose_draft_lengths
from specserve.spec_decode.proposer import Proposal, ProposalInput, Proposer


class AdaptiveDrafts:
    """Drafting with the adaptive schedule (see the module docstring).

    Args:
        step_cost: the target's measured step cost.
        objective, min_gain: passed to `choose_draft_lengths`.

    Attributes:
        tracker: the acceptance estimates.
        last_choice: the most recent `Choice` (for inspection).
        chosen_k: per speculative config, how many times each k was chosen (index = k).
    """

    def __init__(self, step_cost: StepCostModel, *, objective: str = "fair", min_gain: float = 0.0):
        self.step_cost = step_cost
        self.objective = objective
        self.min_gain = min_gain
        self.tracker = AcceptanceTracker()
        self.last_choice: Choice | None = None
        self.chosen_k: dict[Any, list[int]] = defaultdict(list)

    def add_request(self, req: Request) -> None:
        """Track a request of an adaptive config."""
        self.tracker.add_request(req.request_id, req.spec_config, proposer_key(req.spec_config))

    def propose(self, scheduled: list, proposer_of: Callable[[Any], Proposer], *, other_tokens: int,
                other_seqs: int) -> None:
        """Set `drafts` / `draft_probs` of every request in `scheduled` (ScheduledRequests of adaptive
        configs, each with its cap in `num_speculative_tokens`).

        Args:
            proposer_of: the proposer of a SpeculativeConfig.
            other_tokens: new tokens of the rest of the step (other decodes with their drafts, prefill chunks).
            other_seqs: sequences in the rest of the step.
        """
        free: dict[Any, list] = defaultdict(list)
        costly: dict[Any, list] = defaultdict(list)
        for s in scheduled:
            s.request.drafts, s.request.draft_probs = [], None
            if s.num_speculative_tokens <= 0:
                continue
            prop = proposer_of(s.request.spec_config)
            (costly if hasattr(prop, "draft_step_cost") else free)[proposer_key(s.request.spec_config)].append(s)
        proposals: dict[str, Proposal] = {}
        for group in free.values():
            prop = proposer_of(group[0].request.spec_config)
            for s, p in zip(group, prop.propose([_input(s, s.num_speculative_tokens) for s in group])):
                p.token_ids = list(p.token_ids[: s.num_speculative_tokens])
                proposals[s.request.request_id] = p
                self.tracker.add_draft(s.request.request_id, len(s.request.all_token_ids), p.token_ids,
                                       p.match_len, p.confidence)
        reqs, options = [], []
        for group in free.values():
            for s in group:
                p = proposals[s.request.request_id]
                if p.token_ids:
                    reqs.append(s)
                    options.append(DraftOption(self.tracker.estimates(s.request.request_id, len(p.token_ids),
                                                                      p.match_len, p.confidence)))
                else:
                    other_tokens, other_seqs = other_tokens + 1, other_seqs + 1
        for key, group in costly.items():
            cost = proposer_of(group[0].request.spec_config).draft_step_cost()
            for s in group:
                reqs.append(s)
                options.append(DraftOption(self.tracker.estimates(s.request.request_id, s.num_speculative_tokens),
                                           draft_group=key, draft_cost_ms=lambda n, c=cost: c.forward_ms(n, n)))
        other_tokens += sum(1 for s in scheduled if s.num_speculative_tokens <= 0)
        other_seqs += sum(1 for s in scheduled if s.num_speculative_tokens <= 0)
        choice = choose_draft_lengths(options, self.step_cost.step_ms, num_other_tokens=other_tokens,
                                      num_other_seqs=other_seqs, objective=self.objective, min_gain=self.min_gain)
        self.last_choice = choice
        ks = {s.request.request_id: k for s, k in zip(reqs, choice.ks)}
        for s in scheduled:
            k = ks.get(s.request.request_id, 0)
            counts = self.chosen_k[s.request.spec_config]
            counts += [0] * (k + 1 - len(counts))
            counts[k] += 1
            p = proposals.get(s.request.request_id)
            if p is not None and k:
                s.request.drafts = p.token_ids[:k]
                s.request.draft_probs = p.draft_probs[:k] if p.draft_probs is not None else None
        for key, group in costly.items():
            todo = [s for s in group if ks.get(s.request.request_id, 0) > 0]
            if not todo:
                continue
            prop = proposer_of(todo[0].request.spec_config)
            for s, p in zip(todo, prop.propose([_input(s, ks[s.request.request_id]) for s in todo])):
                k = ks[s.request.request_id]
                s.request.drafts = list(p.token_ids[:k])
                s.request.draft_probs = p.draft_probs[: len(s.request.drafts)] if p.draft_probs is not None else None
                self.tracker.add_draft(s.request.request_id, len(s.request.all_token_ids), s.request.drafts)

    def on_commit(self, req: Request) -> None:
        """The request committed tokens: resolve its pending drafts."""
        self.tracker.on_commit(req.request_id, req.all_token_ids)

    def finish_request(self, req: Request) -> None:
        """The request left the engine."""
        self.tracker.finish_request(req.request_id)


def _input(s, k: int) -> ProposalInput:
    r = s.request
    return ProposalInput(r.request_id, r.all_token_ids, r.num_prompt_tokens, k, r.params, r.generator)
