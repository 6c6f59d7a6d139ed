"""Continuous-batching scheduler: which requests run in the next step, and how many tokens each feeds.

What it does, in two phases per step: (1) every decoding request gets its newest token, then an
allowance of up to k drafts from the remaining token budget (k capped so that the step can pass
neither max_tokens nor the context length); (2) after the proposers have drafted, prompts are
prefilled in chunks with what the decodes really used, continuing partial prefills first and then
admitting waiting requests while KV slots are free. Requests join and leave between steps.
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
        num_speculative_tokens: most drafts the proposer may add (decode only; 0 = plain decode).
        samples: this step produces a token for the request (decode, or a prompt's last chunk).
    """

    request: Request
    is_prefill: bool
    num_prefill_tokens: int = 0
    num_speculative_tokens: int = 0
    samples: bool = True

    @property
    def num_new_tokens(self) -> int:
        """Tokens fed to the model for this request this step (drafts count once proposed)."""
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
        """Queue a new request (FCFS)."""
        self.waiting.append(req)

    def admit(self, req: Request) -> None:
        """Move a waiting request to the running batch with a fresh KV slot (its prefill starts next).

        Raises:
            ValueError: `req` is not waiting.
            KVCacheFullError: no free slot.
        """
        if req not in self.waiting:
            raise ValueError(f"request {req.request_id!r} is not waiting")
        req.slot = self.kv.allocate()
        self.waiting.remove(req)
        req.status = RequestStatus.RUNNING
        self.running.append(req)

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
        """True while any request waits or runs."""
        return bool(self.waiting or self.running)

    def num_speculative_tokens_for(self, req: Request, batch_size: int) -> int:
        """The k cap for one decoding request (docs/speculation-cases.md B07, B08): the step commits at most
        k + 1 tokens, so k + 1 <= tokens left under max_tokens and under the context length."""
        if req.spec_config is None:
            return 0
        k = req.spec_config.k_for_batch_size(batch_size)
        if req.params.max_tokens is not None:
            k = min(k, req.params.max_tokens - req.num_output_tokens - 1)
        k = min(k, self.max_model_len - len(req.all_token_ids) - 1)
        return max(k, 0)

    def schedule_decodes(self) -> list[ScheduledRequest]:
        """Phase 1 of a step: every decoding request gets its 1 token, then draft allowances (k caps)
        from what is left of the budget, in FCFS order. The engine charges the drafts really proposed
        when it calls `schedule_prefills`."""
        decoding = [r for r in self.running if not r.in_prefill]
        out = [ScheduledRequest(r, is_prefill=False) for r in decoding[: self.budget]]
        budget = self.budget - len(out)
        for s in out:
            # batch size as vLLM's table means it: the requests in the step (here: every running one)
            s.num_speculative_tokens = min(self.num_speculative_tokens_for(s.request, len(self.running)), budget)
            budget -= s.num_speculative_tokens
        return out

    def estimate_prefill(self, budget: int) -> tuple[int, int]:
        """(tokens, sequences) that `schedule_prefills(budget)` would schedule now, without changing
        anything (the adaptive schedule counts them in the step's cost before the drafts are final)."""
        tokens = seqs = 0
        free = self.kv.num_free_slots
        for req in [r for r in self.running if r.in_prefill] + list(self.waiting):
            if budget <= 0:
                break
            if req.status is RequestStatus.WAITING:
                if free <= 0:
                    break
                free -= 1
            n = min(len(req.prompt_token_ids) - req.num_computed_tokens, budget)
            tokens, seqs, budget = tokens + n, seqs + 1, budget - n
        return tokens, seqs

    def schedule_prefills(self, budget: int) -> list[ScheduledRequest]:
        """Phase 2: prompt chunks within `budget` tokens (what the decodes really left after drafting),
        continuing partial prefills first, then admitting waiting requests while KV slots are free."""
        out: list[ScheduledRequest] = []
        for req in [r for r in self.running if r.in_prefill]:
            if budget < 1:
                return out
            budget -= self._prefill(req, budget, out)
        while self.waiting and budget > 0 and self.kv.num_free_slots > 0:
            req = self.waiting[0]
            self.admit(req)
            budget -= self._prefill(req, budget, out)
        return out

    def _prefill(self, req: Request, budget: int, out: list[ScheduledRequest]) -> int:
        n = min(req.num_prompt_tokens - req.num_computed_tokens, budget)
        last = req.num_computed_tokens + n == req.num_prompt_tokens
        out.append(ScheduledRequest(req, is_prefill=True, num_prefill_tokens=n, samples=last))
        return n
