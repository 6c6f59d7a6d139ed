"""Tool-call parsers: Hermes/Qwen `<tool_call>` blocks (and the bare call objects small Qwen models emit),
Llama-3 JSON, streamed in pieces equal to the whole-text parse, and ordinary JSON never taken for a call."""

import json

import pytest

from specserve.server.tool_parsers import ToolCallStream, detect_tool_parser, parse_tool_calls

NAMES = {"get_weather", "get_time"}
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def _calls(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("parser, text, content, calls", [
    ("hermes", f"<tool_call>\n{CALL}\n</tool_call>", None, [("get_weather", {"city": "Paris"})]),
    ("hermes", f"Let me check.\n<tool_call>\n{CALL}\n</tool_call>\n<tool_call>"
               '{"name": "get_time", "arguments": {}}</tool_call>', "Let me check.",
     [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("hermes", CALL, None, [("get_weather", {"city": "Paris"})]),  # qwen2.5-coder-0.5b leaves the tags out
    ("hermes", CALL + "\n" + CALL, None, [("get_weather", {"city": "Paris"})] * 2),
    ("hermes", '{"name": "other", "arguments": {}}', '{"name": "other", "arguments": {}}', []),  # not a tool
    ("hermes", '{"a": 1}', '{"a": 1}', []),  # an ordinary JSON answer
    ("hermes", "<tool_call>{broken</tool_call> hi", "<tool_call>{broken</tool_call> hi", []),
    ("hermes", "no calls here", "no calls here", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
     [("get_weather", {"city": "Paris"})]),
    ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {}}; ' + CALL, None,
     [("get_time", {}), ("get_weather", {"city": "Paris"})]),
    ("llama3_json", "The weather is nice.", "The weather is nice.", []),
    ("llama3_json", '{"name": "get_weather", "parameters": "not an object"}',
     '{"name": "get_weather", "parameters": "not an object"}', []),
])
def test_parse_and_stream_agree(parser, text, content, calls):
    got_content, got_calls = parse_tool_calls(parser, text, NAMES)
    assert got_content == content and _calls(got_calls) == calls
    assert all(c.id.startswith("call_") for c in got_calls)
    for size in (1, 3, 7, 1000):  # streamed in pieces of every size: same calls, same content
        s = ToolCallStream(parser, NAMES)
        out, streamed = "", []
        for i in range(0, len(text), size):
            piece, found = s.feed(text[i:i + size])
            out, streamed = out + piece, streamed + found
        piece, found = s.finish()
        out, streamed = out + piece, streamed + found
        assert _calls(streamed) == calls
        assert out.strip() == (content or "").strip()


def test_content_before_a_call_streams_at_once():
    s = ToolCallStream("hermes", NAMES)
    assert s.feed("Sure, ")[0] == "Sure, "
    assert s.feed("<tool")[0] == ""  # held: could be the start of a tag
    assert s.feed("_call>" + CALL)[0] == ""
    content, calls = s.feed("</tool_call>")
    assert content == "" and _calls(calls) == [("get_weather", {"city": "Paris"})]


def test_detect_from_chat_template():
    assert detect_tool_parser("... <tool_call>\n{...}\n</tool_call> ...") == "hermes"
    assert detect_tool_parser("{{- '<|python_tag|>' }}") == "llama3_json"
    assert detect_tool_parser("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert detect_tool_parser(None) is None
