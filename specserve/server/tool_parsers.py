"""Tool-call parsers: a model's text -> OpenAI `tool_calls`, whole or as it streams.

What it does: two formats, chosen by `--tool-call-parser` or, by default, from the model's chat
template (`detect_tool_parser`):
- `hermes` (Hermes, Qwen2/2.5/3): calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks anywhere in the text; the text outside them is the message content. Small Qwen models often
  leave the tags out and answer with bare call objects only, so an output that is nothing but call
  objects (one per line) is parsed too.
- `llama3_json` (Llama 3.1+): the whole output (after an optional `<|python_tag|>`) is one or more call
  objects `{"name": ..., "parameters": {...}}` separated by `;` or newlines.
A call object counts only when its `name` is one of the request's tools and its arguments are a JSON
object; anything else stays content, so a model's ordinary JSON answer is never taken for a call.
`ToolCallStream` gives the same result chunk by chunk: content before a call streams at once (holding
back only what could be the start of a `<tool_call>` tag), an output that starts with `{` or
`<|python_tag|>` is held until it ends, and each call goes out as one delta when its block closes.
What it does not do: constrain the model to emit a call (tool_choice "required" / named needs grammar
decoding; refused in `protocol.py`).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

PARSERS = ("hermes", "llama3_json")
_OPEN, _CLOSE, _PY_TAG = "<tool_call>", "</tool_call>", "<|python_tag|>"


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: `arguments` is JSON text, as OpenAI sends it."""

    id: str
    name: str
    arguments: str

    def to_dict(self, index: int | None = None) -> dict[str, Any]:
        d: dict[str, Any] = {"id": self.id, "type": "function",
                             "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            d = {"index": index, **d}
        return d


def detect_tool_parser(chat_template: Any) -> str | None:
    """The parser a chat template's tool format calls for, or None when it shows no tool format."""
    text = chat_template if isinstance(chat_template, str) else json.dumps(chat_template or "")
    if _OPEN in text:
        return "hermes"
    if _PY_TAG in text or ('"parameters"' in text and "function call" in text.lower()):
        return "llama3_json"
    return None


def _call(obj: Any, tool_names: set[str]) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in tool_names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models emit the arguments already as JSON text
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", obj["name"], json.dumps(args, ensure_ascii=False))


def _objects(text: str, separators: str) -> list[Any] | None:
    """The JSON values `text` is made of (separated by whitespace and `separators`), or None."""
    dec = json.JSONDecoder()
    out, i, n = [], 0, len(text)
    while True:
        while i < n and (text[i].isspace() or text[i] in separators):
            i += 1
        if i >= n:
            return out or None
        try:
            value, i = dec.raw_decode(text, i)
        except (ValueError, RecursionError):
            return None
        out.append(value)


def _bare_calls(text: str, tool_names: set[str], separators: str) -> list[ToolCall] | None:
    objs = _objects(text, separators)
    if not objs:
        return None
    calls = [_call(o, tool_names) for o in objs]
    return calls if all(c is not None for c in calls) else None  # type: ignore[return-value]


def parse_tool_calls(parser: str, text: str, tool_names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished output; content is None when the output was only calls."""
    if parser == "llama3_json":
        body = text.strip()
        body = body[len(_PY_TAG):] if body.startswith(_PY_TAG) else body
        calls = _bare_calls(body, tool_names, ";")
        return (None, calls) if calls else (text, [])
    calls = _bare_calls(text, tool_names, "")
    if calls:
        return None, calls
    content, found, pos = [], [], 0
    while True:
        start = text.find(_OPEN, pos)
        if start < 0:
            content.append(text[pos:])
            break
        end = text.find(_CLOSE, start)
        block = text[start + len(_OPEN): end if end >= 0 else len(text)]
        objs = _objects(block, "")
        parsed = [_call(o, tool_names) for o in objs] if objs else [None]
        if all(c is not None for c in parsed):
            content.append(text[pos:start])
            found += parsed
        else:
            content.append(text[pos: end + len(_CLOSE) if end >= 0 else len(text)])
        if end < 0:
            break
        pos = end + len(_CLOSE)
    if not found:
        return text, []
    rest = "".join(content).strip()
    return (rest or None), found


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (held back while streaming)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class ToolCallStream:
    """Incremental `parse_tool_calls`: `feed(delta)` and, at the end, `finish()` each return
    (content delta, new calls); the concatenation equals the whole-text parse."""

    def __init__(self, parser: str, tool_names: set[str]):
        self.parser, self.tool_names = parser, tool_names
        self.buf = ""
        self.mode = "start"  # start -> whole (held to the end) | text (hermes: content and tagged blocks)
        self.num_calls = 0

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self.buf += delta
        if self.mode == "start":
            head = self.buf.lstrip()
            if not head or (self.parser == "llama3_json" and _PY_TAG.startswith(head[: len(_PY_TAG)])
                            and len(head) < len(_PY_TAG)):
                return "", []
            if head.startswith("{") or head.startswith(_PY_TAG):
                self.mode = "whole"
            else:
                self.mode = "text"
        if self.mode == "whole":
            return "", []
        if self.parser == "llama3_json":
            out, self.buf = self.buf, ""
            return out, []
        return self._hermes(final=False)

    def _hermes(self, final: bool) -> tuple[str, list[ToolCall]]:
        out, calls = [], []
        while True:
            start = self.buf.find(_OPEN)
            if start < 0:
                keep = 0 if final else _held_prefix(self.buf, _OPEN)
                out.append(self.buf[: len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                break
            end = self.buf.find(_CLOSE, start)
            if end < 0 and not final:
                out.append(self.buf[:start])
                self.buf = self.buf[start:]
                break
            stop = end + len(_CLOSE) if end >= 0 else len(self.buf)
            block = self.buf[:stop] if end >= 0 else self.buf
            content, found = parse_tool_calls("hermes", self.buf[start:stop], self.tool_names)
            out.append(self.buf[:start])
            if found:
                calls += found
            else:
                out.append(block[start:])
            self.buf = self.buf[stop:]
            if end < 0:
                break
        self.num_calls += len(calls)
        return "".join(out), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        if self.mode in ("start", "whole"):
            text, self.buf = self.buf, ""
            content, calls = parse_tool_calls(self.parser, text, self.tool_names)
            self.num_calls += len(calls)
            return (content or ""), calls
        if self.parser == "llama3_json":
            out, self.buf = self.buf, ""
            return out, []
        return self._hermes(final=True)
