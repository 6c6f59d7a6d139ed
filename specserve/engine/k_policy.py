"""How many drafts (k) each decoding request wants in a step: the hook for choosing k per request.

What it does: `KPolicy` is what the scheduler asks once per step, for all decoding requests at once
(`choose`, which may answer 0 for any request), and what the engine tells after each verify step
(`observe`). `ConfiguredK`, the default, follows each request's SpeculativeConfig:
`num_speculative_tokens`, or vLLM's `num_speculative_tokens_per_batch_size` table. A policy that decides
k from the drafts themselves (`DraftingKPolicy`: the adaptive schedule, `specserve.engine.draft_length`)
also gets `draft`: its `choose` says how deep drafting may go, and `draft` drafts within the capped
values and cuts each proposal to the final k.
What it does not do: the hard caps (max_tokens, the context length, the step's token budget); the
scheduler applies them after the policy (`Scheduler.speculation_caps`), so no policy can break them.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

from specserve.request import Request
from specserve.spec_decode.proposer import Proposal


class KPolicy(Protocol):
    """Chooses k per request per step (the scheduler's `k_policy`)."""

    def choose(self, requests: Sequence[Request], max_draft_tokens: int) -> list[int]:
        """The k each of `requests` (the step's decoding requests, FCFS) wants, >= 0 each.

        Args:
            requests: the decoding requests of this step (the scheduler has not capped anything yet).
            max_draft_tokens: the token budget left for drafts after one token per decoding request.

        Returns:
            one int per request; the scheduler then caps each by max_tokens, the context length and
            the budget, in FCFS order.
        """
        ...

    def observe(self, request: Request, num_draft_tokens: int, num_accepted: int) -> None:
        """A decode step of speculative `request` verified `num_draft_tokens` drafts (0 when it decoded
        plainly) and accepted `num_accepted` (before any stop cut the block); called after the commit,
        so `request.all_token_ids` holds the committed tokens."""
        ...


class DraftingKPolicy(KPolicy, Protocol):
    """A KPolicy that decides the final k after seeing the drafts (the proposer's own confidence)."""

    def draft(self, asks: Sequence[tuple[Request, int]], propose: Callable, *, num_other_tokens: int,
              num_other_seqs: int) -> list[Proposal]:
        """Drafts for `asks` ((request, k cap) pairs after the scheduler's caps, k cap >= 1), each cut to
        the k this policy chooses (0..cap), drafting through `propose` (the engine's callback).

        Args:
            num_other_tokens, num_other_seqs: new tokens and sequences of the rest of the step (decodes
                without drafts, the prompt chunks that would follow).
        """
        ...


class ConfiguredK:
    """The default KPolicy: each request's configured k (see the module docstring)."""

    def choose(self, requests: Sequence[Request], max_draft_tokens: int) -> list[int]:
        out = []
        for r in requests:
            cfg = r.spec_config
            if cfg is None:
                out.append(0)
                continue
            out.append(cfg.k_for_batch_size(len(requests)))  # batch size: the step's decoding requests
        return out

    def observe(self, request: Request, num_draft_tokens: int, num_accepted: int) -> None:
        """Nothing to learn: the configured k does not depend on outcomes."""
