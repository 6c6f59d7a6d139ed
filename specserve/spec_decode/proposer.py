"""The proposer interface: what every draft source (n-gram, suffix tree, draft model) implements.

A proposer guesses up to k next tokens for each request of a decode step. The engine verifies them
with one target forward and commits what the rejection sampler accepts. A proposer never changes a
request; it only reads the committed token ids. Per-request state it keeps (a suffix tree, a draft
KV cache) is keyed by request id and dropped in `finish_request`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence, runtime_checkable

import torch

from specserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class ProposerContext:
    """What a proposer may know about the engine it drafts for (built once by the engine).

    A proposer gets this small frozen view, never the engine itself, so that it cannot reach into
    the scheduler, the target model or other requests.

    Attributes:
        device: the target's device; a draft model is loaded there.
        dtype: the target's resolved dtype name ("float32", "bfloat16", "float16"); a draft model uses it.
        max_model_len: the target's context length in tokens (prompt + output).
        num_slots: most requests running at once (`EngineConfig.max_num_seqs`); a draft model sizes its
            KV cache by it.
        vocab_size: the target's vocabulary size (rows of its logits); drafts must be ids below it.
        tokenizer: the target's tokenizer (a draft model must share its vocabulary).
        num_target_params: parameter count of the target (a draft model warns when it is not smaller).
        enable_prefix_caching, prefix_cache_min_tokens: the engine's prefix caching settings
            (`EngineConfig`); a draft model applies them to its own KV cache.
    """

    device: torch.device
    dtype: str
    max_model_len: int
    num_slots: int
    vocab_size: int
    tokenizer: Any
    num_target_params: int
    enable_prefix_caching: bool = False
    prefix_cache_min_tokens: int = 16


@dataclass
class ProposalInput:
    """One request's view for drafting.

    Attributes:
        request_id: unique id of the request.
        token_ids: prompt + committed output token ids (the last one is not yet in the target KV cache).
            The proposer must not mutate it.
        num_prompt_tokens: how many of `token_ids` are prompt.
        num_speculative_tokens: k, the most drafts to return (>= 1), already capped so that the step cannot pass max_tokens or
            the context length (0 only in `prepare`, which drafts nothing).
        sampling_params: the request's sampling parameters (a draft model samples with them).
        seed: the request's sampling seed; a sampling draft model draws its draft at output position m
            with `uniform(seed_key(seed), m, Purpose.DRAFT)` (`specserve.sample.uniforms`), so that
            seeded requests stay reproducible. Deterministic proposers ignore it.
    """

    request_id: str
    token_ids: Sequence[int]
    num_prompt_tokens: int
    num_speculative_tokens: int
    sampling_params: SamplingParams
    seed: int = 0


@dataclass
class Proposal:
    """Drafts for one request.

    Attributes:
        token_ids: 0..k proposed token ids, in order.
        draft_probs: float32 tensor [len(token_ids), vocab_size] with the distribution q each draft was
            sampled from (rows sum to 1), or None when the drafts are deterministic (one-hot q: n-gram,
            suffix, a greedy draft model). The rejection sampler needs the exact q the draft was drawn from.
        match_len: how many context tokens the draft's source matched (ngram: n of the n-gram; suffix:
            the suffix match length), or None when the proposer has no such signal.
        confidence: per draft token, the proposer's own estimate in [0, 1] that it follows given the
            drafts before it did (suffix: the branch frequency in its tree), or None. Not calibrated:
            the adaptive schedule learns what each level means (`specserve.spec_decode.acceptance`).
    """

    token_ids: list[int]
    draft_probs: torch.Tensor | None = None
    match_len: int | None = None
    confidence: list[float] | None = None


@runtime_checkable
class Proposer(Protocol):
    """A draft source. Implementations: NgramProposer, SuffixProposer, DraftModelProposer."""

    method: str

    def propose(self, inputs: list[ProposalInput]) -> list[Proposal]:
        """Drafts for each input, in the same order; a Proposal may hold fewer than k (or zero) tokens."""
        ...

    def finish_request(self, request_id: str, token_ids: Sequence[int]) -> None:
        """The request finished or was aborted: drop its state (a suffix proposer may keep its output
        in a global cache of recent requests). Must not fail for an id it never saw."""
        ...


# Optional: a proposer whose drafting time grows with k (a draft model runs one forward per drafted
# position) has a method `draft_step_cost() -> StepCostModel` giving the time of one of its forwards;
# the adaptive schedule then chooses k before it drafts and counts that time. A proposer without it
# (ngram, suffix) drafts the most tokens allowed, and the schedule cuts the drafts to the chosen k.
#
# Optional: a proposer with host work that does not depend on the next step's tokens (a suffix
# proposer ingesting a new prompt into its tree, or a finished request's output into its global
# tree) has a method `prepare(inputs: list[ProposalInput]) -> None`: bring its state up to date with
# each input's token_ids (num_speculative_tokens is 0) and do any deferred work, drafting nothing. On
# CUDA the engine calls it while the device runs the step's forward (docs/step-plan.md), so that this
# work overlaps the GPU instead of delaying the next step; the results of `propose` must not depend on
# whether or when it was called.
