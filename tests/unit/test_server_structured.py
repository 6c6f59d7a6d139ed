"""Structured output and forced tool calls over HTTP, on the model-free fake engine whose greedy answer
is scripted (tests/helpers/fake_engine.py): the grammar overrides the script where it disagrees, with
and without n-gram speculation; tool_choice "required" / named return parsed `tool_calls` (streamed
too) with OpenAI's finish reasons; bad schemas and regexes are 400s naming their field."""

import json

import httpx
import openai
import pytest

from specserve.rollout.profiles import profile_set_from_dict
from specserve.server.api import ServerSettings, create_app
from specserve.server.launcher import ServerThread
from tests.helpers.fake_engine import ToyLM, fake_client, scripted_logits

PROFILES = {"profiles": {"baseline": None, "ngram": {"method": "ngram", "num_speculative_tokens": 3}},
            "weights": {"baseline": 1}}
SCRIPT = '{"a": "Hello", "city": "Paris"}'  # what the model says without a grammar
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}}, "required": ["zone"]}}}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
MSGS = [{"role": "user", "content": "weather in Paris?"}]


@pytest.fixture(scope="module")
def server():
    app = create_app(fake_client(max_model_len=1024, lm=ToyLM(scripted_logits(SCRIPT))), profile_set_from_dict(PROFILES),
                     ServerSettings(allow_profile_override=True, tool_call_parser="hermes"))
    with ServerThread(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)


@pytest.mark.parametrize("profile", ["baseline", "ngram"])
def test_json_schema_integer_overrides_the_model(client, profile):
    free = client.chat.completions.create(model="fake-model", messages=MSGS, temperature=0, max_tokens=60,
                                          extra_body={"profile": profile})
    assert free.choices[0].message.content == SCRIPT
    r = client.chat.completions.create(
        model="fake-model", messages=MSGS, temperature=0, max_tokens=60, extra_body={"profile": profile},
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}})
    ch = r.choices[0]
    value = json.loads(ch.message.content)
    assert ch.finish_reason == "stop" and set(value) == {"a"} and type(value["a"]) is int, ch.message.content
    r2 = client.chat.completions.create(model="fake-model", messages=MSGS, temperature=0, max_tokens=60,
                                        extra_body={"profile": "baseline", "structured_outputs": {"json": SCHEMA}})
    assert r2.choices[0].message.content == ch.message.content  # speculation changes nothing; both spellings agree


def test_json_object_regex_choice_on_both_endpoints(server, client):
    r = client.chat.completions.create(model="fake-model", messages=MSGS, temperature=0, max_tokens=60,
                                       response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    for body, check in [({"structured_outputs": {"regex": "[0-9]{2}x"}}, lambda t: len(t) == 3 and t[2] == "x"),
                        ({"guided_regex": "[0-9]{2}x"}, lambda t: len(t) == 3 and t[2] == "x"),
                        ({"structured_outputs": {"choice": ["sunny", "rainy"]}}, lambda t: t in ("sunny", "rainy")),
                        ({"guided_choice": ["sunny", "rainy"]}, lambda t: t in ("sunny", "rainy")),
                        ({"guided_json": SCHEMA}, lambda t: type(json.loads(t)["a"]) is int)]:
        r = httpx.post(server.base_url + "/v1/completions",
                       json={"prompt": "<assistant>", "max_tokens": 40, "temperature": 0, **body})
        assert r.status_code == 200, r.text
        ch = r.json()["choices"][0]
        assert ch["finish_reason"] == "stop" and check(ch["text"]), (body, ch)


def test_tool_choice_named_and_required(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model="fake-model", messages=MSGS, tools=TOOLS, tool_choice=named,
                                       temperature=0, max_tokens=80)
    ch = r.choices[0]
    assert ch.finish_reason == "stop" and ch.message.content is None  # OpenAI: "stop" for a named function
    (call,) = ch.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "lo"}  # script where allowed
    r = client.chat.completions.create(model="fake-model", messages=MSGS, tools=TOOLS, tool_choice="required",
                                       temperature=0, max_tokens=120, parallel_tool_calls=False)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None and len(ch.message.tool_calls) == 1
    call = ch.message.tool_calls[0]
    args = json.loads(call.function.arguments)
    assert (call.function.name, args) == ("get_time", {"zone": "cet"})  # the lowest byte wherever the script is refused
    for choice, finish in [(named, "stop"), ("required", "tool_calls")]:
        deltas, last, content = [], None, ""
        for chunk in client.chat.completions.create(model="fake-model", messages=MSGS, tools=TOOLS, tool_choice=choice,
                                                    temperature=0, max_tokens=120, stream=True,
                                                    parallel_tool_calls=False):
            for c in chunk.choices:
                deltas += c.delta.tool_calls or []
                content += c.delta.content or ""
                last = c.finish_reason or last
        assert last == finish and content == "" and len(deltas) == 1 and deltas[0].index == 0
        assert json.loads(deltas[0].function.arguments) == ({"city": "lo"} if choice is named else {"zone": "cet"})


def test_cut_by_max_tokens_is_length_and_content(client):
    r = client.chat.completions.create(model="fake-model", messages=MSGS, tools=TOOLS, tool_choice="required",
                                       temperature=0, max_tokens=5)
    ch = r.choices[0]
    assert ch.finish_reason == "length" and not ch.message.tool_calls and len(ch.message.content) == 5


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"regex": "a("}}, "structured_outputs.regex"),
    ({"guided_regex": "[a"}, "guided_regex"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"response_format": {"type": "json_object"}, "tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": False}, "parallel_tool_calls"),
    ({"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs.grammar"),
])
def test_bad_constraints_are_400_naming_the_field(server, body, param):
    r = httpx.post(server.base_url + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param.split(".")[0] in err["message"] and "/project/" not in err["message"], err
    ok = httpx.post(server.base_url + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 3})
    assert ok.status_code == 200  # the server goes on
