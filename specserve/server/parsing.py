"""The request-parsing layer: raw body bytes -> a validated pydantic request, or an `InvalidRequestError`.

What it does, and nothing past it can raise on a client's input:
- `parse_json_body()`: UTF-8, JSON with no `NaN`/`Infinity` literals, integers of at most 4300 digits,
  nesting at most `MAX_JSON_DEPTH` levels (checked on the parsed value with an explicit stack, and a
  decoder `RecursionError` is caught), a JSON object at the top. Every failure is an
  `InvalidRequestError` (HTTP 400) with a one-line message and no internal text.
- `validate_model()`: pydantic (strict mode: no string-to-bool, no bool-to-int, no float-to-int, finite
  numbers only) -> the first error becomes an `InvalidRequestError` whose `param` is the path of the
  field at fault as the client spelt it (`stream_options.include_usage`, `tools[0].function.name`) and
  whose message says what the field must be; no class names, no Python text.
- `note_unknown_fields()`: fields nobody defines are logged once per name and ignored (vLLM's rule).
What it does not do: decide ranges (`SamplingParams`' range table) or what a field means
(`protocol.py`, `messages.py`).
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

from pydantic import BaseModel, ValidationError

from specserve.inputs import InvalidRequestError

logger = logging.getLogger("specserve.server")

MAX_JSON_DEPTH = 32
_MAX_SHOWN = 60  # characters of a client's value quoted back in a message

_EXPECTED = {
    "int_type": "must be an integer", "int_parsing": "must be an integer",
    "float_type": "must be a number", "float_parsing": "must be a number", "finite_number": "must be a finite number",
    "bool_type": "must be a boolean (true or false)", "bool_parsing": "must be a boolean (true or false)",
    "string_type": "must be a string", "list_type": "must be an array", "tuple_type": "must be an array",
    "dict_type": "must be an object", "model_type": "must be an object", "model_attributes_type": "must be an object",
    "missing": "is required", "none_required": "must be null", "extra_forbidden": "is not a known field",
    "too_short": "is too short", "too_long": "is too long", "string_too_long": "is too long",
    "string_too_short": "must not be empty", "string_pattern_mismatch": "has characters that are not allowed",
}


# what a union-typed field must be, said once (pydantic reports each alternative separately)
UNION_TEXT = {
    "prompt": "must be a string, an array of token ids, or an array of strings or of token id arrays",
    "stop": "must be a string or an array of strings",
    "content": "must be a string or an array of content parts",
    "tool_choice": 'must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
}


def _reject_constant(name: str) -> Any:
    raise InvalidRequestError(f"request body is not valid JSON: {name} is not a JSON value", code="invalid_json")


def parse_json_body(raw: bytes, *, what: str = "request body") -> dict[str, Any]:
    """Parse a request body into a dict.

    Raises:
        InvalidRequestError: not UTF-8, not JSON, NaN/Infinity, an integer of more than 4300 digits,
            nested deeper than MAX_JSON_DEPTH, or not a JSON object (param None, code "invalid_json").
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRequestError(f"{what} is not valid UTF-8", code="invalid_json") from None
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise InvalidRequestError(f"{what} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}",
                                  code="invalid_json") from None
    except RecursionError:
        raise InvalidRequestError(f"{what} is nested more than {MAX_JSON_DEPTH} levels deep",
                                  code="invalid_json") from None
    except ValueError:  # int() of more than sys.get_int_max_str_digits() digits
        raise InvalidRequestError(f"{what} holds a number with too many digits", code="invalid_json") from None
    if json_depth(body) > MAX_JSON_DEPTH:
        raise InvalidRequestError(f"{what} is nested more than {MAX_JSON_DEPTH} levels deep", code="invalid_json")
    if not isinstance(body, dict):
        raise InvalidRequestError(f"{what} must be a JSON object", code="invalid_json")
    return body


def json_depth(value: Any, limit: int = MAX_JSON_DEPTH) -> int:
    """Nesting depth of a parsed JSON value (a scalar is 0, `[]` is 1), counted with an explicit stack and
    stopping as soon as it passes `limit` (then `limit + 1` is returned)."""
    deepest = 0
    stack = [(value, 1)] if isinstance(value, (list, dict)) else []
    while stack:
        node, depth = stack.pop()
        if depth > deepest:
            deepest = depth
            if deepest > limit:
                return deepest
        for child in (node.values() if isinstance(node, dict) else node):
            if isinstance(child, (list, dict)):
                stack.append((child, depth + 1))
    return deepest


