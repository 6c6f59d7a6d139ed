"""OpenAI-compatible request bodies (pydantic), used at the HTTP boundary only.

What it does: parses and type-checks the JSON bodies of POST /v1/completions and
POST /v1/chat/completions, and turns them into what the engine takes: a typed prompt (`engine_prompt`:
TextPrompt / TokenPrompt / ChatPrompt) and `SamplingParams` (whose range table is the single place
where value ranges are checked). Every refusal is an `InvalidRequestError` whose `param` is the body
field at fault. What it does not do: build responses (see `formatting.py`), tokenize, or choose a
speculation profile (see `specserve.rollout.policy`).

Unknown fields are ignored (as vLLM and OpenAI do for forward compatibility); known fields with the
wrong type are a 400. Completions accept a single prompt (a string or a list of token ids, or a
one-element list of either); batched prompts are refused with a clear message.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from specserve.inputs import ChatPrompt, InvalidRequestError, Prompt, TextPrompt, TokenPrompt
from specserve.sampling_params import SamplingParams, SamplingParamsError

MAX_N = 16  # the server's fan-out limit per request (offline, SamplingParams allows any n >= 1)


class StreamOptions(BaseModel):
    """`include_usage`: a last chunk with the request's usage (OpenAI); `continuous_usage_stats`
    (vLLM's key, needs include_usage): usage on every chunk too."""

    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False
    continuous_usage_stats: bool = False


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


def engine_prompt(req: CompletionRequest | ChatCompletionRequest) -> Prompt:
    """The request's prompt as the engine takes it: chat messages (with tools) or the single
    completion prompt (text or token ids). Raises InvalidRequestError."""
    if isinstance(req, ChatCompletionRequest):
        return ChatPrompt(tuple(chat_messages(req)), tuple(req.tools) if req.tools is not None else None)
    p = completion_prompt(req)
    return TextPrompt(p) if isinstance(p, str) else TokenPrompt(tuple(p))


def completion_prompt(req: CompletionRequest) -> str | list[int]:
    """The single prompt of a completions request (text or token ids)."""
    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        if len(p) != 1:
            raise InvalidRequestError(
                "batched prompts are not supported: send one request per prompt", param="prompt"
            )
        p = p[0]
    if not p:
        raise InvalidRequestError("prompt must not be empty", param="prompt")
    if req.echo:
        raise InvalidRequestError("echo is not supported", param="echo")
    if req.suffix:
        raise InvalidRequestError("suffix is not supported", param="suffix")
    return p


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as plain dicts for the chat template; list-of-parts content is joined to text."""
    if not req.messages:
        raise InvalidRequestError("messages must not be empty", param="messages")
    out = []
    for m in req.messages:
        d = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):
            texts = []
            for part in m.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise InvalidRequestError("only text content parts are supported", param="messages")
                texts.append(part["text"])
            d["content"] = "".join(texts)
        elif m.content is None:
            d["content"] = ""
        out.append(d)
    return out


def _logprobs_count(req: CompletionRequest | ChatCompletionRequest) -> int | None:
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs to be true", param="top_logprobs")
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs


def sampling_params(req: CompletionRequest | ChatCompletionRequest) -> SamplingParams:
    """Build validated SamplingParams for ONE choice (n is kept for information; the server fans out).

    Defaults follow OpenAI: completions max_tokens 16, chat max_tokens unlimited (up to the context);
    temperature 1, top_p 1.

    Raises:
        InvalidRequestError (SamplingParamsError for a value out of range): `param` is the body field,
            e.g. "max_completion_tokens" or "top_logprobs" where those set max_tokens / logprobs.
    """
    is_chat = isinstance(req, ChatCompletionRequest)
    aliases = {"logprobs": "top_logprobs"} if is_chat else {}
    max_tokens = req.max_tokens
    if is_chat and req.max_completion_tokens is not None:
        max_tokens, aliases["max_tokens"] = req.max_completion_tokens, "max_completion_tokens"
    if max_tokens is None and not is_chat:
        max_tokens = 16
    if req.n > MAX_N:
        raise InvalidRequestError(f"n must be at most {MAX_N}, got {req.n}", param="n")
    try:
        return _sampling_params(req, max_tokens)
    except SamplingParamsError as e:
        if e.param in aliases:
            raise e.renamed(aliases[e.param]) from None
        raise


def _sampling_params(req: CompletionRequest | ChatCompletionRequest, max_tokens: int | None) -> SamplingParams:
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
        logit_bias=req.logit_bias,
        stop=req.stop,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        logprobs=_logprobs_count(req),
        skip_special_tokens=req.skip_special_tokens,
    )

