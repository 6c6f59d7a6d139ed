"""Engine and speculation configuration: frozen dataclasses with validation.

`SpeculativeConfig` takes the JSON keys vLLM users already know (`--speculative-config`,
docs/design.md section 4). Unknown keys and methods we do not run are errors naming the valid
choices; there is no silent fallback to "no speculation".
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any


class ConfigError(ValueError):
    """Raised for an invalid engine or speculative configuration; the message says what is valid."""


def _check_number(key: str, value: Any, low: float | None, high: float | None, *, integer: bool,
                  low_open: bool = False) -> None:
    """Raise ConfigError naming `key` and its valid range unless `value` is an integer (not a bool, not a
    fraction) / a finite number within it."""
    kind = "an integer" if integer else "a number"
    rng = f"{'(' if low_open else '['}{low:g}, {high:g}]" if high is not None else f"{'>' if low_open else '>='} {low:g}"
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok_type or (isinstance(value, float) and not math.isfinite(value)):
        raise ConfigError(f"{key} must be {kind} {'in ' if high is not None else ''}{rng}, got {value!r} "
                          f"({type(value).__name__})")
    if (low is not None and (value <= low if low_open else value < low)) or (high is not None and value > high):
        raise ConfigError(f"{key} must be {kind} {'in ' if high is not None else ''}{rng}, got {value!r}")


DEFAULT_PROMPT_LOOKUP = (1, 4)
# key -> (low, high) of the integer keys, (low, high, low excluded) of the number keys
_INT_KEYS = {
    "num_speculative_tokens": (1, 64), "prompt_lookup_min": (1, 64), "prompt_lookup_max": (1, 64),
    "suffix_decoding_max_tree_depth": (1, 1024), "suffix_decoding_max_cached_requests": (0, 10_000_000),
    "draft_tensor_parallel_size": (1, 1),
}
_FLOAT_KEYS = {"suffix_decoding_max_spec_factor": (0, 1e6, True), "suffix_decoding_min_token_prob": (0, 1, False)}

# Methods that run in this engine. Others that vLLM users may name are refused with a clear error.
SUPPORTED_METHODS = ("ngram", "suffix", "draft_model")
KNOWN_UNSUPPORTED_METHODS = ("eagle", "eagle3", "mtp", "medusa", "mlp_speculator")


SCHEDULES = ("constant", "adaptive")
"""Values of `num_speculative_tokens_schedule`."""
ADAPTIVE_OBJECTIVES = ("throughput", "fair")
"""Values of `EngineConfig.adaptive_objective` (serve's --adaptive-objective)."""


def parse_batch_size_table(entries: Any) -> tuple[tuple[int, int, int], ...]:
    """Validate vLLM's `num_speculative_tokens_per_batch_size`: [[bs_lo, bs_hi, k], ...] -> sorted triples.

    Raises:
        ConfigError: not a non-empty list of 3-item integer entries; a range that is empty, not
            positive, overlaps another, or a first range that does not start at 1; k < 0; the 5-item
            (context bucket) form, which is not supported yet.
    """
    name = "num_speculative_tokens_per_batch_size"
    if not isinstance(entries, (list, tuple)) or not entries:
        raise ConfigError(f"{name} must be a non-empty list of [bs_lo, bs_hi, k] entries, got {entries!r}")
    out = []
    for e in entries:
        if isinstance(e, (list, tuple)) and len(e) == 5:
            raise ConfigError(f"{name}: the 5-item form [bs_lo, bs_hi, ctx_lo, ctx_hi, k] (context buckets) "
                              "is not supported yet; use [bs_lo, bs_hi, k] entries")
        if (not isinstance(e, (list, tuple)) or len(e) != 3
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in e)):
            raise ConfigError(f"{name} entries must be [bs_lo, bs_hi, k] integer triples (vLLM's format), got {e!r}")
        lo, hi, k = e
        if lo < 1 or hi < lo:
            raise ConfigError(f"{name}: batch-size range [{lo}, {hi}] must have 1 <= bs_lo <= bs_hi")
        if k < 0:
            raise ConfigError(f"{name}: k must be >= 0, got {k} in {list(e)}")
        out.append((lo, hi, k))
    out.sort()
    if out[0][0] != 1:
        raise ConfigError(f"{name}: the first batch-size range must start at 1 (every batch size needs a k)")
    for (_, prev_hi, _), (lo, hi, _) in zip(out, out[1:]):
        if lo <= prev_hi:
            raise ConfigError(f"{name}: batch-size ranges overlap at [{lo}, {hi}]")
    return tuple(out)


