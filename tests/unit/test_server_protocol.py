"""Request parsing, SamplingParams mapping, response shapes, SSE framing and Prometheus names."""

import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from specserve.inputs import ChatPrompt, InvalidRequestError, TextPrompt, TokenPrompt
from specserve.metrics.prometheus import ServerMetrics
from specserve.outputs import SpecStats, TokenLogprob
from specserve.rollout.profiles import Profile, profile_set_from_dict
from specserve.server import formatting as fmt
from specserve.server import protocol as P


def _parse(body, chat=None, max_model_len=128, vocab_size=260):
    chat = "messages" in body if chat is None else chat
    return P.parse_request(body, chat=chat, max_model_len=max_model_len, vocab_size=vocab_size)


def test_completion_defaults_and_mapping():
    r = _parse({"prompt": "hi", "stop": "x", "seed": 3, "logit_bias": {"5": -100}, "top_k": 20, "min_p": 0.1,
                "logprobs": 2, "n": 2})
    sp = r.params
    assert sp.max_tokens == 16 and sp.temperature == 1.0 and sp.top_p == 1.0
    assert sp.stop == ["x"] and sp.seed == 3 and sp.logit_bias == {5: -100.0}
    assert sp.top_k == 20 and sp.min_p == 0.1 and sp.logprobs == 2 and sp.n == 2
    assert r.prompts == [TextPrompt("hi")] and r.n == r.best_of == 2
    assert _parse({"prompt": [1, 2]}).prompts == [TokenPrompt((1, 2))]
    assert _parse({"prompt": [[1, 2]]}).prompts == [TokenPrompt((1, 2))]
    assert _parse({"prompt": ["x"]}).prompts == [TextPrompt("x")]
    assert _parse({"prompt": ["a", "b"]}).prompts == [TextPrompt("a"), TextPrompt("b")]  # a batch, as vLLM
    assert _parse({"prompt": [[1], [2, 3]]}).prompts == [TokenPrompt((1,)), TokenPrompt((2, 3))]
    # max_completion_tokens on /v1/completions too (it wins over max_tokens)
    r = _parse({"prompt": "x", "max_tokens": 16, "max_completion_tokens": 7})
    assert r.params.max_tokens == 7 and r.max_tokens_param == "max_completion_tokens"


