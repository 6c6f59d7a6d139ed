"""The step plan: what one engine step does, decided once (docs/step-plan.md).

What it does: `StepPlan` lists, per scheduled request, the tokens it feeds this step (a prompt chunk,
or its newest token followed by its drafts), where they go (first position = the KV slot's valid
length, the slot), how many logits rows it gets (0 for a prompt chunk that is not the last, 1 for a
last chunk or a plain decode, 1 + n for a verify block of n drafts) and where its tokens and rows sit
in the flat step, plus the drafts themselves (ids, and q for a sampling draft model). The model runner
reads `plan.model_input(device)` (flat tensors built once), the verifier reads the rows
(`specserve.sample.batch.SamplingBatch.build`), the engine's commit reads the requests and drafts:
nothing else derives the layout.
What it does not do: choose who runs or how many drafts (the scheduler does), draft, run the model,
or verify.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specserve.engine.model_runner import ModelInput
from specserve.request import Request


@dataclass
class ScheduledRequest:
    """One request's share of a step.

    Attributes:
        request: the request.
        is_prefill: feeding prompt tokens (a chunk) rather than decoding.
        start: position of the first new token; equals the KV slot's valid length before the step
            and `request.num_computed_tokens`.
        token_ids: the new tokens: a prompt chunk, or [newest token] + draft_token_ids.
        num_rows: logits rows: 0 (a prompt chunk that is not the last), 1 (last chunk, plain decode),
            or 1 + num_drafts (verify). Row j is the target's distribution for the token after
            the committed tokens and drafts[:j]; rows are the last num_rows new tokens.
        draft_token_ids: the n drafts verified this step (decode only).
        draft_probs: float32 [n, V] distributions the drafts were sampled from (a sampling draft
            model), or None when the drafts are deterministic (one-hot q).
        token_offset: index of the first new token in the step's flat tokens (set by StepPlan).
        row_offset: index of the first logits row in the step's logits (set by StepPlan).
    """

    request: Request
    is_prefill: bool
    start: int
    token_ids: list[int]
    num_rows: int
    draft_token_ids: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None
    token_offset: int = 0
    row_offset: int = 0

    @property
    def num_new_tokens(self) -> int:
        """Tokens fed to the model (what the step's token budget is charged)."""
        return len(self.token_ids)

    @property
    def num_drafts(self) -> int:
        return len(self.draft_token_ids)

    @classmethod
    def decode(cls, req: Request, drafts: list[int], draft_probs: torch.Tensor | None) -> "ScheduledRequest":
        """A decode (no drafts) or verify step: the newest token, then the drafts."""
        return cls(req, False, req.num_computed_tokens, [req.all_token_ids[-1]] + drafts, 1 + len(drafts),
                   drafts, draft_probs if drafts else None)

    @classmethod
    def prefill(cls, req: Request, num_tokens: int) -> "ScheduledRequest":
        """A prompt chunk of `num_tokens`; it samples (1 row) when it ends the prompt."""
        start = req.num_computed_tokens
        last = start + num_tokens == req.num_prompt_tokens
        return cls(req, True, start, req.all_token_ids[start : start + num_tokens], int(last))


@dataclass
class StepPlan:
    """Every scheduled request of one step, decodes first (FCFS) then prompt chunks.

    Attributes:
        scheduled: the requests, in the order of their tokens and rows in the flat step.
        sampled: the subset with num_rows > 0 (in the same order): the verifier's batch.
        num_tokens: T, new tokens in the step.
        num_rows: R, logits rows in the step.
    """

    scheduled: list[ScheduledRequest]
    sampled: list[ScheduledRequest]
    num_tokens: int
    num_rows: int
    _model_input: ModelInput | None = field(default=None, repr=False)

    @classmethod
    def build(cls, scheduled: list[ScheduledRequest]) -> "StepPlan":
        """Fix the offsets of every request's tokens and rows."""
        t = r = 0
        for s in scheduled:
            s.token_offset, s.row_offset = t, r
            t += s.num_new_tokens
            r += s.num_rows
        return cls(scheduled, [s for s in scheduled if s.num_rows], t, r)

    def __bool__(self) -> bool:
        return bool(self.scheduled)

    @property
    def num_draft_tokens(self) -> int:
        return sum(s.num_drafts for s in self.scheduled)

    @property
    def max_query_len(self) -> int:
        """Most new tokens of one request (1 + the largest k for a step without prefill): with the
        number of requests, the (batch, tokens per request) shape a static-shape runner buckets on."""
        return max((s.num_new_tokens for s in self.scheduled), default=0)

    @property
    def has_prefill(self) -> bool:
        return any(s.is_prefill for s in self.scheduled)

    def model_input(self, device: torch.device) -> ModelInput:
        """The runner's flat tensors, built once per plan (one host-to-device copy)."""
        if self._model_input is None:
            s = self.scheduled
            self._model_input = ModelInput.build([x.request.slot for x in s], [x.start for x in s],
                                                 [x.token_ids for x in s], [x.num_rows for x in s], device)
        return self._model_input
