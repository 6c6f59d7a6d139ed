"""Engine correctness on tiny random-weight models (no speculation): logits and greedy tokens vs
transformers, batch invariance, chunked prefill, stops, max_tokens, seeds, logprobs, errors, abort."""

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.engine.llm_engine import RequestError
from specserve.sampling_params import SamplingParamsError

PROMPTS = [
    "def add(a, b):",
    "The engine verifies",
    "x",
    "class Counter:\n    def __init__(self):\n        self.count = 0\n    def increment(self, step=1):",
    "speculative decoding drafts tokens and the target verifies them in one forward pass, then",
    "1: I will not skip any words.\n2: I will not skip any words.\n3:",
]
GREEDY = dict(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def llm(request, tiny_model_dir, tiny_llama_dir):
    path = tiny_model_dir if request.param == "qwen2" else tiny_llama_dir
    return LLM(str(path), max_model_len=256, max_num_seqs=8)


@pytest.fixture(scope="module")
def hf(llm):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(llm.engine.target.files.path), dtype=torch.float32).eval()


def test_logits_match_transformers(llm, hf):
    from specserve.engine.model_runner import SeqInput

    eng = llm.engine
    for p in PROMPTS:
        ids = eng.encode_prompt(p)
        slot = eng.target.kv.allocate()
        ours = eng.target.runner.forward([SeqInput(slot, 0, ids, len(ids))])
        eng.target.kv.free(slot)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        assert ((ours - ref).abs().max() / ref.abs().max()).item() < 1e-4


def test_greedy_matches_transformers_and_batch_invariance(llm, hf):
    params = SamplingParams(**GREEDY)
    batched = llm.generate(PROMPTS, params)
    for p, out in zip(PROMPTS, batched):
        ids = llm.engine.encode_prompt(p)
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(ids):].tolist()
        alone = llm.generate(p, params)[0].outputs[0]
        assert out.outputs[0].token_ids == alone.token_ids == ref
        assert out.outputs[0].finish_reason == "length"


def test_chunked_prefill_equals_whole_prefill(tiny_model_dir):
    small = LLM(str(tiny_model_dir), max_model_len=256, max_num_batched_tokens=16)
    big = LLM(str(tiny_model_dir), max_model_len=256)
    prompt = PROMPTS[3] * 2  # ~60+ tokens: four or more chunks of 16
    a = small.generate([prompt, PROMPTS[0]], SamplingParams(**GREEDY))
    b = big.generate([prompt, PROMPTS[0]], SamplingParams(**GREEDY))
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_seeded_sampling_reproducible_alone_and_in_batch(llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=42, max_tokens=16, ignore_eos=True)
    alone = llm.generate(PROMPTS[1], p)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.8, max_tokens=10)] * 3 + [SamplingParams(**GREEDY)]
    batch = llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[4], PROMPTS[5]],
                         [others[0], p, others[1], others[2], others[3]])
    assert batch[1].outputs[0].token_ids == alone
    other_seed = llm.generate(PROMPTS[1], p.clone(seed=43))[0].outputs[0].token_ids
    assert other_seed != alone


def test_n_completions_use_seed_plus_index(llm):
    p = SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=8, ignore_eos=True)
    outs = llm.generate(PROMPTS[0], p)[0].outputs
    assert len(outs) == 3 and len({tuple(o.token_ids) for o in outs}) > 1
    again = llm.generate(PROMPTS[0], p.clone(n=1, seed=6))[0].outputs[0]
    assert again.token_ids == outs[1].token_ids


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 9])
def test_max_tokens_exact(llm, max_tokens):
    out = llm.generate(PROMPTS[5], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == max_tokens and out.finish_reason == "length"


def test_stop_token_id_and_stop_string(llm):
    base = llm.generate(PROMPTS[4], SamplingParams(**GREEDY))[0].outputs[0]
    p = 6
    t = base.token_ids[p]
    first = base.token_ids.index(t)
    out = llm.generate(PROMPTS[4], SamplingParams(**GREEDY, stop_token_ids=[t]))[0].outputs[0]
    assert out.token_ids == base.token_ids[: first + 1] and out.finish_reason == "stop" and out.stop_reason == t
    tok = llm.get_tokenizer()
    text = base.text
    # a 3-character stop string from the middle of the output, made of whole characters (a random
    # model also emits partial bytes, which decode to U+FFFD)
    starts = [i for i in range(len(text) // 3, len(text) - 3) if "\ufffd" not in text[i : i + 3] and text[i : i + 3].strip()]
    assert starts, text
    stop = text[starts[0] : starts[0] + 3]
    out = llm.generate(PROMPTS[4], SamplingParams(**GREEDY, stop=[stop]))[0].outputs[0]
    assert out.text == text[: text.index(stop)] and out.finish_reason == "stop" and out.stop_reason == stop
    decoded = tok.decode(out.token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert decoded.startswith(out.text) and stop in decoded  # the last token completed the stop
    assert stop not in tok.decode(out.token_ids[:-1], clean_up_tokenization_spaces=False)


def test_min_tokens_masks_eos(llm):
    eos = llm.engine.eos_token_ids[0]
    bias = {eos: 100.0}  # force EOS as the argmax everywhere
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=10, logit_bias=bias))[0].outputs[0]
    assert out.token_ids == [eos] and out.finish_reason == "stop" and out.text == ""
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=10, min_tokens=4, logit_bias=bias))[0].outputs[0]
    assert len(out.token_ids) == 5 and out.token_ids[-1] == eos and eos not in out.token_ids[:4]