def test_chat_mapping_and_logprobs():
    r = _parse({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
                "max_completion_tokens": 7, "max_tokens": 3, "logprobs": True, "top_logprobs": 4})
    assert r.params.max_tokens == 7 and r.params.logprobs == 4
    assert r.prompts == [ChatPrompt(({"role": "user", "content": "a\nb"},))]  # parts joined with "\n", as vLLM
    assert _parse({"messages": [{"role": "user", "content": "x"}]}).params.max_tokens is None
    assert _parse({"messages": [{"role": "user", "content": "x"}], "logprobs": True}).params.logprobs == 0


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": -3}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 2**31}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 128}, "max_tokens"),  # the context is 128: no room for a prompt
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "temperature": -0.1}, "temperature"),
    ({"prompt": "x", "temperature": 1e308}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_p": 1e-300}, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "seed": 2**64}, "seed"),
    ({"prompt": "", "max_tokens": 1}, "prompt"),
    ({"prompt": [], "max_tokens": 1}, "prompt"),
    ({"prompt": [300]}, "prompt"),
    ({"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"999": 1}}, "logit_bias"),
    ({"prompt": "x", "logprobs": 30}, "logprobs"),
    ({"prompt": "x", "n": 17}, "n"),
    ({"prompt": "x", "best_of": 3, "n": 4}, "best_of"),
    ({"prompt": "x", "best_of": 3, "stream": True}, "best_of"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "stop_token_ids": [260]}, "stop_token_ids"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "prompt_logprobs": 1}, "prompt_logprobs"),
    ({"prompt": "x", "echo": True, "logprobs": 1}, "echo"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}},
     "response_format.json_schema"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "nope"}}, "response_format.type"),
    ({"messages": [{"role": "user", "content": "x"}], "structured_outputs": {"regex": "a+", "choice": ["a"]}},
     "structured_outputs"),
    ({"messages": [{"role": "user", "content": "x"}], "structured_outputs": {"grammar": "root ::= x"}},
     "structured_outputs.grammar"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"},
      "structured_outputs": {"regex": "a+"}}, "structured_outputs"),
    ({"prompt": "x", "guided_choice": []}, "guided_choice"),
    ({"prompt": "x", "guided_json": {"type": "object"}, "ignore_eos": True}, "ignore_eos"),
    ({"prompt": "x", "guided_regex": "a+", "min_tokens": 2}, "min_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"}, "tool_choice"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "system", "content": "s"}, {"role": "assistant"}]}, "messages[1].content"),
    ({"messages": [{"role": "tool", "content": "r"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].type"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "model": None}, "model"),
    ({"messages": [{"role": "user", "content": "x"}], "stream": "true"}, "stream"),
    ({"messages": [{"role": "user", "content": "x"}], "stream": True, "stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage"),
    ({"messages": [{"role": "user", "content": "x"}], "n": True}, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 5.0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "audio": {"voice": "x"}}, "audio"),
])
def test_bad_values_name_their_param(body, param):
    with pytest.raises(InvalidRequestError) as ei:
        _parse(body)
    assert ei.value.param == param and param in str(ei.value)  # the message names the field the client sent


def test_unknown_fields_are_logged_once_and_ignored(caplog):
    notes = P.UnknownFieldNotes()
    with caplog.at_level("WARNING", logger="specserve.server"):
        for _ in range(3):
            r = P.parse_request({"prompt": "x", "whatever": {"a": 1}}, chat=False, max_model_len=128, vocab_size=260,
                                notes=notes)
            assert r.prompts == [TextPrompt("x")]
    assert sum("whatever" in rec.getMessage() for rec in caplog.records) == 1


class _Tok:
    def decode(self, ids, skip_special_tokens=False):
        return {1: "a", 2: "é", 3: " b"}[ids[0]]


def test_logprob_shapes():
    tt = fmt.TokenText(_Tok())
    lps = [TokenLogprob(1, -0.1, [(1, -0.1), (2, -2.0)]), TokenLogprob(3, -0.5, [(3, -0.5), (1, -1.0)])]
    c = fmt.completion_logprobs(lps, tt)
    assert c == {"tokens": ["a", " b"], "token_logprobs": [-0.1, -0.5],
                 "top_logprobs": [{"a": -0.1, "é": -2.0}, {" b": -0.5, "a": -1.0}], "text_offset": [0, 1]}
    assert fmt.completion_logprobs(lps[1:], tt, 1)["text_offset"] == [1]
    ch = fmt.chat_logprobs(lps[:1], tt)
    assert ch["refusal"] is None
    assert ch["content"] == [{"token": "a", "logprob": -0.1, "bytes": [97], "top_logprobs": [
        {"token": "a", "logprob": -0.1, "bytes": [97]}, {"token": "é", "logprob": -2.0, "bytes": [195, 169]}]}]


def test_specserve_block_names_and_sse():
    st = SpecStats(2, 8, 5, [2, 2, 1, 0], 7)
    b = fmt.specserve_block(profile_set_from_dict({"profiles": {"n": {"method": "ngram", "num_speculative_tokens": 4}}})
                            .profiles["n"], st)
    assert b == {"profile": "n", "method": "ngram", "num_speculative_tokens": 4, "num_drafts": 2,
                 "num_draft_tokens": 8, "num_accepted_tokens": 5, "num_accepted_tokens_per_pos": [2, 2, 1, 0],
                 "acceptance_rate": 5 / 8, "mean_acceptance_length": 1 + 5 / 2}
    base = fmt.specserve_block(Profile("baseline", None), SpecStats())
    assert base["method"] == "none" and base["acceptance_rate"] is None and base["mean_acceptance_length"] is None
    s = fmt.sse({"a": "é"})
    assert s.startswith("data: ") and s.endswith("\n\n") and json.loads(s[6:]) == {"a": "é"}
    assert fmt.SSE_DONE == "data: [DONE]\n\n"
    ck = fmt.chunk(True, "id", 1, "m", 0, text="x", finish_reason="stop", include_usage=True, spec_block=b)
    assert ck["choices"][0]["delta"] == {"content": "x"} and ck["usage"] is None and ck["specserve"] == b
    ck = fmt.chunk(False, "id", 1, "m", 2, text="y")
    assert ck["object"] == "text_completion" and ck["choices"][0]["index"] == 2 and "usage" not in ck


def test_metrics_names_parse_and_own_registry():
    m1, m2 = ServerMetrics(["baseline", "ngram_4"], "m"), ServerMetrics(["baseline"], "m")
    m1.observe_first_token("ngram_4", 0.05)
    m1.observe_tokens("ngram_4", 0.1, 4)
    m1.observe_finished(profile="ngram_4", status="ok", code=200, prompt_tokens=5, completion_tokens=9, e2e_s=0.3,
                        spec_stats=SpecStats(3, 12, 7, [3, 2, 2, 0], 10))
    m1.observe_finished(profile="none", status="error", code=400)
    m1.set_engine_stats({"num_running": 2, "num_waiting": 1, "kv_cache_usage": 0.25}, 3)
    samples = {}
    for fam in text_string_to_metric_families(m1.render().decode()):
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    p = (("profile", "ngram_4"),)
    assert samples[("specserve:spec_decode_num_drafts_total", p)] == 3
    assert samples[("specserve:spec_decode_num_draft_tokens_total", p)] == 12
    assert samples[("specserve:spec_decode_num_accepted_tokens_total", p)] == 7
    assert samples[("specserve:spec_decode_num_accepted_tokens_per_pos_total",
                    (("position", "1"), ("profile", "ngram_4")))] == 2
    assert samples[("specserve:spec_decode_num_drafts_total", (("profile", "baseline"),))] == 0
    assert samples[("specserve:requests_total", (("code", "400"), ("profile", "none"), ("status", "error")))] == 1
    assert samples[("specserve:generation_tokens_total", p)] == 9
    assert samples[("specserve:inter_token_latency_seconds_count", p)] == 4
    assert samples[("specserve:kv_cache_usage_perc", ())] == 0.25
    assert samples[("specserve:num_requests_running", ())] == 2
    assert b"ngram_4" not in m2.render()  # separate registries


def test_an_sse_event_is_one_line_for_any_line_splitter():
    """Text with U+2028, U+2029 or U+0085 (which str.splitlines, and so httpx's aiter_lines, take for line
    ends) goes out escaped in the event's JSON: the event stays one line, and the value is the same."""
    import json

    from specserve.server.formatting import sse

    text = "a\u2028b\u2029c\x85d\nf"
    ev = sse({"choices": [{"delta": {"content": text}}]})
    body = ev[len("data: "):-2]
    assert ev.endswith("\n\n") and len([x for x in ev.splitlines() if x]) == 1 and "\u2028" not in ev
    assert json.loads(body)["choices"][0]["delta"]["content"] == text
    assert sse({"t": "héllo"}) == 'data: {"t":"héllo"}\n\n'  # other non-ASCII stays UTF-8