def shown(value: Any, limit: int = _MAX_SHOWN) -> str:
    """A client's value for a message, cut to `limit` characters."""
    try:
        s = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        s = type(value).__name__
    return s if len(s) <= limit else s[: limit - 3] + "..."


def _field_names(model: type[BaseModel], seen: set[type] | None = None) -> set[str]:
    """Every field name of `model` and the models nested in it (to tell a field from a union tag in a
    pydantic error location)."""
    seen = seen if seen is not None else set()
    if model in seen:
        return set()
    seen.add(model)
    names = set(model.model_fields)
    for f in model.model_fields.values():
        for t in _nested_models(f.annotation):
            names |= _field_names(t, seen)
    return names


def _nested_models(annotation: Any) -> list[type[BaseModel]]:
    out = []
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    for arg in getattr(annotation, "__args__", ()) or ():
        out += _nested_models(arg)
    return out


def error_param(loc: tuple, names: set[str]) -> str | None:
    """`('tools', 0, 'function', 'name')` -> "tools[0].function.name"; stops at the first location part
    that is not a field name or list index (a union member's tag, a dict key)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and part in names:
            out += f".{part}" if out else part
        else:
            break
    return out or None


def validate_model(model: type[BaseModel], body: dict[str, Any], *, prefix: str = "") -> BaseModel:
    """`model.model_validate(body)`, with errors as one InvalidRequestError naming the field.

    Args:
        prefix: prepended to the param ("messages[2]" when validating one message).

    Raises:
        InvalidRequestError: the first field at fault as `param`; the message says what it must be
            (for a union field, every alternative).
    """
    try:
        return model.model_validate(body)
    except ValidationError as e:
        names = _field_names(model)
        errors = e.errors(include_url=False)
        param = error_param(tuple(errors[0]["loc"]), names)
        same = [x for x in errors if error_param(tuple(x["loc"]), names) == param]
        reasons = []
        for x in same:
            reason = _EXPECTED.get(x["type"]) or _plain(x["msg"])
            if reason not in reasons:
                reasons.append(reason)
        leaf = (param or "").rsplit(".", 1)[-1].split("[")[0]
        if len(reasons) > 1 and leaf in UNION_TEXT:
            reasons = [UNION_TEXT[leaf]]
        full = f"{prefix}.{param}" if prefix and param else (prefix or param)
        what = full or "request body"
        got = "" if errors[0]["type"] == "missing" else f", got {shown(errors[0].get('input'))}"
        raise InvalidRequestError(f"{what} {' or '.join(reasons)}{got}", param=full,
                                  code="missing_required_parameter" if errors[0]["type"] == "missing" else None) from None


def _plain(msg: str) -> str:
    """pydantic's message without class names ("... or instance of X")."""
    msg = msg.split(" or instance of ")[0]
    return msg[:1].lower() + msg[1:] if msg else "is not valid"


class UnknownFieldNotes:
    """Logs each unknown request field name once (a warning), then stays quiet about it."""

    def __init__(self, max_names: int = 1000):
        self._seen: set[str] = set()
        self._lock = threading.Lock()
        self._max = max_names

    def note(self, where: str, names: list[str]) -> None:
        new = []
        with self._lock:
            for n in names:
                key = f"{where}.{n}"[:200]
                if key not in self._seen and len(self._seen) < self._max:
                    self._seen.add(key)
                    new.append(n[:80])
        if new:
            logger.warning("ignoring request field(s) this server does not know, in %s: %s (logged once per name)",
                           where, ", ".join(new))


def unknown_fields(obj: BaseModel, path: str = "") -> list[tuple[str, str]]:
    """(where, name) of every unknown field in `obj` and its nested models."""
    out = [(path or "body", k) for k in (obj.model_extra or {})]
    for name in type(obj).model_fields:
        value = getattr(obj, name, None)
        items = value if isinstance(value, list) else [value]
        for i, v in enumerate(items):
            if isinstance(v, BaseModel):
                sub = f"{path + '.' if path else ''}{name}" + ("[]" if isinstance(value, list) else "")
                out += unknown_fields(v, sub)
    return out
