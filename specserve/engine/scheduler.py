"""Continuous-batching scheduler: which requests run in the next step, and how many tokens each feeds.

What it does: each step, decoding requests go first, each reserving 1 + k tokens (its newest token
plus up to k drafts, k capped so that the step can pass neither max_tokens nor the context length);
then prompts are prefilled in chunks with what is left of the token budget, admitting waiting
requests while KV slots are free. Requests join and leave between steps.
What it does not do: propose drafts, run the model, or commit tokens (the engine does).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from specserve.engine.kv_cache import KVCache
from specserve.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    """One request's share of a step.

    Attributes:
        request: the request.
        is_prefill: feeding prompt tokens (a chunk) rather than decoding.
        num_prefill_tokens: prompt tokens fed this step (prefill only).
        max_drafts: most drafts the proposer may add (decode only; 0 = plain decode).
        samples: this step produces a token for the request (decode, or a prompt's last chunk).
    """

    request: Request
    is_prefill: bool
    num_prefill_tokens: int = 0
    max_drafts: int = 0
    samples: bool = True

    @property
    def num_new_tokens(self) -> int:
        """Tokens fed to the model for this request this step."""
        if self.is_prefill:
            return self.num_prefill_tokens
        return 1 + len(self.request.drafts)


class Scheduler:
    """FCFS continuous batching under a per-step token budget and a slot limit."""

    def __init__(self, kv: KVCache, max_num_batched_tokens: int, max_model_len: int):
        self.kv = kv
        self.budget = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        """Take a request out (finished or aborted) and free its KV slot."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if req.slot is not None:
            self.kv.free(req.slot)
            req.slot = None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def max_drafts_for(self, req: Request, num_decoding: int) -> int:
        """The k cap for one decoding request (shared/cases B07, B08): the step commits at most
        k + 1 tokens, so k + 1 <= tokens left under max_tokens and under the context length."""
        if req.spec is None:
            return 0
        k = req.spec.k_for_batch_size(num_decoding)
        if req.params.max_tokens is not None:
            k = min(k, req.params.max_tokens - req.num_output_tokens - 1)
        k = min(k, self.max_model_len - len(req.all_token_ids) - 1)
        return max(k, 0)

    def schedule(self) -> list[ScheduledRequest]:
        """Pick this step's work. Returns [] when there is nothing to run."""
        out: list[ScheduledRequest] = []
        budget = self.budget
        decoding = [r for r in self.running if not r.in_prefill]
        for req in decoding:
            if budget < 1:
                break
            k = min(self.max_drafts_for(req, len(decoding)), budget - 1)
            out.append(ScheduledRequest(req, is_prefill=False, max_drafts=k))
            budget -= 1 + k
        for req in [r for r in self.running if r.in_prefill]:
            if budget < 1:
                break
            budget -= self._prefill(req, budget, out)
        while self.waiting and budget > 0 and self.kv.num_free_slots > 0:
            req = self.waiting.popleft()
            req.slot = self.kv.allocate()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            budget -= self._prefill(req, budget, out)
        return out

    def _prefill(self, req: Request, budget: int, out: list[ScheduledRequest]) -> int:
        n = min(req.num_prompt_tokens - req.num_computed_tokens, budget)
        last = req.num_computed_tokens + n == req.num_prompt_tokens
        out.append(ScheduledRequest(req, is_prefill=True, num_prefill_tokens=n, samples=last))
        return n
