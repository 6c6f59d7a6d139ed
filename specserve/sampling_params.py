"""Per-request sampling parameters, shaped like vLLM's `SamplingParams`.

What it does: holds and validates the knobs that decide how one request's next tokens are chosen and
when it stops. What it does not do: sampling itself (see `specserve.sample.sampler`) or stop handling
(see `specserve.engine.stop`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field


_GREEDY_EPS = 1e-5
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 512


class SamplingParamsError(ValueError):
    """Raised for an invalid sampling parameter; the message names the parameter and the valid range."""


@dataclass
class SamplingParams:
    """How to sample one request and when to stop it.

    Attributes:
        n: number of independent completions for the prompt (>= 1).
        temperature: 0 means greedy (argmax); > 0 divides the logits before softmax (below 1e-5 it is
            treated as 0, as in vLLM).
        top_p: nucleus mass in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; 0 or -1 disables it.
        min_p: drop tokens whose probability is below min_p * max probability; 0 disables it.
        seed: per-request seed. The same seed gives the same tokens whether the request runs alone or in
            any batch (each request owns its random stream). With speculation on, a seed is reproducible
            for a given speculation profile, but need not give the same tokens as without speculation.
        presence_penalty, frequency_penalty: OpenAI semantics, in [-2, 2], over generated tokens.
        repetition_penalty: CTRL-style, in [0.01, 100] (1 disables), over prompt and generated tokens.
        logit_bias: token id -> bias added to the logit (OpenAI semantics, [-100, 100]).
        stop: up to 16 strings (each up to 512 characters) that end generation; the matched string is
            not returned.
        stop_token_ids: token ids that end generation (the id is not returned in text; it is counted).
        ignore_eos: keep generating past the model's EOS token.
        max_tokens: maximum number of generated tokens (>= 1). None means up to the context length.
        min_tokens: EOS and stop token ids are masked until this many tokens were generated.
        logprobs: None for no logprobs; an int n >= 0 returns the chosen token's logprob plus the top n.
        skip_special_tokens: leave special tokens out of the returned text.

    Raises:
        SamplingParamsError: from `__post_init__` for any out-of-range value.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or [])]
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()

    def _validate(self) -> None:
        def bad(msg: str) -> None:
            raise SamplingParamsError(msg)

        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                bad(f"{name} must be a finite number, got {v!r}")
        if 0 < self.temperature < _GREEDY_EPS:
            # vLLM's rule: a temperature this small is greedy (dividing logits by it overflows)
            self.temperature = 0.0

        if not isinstance(self.n, int) or self.n < 1:
            bad(f"n must be an integer >= 1, got {self.n!r}")
        if self.temperature is None or self.temperature < 0:
            bad(f"temperature must be >= 0, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k is None or self.top_k < -1:
            bad(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not (0.0 <= self.min_p <= 1.0):
            bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not (-2.0 <= self.presence_penalty <= 2.0):
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}")
        if not (-2.0 <= self.frequency_penalty <= 2.0):
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}")
        if not 0.01 <= self.repetition_penalty <= 100.0:
            bad(f"repetition_penalty must be in [0.01, 100], got {self.repetition_penalty!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            bad(f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            bad(f"seed must be an integer, got {self.seed!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            bad(f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_CHARS:
                bad(f"stop strings must be non-empty strings of at most {MAX_STOP_STRING_CHARS} characters, got {s[:40]!r}")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or t < 0:
                bad(f"stop_token_ids must be non-negative integers, got {t!r}")
        if self.logit_bias:
            clean: dict[int, float] = {}
            for tok, bias in self.logit_bias.items():
                try:
                    tok_i = int(tok)
                except (TypeError, ValueError):
                    bad(f"logit_bias keys must be token ids, got {tok!r}")
                if not -100.0 <= float(bias) <= 100.0:
                    bad(f"logit_bias values must be in [-100, 100], got {bias!r}")
                clean[tok_i] = float(bias)
            self.logit_bias = clean

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax token (temperature 0)."""
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """True when any presence/frequency/repetition penalty changes the logits."""
        return (
            self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
        )

    def clone(self, **changes) -> "SamplingParams":
        """A validated copy with `changes` applied."""
        return dataclasses.replace(self, **changes)
