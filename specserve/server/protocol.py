"""OpenAI-compatible request bodies, used at the HTTP boundary only: every field honoured or refused.

What it does: `parse_request()` turns a parsed JSON body into a `ParsedRequest`: the validated pydantic
request (strict types, see `parsing.py`), the typed prompts (`TextPrompt` / `TokenPrompt` /
`ChatPrompt`; a list of prompts on /v1/completions), one `SamplingParams` per engine choice (its range
table is the one place value ranges are checked) and the output options (n, best_of, echo, logprobs,
tools). Field policy, per endpoint (README "Serving" lists it):
- OpenAI fields we implement are honoured; OpenAI and vLLM fields we do not implement are accepted
  only at their default or null, and any other value is a 400 naming the field
  (`code: "unsupported_parameter"`), never a silent no-op (`REFUSED`).
- Fields nobody defines are logged once per name and ignored (vLLM's rule).
- Structured output (`response_format` json_object / json_schema, vLLM's `structured_outputs` /
  `guided_*`) and forced tool calls (`tool_choice` "required" or a named function) need
  grammar-constrained decoding, which the engine does not have yet: a clear 400.
Every refusal is an `InvalidRequestError` whose `param` is the body field at fault.
What it does not do: build responses (`formatting.py`), tokenize (`specserve.tokenization`), check
`max_tokens` against the tokenized prompt (`serving.py`), or choose a profile (`specserve.rollout`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from specserve.inputs import ChatPrompt, InvalidRequestError, Prompt, TextPrompt, TokenPrompt
from specserve.sampling_params import SamplingParams, SamplingParamsError
from specserve.server.messages import NamedToolChoice, ResponseFormat, Tool, parse_messages, tool_dicts
from specserve.server.parsing import UnknownFieldNotes, shown, unknown_fields, validate_model

MAX_N = 16  # the server's fan-out limit per request: n, best_of, and prompts x best_of
MAX_PROMPTS = 16
MAX_LOGIT_BIAS = 1024
MAX_STOP_TOKEN_IDS = 64
_NAME = 256  # longest model / user / id-like string


def _default(value: Any) -> Any:
    return lambda v: v is None or v == value


_GRAMMAR = "needs grammar-constrained decoding, which this server does not support yet"
# name -> (accepted when, why any other value is refused); checked on the raw body before validation.
REFUSED_COMMON: dict[str, tuple[Any, str]] = {
    "prompt_logprobs": (_default(None), "prompt logprobs are not computed by this engine"),
    "structured_outputs": (_default(None), _GRAMMAR),
    "guided_json": (_default(None), _GRAMMAR), "guided_regex": (_default(None), _GRAMMAR),
    "guided_choice": (_default(None), _GRAMMAR), "guided_grammar": (_default(None), _GRAMMAR),
    "guided_decoding_backend": (_default(None), _GRAMMAR), "guided_whitespace_pattern": (_default(None), _GRAMMAR),
    "include_stop_str_in_output": (_default(False), "stop strings are always cut from the output"),
    "use_beam_search": (_default(False), "beam search is not supported"),
    "length_penalty": (_default(1.0), "beam search is not supported"),
    "allowed_token_ids": (_default(None), "allowed_token_ids is not supported; use logit_bias"),
    "bad_words": (lambda v: v is None or v == [], "bad_words is not supported; use logit_bias"),
    "truncate_prompt_tokens": (_default(None), "prompts are never truncated; send a shorter prompt"),
    "logits_processors": (_default(None), "custom logits processors are not supported"),
    "return_tokens_as_token_ids": (_default(False), "not supported"),
    "return_token_ids": (_default(False), "not supported"),
    "priority": (_default(0), "request priorities are not supported"),
    "spaces_between_special_tokens": (_default(True), "not supported"),
    "add_special_tokens": (lambda v: v is None or isinstance(v, bool), "must be a boolean"),  # see below
    "cache_salt": (_default(None), "there is no prefix cache"), "kv_transfer_params": (_default(None), "not supported"),
    "vllm_xargs": (_default(None), "not supported"),
}
REFUSED_CHAT: dict[str, tuple[Any, str]] = {
    "audio": (_default(None), "audio output is not supported"),
    "modalities": (lambda v: v is None or v == ["text"], 'only ["text"] is supported'),
    "functions": (_default(None), "deprecated; use tools"), "function_call": (_default(None), "deprecated; use tool_choice"),
    "store": (_default(False), "this server does not store completions"),
    "metadata": (_default(None), "metadata is for stored completions, which this server does not keep"),
    "prediction": (_default(None), "predicted outputs are not supported"),
    "reasoning_effort": (_default(None), "this server's models do not reason"),
    "verbosity": (_default(None), "not supported"),
    "web_search_options": (_default(None), "web search is not supported"),
    "service_tier": (lambda v: v in (None, "auto", "default"), 'only "auto" and "default" are served'),
    "chat_template": (_default(None), "a per-request chat template is not supported"),
    "documents": (_default(None), "not supported"), "mm_processor_kwargs": (_default(None), "not supported"),
    "echo": (_default(False), "echo on chat is not supported"),
}
REFUSED_COMPLETIONS: dict[str, tuple[Any, str]] = {
    "suffix": (lambda v: v is None or v == "", "suffix (insertion) is not supported"),
}


_RESERVED_TEMPLATE_KWARGS = {
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs"}


class StreamOptions(BaseModel):
    """`include_usage`: a last chunk with the request's usage (OpenAI); `continuous_usage_stats`
    (vLLM's key, needs include_usage): usage on every chunk too."""

    model_config = ConfigDict(strict=True, extra="allow")
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class _Request(BaseModel):
    """Fields shared by both endpoints (OpenAI names plus vLLM's extra sampling knobs). Every optional
    field takes null as "the default", as in OpenAI's schema."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    model: str | None = Field(default=None, max_length=_NAME)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool | None = None
    user: str | None = Field(default=None, max_length=_NAME)
    safety_identifier: str | None = Field(default=None, max_length=_NAME)
    prompt_cache_key: str | None = Field(default=None, max_length=_NAME)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    profile: str | None = Field(default=None, max_length=64, description="speculation profile (--allow-profile-override)")


class CompletionRequest(_Request):
    """POST /v1/completions. `prompt`: text, token ids, or a list of either (one choice group each)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    add_special_tokens: bool | None = None


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions. `logprobs` is a bool; `top_logprobs` (0..20) needs it true."""

    messages: list[Any]
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(default=None, max_length=32)


@dataclass
class ParsedRequest:
    """What a generation request asks for, checked.

    Attributes:
        req: the validated body. chat: which endpoint.
        prompts: one typed prompt per choice group (chat: one).
        params: SamplingParams of choice 0 (each engine choice gets `params.for_choice(i)`).
        n: choices returned per prompt; best_of: choices generated per prompt (>= n; > n only without
            streaming: the n with the highest mean token logprob are returned).
        max_tokens_param: the body field that set max_tokens ("max_tokens" or "max_completion_tokens").
        want_logprobs: the client asked for logprobs (they may be computed for best_of alone).
        echo: completions: return the prompt before the output.
        tools: tool definitions (chat); parse_tools: parse tool calls from the output.
        stream, include_usage: streaming options; continuous_usage: `stream_options.continuous_usage_stats`
            (vLLM's key: usage on every chunk; only with include_usage).
        sticky_key: the `user` (else safety_identifier, else prompt_cache_key) for sticky routing.
    """

    req: CompletionRequest | ChatCompletionRequest
    chat: bool
    prompts: list[Prompt]
    params: SamplingParams
    n: int
    best_of: int
    max_tokens_param: str
    want_logprobs: bool
    echo: bool = False
    tools: list[dict[str, Any]] | None = None
    parse_tools: bool = False
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    sticky_key: str | None = None
    unknown: list[tuple[str, str]] = field(default_factory=list)


def _check_refused(body: dict[str, Any], table: dict[str, tuple[Any, str]]) -> None:
    for name, (ok, why) in table.items():
        if name in body and not ok(body[name]):
            raise InvalidRequestError(f"{name} is not supported by this server ({why}), got {shown(body[name])}",
                                      param=name, code="unsupported_parameter")


def parse_request(body: dict[str, Any], *, chat: bool, max_model_len: int, vocab_size: int,
                  notes: UnknownFieldNotes | None = None) -> ParsedRequest:
    """Validate a generation request body (see the module docstring).

    Args:
        max_model_len: context length: max_tokens above max_model_len - 1 is refused here (the server
            checks prompt + max_tokens once the prompt is tokenized).
        vocab_size: token ids (prompt, logit_bias keys, stop_token_ids) must be below it.
        notes: where unknown field names are logged once.

    Raises:
        InvalidRequestError: `param` names the field at fault.
    """
    for name in ("model", "messages" if chat else "prompt"):
        if name in body and body[name] is None:
            raise InvalidRequestError(f"{name} must not be null", param=name)
    _check_refused(body, REFUSED_COMMON)
    _check_refused(body, REFUSED_CHAT if chat else REFUSED_COMPLETIONS)
    clean = {k: v for k, v in body.items() if k not in REFUSED_COMMON and k not in (REFUSED_CHAT if chat else
                                                                                      REFUSED_COMPLETIONS)}
    if not chat and "add_special_tokens" in body:
        clean["add_special_tokens"] = body["add_special_tokens"]
    req = validate_model(ChatCompletionRequest if chat else CompletionRequest, clean)
    unknown = unknown_fields(req)
    if chat:
        messages, typed = parse_messages(req.messages)
        for i, m in enumerate(typed):
            unknown += unknown_fields(m, "messages[]")
    if notes is not None and unknown:
        for where in sorted({w for w, _ in unknown}):
            notes.note(where, [n for w, n in unknown if w == where])
    if req.response_format is not None and req.response_format.type != "text":
        raise InvalidRequestError(f"response_format {req.response_format.type!r} {_GRAMMAR}",
                                  param="response_format", code="unsupported_value")
    if req.stream_options is not None and not req.stream:
        raise InvalidRequestError("stream_options is only allowed when stream is true", param="stream_options")
    n = 1 if req.n is None else req.n
    if isinstance(n, int) and n > MAX_N:
        raise InvalidRequestError(f"n must be at most {MAX_N}, got {n}", param="n")
    best_of, echo, tools, parse_tools = n, False, None, False
    if chat:
        tools, parse_tools = _tools(req)
        prompts: list[Prompt] = [ChatPrompt(
            tuple(messages), tuple(tools) if tools is not None else None,
            add_generation_prompt=True if req.add_generation_prompt is None else req.add_generation_prompt,
            continue_final_message=bool(req.continue_final_message), template_kwargs=req.chat_template_kwargs)]
        reserved = sorted(set(req.chat_template_kwargs or {}) & _RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise InvalidRequestError(f"chat_template_kwargs may not set {reserved[0]!r} (a request field or an "
                                      "option of the tokenizer itself)", param="chat_template_kwargs")
        if req.continue_final_message and req.add_generation_prompt:
            raise InvalidRequestError("continue_final_message and add_generation_prompt cannot both be true",
                                      param="continue_final_message")
        if req.continue_final_message and messages[-1]["role"] != "assistant":
            raise InvalidRequestError("continue_final_message needs an assistant message last",
                                      param="continue_final_message")
    else:
        prompts = completion_prompts(req, vocab_size, max_model_len)
        echo = bool(req.echo)
        if req.best_of is not None:
            best_of = req.best_of
            if not 1 <= best_of <= MAX_N or best_of < n:
                raise InvalidRequestError(f"best_of must be an integer in [n, {MAX_N}] (n = {n}), got {best_of}",
                                          param="best_of")
            if best_of > n and req.stream:
                raise InvalidRequestError("best_of > n cannot be streamed", param="best_of")
        if len(prompts) * best_of > MAX_N * MAX_PROMPTS:
            raise InvalidRequestError(f"prompts x best_of must be at most {MAX_N * MAX_PROMPTS}", param="prompt")
        if echo and req.logprobs is not None:
            raise InvalidRequestError("echo with logprobs needs prompt logprobs, which this engine does not compute",
                                      param="echo", code="unsupported_value")
        if req.add_special_tokens is False:
            raise InvalidRequestError("add_special_tokens false is not supported (the tokenizer adds BOS as the "
                                      "model expects)", param="add_special_tokens", code="unsupported_parameter")
    params, max_tokens_param = sampling_params(req, max_model_len=max_model_len, vocab_size=vocab_size,
                                               internal_logprobs=best_of > n)
    sticky = req.user or req.safety_identifier or req.prompt_cache_key or None
    return ParsedRequest(
        req=req, chat=chat, prompts=prompts, params=params, n=n, best_of=best_of, max_tokens_param=max_tokens_param,
        want_logprobs=_logprobs_count(req) is not None, echo=echo, tools=tools, parse_tools=parse_tools,
        stream=bool(req.stream), include_usage=bool(req.stream_options and req.stream_options.include_usage),
        continuous_usage=bool(req.stream_options and req.stream_options.include_usage
                              and req.stream_options.continuous_usage_stats),
        sticky_key=sticky, unknown=unknown)


def _tools(req: ChatCompletionRequest) -> tuple[list[dict[str, Any]] | None, bool]:
    """(tool dicts for the template, whether to parse tool calls). Raises InvalidRequestError."""
    choice = req.tool_choice
    if not req.tools:
        if choice is not None and choice != "none":
            raise InvalidRequestError("tool_choice needs tools", param="tool_choice")
        return (None if req.tools is None else []), False
    names = [t.function.name for t in req.tools]
    if len(set(names)) != len(names):
        raise InvalidRequestError("tools must have distinct function names", param="tools")
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise InvalidRequestError(f"tool_choice names {choice.function.name!r}, which is not in tools",
                                      param="tool_choice")
        raise InvalidRequestError(f"tool_choice naming a function {_GRAMMAR}", param="tool_choice",
                                  code="unsupported_value")
    if choice == "required":
        raise InvalidRequestError(f"tool_choice \"required\" {_GRAMMAR}", param="tool_choice",
                                  code="unsupported_value")
    if req.parallel_tool_calls is False:
        raise InvalidRequestError(f"parallel_tool_calls false {_GRAMMAR}", param="parallel_tool_calls",
                                  code="unsupported_value")
    return tool_dicts(req.tools), choice != "none"


def completion_prompts(req: CompletionRequest, vocab_size: int, max_model_len: int | None = None) -> list[Prompt]:
    """The prompts of a completions request: one text, one token id list, or a list of either (a token
    id list longer than the context is refused before its ids are checked)."""
    p = req.prompt
    if isinstance(p, str):
        items: list[Any] = [p]
    elif p and all(isinstance(x, int) for x in p):
        items = [p]
    else:
        items = list(p)
    if not items:
        raise InvalidRequestError("prompt must not be empty", param="prompt")
    if len(items) > MAX_PROMPTS:
        raise InvalidRequestError(f"prompt holds {len(items)} prompts; at most {MAX_PROMPTS}", param="prompt")
    out: list[Prompt] = []
    for i, item in enumerate(items):
        where = "prompt" if len(items) == 1 else f"prompt[{i}]"
        if not item:
            raise InvalidRequestError(f"{where} must not be empty", param="prompt")
        if isinstance(item, str):
            out.append(TextPrompt(item))
            continue
        if max_model_len is not None and len(item) > max_model_len - 1:
            raise InvalidRequestError(f"{where} has {len(item)} tokens; this model's context is {max_model_len} tokens "
                                      "(prompt + at least 1 output token)", param="prompt",
                                      code="context_length_exceeded")
        bad = next((t for t in item if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(f"{where}: token ids must be in [0, {vocab_size}), got {bad}", param="prompt")
        out.append(TokenPrompt(tuple(item)))
    return out


def _logprobs_count(req: CompletionRequest | ChatCompletionRequest) -> int | None:
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs to be true", param="top_logprobs")
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs


def sampling_params(req: CompletionRequest | ChatCompletionRequest, *, max_model_len: int | None = None,
                    vocab_size: int | None = None, internal_logprobs: bool = False) -> tuple[SamplingParams, str]:
    """Validated SamplingParams for ONE choice, and the body field that set max_tokens.

    Defaults follow OpenAI: completions max_tokens 16, chat max_tokens unlimited (up to the context);
    temperature 1, top_p 1. `max_completion_tokens` wins over `max_tokens` on both endpoints.

    Raises:
        InvalidRequestError (SamplingParamsError for a value out of range): `param` is the body field,
            e.g. "max_completion_tokens" or "top_logprobs" where those set max_tokens / logprobs.
    """
    is_chat = isinstance(req, ChatCompletionRequest)
    aliases = {"logprobs": "top_logprobs"} if is_chat else {}
    max_tokens, max_param = req.max_tokens, "max_tokens"
    if req.max_completion_tokens is not None:
        max_tokens, max_param = req.max_completion_tokens, "max_completion_tokens"
        aliases["max_tokens"] = max_param
    if max_tokens is None and not is_chat:
        max_tokens = 16
    if max_model_len is not None and max_tokens is not None and isinstance(max_tokens, int) \
            and max_tokens > max_model_len - 1:
        raise InvalidRequestError(f"{max_param} must be at most {max_model_len - 1} (this model's context is "
                                  f"{max_model_len} tokens, prompt included), got {max_tokens}",
                                  param=max_param, code="context_length_exceeded")
    if vocab_size is not None:
        _check_token_ids(req, vocab_size)
    logprobs = _logprobs_count(req)
    if internal_logprobs and logprobs is None:
        logprobs = 0  # best_of ranks choices by their tokens' logprobs
    try:
        params = SamplingParams(
            n=1 if req.n is None else req.n,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            seed=req.seed,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=req.logit_bias,
            stop=req.stop,
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=bool(req.ignore_eos),
            max_tokens=max_tokens,
            min_tokens=req.min_tokens or 0,
            logprobs=logprobs,
            skip_special_tokens=True if req.skip_special_tokens is None else req.skip_special_tokens,
        )
    except SamplingParamsError as e:
        if e.param in aliases:
            raise e.renamed(aliases[e.param]) from None
        raise
    return params, max_param


def _check_token_ids(req: CompletionRequest | ChatCompletionRequest, vocab_size: int) -> None:
    if req.logit_bias is not None:
        if len(req.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequestError(f"logit_bias holds at most {MAX_LOGIT_BIAS} entries", param="logit_bias")
        for key in req.logit_bias:
            if not (key.isascii() and key.isdigit() and len(key) <= 12 and int(key) < vocab_size):
                raise InvalidRequestError(f"logit_bias keys must be token ids in [0, {vocab_size}), got {shown(key)}",
                                          param="logit_bias")
    for t in req.stop_token_ids or []:
        if not 0 <= t < vocab_size:
            raise InvalidRequestError(f"stop_token_ids must be token ids in [0, {vocab_size}), got {t}",
                                      param="stop_token_ids")
