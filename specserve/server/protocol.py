"""OpenAI-compatible request bodies (pydantic), used at the HTTP boundary only.

What it does: parses and type-checks the JSON bodies of POST /v1/completions and
POST /v1/chat/completions, and turns them into the engine's `SamplingParams` (whose `__post_init__`
is the single place where value ranges are checked). What it does not do: build responses (see
`formatting.py`), tokenize, or choose a speculation profile (see `specserve.rollout.policy`).

Unknown fields are ignored (as vLLM and OpenAI do for forward compatibility); known fields with the
wrong type are a 400. Completions accept a single prompt (a string or a list of token ids, or a
one-element list of either); batched prompts are refused with a clear message.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from specserve.sampling_params import SamplingParams


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by both endpoints (OpenAI names plus vLLM's extra sampling knobs)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool = True
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    profile: str | None = Field(default=None, description="speculation profile (needs --allow-profile-override)")


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. `logprobs` is an int: the chosen token's logprob plus the top `logprobs`."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions. `logprobs` is a bool; `top_logprobs` (0..20) needs it true."""

    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None


class RequestValueError(ValueError):
    """A well-typed but unusable request value; `param` names the field for the error body."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def completion_prompt(req: CompletionRequest) -> str | list[int]:
    """The single prompt of a completions request (text or token ids)."""
    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        if len(p) != 1:
            raise RequestValueError(
                "batched prompts are not supported: send one request per prompt", param="prompt"
            )
        p = p[0]
    if isinstance(p, str) and not p:
        raise RequestValueError("prompt must not be empty", param="prompt")
    if isinstance(p, list) and not p:
        raise RequestValueError("prompt must not be empty", param="prompt")
    if req.echo:
        raise RequestValueError("echo is not supported", param="echo")
    if req.suffix:
        raise RequestValueError("suffix is not supported", param="suffix")
    return p


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as plain dicts for the chat template; list-of-parts content is joined to text."""
    if not req.messages:
        raise RequestValueError("messages must not be empty", param="messages")
    out = []
    for m in req.messages:
        d = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):
            texts = []
            for part in m.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise RequestValueError("only text content parts are supported", param="messages")
                texts.append(part["text"])
            d["content"] = "".join(texts)
        elif m.content is None:
            d["content"] = ""
        out.append(d)
    return out


def _logprobs_count(req: CompletionRequest | ChatCompletionRequest) -> int | None:
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise RequestValueError("top_logprobs needs logprobs to be true", param="top_logprobs")
        if not req.logprobs:
            return None
        k = req.top_logprobs or 0
        if not 0 <= k <= 20:
            raise RequestValueError(f"top_logprobs must be in [0, 20], got {k}", param="top_logprobs")
        return k
    if req.logprobs is not None and not 0 <= req.logprobs <= 20:
        raise RequestValueError(f"logprobs must be in [0, 20], got {req.logprobs}", param="logprobs")
    return req.logprobs


def sampling_params(req: CompletionRequest | ChatCompletionRequest) -> SamplingParams:
    """Build validated SamplingParams for ONE choice (n is kept for information; the server fans out).

    Defaults follow OpenAI: completions max_tokens 16, chat max_tokens unlimited (up to the context);
    temperature 1, top_p 1. Raises RequestValueError / SamplingParamsError (both 400 upstream).
    """
    is_chat = isinstance(req, ChatCompletionRequest)
    max_tokens = req.max_tokens
    if is_chat and req.max_completion_tokens is not None:
        max_tokens = req.max_completion_tokens
    if max_tokens is None and not is_chat:
        max_tokens = 16
    param_name = "max_completion_tokens" if is_chat and req.max_completion_tokens is not None else "max_tokens"
    if max_tokens is not None and max_tokens < 1:
        raise RequestValueError(f"{param_name} must be >= 1, got {max_tokens}", param=param_name)
    if req.n < 1:
        raise RequestValueError(f"n must be >= 1, got {req.n}", param="n")
    if req.n > 16:
        raise RequestValueError(f"n must be <= 16, got {req.n}", param="n")
    logit_bias = None
    if req.logit_bias:
        try:
            logit_bias = {int(k): float(v) for k, v in req.logit_bias.items()}
        except ValueError:
            raise RequestValueError("logit_bias keys must be token ids", param="logit_bias") from None
    return SamplingParams(
        n=req.n,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if req.top_k is None else req.top_k,
        min_p=0.0 if req.min_p is None else req.min_p,
        seed=req.seed,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty,
        logit_bias=logit_bias,
        stop=req.stop,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        logprobs=_logprobs_count(req),
        skip_special_tokens=req.skip_special_tokens,
    )


def param_from_message(message: str) -> str | None:
    """Best-effort field name from a SamplingParamsError message ("top_p must be ..." -> "top_p")."""
    head = message.split(" ", 1)[0].strip(":,")
    return head if head.replace("_", "").isalpha() else None


Endpoint = Literal["completions", "chat"]
