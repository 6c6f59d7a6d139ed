"""Structured output and forced tool calls at the HTTP boundary: request fields -> one
`StructuredOutputsParams`, and a forced call's output -> `tool_calls` (docs/structured-output.md).

What it does:
- `output_constraint()` reads OpenAI's `response_format` (`json_object`; `json_schema` with its `schema`),
  vLLM's `structured_outputs` (`json`, `regex`, `choice`, `json_object`; its other keys are refused
  with a 400 naming them) and vLLM's older `guided_json` / `guided_regex` / `guided_choice`, and
  `tool_choice` "required" / a named function on chat; more than one of them is a 400 naming the
  second. `tool_choice` follows vLLM: "required" constrains the output to a JSON array (at least one
  item; one with `parallel_tool_calls: false`) of `{"name": <a tool's name>, "parameters": <its
  parameters schema>}`; a named function constrains it to that function's parameters object.
- `parse_forced()` / `ForcedToolStream` turn such an output into `tool_calls` (an output the length
  limit cut, which no longer parses, stays content).
What it does not do: compile the grammar (the engine's `GrammarCompiler`, called by the server on its
tokenizer thread) or parse free-form tool calls (`tool_parsers.py`).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from specserve.inputs import InvalidRequestError
from specserve.sampling_params import StructuredOutputsParams
from specserve.server.messages import NamedToolChoice
from specserve.server.tool_parsers import ToolCall

# vLLM's structured_outputs keys this server does not implement: refused unless null / false
_SO_REFUSED = ("grammar", "structural_tag", "whitespace_pattern", "disable_fallback", "disable_any_whitespace",
               "disable_additional_properties")
_SO_KEYS = ("json", "regex", "choice", "json_object")
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def _from_structured_outputs(so: Any) -> StructuredOutputsParams:
    if not isinstance(so, dict):
        raise InvalidRequestError("structured_outputs must be an object with one of json, regex, choice, json_object",
                                  param="structured_outputs")
    for key, value in so.items():
        if key in _SO_REFUSED:
            if value not in (None, False, ""):
                raise InvalidRequestError(f"structured_outputs.{key} is not supported by this server (json, regex, "
                                          "choice and json_object are)", param=f"structured_outputs.{key}",
                                          code="unsupported_parameter")
        elif key not in _SO_KEYS:
            raise InvalidRequestError(f"structured_outputs has no field {key!r} (json, regex, choice, json_object)",
                                      param=f"structured_outputs.{key}")
    given = [k for k in _SO_KEYS if so.get(k) not in (None, False)]
    if len(given) != 1:
        raise InvalidRequestError("structured_outputs must set exactly one of json, regex, choice, json_object, got "
                                  f"{given or 'none'}", param="structured_outputs")
    key = given[0]
    value = so[key]
    if key == "json_object" and value is not True:
        raise InvalidRequestError("structured_outputs.json_object must be true", param="structured_outputs.json_object")
    return _params(key, value, f"structured_outputs.{key}")


def _params(key: str, value: Any, param: str) -> StructuredOutputsParams:
    """One constraint; a value of the wrong type is a 400 naming `param` (from SamplingParamsError)."""
    if key == "json":
        return StructuredOutputsParams(json=value, param=param)
    if key == "json_object":
        return StructuredOutputsParams(json_object=True, param=param)
    if key == "regex":
        return StructuredOutputsParams(regex=value, param=param)
    return StructuredOutputsParams(choice=value, param=param)


def _from_response_format(rf: Any) -> StructuredOutputsParams | None:
    if rf is None or rf.type == "text":
        if rf is not None and rf.json_schema is not None:
            raise InvalidRequestError('response_format.json_schema needs type "json_schema"',
                                      param="response_format.json_schema")
        return None
    if rf.type == "json_object":
        return StructuredOutputsParams(json_object=True, param="response_format")
    js = rf.json_schema
    if not isinstance(js, dict):
        raise InvalidRequestError('response_format.json_schema is required with type "json_schema": '
                                  '{"name": ..., "schema": {...}}',
                                  param="response_format.json_schema", code="missing_required_parameter")
    if not isinstance(js.get("name"), str) or not js["name"]:
        raise InvalidRequestError("response_format.json_schema.name must be a non-empty string",
                                  param="response_format.json_schema.name")
    if "strict" in js and js["strict"] is not None and not isinstance(js["strict"], bool):
        raise InvalidRequestError("response_format.json_schema.strict must be a boolean",
                                  param="response_format.json_schema.strict")
    schema = js.get("schema")
    if schema is None:
        schema = {}  # OpenAI: no schema means any JSON value
    if not isinstance(schema, dict):
        raise InvalidRequestError("response_format.json_schema.schema must be a JSON schema object",
                                  param="response_format.json_schema.schema")
    return StructuredOutputsParams(json=schema, param="response_format.json_schema.schema")


def tool_choice_schema(tools: list[Any], choice: Any, parallel_tool_calls: bool | None) -> tuple[dict, str]:
    """(the JSON schema the output must follow, the forced mode: "required" or the function's name)."""
    if isinstance(choice, NamedToolChoice):
        fn = next(t.function for t in tools if t.function.name == choice.function.name)
        return (fn.parameters if fn.parameters is not None else _EMPTY_PARAMETERS), fn.name
    items = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [t.function.name]},
                             "parameters": t.function.parameters if t.function.parameters is not None
                             else _EMPTY_PARAMETERS},
              "required": ["name", "parameters"]} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    return schema, "required"