@dataclass(frozen=True)
class SpeculativeConfig:
    """One speculation setting (a 'profile' is a named one of these).

    Attributes:
        method: "ngram" (prompt lookup), "suffix" (SuffixDecoding, Oliaro et al. 2024) or "draft_model".
        num_speculative_tokens: k, the drafts proposed per step (>= 1).
        model: draft model name / path (draft_model only).
        prompt_lookup_min, prompt_lookup_max: n-gram sizes tried, longest first (ngram only); when only
            one is given the other takes its value (vLLM's rule), when neither 1 and 4.
        suffix_decoding_max_tree_depth: longest suffix matched and deepest speculation (suffix only).
        suffix_decoding_max_cached_requests: finished requests kept in the global tree (suffix only).
        suffix_decoding_max_spec_factor: drafts <= factor * match length (suffix only).
        suffix_decoding_min_token_prob: stop extending a draft below this estimated probability (suffix only).
        draft_tensor_parallel_size: accepted for vLLM compatibility; only 1 is supported.
        num_speculative_tokens_per_batch_size: vLLM's dynamic speculative decoding table, a list of
            [bs_lo, bs_hi, k] entries (vLLM `vllm/v1/spec_decode/dynamic/utils.py`, same key and
            meaning): a step whose batch (its decoding requests) has bs_lo <= size <= bs_hi uses at most
            k drafts per request (0 turns speculation off); a size in a gap between ranges uses the k of
            the range before it, a size beyond the last range the last k; k is capped at
            num_speculative_tokens. Ranges must start at 1 and must not overlap. vLLM's 5-item form
            (with context-length buckets) is refused as not supported yet.
        num_speculative_tokens_schedule: how k is chosen each step for each request, up to
            num_speculative_tokens (and the batch-size table): "constant" (vLLM's behaviour: always the
            maximum) or "adaptive" (specserve's extension, docs/adaptive-speculation.md): every step k
            (0 included) is chosen per request to maximise the expected committed tokens per second
            of the whole step, from the target's measured step cost and each request's acceptance
            estimate. Losslessness does not depend on k.
    """

    method: str
    num_speculative_tokens: int = 5
    model: str | None = None
    prompt_lookup_min: int | None = None  # None: the other size's value, or 1 when neither is given
    prompt_lookup_max: int | None = None  # None: the other size's value, or 4 when neither is given
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    draft_tensor_parallel_size: int = 1
    num_speculative_tokens_per_batch_size: tuple[tuple[int, int, int], ...] | None = None
    num_speculative_tokens_schedule: str = "constant"

    def __post_init__(self) -> None:
        m = self.method
        if not isinstance(m, str):
            raise ConfigError(f'"method" must be a string (one of {", ".join(SUPPORTED_METHODS)}), got {m!r}')
        if m in KNOWN_UNSUPPORTED_METHODS:
            raise ConfigError(
                f"speculative method {m!r} is not supported yet; supported methods: {', '.join(SUPPORTED_METHODS)}"
            )
        if m not in SUPPORTED_METHODS:
            raise ConfigError(f"unknown speculative method {m!r}; supported methods: {', '.join(SUPPORTED_METHODS)}")
        # vLLM's rule for the n-gram sizes: a missing one takes the other's value
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for key, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if value is not None:
                _check_number(key, value, *_INT_KEYS[key], integer=True)
        if lo is None and hi is None:
            lo, hi = DEFAULT_PROMPT_LOOKUP
        object.__setattr__(self, "prompt_lookup_min", hi if lo is None else lo)
        object.__setattr__(self, "prompt_lookup_max", lo if hi is None else hi)
        for key, (low, high) in _INT_KEYS.items():
            _check_number(key, getattr(self, key), low, high, integer=True)
        for key, (low, high, low_open) in _FLOAT_KEYS.items():
            _check_number(key, getattr(self, key), low, high, integer=False, low_open=low_open)
        if self.model is not None and not isinstance(self.model, str):
            raise ConfigError(f'"model" must be a string (a draft model name or path), got {self.model!r}')
        if m == "draft_model" and not self.model:
            raise ConfigError('method "draft_model" needs "model": the draft model name or path')
        if m != "draft_model" and self.model:
            raise ConfigError(f'"model" is only used by method "draft_model", not {m!r}')
        if m == "ngram" and not self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError(
                f"need prompt_lookup_min <= prompt_lookup_max, got {self.prompt_lookup_min}, {self.prompt_lookup_max}"
            )
        if self.num_speculative_tokens_schedule not in SCHEDULES:
            raise ConfigError(
                f"num_speculative_tokens_schedule must be one of {', '.join(map(repr, SCHEDULES))}, "
                f"got {self.num_speculative_tokens_schedule!r}"
            )
        if self.num_speculative_tokens_per_batch_size is not None:
            table = parse_batch_size_table(self.num_speculative_tokens_per_batch_size)
            object.__setattr__(self, "num_speculative_tokens_per_batch_size", table)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "SpeculativeConfig | None":
        """Build from vLLM-shaped keys. None or {} (or method "none"/"baseline") means no speculation.

        Raises:
            ConfigError: unknown key (naming the valid ones), missing method, unsupported method, bad value.
        """
        if not d:
            return None
        if not isinstance(d, dict):
            raise ConfigError(f"speculative config must be a JSON object, got {type(d).__name__}")
        valid = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - valid)
        if unknown:
            raise ConfigError(f"unknown speculative config key(s) {unknown}; valid keys: {sorted(valid)}")
        if "method" not in d:
            raise ConfigError(f'speculative config needs "method" (one of {", ".join(SUPPORTED_METHODS)})')
        if d["method"] in (None, "none", "baseline"):
            return None
        try:
            return cls(**d)
        except TypeError as e:  # wrong value types that dataclass construction trips on
            raise ConfigError(f"invalid speculative config: {e}") from None

    @classmethod
    def from_json(cls, text: str) -> "SpeculativeConfig | None":
        """Parse `--speculative-config` JSON text. Raises ConfigError for invalid JSON or values."""
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--speculative-config is not valid JSON: {e}") from None
        return cls.from_dict(d)

    def k_for_batch_size(self, batch_size: int) -> int:
        """The most drafts per request for a step whose batch holds `batch_size` requests: the batch-size
        table's k (vLLM's lookup: gaps carry the previous range's k, sizes past the last range take its
        k; capped at num_speculative_tokens), or num_speculative_tokens without a table."""
        table = self.num_speculative_tokens_per_batch_size
        if not table:
            return self.num_speculative_tokens
        k = table[0][2]
        for lo, _hi, range_k in table:
            if batch_size < lo:
                break
            k = range_k
        return min(k, self.num_speculative_tokens)

    @property
    def adaptive(self) -> bool:
        """True when k is chosen per step by the cost-aware schedule ("adaptive")."""
        return self.num_speculative_tokens_schedule == "adaptive"

    def effective(self) -> dict[str, Any]:
        """Every key with the value in force after defaults (what start-up prints and /v1/models,
        /admin/profiles show), JSON-ready."""
        d = asdict(self)
        if d["num_speculative_tokens_per_batch_size"] is not None:
            d["num_speculative_tokens_per_batch_size"] = [list(p) for p in d["num_speculative_tokens_per_batch_size"]]
        return d

    def to_dict(self) -> dict[str, Any]:
        """The non-default keys plus method and k, JSON-ready; `SpeculativeConfig(**d)` gives this config
        back. The two n-gram sizes go together: a lone size stands for both (`__post_init__`), so
        writing only min 2 of (2, 4) would read back as (2, 2)."""
        out = {}
        defaults = {f.name: f.default for f in fields(self)}
        defaults["prompt_lookup_min"], defaults["prompt_lookup_max"] = DEFAULT_PROMPT_LOOKUP
        for k, v in asdict(self).items():
            if k in ("method", "num_speculative_tokens") or v != defaults[k]:
                out[k] = v
        if "prompt_lookup_min" in out or "prompt_lookup_max" in out:
            out["prompt_lookup_min"], out["prompt_lookup_max"] = self.prompt_lookup_min, self.prompt_lookup_max
        return out


