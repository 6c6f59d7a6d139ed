"""Continuous-batching scheduler: one call per step returns the step's `StepPlan` (docs/step-plan.md).

What it does, in `schedule(propose)`: (1) every decoding request gets its newest token; (2) each gets
a k cap, decided in one place (`speculation_caps`: the `k_policy` hook says what it wants, then
max_tokens, the context length and the token budget cap it, FCFS); (3) the proposers draft within those
caps (the `propose` callback the engine passes; a policy that decides k from the drafts themselves,
such as the adaptive schedule, drafts through it and cuts the drafts, never above the caps); (4) prompts are prefilled in chunks with the budget the
decodes and their real drafts left, continuing partial prefills first, then admitting waiting requests
while KV slots are free; (5) the plan is fixed. Requests join and leave between steps.
With prefix caching on (docs/prefix_caching.md), a waiting request is admitted into the slot holding
the longest cached prefix of its prompt (`KVCache.allocate_for_prefix`) and prefills only the rest; a
finished request's slot keeps its committed tokens' K/V as a cached entry.
What it does not do: draft (the callback does), run the model, or commit tokens (the engine does).
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Sequence

from specserve.engine.k_policy import ConfiguredK, KPolicy
from specserve.engine.kv_cache import KVCache
from specserve.engine.step_plan import ScheduledRequest, StepPlan
from specserve.request import Request, RequestStatus
from specserve.spec_decode.proposer import Proposal

ProposeFn = Callable[[Sequence[tuple[Request, int]]], Sequence[Proposal]]
"""propose([(request, k), ...]) -> one Proposal per pair, in order, each with at most k drafts."""


class Scheduler:
    """FCFS continuous batching under a per-step token budget and a slot limit.

    Attributes:
        budget: tokens per step (`max_num_batched_tokens`).
        enable_prefix_caching: reuse cached prefixes at admission and cache finished requests' tokens.
        prefix_cache_min_tokens: the shortest cached prefix worth reusing (shorter matches are misses).
        prefix_cache_recompute_tokens: the last prompt tokens that are prefilled even when cached (>= 1;
            see `EngineConfig.prefix_cache_recompute_tokens`).
        prefix_cache_queries, prefix_cache_hits: prompt tokens of every admitted request, and how many
            of them were found in the prefix cache (counted with prefix caching off too: hits stay 0).
        k_policy: the `KPolicy` that says how many drafts each decoding request wants (default
            `ConfiguredK`); replace it to choose k per request per step.
    """

    def __init__(self, kv: KVCache, max_num_batched_tokens: int, max_model_len: int, k_policy: KPolicy | None = None,
                 enable_prefix_caching: bool = False, prefix_cache_min_tokens: int = 16,
                 prefix_cache_recompute_tokens: int = 16):
        if prefix_cache_min_tokens < 1 or prefix_cache_recompute_tokens < 1:
            raise ValueError("prefix_cache_min_tokens and prefix_cache_recompute_tokens must be >= 1, got "
                             f"{prefix_cache_min_tokens} and {prefix_cache_recompute_tokens}")
        self.kv = kv
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_cache_min_tokens = prefix_cache_min_tokens
        self.prefix_cache_recompute_tokens = prefix_cache_recompute_tokens
        self.prefix_cache_queries = 0  # prompt tokens of admitted requests (vLLM's prefix_cache_queries)
        self.prefix_cache_hits = 0  # of those, tokens whose K/V came from the prefix cache
        self.budget = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.k_policy: KPolicy = k_policy or ConfiguredK()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        """Queue a new request (FCFS)."""
        self.waiting.append(req)

    def admit(self, req: Request) -> None:
        """Move a waiting request to the running batch with a KV slot (its prefill starts next). With
        prefix caching the slot may already hold a prefix of the prompt: `num_computed_tokens` is then
        that prefix's length (at most the prompt's length - prefix_cache_recompute_tokens, so the
        prefill still yields logits).

        Raises:
            ValueError: `req` is not waiting.
            KVCacheFullError: no free slot.
        """
        if req not in self.waiting:
            raise ValueError(f"request {req.request_id!r} is not waiting")
        hit = 0
        if self.enable_prefix_caching:
            req.slot, hit = self.kv.allocate_for_prefix(req.prompt_token_ids, self.prefix_cache_min_tokens,
                                                        self.prefix_cache_recompute_tokens)
        else:
            req.slot = self.kv.allocate()
        req.num_computed_tokens = hit
        self.prefix_cache_queries += req.num_prompt_tokens
        self.prefix_cache_hits += hit
        self.waiting.remove(req)
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def remove(self, req: Request, cache: bool = True) -> None:
        """Take a request out (finished or aborted) and free its KV slot. With prefix caching on and
        `cache`, the slot stays as a cached entry of the request's committed tokens: positions below
        `num_computed_tokens` (and the slot's valid length), never a rejected draft's."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if req.slot is not None:
            tokens = None
            if self.enable_prefix_caching and cache:
                tokens = req.all_token_ids[: min(req.num_computed_tokens, self.kv.lengths[req.slot])]
            self.kv.free(req.slot, tokens)
            req.slot = None

    def has_work(self) -> bool:
        """True while any request waits or runs."""
        return bool(self.waiting or self.running)

    # ---- one step ---------------------------------------------------------------------------------

    def schedule(self, propose: ProposeFn | None = None) -> StepPlan:
        """Plan the next step (see the module docstring); an empty plan when nothing can run.

        Args:
            propose: drafts for the (request, k cap) pairs with k > 0; None = no speculation this step.

        Raises:
            RuntimeError: `propose` returned the wrong number of proposals.
        """
        decoding = [r for r in self.running if not r.in_prefill][: self.budget]
        caps = self.speculation_caps(decoding)
        asks = [(r, k) for r, k in zip(decoding, caps) if k > 0]
        proposals = self._draft(asks, propose, len(decoding)) if asks and propose is not None else []
        if asks and propose is not None and len(proposals) != len(asks):
            raise RuntimeError(f"propose returned {len(proposals)} proposals for {len(asks)} requests")
        by_req = {id(r): (k, p) for (r, k), p in zip(asks, proposals)}
        scheduled = []
        for r in decoding:
            drafts, q = [], None
            if id(r) in by_req:
                k, p = by_req[id(r)]
                drafts = list(p.token_ids[:k])
                q = p.draft_probs[: len(drafts)] if p.draft_probs is not None else None
            scheduled.append(ScheduledRequest.decode(r, drafts, q))
        scheduled += self.schedule_prefills(self.budget - sum(s.num_new_tokens for s in scheduled))
        return StepPlan.build(scheduled)

    def speculation_caps(self, decoding: Sequence[Request]) -> list[int]:
        """The k cap of each decoding request this step, computed here and only here.

        What `k_policy` wants, capped (docs/speculation-cases.md B07, B08) so that the step commits at
        most k + 1 tokens within max_tokens and the context length, and by the token budget left after
        one token per decoding request, in FCFS order. A request without a speculative config gets 0.
        """
        budget = self.budget - len(decoding)
        wanted = self.k_policy.choose(decoding, budget)
        caps = []
        for r, k in zip(decoding, wanted):
            if r.spec_config is None:
                k = 0
            if r.params.max_tokens is not None:
                k = min(k, r.params.max_tokens - r.num_output_tokens - 1)
            k = max(min(k, self.max_model_len - len(r.all_token_ids) - 1, budget), 0)
            budget -= k
            caps.append(k)
        return caps

    def _draft(self, asks: Sequence[tuple[Request, int]], propose: ProposeFn, num_decoding: int) -> list[Proposal]:
        """Drafts for the capped asks: `propose(asks)`, or, when the policy decides k from the drafts
        themselves (a `DraftingKPolicy`, e.g. the adaptive schedule), the policy's `draft`, told what
        else the step holds (the decodes without drafts and the prompt chunks that would follow)."""
        draft = getattr(self.k_policy, "draft", None)
        if draft is None:
            return list(propose(asks))
        tokens, seqs = self.estimate_prefill(self.budget - num_decoding)
        rest = num_decoding - len(asks)
        return list(draft(asks, propose, num_other_tokens=rest + tokens, num_other_seqs=rest + seqs))

    def estimate_prefill(self, budget: int) -> tuple[int, int]:
        """(tokens, sequences) that `schedule_prefills(budget)` would schedule now, without changing
        anything (the adaptive schedule counts them in the step's cost before the drafts are final)."""
        tokens = seqs = 0
        free = self.kv.num_free_slots
        for req in [r for r in self.running if r.in_prefill] + list(self.waiting):
            if budget <= 0:
                break
            done = req.num_computed_tokens
            if req.status is RequestStatus.WAITING:
                if free <= 0:
                    break
                free -= 1
                if self.enable_prefix_caching:
                    hit = self.kv.longest_prefix(req.prompt_token_ids, self.prefix_cache_recompute_tokens)[1]
                    done = hit if hit >= self.prefix_cache_min_tokens else 0
            n = min(req.num_prompt_tokens - done, budget)
            tokens, seqs, budget = tokens + n, seqs + 1, budget - n
        return tokens, seqs

    def schedule_prefills(self, budget: int) -> list[ScheduledRequest]:
        """Prompt chunks within `budget` tokens, continuing partial prefills first, then admitting
        waiting requests while KV slots are free."""
        out: list[ScheduledRequest] = []
        for req in [r for r in self.running if r.in_prefill]:
            if budget < 1:
                return out
            out.append(ScheduledRequest.prefill(req, min(req.num_prompt_tokens - req.num_computed_tokens, budget)))
            budget -= out[-1].num_new_tokens
        while self.waiting and budget > 0 and self.kv.num_free_slots > 0:
            req = self.waiting[0]
            self.admit(req)
            out.append(ScheduledRequest.prefill(req, min(req.num_prompt_tokens - req.num_computed_tokens, budget)))
            budget -= out[-1].num_new_tokens
        return out
