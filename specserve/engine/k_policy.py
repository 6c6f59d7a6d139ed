"""How many drafts (k) each decoding request wants in a step: the hook for choosing k per request.

What it does: `KPolicy` is what the scheduler asks once per step, for all decoding requests at once
(`choose`, which may answer 0 for any request), and what the engine tells after each verify step
(`observe`). `ConfiguredK`, the default, follows each request's SpeculativeConfig:
`num_speculative_tokens`, `num_speculative_tokens_per_batch_size`, and the opt-in "heuristic" schedule
(k grows by 2 after a step that accepted every draft, shrinks by 1 otherwise, between 1 and k).
What it does not do: the hard caps (max_tokens, the context length, the step's token budget); the
scheduler applies them after the policy (`Scheduler.speculation_caps`), so no policy can break them.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from specserve.request import Request


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
        """A verify step of `request` proposed `num_draft_tokens` drafts and accepted `num_accepted`
        (before any stop cut the block)."""
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
            k = cfg.k_for_batch_size(len(requests))
            if r.num_speculative_tokens is not None:
                k = min(k, r.num_speculative_tokens)
            out.append(k)
        return out

    def observe(self, request: Request, num_draft_tokens: int, num_accepted: int) -> None:
        cfg = request.spec_config
        if cfg is None or cfg.num_speculative_tokens_schedule != "heuristic":
            return
        k_max = cfg.num_speculative_tokens
        k_now = request.num_speculative_tokens or k_max
        full = num_accepted == num_draft_tokens
        request.num_speculative_tokens = min(k_now + 2, k_max) if full else max(k_now - 1, 1)
