"""Prompt encoding off the engine thread: the byte-size check refuses a prompt without tokenizing it, the
per-request token limit, the server never tokenizes on the engine thread, and config values are checked
by type (issue 11: `"num_speculative_tokens": true`, `"prompt_lookup_max": "4"`)."""

import threading

import httpx
import pytest

from specserve.config import ConfigError, SpeculativeConfig
from specserve.inputs import ChatPrompt, TextPrompt, TokenPrompt
from specserve.server.api import ServerSettings, create_app
from specserve.server.async_engine import AsyncEngine
from specserve.server.launcher import ServerThread
from specserve.tokenization import PromptEncoder, RequestError
from tests.helpers.fake_engine import ByteTokenizer, fake_engine


class CountingTokenizer(ByteTokenizer):
    def __init__(self):
        self.calls, self.threads = 0, set()

    def encode(self, text, add_special_tokens=True):
        self.calls += 1
        self.threads.add(threading.current_thread().name)
        return super().encode(text, add_special_tokens)


def test_size_check_refuses_before_tokenizing_and_limit_after():
    tok = CountingTokenizer()
    enc = PromptEncoder(tok, vocab_size=260, max_model_len=100, max_prompt_tokens=50)
    assert enc.max_bytes_per_token == 5  # id 256 decodes to "<eos>", the longest token
    with pytest.raises(RequestError) as ei:
        enc.encode(TextPrompt("x" * 251))  # 251 bytes > 50 tokens x 5 bytes
    assert ei.value.code == "context_length_exceeded" and ei.value.param == "prompt" and tok.calls == 0
    with pytest.raises(RequestError) as ei:
        enc.encode(ChatPrompt(({"role": "user", "content": "y" * 300},)))
    assert ei.value.param == "messages" and tok.calls == 0
    with pytest.raises(RequestError, match="at most 50 tokens"):
        enc.encode(TextPrompt("x" * 51))  # passes the byte check, refused after tokenization
    assert tok.calls == 1
    assert enc.encode(TextPrompt("x" * 50)) == [ord("x")] * 50
    with pytest.raises(RequestError, match=r"\[0, 260\)"):
        enc.encode(TokenPrompt((1, 999)))


def test_server_tokenizes_off_the_engine_thread():
    eng = fake_engine()
    client = AsyncEngine(eng, max_prompt_tokens=20)
    tok = CountingTokenizer()
    client._encoder.tokenizer = tok
    eng.tokenizer.encode = lambda *a, **k: (_ for _ in ()).throw(AssertionError("tokenized on the engine thread"))
    with ServerThread(create_app(client, None, ServerSettings())) as srv:
        r = httpx.post(srv.base_url + "/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 200, r.text
        r = httpx.post(srv.base_url + "/v1/completions", json={"prompt": "x" * 25, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        r = httpx.post(srv.base_url + "/v1/completions", json={"prompt": "x" * 10, "max_tokens": 250})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"  # 10 + 250 > 256
    assert tok.threads == {"specserve-tokenizer_0"}


@pytest.mark.parametrize("cfg, key", [
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2.0}, "num_speculative_tokens"),
    ({"method": "ngram", "prompt_lookup_max": "4"}, "prompt_lookup_max"),
    ({"method": "ngram", "prompt_lookup_min": 1.5}, "prompt_lookup_min"),
    ({"method": "suffix", "suffix_decoding_max_tree_depth": 2.5}, "suffix_decoding_max_tree_depth"),
    ({"method": "suffix", "suffix_decoding_min_token_prob": True}, "suffix_decoding_min_token_prob"),
    ({"method": "suffix", "suffix_decoding_max_spec_factor": float("inf")}, "suffix_decoding_max_spec_factor"),
    ({"method": "ngram", "num_speculative_tokens_per_batch_size": [[True, 1]]}, "num_speculative_tokens_per_batch_size"),
    ({"method": 5}, "method"),
])
def test_config_values_are_checked_by_type(cfg, key):
    with pytest.raises(ConfigError) as ei:
        SpeculativeConfig.from_dict(cfg)
    assert key in str(ei.value) and ("must be" in str(ei.value))


def test_effective_config_follows_vllms_lookup_rule():
    assert SpeculativeConfig.from_dict({"method": "ngram", "prompt_lookup_max": 3}).effective()["prompt_lookup_min"] == 3
    assert SpeculativeConfig.from_dict({"method": "ngram", "prompt_lookup_min": 2}).effective()["prompt_lookup_max"] == 2
    eff = SpeculativeConfig.from_dict({"method": "ngram"}).effective()
    assert (eff["prompt_lookup_min"], eff["prompt_lookup_max"], eff["num_speculative_tokens"]) == (1, 4, 5)
