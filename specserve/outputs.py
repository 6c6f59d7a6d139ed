"""What the engine returns: per-step deltas (`RequestOutput`) and the vLLM-shaped offline result.

`LLMEngine.step()` returns one `RequestOutput` for each request that got new tokens (or finished) in
that step. The delta fields (`new_token_ids`, `new_text`, `new_logprobs`) are what a streaming server
sends; the cumulative fields are what a non-streaming response returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """Log-probability of one generated token under the target model.

    Values are the target's raw distribution (log_softmax of the model logits, before temperature,
    penalties and top-k/top-p), like vLLM's default `raw_logprobs`.

    Attributes:
        token_id: the chosen token.
        logprob: its natural-log probability.
        top: the `logprobs` most likely (token_id, logprob) pairs, most likely first.
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class SpecStats:
    """Speculation counters of one request (or summed over many).

    Only drafts the request really committed count as accepted: when EOS, a stop or max_tokens ends the
    request inside an accepted block, the drafts after that point are not counted (shared/cases B10).

    Attributes:
        num_drafts: verify steps that carried at least one draft token.
        num_draft_tokens: draft tokens proposed and verified.
        num_accepted_tokens: draft tokens accepted and committed.
        num_accepted_tokens_per_pos: accepted count at draft position i (0-based), length = max k seen.
        num_decode_tokens: tokens committed by verify steps that carried drafts (accepted + recovered/bonus).
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    num_decode_tokens: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        """accepted / drafted tokens, or None when nothing was drafted."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """1 + accepted / drafts (DESIGN.md section 5): tokens per target forward in drafted steps."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    def add(self, other: "SpecStats") -> None:
        """Accumulate `other` into self."""
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.num_decode_tokens += other.num_decode_tokens
        if len(other.num_accepted_tokens_per_pos) > len(self.num_accepted_tokens_per_pos):
            self.num_accepted_tokens_per_pos += [0] * (
                len(other.num_accepted_tokens_per_pos) - len(self.num_accepted_tokens_per_pos)
            )
        for i, c in enumerate(other.num_accepted_tokens_per_pos):
            self.num_accepted_tokens_per_pos[i] += c

    def to_dict(self) -> dict:
        """JSON-ready, with the derived rates."""
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
        }


@dataclass
class RequestOutput:
    """One engine step's news about one request.

    Attributes:
        request_id: the id given to `add_request`.
        prompt_token_ids: the prompt's token ids.
        new_token_ids: tokens committed in this step (after stop handling; nothing past a stop).
        new_text: text that became final in this step (a streaming delta; may be "" while a multi-byte
            character or a possible stop-string prefix is held back).
        new_logprobs: one entry per new token when logprobs were asked, else None.
        token_ids, text, logprobs: cumulative output so far.
        finished: True on the request's last output.
        finish_reason: "stop" (EOS, stop string, stop token id), "length" (max_tokens or context end),
            "abort", "error" (the engine failed on this request alone; `stop_reason` says why), or None
            while running.
        stop_reason: the stop string or stop token id that ended it, when one did.
        spec_stats: the request's speculation counters so far.
        metrics: timestamps (seconds, time.monotonic): arrival, first_scheduled, first_token, finished.
    """

    request_id: str
    prompt_token_ids: list[int]
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprob] | None
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None
    stop_reason: str | int | None
    spec_stats: SpecStats
    metrics: dict[str, float | None]


@dataclass
class CompletionOutput:
    """One completion of an offline `LLM.generate` call (vLLM's shape).

    `metrics` holds time.monotonic() timestamps in seconds: arrival, first_scheduled, first_token, finished.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    metrics: dict[str, float | None] = field(default_factory=dict)

    @property
    def mean_acceptance_length(self) -> float | None:
        """1 + accepted / drafts, or None without drafts."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None


@dataclass
class GenerationOutput:
    """All completions of one prompt (vLLM's `RequestOutput` of `LLM.generate`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
