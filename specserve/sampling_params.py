"""Per-request sampling parameters, shaped like vLLM's `SamplingParams`.

What it does: holds and validates the knobs that decide how one request's next tokens are chosen and
when it stops. What it does not do: sampling itself (see `specserve.sample.sampler`) or stop handling
(see `specserve.engine.stop`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from specserve.inputs import InvalidRequestError


_GREEDY_EPS = 1e-5
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 512
_NO_VALUE: Any = object()


class SamplingParamsError(InvalidRequestError):
    """An invalid sampling parameter. `param` names it; the message says what is valid.

    Args:
        param: the parameter ("top_p").
        requirement: what it must be ("must be a number in (0, 1]").
        value: the value given (left out of the message when not passed).
    """

    def __init__(self, param: str, requirement: str, value: Any = _NO_VALUE):
        got = "" if value is _NO_VALUE else f", got {_short_repr(value)}"
        super().__init__(f"{param} {requirement}{got}", param=param)
        self.requirement = requirement
        self.value = value

    def renamed(self, param: str) -> "SamplingParamsError":
        """The same error under the name of the request field that set this parameter (the server's
        `max_completion_tokens` sets `max_tokens`)."""
        return SamplingParamsError(param, self.requirement, self.value)


def _short_repr(value: Any, limit: int = 60) -> str:
    """repr(value) cut to `limit` characters (a client's value quoted back in an error message)."""
    try:
        r = repr(value)
    except ValueError:  # an int too long for str()
        r = f"<{type(value).__name__}>"
    return r if len(r) <= limit else r[: limit - 3] + "..."


@dataclass(frozen=True)
class _Range:
    """One row of the range table: `name` must be an integer (`integer`) or a finite number within
    `low`..`high` (None: unbounded; `low_open`: low itself is excluded); `optional`: None is allowed."""

    name: str
    integer: bool
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    optional: bool = False
    note: str = ""

    def requirement(self) -> str:
        kind = "an integer" if self.integer else "a number"
        lo, hi = (str(int(x)) if self.integer and x is not None else f"{x:g}" if x is not None else None
                  for x in (self.low, self.high))
        if self.low is not None and self.high is not None:
            bounds = f" in {'(' if self.low_open else '['}{lo}, {hi}]"
        elif self.low is not None:
            bounds = f" {'>' if self.low_open else '>='} {lo}"
        else:
            bounds = ""
        return f"must be {kind}{bounds}{self.note}"

    def check(self, value: Any) -> None:
        if value is None and self.optional:
            return
        if isinstance(value, bool) or not isinstance(value, int if self.integer else (int, float)):
            raise SamplingParamsError(self.name, self.requirement(), value)
        too_low = self.low is not None and (value <= self.low if self.low_open else value < self.low)
        if (isinstance(value, float) and not math.isfinite(value)) or too_low or (self.high is not None and value > self.high):
            raise SamplingParamsError(self.name, self.requirement(), value)


# The one place where value ranges are checked (the server's protocol builds SamplingParams, so its
# 400s come from here too).
_INT32_MAX = 2**31 - 1
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # a seed is a signed 64-bit integer (vLLM's bound)
MIN_TOP_P = 1e-6  # below this the nucleus mass rounds to 0 in float32 and the sampler would keep no token
MAX_TEMPERATURE = 100.0  # logits / temperature stays finite and informative; above it sampling is uniform

_RANGES = (
    _Range("n", integer=True, low=1, high=4096),
    _Range("temperature", integer=False, low=0, high=MAX_TEMPERATURE),
    _Range("top_p", integer=False, low=MIN_TOP_P, high=1),
    _Range("top_k", integer=True, low=-1, high=_INT32_MAX, note=" (-1 or 0 disables it)"),
    _Range("min_p", integer=False, low=0, high=1),
    _Range("presence_penalty", integer=False, low=-2, high=2),
    _Range("frequency_penalty", integer=False, low=-2, high=2),
    _Range("repetition_penalty", integer=False, low=0.01, high=100),
    _Range("max_tokens", integer=True, low=1, high=_INT32_MAX, optional=True),
    _Range("min_tokens", integer=True, low=0, high=_INT32_MAX),
    _Range("logprobs", integer=True, low=0, high=20, optional=True),
    _Range("seed", integer=True, low=SEED_MIN, high=SEED_MAX, optional=True),
)


@dataclass
class SamplingParams:
    """How to sample one request and when to stop it.

    Attributes:
        n: number of independent completions for the prompt (>= 1).
        temperature: in [0, 100]; 0 means greedy (argmax); > 0 divides the logits before softmax (below
            1e-5 it is treated as 0, as in vLLM).
        top_p: nucleus mass in [1e-6, 1]; 1 disables it.
        top_k: keep the k most likely tokens; 0 or -1 disables it.
        min_p: drop tokens whose probability is below min_p * max probability; 0 disables it.
        seed: per-request seed, a signed 64-bit integer. The same seed gives the same tokens whether the request runs alone or in
            any batch (every uniform is a function of the seed and the output position; docs/step-plan.md).
            With ngram or suffix speculation (one-hot drafts) it also gives the same tokens as without
            speculation (README, "Guarantees"); with a draft model that samples its drafts a seed is
            reproducible for a given speculation profile and k.
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
        SamplingParamsError: from `__post_init__` for any out-of-range value (`param` names it).
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
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        for row in _RANGES:
            row.check(getattr(self, row.name))
        if 0 < self.temperature < _GREEDY_EPS:
            self.temperature = 0.0  # vLLM's rule: a temperature this small is greedy (dividing by it overflows)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamsError("min_tokens", f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        self._check_stops()
        self.logit_bias = _clean_logit_bias(self.logit_bias)

    def _check_stops(self) -> None:
        if len(self.stop) > MAX_STOP_STRINGS:
            raise SamplingParamsError("stop", f"must hold at most {MAX_STOP_STRINGS} strings", len(self.stop))
        for s in self.stop:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_CHARS:
                raise SamplingParamsError("stop", f"must be non-empty strings of at most {MAX_STOP_STRING_CHARS} "
                                          "characters", s[:40] if isinstance(s, str) else s)
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise SamplingParamsError("stop_token_ids", "must be non-negative integers", t)

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

    def for_choice(self, index: int) -> "SamplingParams":
        """Parameters of completion `index` of an n > 1 request: n = 1, and seed s becomes s + index so
        the n completions differ but stay reproducible (offline and over HTTP alike)."""
        if self.seed is None:
            return self.clone(n=1)
        seed = (self.seed + index - SEED_MIN) % 2**64 + SEED_MIN  # wraps within the signed 64-bit range
        return self.clone(n=1, seed=seed)


def _clean_logit_bias(logit_bias: dict | None) -> dict[int, float] | None:
    """Keys as int token ids, values as floats in [-100, 100]. Raises SamplingParamsError."""
    if not logit_bias:
        return logit_bias
    clean: dict[int, float] = {}
    for tok, bias in logit_bias.items():
        try:
            tok_i, bias_f = int(tok), float(bias)
        except (TypeError, ValueError):
            raise SamplingParamsError("logit_bias", "must map token ids to numbers", {tok: bias}) from None
        if not -100.0 <= bias_f <= 100.0:
            raise SamplingParamsError("logit_bias", "values must be in [-100, 100]", bias)
        clean[tok_i] = bias_f
    return clean
