"""OpenAI's chat message and tool schema, strictly: roles, content types, tool calls, tool results.

What it does: `parse_messages()` checks each message against the model of its role (system/developer,
user, assistant, tool; the deprecated "function" role is refused) and returns the plain dicts the chat
template takes: content as text (text parts joined with "\n", as vLLM does), `developer` rendered as
`system`, an assistant's `tool_calls` with their `arguments` JSON decoded to an object (what the
Hermes/Qwen and Llama-3 templates print), a tool result's `tool_call_id` kept. Content null or missing
is refused where OpenAI requires it (system, user, tool; an assistant needs content or tool_calls).
Image, audio and file parts are refused (text-only models). `Tool` / `ToolChoice` / `ResponseFormat` are
the request's tool and output-format objects.
What it does not do: render the template (see `specserve.tokenization`) or parse the model's tool
calls (see `tool_parsers.py`).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from specserve.inputs import InvalidRequestError
from specserve.server.parsing import shown, validate_model

ROLES = ("system", "developer", "user", "assistant", "tool")
TOOL_NAME_PATTERN = r"^[A-Za-z0-9_.\-]{1,64}$"


class _Obj(BaseModel):
    """An OpenAI object: strict types; unknown keys are kept aside (logged once, ignored)."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


class TextPart(_Obj):
    type: Literal["text"]
    text: str


class RefusalPart(_Obj):
    type: Literal["refusal"]
    refusal: str


class FunctionCall(_Obj):
    name: str = Field(pattern=TOOL_NAME_PATTERN)
    arguments: str


class ToolCall(_Obj):
    id: str = Field(max_length=256)
    type: Literal["function"]
    function: FunctionCall


class SystemMessage(_Obj):
    role: Literal["system", "developer"]
    content: str | list[TextPart]
    name: str | None = Field(default=None, max_length=256)


class UserMessage(_Obj):
    role: Literal["user"]
    content: str | list[dict[str, Any]]
    name: str | None = Field(default=None, max_length=256)


class AssistantMessage(_Obj):
    role: Literal["assistant"]
    content: str | list[TextPart | RefusalPart] | None = None
    refusal: str | None = None
    name: str | None = Field(default=None, max_length=256)
    tool_calls: list[ToolCall] | None = None
    function_call: None = None  # deprecated; only null accepted
    audio: None = None
    annotations: list[Any] | None = None


class ToolMessage(_Obj):
    role: Literal["tool"]
    content: str | list[TextPart]
    tool_call_id: str = Field(max_length=256)


_BY_ROLE: dict[str, type[_Obj]] = {"system": SystemMessage, "developer": SystemMessage, "user": UserMessage,
                                   "assistant": AssistantMessage, "tool": ToolMessage}


class FunctionDef(_Obj):
    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Obj):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Obj):
    name: str


class NamedToolChoice(_Obj):
    type: Literal["function"]
    function: NamedFunction


class ResponseFormat(_Obj):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


def _text(content: Any, param: str) -> str:
    """Text of a message's content: a string, or text (and refusal) parts joined with "\n"."""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, TextPart):
            texts.append(part.text)
        elif isinstance(part, RefusalPart):
            texts.append(part.refusal)
        else:  # a user message's raw part
            kind = part.get("type")
            if kind != "text":
                if kind in ("image_url", "input_audio", "file", "image", "audio", "video"):
                    raise InvalidRequestError(f"{param}[{j}].type {kind!r} is not supported: this server's models read "
                                              "text only", param=f"{param}[{j}].type", code="unsupported_value")
                raise InvalidRequestError(f"{param}[{j}].type must be \"text\", got {shown(kind)}",
                                          param=f"{param}[{j}].type")
            texts.append(validate_model(TextPart, part, prefix=f"{param}[{j}]").text)
    return "\n".join(texts)


def parse_messages(raw: Any) -> tuple[list[dict[str, Any]], list[BaseModel]]:
    """Check chat messages; returns (template dicts, the typed messages for unknown-field notes).

    Raises:
        InvalidRequestError: `param` is the message field at fault, e.g. "messages[1].content".
    """
    if not isinstance(raw, list) or not raw:
        raise InvalidRequestError("messages must be a non-empty array of message objects", param="messages")
    out, typed = [], []
    for i, m in enumerate(raw):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise InvalidRequestError(f"{p} must be an object, got {shown(m)}", param=p)
        role = m.get("role")
        if role == "function":
            raise InvalidRequestError(f'{p}.role "function" is deprecated and not supported; send tool results as '
                                      'role "tool" with tool_call_id', param=f"{p}.role", code="unsupported_value")
        if role not in _BY_ROLE:
            raise InvalidRequestError(f"{p}.role must be one of {', '.join(ROLES)}, got {shown(role)}",
                                      param=f"{p}.role")
        msg = validate_model(_BY_ROLE[role], m, prefix=p)
        typed.append(msg)
        d: dict[str, Any] = {"role": "system" if role == "developer" else role}
        if isinstance(msg, AssistantMessage):
            if msg.content is None and not msg.tool_calls:
                raise InvalidRequestError(f"{p}.content is required unless tool_calls is given",
                                          param=f"{p}.content", code="missing_required_parameter")
            d["content"] = _text(msg.content, f"{p}.content") if msg.content is not None else None
            if msg.tool_calls:
                d["tool_calls"] = [{"id": c.id, "type": "function",
                                    "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                                   for c in msg.tool_calls]
        else:
            d["content"] = _text(msg.content, f"{p}.content")
        if getattr(msg, "name", None) is not None:
            d["name"] = msg.name
        if isinstance(msg, ToolMessage):
            d["tool_call_id"] = msg.tool_call_id
        out.append(d)
    return out, typed


def _arguments(text: str) -> Any:
    """A tool call's `arguments` string as the object chat templates print; kept as text if not JSON."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return text
    return value if isinstance(value, dict) else text


def tool_dicts(tools: list[Tool]) -> list[dict[str, Any]]:
    """Tools as the chat template takes them (OpenAI's shape, unknown keys dropped)."""
    return [{"type": "function", "function": t.function.model_dump(exclude_none=True, exclude=set(t.function.model_extra or {}))}
            for t in tools]
