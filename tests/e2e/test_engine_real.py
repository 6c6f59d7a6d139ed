"""Real models (fp32, CPU) against transformers, and speculation that really pays on a code edit.

- Logits of our forward equal transformers' for the same weights within 1e-4 relative error, and greedy
  tokens equal transformers' greedy tokens on real prompts (smollm2-135m-instruct, qwen2.5-coder-0.5b).
- One batch mixing every method and k with no speculation gives each request its solo baseline tokens.
- On a code-edit prompt (return the function with one name changed) ngram's and suffix's mean acceptance
  length is well above 1.
"""


import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.config import SpeculativeConfig
from specserve.engine.model_runner import SeqInput
from tests.helpers.cases import Submission, assert_greedy_equal, run_engine

pytestmark = [pytest.mark.real_model, pytest.mark.usefixtures("torch_threads")]

CHATS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that returns the factorial of n.",
    "Explain recursion to a child in two sentences.",
]
CODE = '''def binary_search(arr, target):
    lo, hi = 0, len(arr) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if arr[mid] == target:
            return mid
        elif arr[mid] < target:
            lo = mid + 1
        else:
            hi = mid - 1
    return -1
'''
EDIT = "Rename the function `binary_search` to `find_index` and return the whole code, nothing else:\n```python\n" + CODE + "```"




@pytest.fixture(scope="module", params=["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"])
def pair(request, real_model):
    from transformers import AutoModelForCausalLM

    files = real_model(request.param)
    llm = LLM(str(files.path), max_model_len=1024, max_num_seqs=8)
    hf = AutoModelForCausalLM.from_pretrained(str(files.path), dtype=torch.float32).eval()
    return llm, hf


def test_logits_and_greedy_match_transformers(pair):
    llm, hf = pair
    eng = llm.engine
    prompts = [eng.encode_chat([{"role": "user", "content": c}]) for c in CHATS]
    for ids in prompts:
        slot = eng.target.kv.allocate()
        ours = eng.target.runner.forward([SeqInput(slot, 0, ids, len(ids))])
        eng.target.kv.free(slot)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        rel = ((ours - ref).abs().max() / ref.abs().max()).item()
        assert rel < 1e-4, rel
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(ids):].tolist()
        assert_greedy_equal(llm, ids, out.outputs[0].token_ids, ref)


def test_mixed_methods_batch_equals_solo_baseline(real_model):
    path = str(real_model("smollm2-135m-instruct").path)
    llm = LLM(path, max_model_len=1024, max_num_seqs=16)
    eng = llm.engine
    prompts = [eng.encode_chat([{"role": "user", "content": c}]) for c in CHATS + [EDIT]]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    base = [o.outputs[0].token_ids for o in llm.generate(prompts, params, speculative_config=None)]
    cfgs = [None, SpeculativeConfig("ngram", 3, prompt_lookup_min=1, prompt_lookup_max=4),
            SpeculativeConfig("suffix", 5), SpeculativeConfig("draft_model", 8, model=path)]
    plan = [(i, c) for i in range(len(prompts)) for c in cfgs]
    streams = run_engine(eng, [Submission(f"r{n}", prompts[i], params, c) for n, (i, c) in enumerate(plan)])
    done = {rid: st.final for rid, st in streams.items()}
    for n, (i, c) in enumerate(plan):
        assert_greedy_equal(llm, prompts[i], done[f"r{n}"].token_ids, base[i], msg=str(c))
    assert sum(done[f"r{n}"].spec_stats.num_accepted_tokens for n in range(len(plan))) > 0


def test_code_edit_acceptance_is_real(real_model):
    llm = LLM(str(real_model("qwen2.5-coder-0.5b-instruct").path), max_model_len=1024)
    ids = llm.engine.encode_chat([{"role": "user", "content": EDIT}])
    params = SamplingParams(temperature=0, max_tokens=96)
    base = llm.generate([ids], params, speculative_config=None)[0].outputs[0]
    assert "find_index" in base.text
    for cfg in (SpeculativeConfig("ngram", 5, prompt_lookup_min=2, prompt_lookup_max=4), SpeculativeConfig("suffix", 8)):
        out = llm.generate([ids], params, speculative_config=cfg)[0].outputs[0]
        assert out.token_ids == base.token_ids
        assert out.mean_acceptance_length > 2.5, (cfg.method, out.mean_acceptance_length)


def test_prefix_cache_greedy_equals_uncached(real_model):
    """Prefix caching (docs/prefix_caching.md) on a real model: repeated chat prompts and a second chat
    turn that contains the first turn's answer give the same greedy tokens as an engine without the
    cache (alone, with ngram, in a batch), and most of their prompt tokens come from the cache."""
    path = str(real_model("smollm2-135m-instruct").path)
    on = LLM(path, max_model_len=1024, max_num_seqs=4)
    off = LLM(path, max_model_len=1024, max_num_seqs=4, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    ngram = SpeculativeConfig("ngram", 4, prompt_lookup_min=1, prompt_lookup_max=4)
    first = [on.engine.encode_chat([{"role": "user", "content": c}]) for c in CHATS[:2] + [EDIT]]
    answers = [o.outputs[0] for o in off.generate(first, params, speculative_config=None)]
    turn2 = [on.engine.encode_chat([{"role": "user", "content": c}, {"role": "assistant", "content": a.text},
                                    {"role": "user", "content": "Say it again, shorter."}])
             for c, a in zip(CHATS[:2] + [EDIT], answers)]
    for cfg in (None, ngram):
        for ids, base in zip(first, answers):
            assert_greedy_equal(on, ids, on.generate([ids], params, speculative_config=cfg)[0].outputs[0].token_ids,
                                base.token_ids, msg=f"repeat {cfg}")
        got = on.generate(turn2, params, speculative_config=cfg)
        want = off.generate(turn2, params, speculative_config=None)
        for ids, a, b in zip(turn2, got, want):
            assert_greedy_equal(on, ids, a.outputs[0].token_ids, b.outputs[0].token_ids, msg=f"turn 2 {cfg}")
    s = on.engine.stats()
    assert s["prefix_cache_hits"] > 0.5 * s["prefix_cache_queries"], s