def test_logprobs_match_reference(llm, hf):
    out = llm.generate(PROMPTS[1], SamplingParams(**GREEDY, logprobs=3))[0]
    ids = out.prompt_token_ids + out.outputs[0].token_ids
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0], -1)
    comp = out.outputs[0]
    assert len(comp.logprobs) == len(comp.token_ids)
    for j, entry in enumerate(comp.logprobs):
        row = lp[len(out.prompt_token_ids) - 1 + j]
        assert entry.token_id == comp.token_ids[j]
        assert abs(entry.logprob - row[entry.token_id].item()) < 1e-4
        assert [t for t, _ in entry.top] == torch.topk(row, 3).indices.tolist()


def test_penalties_push_greedy_output_the_right_way(llm):
    """Penalties change the output in their direction: a positive frequency or presence penalty makes
    fewer repeated output tokens, a negative one no fewer; a repetition penalty > 1 makes fewer tokens
    that were already in the prompt or the output."""
    prompt_ids = llm.engine.encode_prompt(PROMPTS[5])

    def gen(**kw):
        return llm.generate(PROMPTS[5], SamplingParams(**GREEDY, **kw))[0].outputs[0].token_ids

    def repeats(ids):  # output tokens that already occurred in the output
        return len(ids) - len(set(ids))

    def seen_before(ids):  # output tokens that already occurred in the prompt or the output
        return sum(t in prompt_ids or t in ids[:i] for i, t in enumerate(ids))

    base = gen()
    assert repeats(gen(frequency_penalty=2.0)) < repeats(base) <= repeats(gen(frequency_penalty=-2.0))
    assert repeats(gen(presence_penalty=1.5)) < repeats(base) <= repeats(gen(presence_penalty=-1.5))
    assert seen_before(gen(repetition_penalty=1.5)) < seen_before(base)


def test_penalties_lower_the_logprob_of_seen_tokens():
    """The processors themselves, on random logits: frequency f and presence p subtract f * count + p
    from each output token seen (count times) and nothing else; repetition r > 1 moves every token of
    the prompt or the output towards lower logits; so each penalized token's logprob goes down."""
    from specserve.sample.sampler import process_logits

    torch.manual_seed(0)
    raw = torch.randn(1, 50) * 3
    prompt, output = [1, 2, 3], [4, 4, 4, 5]
    seen_out, seen_any = [4, 5], [1, 2, 3, 4, 5]
    unseen = [t for t in range(50) if t not in seen_any]

    def processed(**kw):
        return process_logits(raw, SamplingParams(**GREEDY, **kw), prompt, output, [], [])[0]

    diff = processed(frequency_penalty=0.5, presence_penalty=0.25) - raw[0]
    assert diff[4].item() == pytest.approx(-0.5 * 3 - 0.25) and diff[5].item() == pytest.approx(-0.5 - 0.25)
    assert torch.all(diff[[t for t in range(50) if t not in seen_out]] == 0)
    assert torch.all(processed(frequency_penalty=-0.5)[seen_out] > raw[0, seen_out])  # negative: favoured
    rep = processed(repetition_penalty=1.5)
    assert torch.all(rep[seen_any] < raw[0, seen_any]) and torch.equal(rep[unseen], raw[0, unseen])
    for kw in (dict(frequency_penalty=0.5), dict(presence_penalty=0.5), dict(repetition_penalty=1.5)):
        lp, lp_raw = torch.log_softmax(processed(**kw), -1), torch.log_softmax(raw[0], -1)
        pen = seen_out if "repetition_penalty" not in kw else seen_any
        assert torch.all(lp[pen] < lp_raw[pen]), kw


def test_errors_and_abort(llm):
    eng = llm.engine
    with pytest.raises(RequestError, match="context"):
        eng.add_request("long", list(range(3, 3 + 256)), SamplingParams())
    with pytest.raises(RequestError, match="empty"):
        eng.add_request("empty", [], SamplingParams())
    for bad in [dict(max_tokens=-1), dict(max_tokens=0), dict(temperature=-0.5), dict(top_p=0.0), dict(top_p=1.5), dict(n=0)]:
        with pytest.raises(SamplingParamsError):
            SamplingParams(**bad)
    before = eng.stats()
    eng.add_request("a", PROMPTS[3], SamplingParams(**GREEDY))
    eng.step()
    assert eng.stats()["num_kv_tokens"] > before["num_kv_tokens"]
    eng.abort_request("a")
    gauges = ("num_running", "num_waiting", "kv_cache_usage", "num_kv_tokens", "num_free_slots")
    assert {k: eng.stats()[k] for k in gauges} == {k: before[k] for k in gauges}  # the rest are prefix cache counts
    outs = eng.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("a", "abort")]
    assert not eng.has_unfinished_requests()
