"""What the engine returns: per-step deltas (`RequestOutput`) and the vLLM-shaped offline result.

`LLMEngine.step()` returns one `RequestOutput` for each request that got new tokens (or finished) in
that step: only what is new (`new_token_ids`, `new_text`, `new_logprobs`) plus a frozen snapshot of the
request's speculation counters (`SpecStats`). A streaming server sends the deltas as they are; a
consumer that wants the whole result (offline `LLM`, a non-streaming response) sums them with
`OutputAccumulator`. What it does not do: decide what is new (the engine does, see
`specserve.engine.stop`) or format responses (see `specserve.server.formatting`).
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


@dataclass(frozen=True)
class SpecStats:
    """Speculation counters of one request (or summed over many): an immutable snapshot.

    Only drafts the request really committed count as accepted: when EOS, a stop or max_tokens ends the
    request inside an accepted block, the drafts after that point are not counted
    (docs/speculation-cases.md B10). Sum snapshots with `+`; nothing changes one after it is made, so the
    engine hands the same object to other threads without copying it.

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
    num_accepted_tokens_per_pos: tuple[int, ...] = ()
    num_decode_tokens: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_accepted_tokens_per_pos", tuple(self.num_accepted_tokens_per_pos))

    @property
    def acceptance_rate(self) -> float | None:
        """accepted / drafted tokens, or None when nothing was drafted."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """1 + accepted / drafts (docs/design.md section 5): tokens per target forward in drafted steps."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    def __add__(self, other: "SpecStats") -> "SpecStats":
        """The counters of both; per-position counts add position by position."""
        a, b = self.num_accepted_tokens_per_pos, other.num_accepted_tokens_per_pos
        if len(a) < len(b):
            a, b = b, a
        per_pos = tuple(x + (b[i] if i < len(b) else 0) for i, x in enumerate(a))
        return SpecStats(self.num_drafts + other.num_drafts, self.num_draft_tokens + other.num_draft_tokens,
                         self.num_accepted_tokens + other.num_accepted_tokens, per_pos,
                         self.num_decode_tokens + other.num_decode_tokens)

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


@dataclass(frozen=True)
class RequestOutput:
    """One engine step's news about one request: what is new, never what was sent before.

    Its size does not grow with the tokens generated so far (a step adds at most k + 1 tokens), so a
    request of n tokens costs O(n) in outputs; consumers that want the whole result sum the outputs
    with `OutputAccumulator`.

    Attributes:
        request_id: the id given to `add_request`.
        prompt_token_ids: the prompt's token ids (the request's own list, the same in every output).
        new_token_ids: tokens committed in this step (after stop handling; nothing past a stop).
        new_text: text that became final in this step (may be "" while a multi-byte character or a
            possible stop-string prefix is held back; the request's last output flushes what was held).
        new_logprobs: one entry per new token when logprobs were asked, else None.
        finished: True on the request's last output.
        finish_reason: "stop" (EOS, stop string, stop token id), "length" (max_tokens or context end),
            "abort", "error" (the engine failed on this request alone; `stop_reason` says why), or None
            while running.
        stop_reason: the stop string or stop token id that ended it, when one did.
        spec_stats: the request's speculation counters so far (a frozen snapshot).
        metrics: timestamps (seconds, time.monotonic): arrival, first_scheduled, first_token, finished.
    """

    request_id: str
    prompt_token_ids: list[int]
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None
    stop_reason: str | int | None
    spec_stats: SpecStats
    metrics: dict[str, float | None]


class OutputAccumulator:
    """One request's outputs summed: its token ids, text and logprobs so far, and the latest finish
    reason, counters and timestamps. O(new tokens) per `add`.

    Attributes:
        prompt_token_ids, token_ids, logprobs (None unless asked), finished, finish_reason, stop_reason,
        spec_stats, metrics: as in RequestOutput, cumulative; `text` joins the text deltas.

    Raises:
        ValueError: from `add`, for an output after the request's finished one.
    """

    def __init__(self) -> None:
        self.prompt_token_ids: list[int] = []
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] | None = None
        self._text: list[str] = []
        self.finished = False
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.spec_stats = SpecStats()
        self.metrics: dict[str, float | None] = {}

    def add(self, out: RequestOutput) -> None:
        """Take one step's output of this request."""
        if self.finished:
            raise ValueError(f"request {out.request_id}: output after its finished one")
        self.prompt_token_ids = out.prompt_token_ids
        self.token_ids += out.new_token_ids
        if out.new_logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs += out.new_logprobs
        if out.new_text:
            self._text.append(out.new_text)
        self.finished, self.finish_reason, self.stop_reason = out.finished, out.finish_reason, out.stop_reason
        self.spec_stats, self.metrics = out.spec_stats, out.metrics

    @property
    def text(self) -> str:
        """The text so far (the deltas joined)."""
        if len(self._text) > 1:
            self._text = ["".join(self._text)]
        return self._text[0] if self._text else ""

    def completion(self, index: int) -> "CompletionOutput":
        """The result as completion `index` of an offline `LLM.generate` call."""
        s = self.spec_stats
        return CompletionOutput(
            index=index, text=self.text, token_ids=list(self.token_ids), finish_reason=self.finish_reason,
            stop_reason=self.stop_reason, logprobs=self.logprobs, num_drafts=s.num_drafts,
            num_draft_tokens=s.num_draft_tokens, num_accepted_tokens=s.num_accepted_tokens,
            num_accepted_tokens_per_pos=list(s.num_accepted_tokens_per_pos), metrics=dict(self.metrics),
        )


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
