"""commit_tokens' block path (no stop strings: one detokenization per verified block) must leave a request
exactly as the one-token-at-a-time path does: same token ids, text, logprobs and finish reason after every block,
for random blocks that split multi-byte characters, hit EOS / stop token ids / max_tokens / the context end."""

from __future__ import annotations

import copy
import random

import pytest

from specserve.engine import stop
from specserve.outputs import TokenLogprob
from specserve.request import Request
from specserve.sampling_params import SamplingParams
from tests.helpers.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(make_tiny_model(tmp_path_factory.mktemp("tiny"), arch="qwen2")))


def _request(tokenizer, params: SamplingParams) -> Request:
    prompt = tokenizer.encode("déjà vu: naïve café — ", add_special_tokens=False)
    return Request("r", prompt, params, None, 0)


def _state(r: Request) -> tuple:
    """What a client can see (the detokenization offsets may differ: a block that ends on a token with no
    text, e.g. a skipped special token, moves them past it, one token at a time does not)."""
    return (r.all_token_ids, r.text, r.finish_reason, r.stop_reason,
            [lp.logprob for lp in r.logprobs] if r.logprobs is not None else None)


def test_block_path_equals_per_token_path(tokenizer):
    rng = random.Random(0)
    # pieces whose bytes split across tokens: accents, CJK, emoji
    text = "naïve café 東京 🙂 déjà-vu, ünïcödé 🙂🙂 ok " * 3
    ids = tokenizer.encode(text, add_special_tokens=False)
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    vocab = len(tokenizer)
    mismatches = 0
    for case in range(300):
        params = SamplingParams(max_tokens=rng.choice([None, 5, 17, 40]), min_tokens=rng.choice([0, 0, 3]),
                                stop_token_ids=rng.choice([[], [ids[7]]]), ignore_eos=rng.random() < 0.2,
                                logprobs=rng.choice([None, 0]), skip_special_tokens=rng.random() < 0.8)
        max_model_len = rng.choice([10_000, 60])
        a = _request(tokenizer, params)
        b = copy.deepcopy(a)
        stream = [rng.choice(ids) if rng.random() < 0.8 else rng.randrange(vocab) for _ in range(60)]
        for j in range(rng.randrange(1, 4)):
            stream[rng.randrange(len(stream))] = eos
        pos = 0
        while a.finish_reason is None and pos < len(stream):
            block = stream[pos : pos + rng.randint(1, 9)]
            lps = [TokenLogprob(t, -0.1 * i, None) for i, t in enumerate(block)]
            na = stop._commit_block(a, list(block), lps, tokenizer, (eos,), max_model_len)
            nb = stop._commit_each(b, list(block), lps, tokenizer, (eos,), max_model_len)
            assert na == nb, f"case {case}: committed {na} vs {nb}"
            assert _state(a) == _state(b), f"case {case}: after a block"
            pos += len(block)
        mismatches += _state(a) != _state(b)
        assert _state(a) == _state(b), f"case {case}"
    assert mismatches == 0


def test_commit_tokens_takes_the_per_token_path_for_stop_strings(tokenizer, monkeypatch):
    calls = []
    monkeypatch.setattr(stop, "_commit_block", lambda *a: calls.append("block") or 0)
    monkeypatch.setattr(stop, "_commit_each", lambda *a: calls.append("each") or 0)
    stop.commit_tokens(_request(tokenizer, SamplingParams(max_tokens=8)), [5], None, tokenizer, (0,), 100)
    stop.commit_tokens(_request(tokenizer, SamplingParams(max_tokens=8, stop=["x"])), [5], None, tokenizer, (0,), 100)
    assert calls == ["block", "each"]


def test_block_ending_in_a_split_character_emits_what_is_complete(tokenizer):
    """A block whose last token leaves half a character: the characters before it are in the text now
    (as token-by-token commits would have them), and the rest arrives with the token that completes it."""
    ids = tokenizer.encode("ab🙂", add_special_tokens=False)
    cut = next(i for i in range(1, len(ids)) if tokenizer.decode(ids[:i]).endswith("\ufffd"))
    r = _request(tokenizer, SamplingParams(max_tokens=100))
    stop._commit_block(r, ids[:cut], None, tokenizer, (0,), 1000)
    assert r.text.endswith("ab") or r.text.endswith("b")
    assert "\ufffd" not in r.text
    stop._commit_block(r, ids[cut:], None, tokenizer, (0,), 1000)
    assert r.text.endswith("ab🙂")


def test_fast_tokenizer_backend_decode_equals_transformers_decode(tokenizer):
    """`_decode` calls the tokenizers backend directly; it must equal transformers' decode without clean-up."""
    rng = random.Random(3)
    for _ in range(500):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 8))]
        for skip in (True, False):
            assert stop._decode(tokenizer, ids, skip) == tokenizer.decode(
                ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


class _CountingTokenizer:
    """Decodes token t to chr(t), except ids >= 1000, which decode to nothing (as a skipped special token
    does); counts decode calls."""

    def __init__(self):
        self.calls = 0

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        self.calls += 1
        return "".join(chr(t) for t in ids if t < 1000)


@pytest.mark.parametrize("block", [1, 5])
def test_text_that_stays_incomplete_costs_a_bounded_number_of_decodes_per_step(block):
    """A request whose new tokens add no text (here: 300 tokens that decode to nothing) keeps its
    detokenization offsets where they are; each step must still decode only its own tokens, not every
    pending one again (that was ~72 tokenizer calls per token at 16 concurrent requests of a random model)."""
    tok = _CountingTokenizer()
    r = Request("r", [65, 66], SamplingParams(max_tokens=None), None, 0)
    steps = 0
    for start in range(0, 300, block):
        stop._commit_block(r, [1000 + start + i for i in range(block)], None, tok, (), 10_000)
        steps += 1
    assert r.text == ""
    assert tok.calls <= steps * (2 + 2 * block), tok.calls  # the block's decode pair + one pair per new token
    stop._commit_block(r, [67, 68], None, tok, (), 10_000)  # text again: everything pending comes out
    assert r.text == "CD"