def output_constraint(req: Any, chat: bool) -> tuple[StructuredOutputsParams | None, str | None]:
    """(the request's output constraint or None, the forced tool mode or None); see the module docstring.

    Raises:
        InvalidRequestError / SamplingParamsError: `param` names the field at fault.
    """
    found: list[tuple[str, StructuredOutputsParams]] = []
    rf = _from_response_format(req.response_format)
    if rf is not None:
        found.append(("response_format", rf))
    if req.structured_outputs is not None:
        found.append(("structured_outputs", _from_structured_outputs(req.structured_outputs)))
    for key in ("json", "regex", "choice"):
        value = getattr(req, f"guided_{key}")
        if value is not None:
            found.append((f"guided_{key}", _params(key, value, f"guided_{key}")))
    forced = None
    if chat and req.tools and (req.tool_choice == "required" or isinstance(req.tool_choice, NamedToolChoice)):
        schema, forced = tool_choice_schema(req.tools, req.tool_choice, req.parallel_tool_calls)
        found.append(("tool_choice", StructuredOutputsParams(json=schema, param="tool_choice")))
    if len(found) > 1:
        first, second = found[0][0], found[1][0]
        raise InvalidRequestError(f"{second} cannot be combined with {first}: a request has one output constraint",
                                  param=second)
    return (found[0][1] if found else None), forced


def _new_call(name: str, arguments: Any) -> ToolCall:
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", name, json.dumps(arguments, ensure_ascii=False))


def parse_forced(forced: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of an output constrained by `tool_choice_schema`: "required" -> every array
    item's call; a function's name -> one call whose arguments are the output object. An output that
    does not parse (cut by max_tokens) is returned as content with no calls."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return text, []
    if forced == "required":
        if not (isinstance(value, list) and value and all(isinstance(v, dict) and isinstance(v.get("name"), str)
                                                         and isinstance(v.get("parameters"), dict) for v in value)):
            return text, []
        return None, [_new_call(v["name"], v["parameters"]) for v in value]
    if not isinstance(value, dict):
        return text, []
    return None, [_new_call(forced, value)]


class ForcedToolStream:
    """`ToolCallStream`'s interface for a forced call: the output is held (it is JSON, not content) and
    parsed once it ends, then sent as `tool_calls` deltas (or as content when it does not parse)."""

    def __init__(self, forced: str):
        self.forced = forced
        self.buf = ""
        self.num_calls = 0

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self.buf += delta
        return "", []

    def finish(self) -> tuple[str, list[ToolCall]]:
        content, calls = parse_forced(self.forced, self.buf)
        self.buf = ""
        self.num_calls += len(calls)
        return (content or ""), calls
