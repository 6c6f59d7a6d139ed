"""Per-request state inside the engine.

What it does: holds one request's tokens, progress (`num_computed_tokens`: positions whose K/V are in
the cache), its sampling seed, detokenization/stop state, and its speculation counters. What it does
not do: decide anything, or hold a step's drafts (those live in the step's `StepPlan`); the scheduler
and the engine's commit change it.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from specserve.config import SpeculativeConfig
from specserve.outputs import SpecStats, TokenLogprob
from specserve.sample.uniforms import seed_key
from specserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # identity semantics: the scheduler's `in` / `remove` must not compare fields
class Request:
    """One sequence being generated.

    Attributes:
        request_id: unique id.
        prompt_token_ids: the prompt.
        params: its SamplingParams.
        spec_config: its speculation setting (None = no speculation).
        output_token_ids: committed output tokens (nothing past a stop).
        num_computed_tokens: positions [0, n) of prompt + output whose K/V are cached. While decoding,
            this is len(all_token_ids) - 1: the newest token is fed in the next step.
        slot: KV cache slot, or None while waiting.
        seed: this request's sampling seed (its own, or one the engine drew for it); every uniform it
            uses is u(seed, output position, purpose) (`specserve.sample.uniforms`), so it is
            reproducible alone or in any batch. `rng_key` is the derived stream key.
        text: detokenized output, cut at a stop string; emitted_text_len: how much was streamed.
        prefix_offset, read_offset: incremental detokenization offsets into all_token_ids.
        grammar: its structured-output state (`specserve.grammar.matcher.GrammarState`), advanced by
            committed tokens only; None without structured output.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    spec_config: SpeculativeConfig | None
    seed: int
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    slot: int | None = None
    logprobs: list[TokenLogprob] | None = None
    text: str = ""
    emitted_text_len: int = 0
    emitted_token_len: int = 0
    prefix_offset: int = 0
    read_offset: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    spec_stats: SpecStats = field(default_factory=SpecStats)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    grammar: Any = None  # GrammarState | None (kept untyped: request.py does not import xgrammar)

    def __post_init__(self) -> None:
        self.rng_key = seed_key(self.seed)
        self.all_token_ids = list(self.prompt_token_ids)
        self.prefix_offset = max(len(self.prompt_token_ids) - 5, 0)
        self.read_offset = len(self.prompt_token_ids)
        if self.params.logprobs is not None:
            self.logprobs = []

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids) :]

    @property
    def in_prefill(self) -> bool:
        """True until the whole prompt is in the KV cache."""
        return self.num_computed_tokens < len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
