"""A catalogue of bad requests for every endpoint, and the check every answer must pass.

What it does: `catalogue()` lists named bad requests (kind, method, path, body bytes, the `param` the
400 must name, or None where no single field is at fault): for every field of both generation
endpoints, values of the wrong type (string-for-number, bool-for-int, float-for-int, string-for-bool,
arrays, objects, null where OpenAI forbids it) and out of range (negative, zero, 2^31 .. 1e308, beyond 64
bits, tiny top_p), the chat message schema (roles, content null / missing / of the wrong type, image
parts, tool messages without tool_call_id), tools and tool_choice, refused fields, bodies that are not
JSON, too deep, NaN, not objects, and admin bodies. `random_body()` draws a random mutation of a valid
body (for the property-based test). `check_answer()` is the property: a 4xx with an OpenAI-shaped body
(naming the expected `param`), or a valid 2xx (no error inside, a known finish_reason); never a 5xx,
never internal text (exception names, tracebacks, module paths) in any body.
Used by tests/unit/test_server_fuzz.py (bounded, in CI) and benchmarks/server_reliability.py (the
recorded run). What it does not do: send anything (the callers do).
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from typing import Any

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
BASE_CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
BASE_COMPLETIONS = {"prompt": "hi", "max_tokens": 3}
INTERNAL = ("Traceback", "RecursionError", "ValidationError", "pydantic", "specserve.", "File \"", "KeyError",
            "TypeError", "AttributeError", "NoneType", "object has no attribute", "instance of")
FINISH_REASONS = {"stop", "length", "tool_calls"}

_INT_FIELDS = ["max_tokens", "max_completion_tokens", "n", "seed", "top_k", "min_tokens"]
_FLOAT_FIELDS = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"]
_BOOL_FIELDS = ["stream", "ignore_eos", "skip_special_tokens"]
_WRONG_FOR_INT = ["1", True, 1.5, 2.0, [], {}, "lots"]
_WRONG_FOR_FLOAT = ["0.5", True, [], {}, "x"]
_WRONG_FOR_BOOL = ["true", "yes", 1, 0, [], {}]
_OUT_OF_RANGE = {
    "max_tokens": [0, -1, 2**31, 2**63, 10**30], "max_completion_tokens": [0, -5, 2**31, 10**30],
    "n": [0, -1, 17, 1000], "seed": [2**64, -(2**64), 10**40], "top_k": [-2, 2**40],
    "min_tokens": [-1, 2**40], "temperature": [-0.1, 1e308, 101, 1e10], "top_p": [0, 1e-300, 1e-7, 1.5, -1],
    "min_p": [-0.1, 1.1], "presence_penalty": [-2.1, 3, 1e308], "frequency_penalty": [2.5, -1e308],
    "repetition_penalty": [0, 0.001, 101, -1],
}


@dataclass(frozen=True)
class BadRequest:
    """One catalogued bad request. `param` None: no single field is at fault (e.g. not JSON)."""

    kind: str
    method: str
    path: str
    body: bytes
    param: str | None
    statuses: tuple[int, ...] = (400,)


def _j(d: Any) -> bytes:
    return json.dumps(d).encode()


def _with(base: dict, **kw: Any) -> dict:
    d = json.loads(json.dumps(base))
    d.update(kw)
    return d


def catalogue(admin: bool = True) -> list[BadRequest]:
    """Every catalogued bad request (about 400; the benchmark sends each under several variants)."""
    out: list[BadRequest] = []
    for path, base in ((COMPLETIONS, BASE_COMPLETIONS), (CHAT, BASE_CHAT)):
        ep = "chat" if path == CHAT else "completions"
        for f in _INT_FIELDS:
            for v in _WRONG_FOR_INT:
                out.append(BadRequest(f"{ep}:{f}:type:{type(v).__name__}", "POST", path, _j(_with(base, **{f: v})), f))
        for f in _FLOAT_FIELDS:
            for v in _WRONG_FOR_FLOAT:
                out.append(BadRequest(f"{ep}:{f}:type:{type(v).__name__}", "POST", path, _j(_with(base, **{f: v})), f))
        for f in _BOOL_FIELDS:
            for v in _WRONG_FOR_BOOL:
                out.append(BadRequest(f"{ep}:{f}:type:{type(v).__name__}", "POST", path, _j(_with(base, **{f: v})), f))
        for f, values in _OUT_OF_RANGE.items():
            for v in values:
                out.append(BadRequest(f"{ep}:{f}:range", "POST", path, _j(_with(base, **{f: v})), f))
        for v in [3, [""], ["x"] * 17, [1], {"a": 1}, ["x" * 600]]:
            out.append(BadRequest(f"{ep}:stop:bad", "POST", path, _j(_with(base, stop=v)), "stop"))
        for v in [{"a": 1}, {"5": 101}, {"5": "x"}, {"99999999": 1}, [1], "x", {"-1": 1}]:
            out.append(BadRequest(f"{ep}:logit_bias:bad", "POST", path, _j(_with(base, logit_bias=v)), "logit_bias"))
        for v in [[-1], [10**9], ["1"], [True], 5]:
            out.append(BadRequest(f"{ep}:stop_token_ids:bad", "POST", path, _j(_with(base, stop_token_ids=v)),
                                  "stop_token_ids"))
        out.append(BadRequest(f"{ep}:model:null", "POST", path, _j(_with(base, model=None)), "model"))
        out.append(BadRequest(f"{ep}:model:type", "POST", path, _j(_with(base, model=5)), "model"))
        out.append(BadRequest(f"{ep}:model:unknown", "POST", path, _j(_with(base, model="nope")), "model", (404,)))
        out.append(BadRequest(f"{ep}:user:type", "POST", path, _j(_with(base, user=5)), "user"))
        out.append(BadRequest(f"{ep}:user:long", "POST", path, _j(_with(base, user="u" * 300)), "user"))
        out.append(BadRequest(f"{ep}:stream_options:without_stream", "POST", path,
                              _j(_with(base, stream_options={"include_usage": True})), "stream_options"))
        for v in ["yes", 1]:
            out.append(BadRequest(f"{ep}:stream_options.include_usage:type", "POST", path,
                                  _j(_with(base, stream=True, stream_options={"include_usage": v})),
                                  "stream_options.include_usage"))
        for v, param in [({"type": "nope"}, "response_format.type"), ("json", "response_format"),
                         ({}, "response_format.type"), ({"type": "json_schema"}, "response_format.json_schema"),
                         ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}},
                          "response_format.json_schema.schema"),
                         ({"type": "json_schema", "json_schema": {"name": "x", "schema": []}},
                          "response_format.json_schema.schema")]:
            out.append(BadRequest(f"{ep}:response_format", "POST", path, _j(_with(base, response_format=v)), param))
        for v, param in [({"regex": "a("}, "structured_outputs.regex"), ({"grammar": "root ::= x"},
                          "structured_outputs.grammar"), ({}, "structured_outputs"), ("a+", "structured_outputs"),
                         ({"regex": "a+", "choice": ["a"]}, "structured_outputs"),
                         ({"json": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}, "structured_outputs.json"),
                         ({"choice": []}, "structured_outputs.choice")]:
            out.append(BadRequest(f"{ep}:structured_outputs", "POST", path, _j(_with(base, structured_outputs=v)), param))
        out.append(BadRequest(f"{ep}:structured_outputs:with_response_format", "POST", path,
                              _j(_with(base, response_format={"type": "json_object"}, structured_outputs={"regex": "a"})),
                              "structured_outputs"))
        out.append(BadRequest(f"{ep}:guided_regex:bad", "POST", path, _j(_with(base, guided_regex="[a")), "guided_regex"))
        for name, v in [("prompt_logprobs", 1), ("guided_grammar", "root ::= x"), ("guided_whitespace_pattern", " "),
                        ("use_beam_search", True), ("include_stop_str_in_output", True),
                        ("truncate_prompt_tokens", 5), ("priority", 1), ("allowed_token_ids", [1])]:
            out.append(BadRequest(f"{ep}:refused:{name}", "POST", path, _j(_with(base, **{name: v})), name))
        for raw, kind in [(b"[" * 1000 + b"]" * 1000, "deep"), (b'{"a":' * 40 + b"1" + b"}" * 40, "deep_object"),
                          (b'{"prompt": NaN}', "nan"), (b'{"max_tokens": Infinity}', "infinity"),
                          (b"\xff\xfe\x00", "not_utf8"), (b"{", "truncated"), (b"[]", "array"), (b'"x"', "string"),
                          (b"null", "null"), (b"", "empty"), (b'{"n": 1' + b"0" * 5000 + b"}", "huge_int")]:
            out.append(BadRequest(f"{ep}:body:{kind}", "POST", path, raw, None))
    out += _completions_only() + _chat_only()
    if admin:
        for raw, kind in [(b"[" * 1000 + b"]" * 1000, "deep"), (b"{", "truncated"), (b"[]", "array"),
                          (_j({"weights": {"baseline": 1e308, "ngram": 1e308}}), "inf_sum"),
                          (_j({"weights": {"baseline": True}}), "bool"), (_j({"weights": {"x" * 5000: 1}}), "long_name"),
                          (_j({"weights": {"baseline": -1}}), "negative"), (_j({"weights": {"baseline": 0}}), "zero"),
                          (_j({"weights": "x"}), "type"), (_j({"weights": {"baseline": "1"}}), "string"),
                          (_j({"weights": {"baseline": 1}, "x": 1}), "unknown_field"), (_j({}), "missing")]:
            out.append(BadRequest(f"admin:weights:{kind}", "PUT", "/admin/weights", raw, None))
    return out


def _completions_only() -> list[BadRequest]:
    b, p = BASE_COMPLETIONS, COMPLETIONS
    cases = [("prompt:null", _with(b, prompt=None), "prompt"), ("prompt:missing", {"max_tokens": 3}, "prompt"),
             ("prompt:empty", _with(b, prompt=""), "prompt"), ("prompt:empty_list", _with(b, prompt=[]), "prompt"),
             ("prompt:type", _with(b, prompt=5), "prompt"), ("prompt:mixed", _with(b, prompt=["a", [1]]), "prompt"),
             ("prompt:bad_id", _with(b, prompt=[10**9]), "prompt"), ("prompt:negative_id", _with(b, prompt=[-1]), "prompt"),
             ("prompt:bool_ids", _with(b, prompt=[True]), "prompt"), ("prompt:too_many", _with(b, prompt=["a"] * 17), "prompt"),
             ("prompt:nested_empty", _with(b, prompt=[[]]), "prompt"),
             ("logprobs:range", _with(b, logprobs=21), "logprobs"), ("logprobs:type", _with(b, logprobs=True), "logprobs"),
             ("logprobs:negative", _with(b, logprobs=-1), "logprobs"),
             ("echo:type", _with(b, echo="yes"), "echo"), ("echo:logprobs", _with(b, echo=True, logprobs=1), "echo"),
             ("suffix", _with(b, suffix="x"), "suffix"), ("best_of:range", _with(b, best_of=0), "best_of"),
             ("best_of:below_n", _with(b, best_of=1, n=2), "best_of"), ("best_of:type", _with(b, best_of="3"), "best_of"),
             ("best_of:stream", _with(b, best_of=2, stream=True), "best_of"),
             ("best_of:too_many", _with(b, best_of=17), "best_of"),
             ("add_special_tokens", _with(b, add_special_tokens=False), "add_special_tokens")]
    return [BadRequest(f"completions:{k}", "POST", p, _j(v), param) for k, v, param in cases]


def _chat_only() -> list[BadRequest]:
    b, p = BASE_CHAT, CHAT
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    m = [("messages:null", _with(b, messages=None), "messages"), ("messages:missing", {"max_tokens": 3}, "messages"),
         ("messages:empty", _with(b, messages=[]), "messages"), ("messages:type", _with(b, messages="hi"), "messages"),
         ("messages:item_type", _with(b, messages=["hi"]), "messages[0]"),
         ("role:unknown", _with(b, messages=[{"role": "robot", "content": "x"}]), "messages[0].role"),
         ("role:missing", _with(b, messages=[{"content": "x"}]), "messages[0].role"),
         ("role:function", _with(b, messages=[{"role": "function", "name": "f", "content": "x"}]), "messages[0].role"),
         ("content:null_user", _with(b, messages=[{"role": "user", "content": None}]), "messages[0].content"),
         ("content:missing_user", _with(b, messages=[{"role": "user"}]), "messages[0].content"),
         ("content:null_system", _with(b, messages=[{"role": "system", "content": None}, {"role": "user", "content": "x"}]),
          "messages[0].content"),
         ("content:missing_assistant", _with(b, messages=[{"role": "user", "content": "x"}, {"role": "assistant"}]),
          "messages[1].content"),
         ("content:type", _with(b, messages=[{"role": "user", "content": 5}]), "messages[0].content"),
         ("content:image", _with(b, messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
          "messages[0].content[0].type"),
         ("content:part_type", _with(b, messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]),
          "messages[0].content[0].text"),
         ("content:unknown_part", _with(b, messages=[{"role": "user", "content": [{"type": "nope"}]}]),
          "messages[0].content[0].type"),
         ("tool:no_id", _with(b, messages=[{"role": "tool", "content": "r"}]), "messages[0].tool_call_id"),
         ("tool_calls:type", _with(b, messages=[{"role": "assistant", "tool_calls": "x"}]), "messages[0].tool_calls"),
         ("tool_calls:bad_fn", _with(b, messages=[{"role": "assistant", "tool_calls": [
             {"id": "1", "type": "function", "function": {"name": "f"}}]}]), "messages[0].tool_calls[0].function.arguments"),
         ("name:type", _with(b, messages=[{"role": "user", "content": "x", "name": 5}]), "messages[0].name"),
         ("tools:type", _with(b, tools="x"), "tools"), ("tools:item", _with(b, tools=[{"type": "x"}]), "tools[0].type"),
         ("tools:name", _with(b, tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools[0].function.name"),
         ("tools:duplicate", _with(b, tools=[tool, tool]), "tools"),
         ("tool_choice:without_tools", _with(b, tool_choice="auto"), "tool_choice"),
         ("tool_choice:value", _with(b, tools=[tool], tool_choice="always"), "tool_choice"),
         ("tool_choice:required+response_format", _with(b, tools=[tool], tool_choice="required",
                                                         response_format={"type": "json_object"}), "tool_choice"),
         ("tool_choice:unknown_name", _with(b, tools=[tool], tool_choice={"type": "function", "function": {"name": "g"}}),
          "tool_choice"),
         ("parallel_tool_calls:false", _with(b, tools=[tool], parallel_tool_calls=False), "parallel_tool_calls"),
         ("logprobs:type", _with(b, logprobs=1), "logprobs"),
         ("top_logprobs:without", _with(b, top_logprobs=2), "top_logprobs"),
         ("top_logprobs:range", _with(b, logprobs=True, top_logprobs=21), "top_logprobs"),
         ("audio", _with(b, audio={"voice": "x", "format": "wav"}), "audio"), ("modalities", _with(b, modalities=["audio"]),
                                                                                "modalities"),
         ("functions", _with(b, functions=[{"name": "f"}]), "functions"), ("store", _with(b, store=True), "store"),
         ("metadata", _with(b, metadata={"a": "b"}), "metadata"), ("prediction", _with(b, prediction={"type": "content"}),
                                                                    "prediction"),
         ("reasoning_effort", _with(b, reasoning_effort="low"), "reasoning_effort"),
         ("service_tier", _with(b, service_tier="flex"), "service_tier"), ("echo", _with(b, echo=True), "echo"),
         ("chat_template", _with(b, chat_template="{{x}}"), "chat_template"),
         ("continue_final_message", _with(b, continue_final_message=True), "continue_final_message"),
         ("chat_template_kwargs:type", _with(b, chat_template_kwargs="x"), "chat_template_kwargs"),
         ("chat_template_kwargs:reserved", _with(b, chat_template_kwargs={"chat_template": "{{x}}"}),
          "chat_template_kwargs"),
         ("chat_template_kwargs:tokenize", _with(b, chat_template_kwargs={"tokenize": True}), "chat_template_kwargs")]
    return [BadRequest(f"chat:{k}", "POST", p, _j(v), param) for k, v, param in m]


def variants(bad: BadRequest, rng: random.Random) -> list[BadRequest]:
    """The same fault under other valid surroundings: streaming on, a seed, another field set (the fault
    must be found whatever else the body holds)."""
    try:
        body = json.loads(bad.body)
    except (ValueError, RecursionError):
        return []
    if not isinstance(body, dict) or bad.path not in (CHAT, COMPLETIONS):
        return []
    out = []
    for extra in ({"stream": True}, {"seed": rng.randrange(1000)}, {"temperature": 0}, {"user": "u1"}):
        if set(extra) & set(body) or (bad.param and bad.param.split(".")[0].split("[")[0] in extra):
            continue
        if "stream" in extra and ("stream_options" in body or "best_of" in body):
            continue
        d = dict(body, **extra)
        out.append(BadRequest(bad.kind + "+" + ",".join(extra), bad.method, bad.path, _j(d), bad.param, bad.statuses))
    return out


def check_answer(bad: BadRequest | None, status: int, text: str, stream: bool = False) -> str | None:
    """None when the answer is acceptable for this request (`bad` None: any generated body), else why not."""
    if status >= 500:
        return f"status {status}"
    for word in INTERNAL:
        if word in text:
            return f"internal text {word!r} in the body"
    if status < 300:
        if bad is not None:
            return f"malformed request accepted ({status})"
        return _check_ok(text, stream)
    try:
        err = json.loads(text)["error"]
    except (ValueError, KeyError, TypeError):
        return "error body is not OpenAI-shaped"
    if not (isinstance(err, dict) and isinstance(err.get("message"), str) and isinstance(err.get("type"), str)
            and "param" in err and "code" in err):
        return "error body lacks message/type/param/code"
    if bad is not None:
        if status not in bad.statuses:
            return f"status {status}, expected {bad.statuses}"
        got = err["param"] if isinstance(err["param"], str) else ""
        if bad.param is not None and not (got == bad.param or got.startswith((bad.param + "[", bad.param + "."))):
            return f"param {err['param']!r}, expected {bad.param!r}"
    return None


def _check_ok(text: str, stream: bool) -> str | None:
    if stream:
        # SSE lines end at LF (or CR): not str.splitlines(), which also splits at U+2028 inside a JSON string
        events = [line[6:] for line in re.split(r"\r\n|\r|\n", text) if line.startswith("data: ")]
        if not events or events[-1] != "[DONE]":
            return "stream without [DONE]"
        for e in events[:-1]:
            d = json.loads(e)
            if "error" in d:
                return "200 stream with an error event"
            for c in d.get("choices", []):
                if c.get("finish_reason") not in (None, *FINISH_REASONS):
                    return f"finish_reason {c.get('finish_reason')!r}"
        return None
    d = json.loads(text)
    if "error" in d:
        return "200 with an error inside"
    if "choices" in d:
        for c in d["choices"]:
            if c.get("finish_reason") not in FINISH_REASONS:
                return f"finish_reason {c.get('finish_reason')!r}"
    return None


_RANDOM_VALUES: list[Any] = [None, True, False, 0, 1, -1, 2, 0.5, 1e-300, 1e308, 2**31, 2**64, "", "x", "true",
                             [], [1], ["a"], {}, {"a": 1}, [[1]], {"type": "text"}]
_FIELDS = sorted(set(_INT_FIELDS + _FLOAT_FIELDS + _BOOL_FIELDS + [
    "stop", "logit_bias", "stop_token_ids", "user", "stream_options", "response_format", "logprobs", "model",
    "echo", "best_of", "suffix", "tools", "tool_choice", "top_logprobs", "prompt", "messages", "profile",
    "prompt_logprobs", "structured_outputs", "parallel_tool_calls", "chat_template_kwargs", "unknown_field"]))


def random_body(rng: random.Random) -> tuple[str, bytes]:
    """(path, body): a valid body with 1-3 fields set to random JSON values (may or may not be valid)."""
    path = rng.choice([CHAT, COMPLETIONS])
    body = dict(BASE_CHAT if path == CHAT else BASE_COMPLETIONS)
    for _ in range(rng.randint(1, 3)):
        body[rng.choice(_FIELDS)] = rng.choice(_RANDOM_VALUES)
    return path, _j(body)