@dataclass(frozen=True)
class EngineConfig:
    """Engine-wide settings.

    Attributes:
        model: catalog name, local Hugging Face folder or .gguf path (resolved by `specserve.hub`).
        dtype: "float32", "bfloat16" or "float16"; "auto" = float32 on CPU, bfloat16 on CUDA.
        device: "cpu", "cuda", "cuda:N" or "auto" (CUDA when available).
        max_model_len: context length in tokens (prompt + output); None = the model's own limit, capped at 4096.
        max_num_seqs: most requests running at once (KV cache slots).
        max_num_batched_tokens: token budget of one step (prefill chunks + 1 + k per decoding request).
        speculative_config: engine-wide default speculation (None = off); requests may choose another.
        seed: seed for requests that give none (for reproducible runs of a whole engine).
        enforce_eager: on CUDA, run every step eagerly instead of replaying CUDA graphs (as vLLM's flag).
        batch_invariant: on CUDA, compute every row in a fixed reduction order whatever the batch shape, so
            a verify block's logits are bit-identical to one-token decodes and greedy speculation is
            token-identical to the baseline in bf16 too (slower matmuls; see docs/gpu-notes.md).
        refresh_step_cost: measure the target's step cost again instead of reading the cached
            measurement (the adaptive schedule needs it; `specserve.engine.step_cost`).
        adaptive_objective: what the adaptive schedule maximises each step over the whole batch
            (`specserve.spec_decode.adaptive`): "throughput" (default; expected committed tokens per ms of
            step time, issue 10's definition) or "fair" (the sum of log per-request token rates: a
            request's drafts must not slow the others in its step more than they gain; stricter where
            drafting has a fixed price, as on a GPU at 16 concurrent requests). Identical at batch size 1.
        cpu_threads: threads of the CPU forward, sampler and verifier; None = OMP_NUM_THREADS if set,
            else every CPU the process may run on (`specserve.engine.cpu_threads`). CPU device only.
        cpu_linear: how linear layers run on the CPU: "auto" (float32: the panel kernel,
            `specserve.model.panel_linear`, built once per machine; oneDNN with prepacked weights where it
            cannot be built; else F.linear / MKL), "panel" (the panel kernel, or an error where it cannot be
            built), "onednn" (oneDNN, or an error where this torch build lacks it), "torch" (F.linear /
            MKL). In float32 the panel kernel and oneDNN give a row the same result alone and in any batch
            (`specserve.model.cpu_linear`), so greedy speculation is exact and seeded sampling batch
            invariant; oneDNN's bfloat16 kernels are not, so "auto" keeps F.linear there. F.linear (MKL) is
            not row independent on every CPU (on an Intel host a lone row and a row in a batch differ).
        enable_prefix_caching: automatic prefix caching (vLLM's flag, on by default): a finished
            request's KV slot keeps its committed tokens' keys/values, and a new request whose prompt
            shares a prefix with them prefills only the rest (docs/prefix_caching.md). Exact: the
            reused keys/values are those a full prefill computes. Off: every prompt is prefilled whole.
        prefix_cache_min_tokens: the shortest shared prefix that is reused (default 16, one vLLM block).
        prefix_cache_recompute_tokens: the last prompt tokens that are prefilled even when cached (>= 1,
            default 16): the first output token needs the last one's logits, and a tail of several rows
            keeps the fp32 CPU logprobs bit-identical to a whole-prompt prefill where a one-row tail
            rounds differently (docs/prefix_caching.md, "Exactness").
    """

    model: str
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    speculative_config: SpeculativeConfig | None = None
    seed: int = 0
    enforce_eager: bool = False
    batch_invariant: bool = False
    refresh_step_cost: bool = False
    adaptive_objective: str = "throughput"
    cpu_threads: int | None = None
    cpu_linear: str = "auto"
    enable_prefix_caching: bool = True
    prefix_cache_min_tokens: int = 16
    prefix_cache_recompute_tokens: int = 16
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.max_num_seqs < 1:
            raise ConfigError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < 16:
            raise ConfigError("max_num_batched_tokens must be >= 16")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError("max_model_len must be >= 2")
        if self.cpu_threads is not None and (not isinstance(self.cpu_threads, int) or self.cpu_threads < 1):
            raise ConfigError(f"cpu_threads must be a positive integer, got {self.cpu_threads!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ConfigError(f"enable_prefix_caching must be true or false, got {self.enable_prefix_caching!r}")
        if (isinstance(self.prefix_cache_min_tokens, bool) or not isinstance(self.prefix_cache_min_tokens, int)
                or self.prefix_cache_min_tokens < 1):
            raise ConfigError(f"prefix_cache_min_tokens must be a positive integer, got {self.prefix_cache_min_tokens!r}")
        if (isinstance(self.prefix_cache_recompute_tokens, bool) or not isinstance(self.prefix_cache_recompute_tokens, int)
                or self.prefix_cache_recompute_tokens < 1):
            raise ConfigError("prefix_cache_recompute_tokens must be a positive integer, got "
                              f"{self.prefix_cache_recompute_tokens!r}")
        if self.adaptive_objective not in ADAPTIVE_OBJECTIVES:
            raise ConfigError(f"adaptive_objective must be one of {', '.join(ADAPTIVE_OBJECTIVES)}, got "
                              f"{self.adaptive_objective!r}")
        if self.cpu_linear not in ("auto", "panel", "onednn", "torch"):
            raise ConfigError(f"cpu_linear must be auto, panel, onednn or torch, got {self.cpu_linear!r}")
