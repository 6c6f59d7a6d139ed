"""The one interface between the HTTP server and the engine: `EngineClient`, and what travels over it.

What it does: names everything the server needs from an engine (tokenize a prompt off the engine
thread, submit a request's choices, abort them, live gauges, health and the watchdog's step age, the
model's name / context length / vocabulary / checksum / tokenizer, preparing the profiles' proposers,
also for a profile added at run time, the adaptive schedule's state) as a Protocol, and types what
comes back: `submit()` returns an `EngineRequest`
whose queue yields one `QueueItem` at a time, `Output` (a step's `RequestOutput` delta for one
choice), then a final `Output`, `Aborted` or `Failed` per choice. The server imports nothing else from
the engine side. `AsyncEngine` (async_engine.py) implements it over an `LLMEngine`.
What it does not do: run anything (see `async_engine.py`) or speak HTTP (see `serving.py`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, Union, runtime_checkable

from specserve.config import SpeculativeConfig
from specserve.inputs import Prompt
from specserve.outputs import RequestOutput
from specserve.sampling_params import SamplingParams, StructuredOutputsParams


class EngineDeadError(RuntimeError):
    """The engine loop failed or is shutting down; the server cannot generate any more (HTTP 503)."""


@dataclass(frozen=True)
class Output:
    """A step's output (a delta) for choice `index`; `output.finished` marks the choice's last one."""

    index: int
    output: RequestOutput


@dataclass(frozen=True)
class Aborted:
    """Choice `index` was aborted (the client left); nothing more comes for it."""

    index: int


@dataclass(frozen=True)
class Failed:
    """The engine died while choice `index` ran (an `EngineDeadError`); nothing more comes for it."""

    index: int
    error: BaseException


QueueItem = Union[Output, Aborted, Failed]


@dataclass(frozen=True)
class EngineRequest:
    """One submitted HTTP request as the engine holds it.

    Attributes:
        prompt_token_ids: the prompt as tokenized (chat template applied).
        child_ids: the engine request id of each choice (`f"{request_id}-{i}"`), for `abort`.
        queue: yields `QueueItem`s for every choice, in the order the engine produced them.
    """

    prompt_token_ids: list[int]
    child_ids: list[str]
    queue: asyncio.Queue


@runtime_checkable
class EngineClient(Protocol):
    """What the server needs from an engine (vLLM's `EngineClient` plays the same part).

    Attributes:
        model_name, model_checksum: what /v1/models and the request log report.
        max_model_len: context length (prompt + output tokens).
        vocab_size: token ids must be below it.
        max_prompt_tokens: the per-request prompt limit (tokens, at most max_model_len - 1).
        max_num_seqs: most requests running at once (the server's queue limit counts from it).
        tokenizer: decodes single token ids for logprobs (`decode([id], skip_special_tokens=False)`).
        in_flight: engine requests submitted and not finished yet (read on the event-loop thread).
        alive: True while the engine runs and has not failed (/health).
        dead: the error that stopped the engine, or None.
    """

    model_name: str
    model_checksum: str | None
    max_model_len: int
    vocab_size: int
    max_prompt_tokens: int
    max_num_seqs: int
    tokenizer: Any
    in_flight: int

    @property
    def alive(self) -> bool: ...

    @property
    def dead(self) -> BaseException | None: ...

    def last_step_age_s(self) -> float:
        """Seconds since the engine last finished a step while work is pending; 0 when idle (watchdog)."""

    async def encode(self, prompt: Prompt) -> list[int]:
        """Tokenize `prompt` (chat template applied) off the engine thread, after a size check that needs
        no tokenization.

        Raises:
            InvalidRequestError: empty, over the per-request limit, bad token ids, a chat the template refuses.
        """

    async def compile_grammar(self, spec: StructuredOutputsParams) -> None:
        """Compile a structured-output constraint off the engine thread (cached, so the engine finds it).

        Raises:
            SamplingParamsError: the grammar library cannot compile it (`param` names the request field).
        """

    def prepare_speculative_config(self, spec_config: SpeculativeConfig) -> None:
        """Build a profile's proposer now (draft models load once); call before `start`."""

    async def add_speculative_config(self, spec_config: SpeculativeConfig) -> None:
        """Build the proposer of a profile added while serving (POST /admin/profiles), between steps.

        Raises:
            ConfigError, ModelError: the engine cannot build it (e.g. a draft model with another vocabulary).
            RuntimeError: it cannot be prepared now (no free KV slot to measure the step cost with).
            EngineDeadError: the engine is not running.
        """

    def speculation_stats(self) -> dict[str, Any]:
        """The adaptive schedule's state for /metrics: {"step_cost": {(model, "target" | "draft"): StepCostModel},
        "chain_scale": {draft model: float}, "configs": [{"config", "chosen_k", "acceptance"}]}; {} without an adaptive profile."""

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start generating; outputs are delivered on `loop` (default: the running loop)."""

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop; requests in flight get `Failed(EngineDeadError)`."""

    async def submit(self, request_id: str, prompt: Prompt, params: Sequence[SamplingParams],
                     spec_config: SpeculativeConfig | None, arrival_time: float | None = None, *,
                     queue: asyncio.Queue | None = None, first_index: int = 0) -> EngineRequest:
        """Add one engine request per SamplingParams (the choices) for `prompt` (the server passes token
        ids from `encode`). Items go to `queue` (default: a new one) with index `first_index + i`.

        Raises:
            InvalidRequestError: the engine refuses the prompt (too long, empty, bad token ids, chat).
            EngineDeadError: the engine is not running.
        """

    def abort(self, child_ids: Sequence[str]) -> None:
        """Cancel engine requests and free their KV now; unknown or finished ids are ignored."""

    def stats(self) -> dict[str, Any]:
        """Live gauges: num_running, num_waiting, kv_cache_usage (0..1), num_kv_tokens."""
