"""docs/speculation-cases.md on real models in fp32 on CPU (smollm2-135m-instruct; a few checks
on qwen2.5-coder-0.5b-instruct), through the offline API and the engine's step() (the streaming view).

Every case's assertion is kept as stated; recipes are scaled down for 2 shared CPU cores (max_tokens
32-64 instead of 128, k subsets where the case sweeps k). "Each method" = ngram, suffix and draft_model
(the target drafting for itself). BASE = the same engine and request with speculative_config=None.
B22 (2) lives in tests/stat/test_spec_distribution_e2e.py (tiny models: 2000 requests per setting).

Torch runs single-threaded here (SPECSERVE_TEST_THREADS to change): on a shared 2-core machine the
second OpenMP thread mostly spins and costs several times the CPU of the work it does.
"""

from __future__ import annotations

import random

import pytest

from specserve import LLM, SamplingParams
from specserve.config import SpeculativeConfig
from specserve.engine.llm_engine import RequestError
from specserve.spec_decode import make_proposer
from specserve.spec_decode.draft_model import DraftModelProposer
from tests.helpers.cases import (
    Submission,
    assert_greedy_equal,
    assert_spec_invariants,
    block_ends,
    first_diff,
    pick_forced_stop_string,
    pick_forced_token,
    run_engine,
)
from tests.helpers.proposers import WrongProposer

pytestmark = [pytest.mark.real_model, pytest.mark.usefixtures("torch_threads")]

SMOL = "smollm2-135m-instruct"
QWEN = "qwen2.5-coder-0.5b-instruct"
METHODS = ("ngram", "suffix", "draft_model")

LIST = "1: I will not skip any words.\n2: I will not skip any words.\n3:"
SERVING = "serving " * 48
HA = "Write 'ha' forty times separated by spaces: ha ha ha ha"
HELLO = "Repeat the word 'hello' many times: hello"
NATURAL = "The capital of France is"
CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):"
ROBOT = "A robot may not"
MB_CASE = "Repeat: café naïve 東京 😀 café naïve 東京 😀"
MB_LINES = "café naïve 東京 😀\ncafé naïve 東京 😀\ncafé naïve 東京 😀\n"
BATCH8 = [LIST, SERVING, HA, HELLO, NATURAL, CODE, MB_LINES, ROBOT]
N = 48  # BASE length of the shared table


def G(max_tokens: int = N, **kw) -> SamplingParams:
    """Greedy params (ignore_eos unless given)."""
    kw.setdefault("ignore_eos", True)
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def spec(method: str, k: int, draft: str = SMOL, **kw) -> SpeculativeConfig:
    d: dict = {"method": method, "num_speculative_tokens": k}
    if method == "ngram":
        d.update(prompt_lookup_min=1, prompt_lookup_max=4)
    if method == "draft_model":
        d["model"] = draft
    d.update(kw)
    return SpeculativeConfig.from_dict(d)


def gen(llm, prompts, params, cfg):
    return [o.outputs[0] for o in llm.generate(prompts, params, speculative_config=cfg)]




@pytest.fixture(scope="module")
def smol(real_model):
    real_model(SMOL)
    return LLM(SMOL, max_model_len=512, max_num_seqs=16, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def enc(smol):
    return smol.engine.encode_prompt


@pytest.fixture(scope="module")
def base(smol):
    """BASE: greedy, ignore_eos, N tokens, for the 8 prompts (one batch) -> {prompt: CompletionOutput}."""
    return dict(zip(BATCH8, gen(smol, BATCH8, G(), None)))


LIST_CONFIGS = [("ngram", 2), ("ngram", 4), ("ngram", 5), ("ngram", 6), ("ngram", 8), ("suffix", 4),
                ("suffix", 6), ("draft_model", 4), ("draft_model", 6)]


@pytest.fixture(scope="module")
def list_runs(smol, enc, base):
    """SPEC runs of LIST (N tokens, ignore_eos) for the configs the forcing trick needs, in one batch:
    their commit blocks tell where a stop lands strictly inside an accepted block."""
    subs = [Submission(f"list-{m}-{k}", LIST, G(), spec(m, k)) for m, k in LIST_CONFIGS]
    runs = run_engine(smol.engine, subs)
    out = {}
    for m, k in LIST_CONFIGS:
        st = runs[f"list-{m}-{k}"]
        assert_greedy_equal(smol, enc(LIST), st.final.token_ids, base[LIST].token_ids, msg=f"{m} k={k}")
        assert st.final.spec_stats.num_accepted_tokens > 0
        out[(m, k)] = st
    return out


def assert_kv_idle(llm):
    s = llm.engine.stats()
    assert s["num_kv_tokens"] == 0 and s["num_running"] == 0 and s["num_free_slots"] == llm.engine.config.max_num_seqs
    for prop in llm.engine.proposers():
        if isinstance(prop, DraftModelProposer):
            draft = prop.draft
            assert draft.kv.num_used_tokens == 0 and draft.kv.num_free_slots == draft.kv.num_slots


# ---- B01: greedy output must not change under speculation -----------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_b01_greedy_equal_alone_every_k(smol, enc, base, method):
    """B01 alone: SPEC ids == BASE ids (greedy equality rule) for k in {1, 3, 5, 8}; drafts accepted."""
    for k in (1, 3, 5, 8):
        out = gen(smol, [SERVING], G(32), spec(method, k))[0]
        assert_greedy_equal(smol, enc(SERVING), out.token_ids, base[SERVING].token_ids[:32], msg=f"{method} k={k}")
        assert out.num_accepted_tokens > 0, (method, k)
    assert_kv_idle(smol)


@pytest.mark.parametrize("method,k", [("ngram", 3), ("ngram", 8), ("suffix", 5), ("draft_model", 5)])
def test_b01_greedy_equal_batch_of_8(smol, enc, base, method, k):
    """B01 batched: 8 different prompts in one batch, each == its BASE; acceptance counter > 0."""
    outs = gen(smol, BATCH8, G(), spec(method, k))
    for p, o in zip(BATCH8, outs):
        assert_greedy_equal(smol, enc(p), o.token_ids, base[p].token_ids, msg=f"{method} k={k} {p[:20]!r}")
    assert sum(o.num_accepted_tokens for o in outs) > 0
    assert_kv_idle(smol)


# ---- B02: EOS / stop token id accepted inside a draft block --------------------------------------------


@pytest.mark.parametrize("method,k", [("ngram", 2), ("ngram", 4), ("ngram", 8), ("draft_model", 4), ("suffix", 4)])
def test_b02_stop_token_inside_accepted_block(smol, enc, base, list_runs, method, k):
    """B02: stop_token_ids=[T] with T first produced at 5 < p < 50, strictly inside an accepted block:
    ids == BASE[:p+1] (the stop id is kept, as in BASE), finish "stop", nothing after p in any chunk."""
    eos = set(smol.engine.eos_token_ids)
    ref = base[LIST].token_ids
    p, t = pick_forced_token(ref, 5, 50, blocks=list_runs[(method, k)].blocks, avoid=eos)
    params = G(stop_token_ids=[t])
    want = gen(smol, [LIST], params, None)[0]
    assert want.token_ids == ref[: p + 1] and want.finish_reason == "stop"  # BASE's policy
    cfg = spec(method, k)
    plain = gen(smol, [LIST], params, cfg)[0]
    st = run_engine(smol.engine, [Submission("b02", LIST, params, cfg)])["b02"]
    for out in (plain, st.final):
        assert out.token_ids == want.token_ids, (p, t)
        assert out.text == want.text
        assert out.finish_reason == "stop" and out.stop_reason == t
    assert [i for b in st.blocks for i in b] == want.token_ids  # no token after p in any chunk
    assert "".join(st.deltas) == want.text
    assert len(st.final.token_ids) == p + 1  # usage.completion_tokens == returned tokens
    assert st.final.spec_stats.num_accepted_tokens > 0
    assert_kv_idle(smol)


@pytest.mark.parametrize("method", METHODS)
def test_b02_natural_eos_inside_block(smol, enc, method):
    """B02 with the model's own EOS (LIST makes smollm2 emit <|im_end|> after ~35 tokens)."""
    params = G(64, ignore_eos=False)
    want = gen(smol, [LIST], params, None)[0]
    assert want.finish_reason == "stop" and want.token_ids[-1] in smol.engine.eos_token_ids
    st = run_engine(smol.engine, [Submission("eos", LIST, params, spec(method, 5))])["eos"]
    assert_greedy_equal(smol, enc(LIST), st.final.token_ids, want.token_ids, msg=method)
    assert st.final.finish_reason == "stop" and st.final.stop_reason is None
    assert [i for b in st.blocks for i in b] == st.final.token_ids
    assert "".join(st.deltas) == st.final.text == want.text


# ---- B03: stop string inside an accepted block (token ids and logprobs side) ---------------------------


def _check_stop_string(smol, enc, prompt, s, params, cfg, base_text_full):
    tok = smol.get_tokenizer()
    want = gen(smol, [prompt], params, None)[0]
    plain = gen(smol, [prompt], params, cfg)[0]
    st = run_engine(smol.engine, [Submission("b03", prompt, params, cfg)])["b03"]
    cut = base_text_full.find(s)
    assert want.text == base_text_full[:cut]
    for out in (plain, st.final):
        assert out.token_ids == want.token_ids and out.text == want.text
        assert out.text == base_text_full[:cut] and s not in out.text  # ends right before the stop
        assert out.finish_reason == "stop" and out.stop_reason == s
        full = tok.decode(out.token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        before = tok.decode(out.token_ids[:-1], skip_special_tokens=True, clean_up_tokenization_spaces=False)
        # detokenized ids reach the stop only through their last token (the one that completed it)
        assert full.startswith(out.text) and s in full and s not in before
        assert len(out.logprobs) == len(out.token_ids)
        assert all(len(lp.top) == params.logprobs for lp in out.logprobs)
        assert [lp.token_id for lp in out.logprobs] == out.token_ids
    assert "".join(st.deltas) == st.final.text  # no chunk carried text after the stop
    return st


@pytest.mark.parametrize("method", METHODS)
def test_b03_stop_string_inside_accepted_block(smol, enc, base, list_runs, method):
    """B03: the recipe's " ha ha ha" on the ha prompt, and a forced stop string (first occurrence
    completed by a token strictly inside an accepted block of LIST). logprobs=2, k=5/6."""
    ha_full = base[HA].text
    st = _check_stop_string(smol, enc, HA, " ha ha ha", G(64, stop=[" ha ha ha"], logprobs=2), spec(method, 5), ha_full)
    assert st.final.token_ids == base[HA].token_ids[:3]
    k = 6 if method != "ngram" else 5
    s, j, _ = pick_forced_stop_string(smol.get_tokenizer(), enc(LIST), base[LIST].token_ids, base[LIST].text, 5, 45,
                                      blocks=list_runs[(method, k) if (method, k) in list_runs else (method, 4)].blocks)
    st = _check_stop_string(smol, enc, LIST, s, G(64, stop=[s], logprobs=2), spec(method, k), base[LIST].text)
    assert st.final.token_ids == base[LIST].token_ids[: j + 1]
    assert st.final.spec_stats.num_accepted_tokens > 0


# ---- B06: stop and max_tokens in the same block -------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_b06_stop_before_cap_and_cap_before_stop(smol, enc, base, method):
    """B06: with max_tokens=5 (k=6), a stop id (and a stop string) at position p strictly inside an
    accepted block -> "stop", BASE[:p+1]; control: a stop at position 7 -> "length", exactly 5 tokens.
    p is the recipe's 3 when a block of the 5-token SPEC run spans it, else 2 (suffix drafts fewer
    tokens here); without one the case fails: it cannot pass on a stop at a block's end."""
    ref, text = base[LIST].token_ids, base[LIST].text
    cfg = spec(method, 6)
    tok = smol.get_tokenizer()
    blocks = run_engine(smol.engine, [Submission("b06-blocks", LIST, G(5), cfg)])["b06-blocks"].blocks
    assert [x for b in blocks for x in b] == ref[:5]
    p = next((q for q in (3, 2) if q not in block_ends(blocks)), None)  # 1: no accepted draft before it
    assert p is not None, f"{method}: neither position 3 nor 2 lies inside an accepted block: {blocks}"
    _, t = pick_forced_token(ref, p - 1, p + 1, exact=p)
    s, j, _ = pick_forced_stop_string(tok, enc(LIST), ref, text, p - 1, p + 1, blocks=blocks, span=0)
    q, t7 = pick_forced_token(ref, 6, 8, exact=7)
    s7 = tok.decode(ref[5:8])
    assert text.find(s7) == len(tok.decode(ref[:5]))
    cases = [
        (G(5, stop_token_ids=[t]), "stop", ref[: p + 1]),
        (G(5, stop=[s]), "stop", ref[: j + 1]),
        (G(5, stop_token_ids=[t7]), "length", ref[:5]),
        (G(5, stop=[s7]), "length", ref[:5]),
    ]
    params = [c[0] for c in cases]
    want = gen(smol, [LIST] * 4, params, None)
    got = gen(smol, [LIST] * 4, params, cfg)
    streams = run_engine(smol.engine, [Submission(f"b06-{i}", LIST, pp, cfg) for i, pp in enumerate(params)])
    for i, (pp, reason, ids) in enumerate(cases):
        for out in (want[i], got[i], streams[f"b06-{i}"].final):
            assert out.finish_reason == reason, (i, out.finish_reason)
            assert out.token_ids == ids, i
        assert got[i].text == want[i].text == streams[f"b06-{i}"].final.text
        assert [x for b in streams[f"b06-{i}"].blocks for x in b] == ids
    assert streams["b06-0"].final.spec_stats.num_accepted_tokens > 0


# ---- B07: max_tokens never exceeded by accepted tokens ------------------------------------------------


def test_b07_max_tokens_sweep(smol, base):
    """B07: max_tokens 1..10 x ngram k in {1, 3, 5, 8}, plus draft_model and suffix (k=4), streamed:
    exactly max_tokens tokens, "length", == BASE[:max_tokens], streamed counts sum to max_tokens."""
    ref = base[LIST].token_ids
    cfgs = [spec("ngram", k) for k in (1, 3, 5, 8)] + [spec("draft_model", 4), spec("suffix", 4)]
    subs = [Submission(f"b07-{ci}-{m}", LIST, G(m), cfg, at_step=ci)
            for ci, cfg in enumerate(cfgs) for m in range(1, 11)]
    streams = run_engine(smol.engine, subs)
    for s in subs:
        st, m = streams[s.rid], s.params.max_tokens
        assert len(st.final.token_ids) == m and st.final.finish_reason == "length", s.rid
        assert st.final.token_ids == ref[:m], s.rid
        assert sum(len(b) for b in st.blocks) == m
    # the non-streamed path too, for the draft method (it accepts every draft, so blocks are longest)
    outs = gen(smol, [LIST] * 10, [G(m) for m in range(1, 11)], spec("draft_model", 8))
    for m, o in zip(range(1, 11), outs):
        assert o.token_ids == ref[:m] and o.finish_reason == "length"
    assert_kv_idle(smol)


# ---- B08: drafts never pass max_model_len -------------------------------------------------------------


@pytest.fixture(scope="module")
def smol128(real_model):
    real_model(SMOL)
    return LLM(SMOL, max_model_len=128, max_num_seqs=4, dtype="float32", device="cpu")


def test_b08_context_end_inside_block(smol128):
    """B08: max_model_len=128, repetitive prompts of P in {120 (= 128 - k, "about 120"), 127}, k=8,
    max_tokens=100: exactly 128 - P tokens, "length", == BASE; P=128 is refused up front; a follow-up
    request == its BASE (no KV corruption)."""
    llm, k = smol128, 8
    eng = llm.engine
    ids = eng.encode_prompt("".join(f"{i}: I will not skip any words.\n" for i in range(1, 30)))
    assert len(ids) >= 128
    follow = gen(llm, [NATURAL], G(16), None)[0].token_ids
    params = G(100)
    prompts = [ids[:P] for P in (128 - k, 127)]
    want = gen(llm, prompts, params, None)
    for pr, w in zip(prompts, want):
        assert len(w.token_ids) == 128 - len(pr) and w.finish_reason == "length"
    for method in METHODS:
        cfg = spec(method, k)
        streams = run_engine(eng, [Submission(f"b08-{method}-{len(pr)}", pr, params, cfg) for pr in prompts])
        for pr, w in zip(prompts, want):
            out = streams[f"b08-{method}-{len(pr)}"].final
            assert len(pr) + len(out.token_ids) <= 128
            assert len(out.token_ids) == 128 - len(pr) and out.finish_reason == "length", (method, len(pr))
            assert_greedy_equal(llm, pr, out.token_ids, w.token_ids, msg=f"{method} P={len(pr)}")
        with pytest.raises(RequestError):
            eng.add_request(f"b08-full-{method}", ids[:128], params, speculative_config=cfg)
        assert gen(llm, [NATURAL], G(16), cfg)[0].token_ids == follow
    assert gen(llm, [NATURAL], G(16), None)[0].token_ids == follow
    assert_kv_idle(llm)


# ---- B10: acceptance counters with a stop inside the accepted prefix ------------------------------------


@pytest.mark.parametrize("variant", ["stop_token", "stop_string", "max_tokens"])
def test_b10_counters_with_stop_inside_block(smol, enc, base, list_runs, variant):
    """B10: single request, ngram k=5, the counters (per request and the engine's delta) obey the
    invariants when a stop id (B02), a stop string (B03) or max_tokens (B06) ends it inside a block."""
    k = 5
    ref = base[LIST].token_ids
    blocks = list_runs[("ngram", k)].blocks
    if variant == "stop_token":
        p, t = pick_forced_token(ref, 5, 50, blocks=blocks, avoid=set(smol.engine.eos_token_ids))
        params, n_want = G(stop_token_ids=[t]), p + 1
    elif variant == "stop_string":
        s, j, _ = pick_forced_stop_string(smol.get_tokenizer(), enc(LIST), ref, base[LIST].text, 5, 45, blocks=blocks)
        params, n_want = G(stop=[s]), j + 1
    else:
        inside = sorted(set(range(6, 30)) - block_ends(blocks))[0]
        params, n_want = G(inside + 1), inside + 1
    eng = smol.engine
    before = eng.spec_stats.get("ngram")
    before = (before.num_drafts, before.num_draft_tokens, before.num_accepted_tokens) if before else (0, 0, 0)
    st = run_engine(eng, [Submission("b10", LIST, params, spec("ngram", k))])["b10"]
    assert st.final.token_ids == ref[:n_want]
    assert_spec_invariants(st, k, variant)
    after = eng.spec_stats["ngram"]
    s = st.final.spec_stats
    assert (after.num_drafts - before[0], after.num_draft_tokens - before[1], after.num_accepted_tokens - before[2]) == (
        s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens)


# ---- B12: logprobs under speculation ------------------------------------------------------------------


def _assert_logprobs_match(spec_out, base_out, n_top, where, tol=1e-3):
    n = len(spec_out.token_ids)
    assert len(spec_out.logprobs) == n, where  # one entry per generated token
    upto = first_diff(spec_out.token_ids, base_out.token_ids)
    upto = n if upto is None else upto
    for i in range(upto):
        a, b = spec_out.logprobs[i], base_out.logprobs[i]
        assert a.token_id == b.token_id == spec_out.token_ids[i]
        assert abs(a.logprob - b.logprob) < tol, (where, i, a.logprob, b.logprob)
        assert len(a.top) == n_top
        assert {t for t, _ in a.top} == {t for t, _ in b.top}, (where, i, a.top, b.top)
        for (ta, la), (tb, lb) in zip(sorted(a.top), sorted(b.top)):
            assert abs(la - lb) < tol, (where, i)
    assert not all(lp.logprob == 0.0 for lp in spec_out.logprobs), where


@pytest.fixture(scope="module")
def b12_base(smol):
    return gen(smol, [LIST, NATURAL], G(N, logprobs=3), None)


@pytest.mark.parametrize("method", METHODS)
def test_b12_logprobs_equal_base(smol, enc, b12_base, method):
    """B12: logprobs=3, greedy, 48 tokens, repetitive + natural prompt, k=4: one entry per token, values
    == BASE within 1e-3, same top-3 sets, not all 0.0, and accepted drafts were covered."""
    prompts = [LIST, NATURAL]
    params = G(N, logprobs=3)
    want = b12_base
    got = gen(smol, prompts, params, spec(method, 4))
    for p, w, g in zip(prompts, want, got):
        assert_greedy_equal(smol, enc(p), g.token_ids, w.token_ids, msg=method)
        _assert_logprobs_match(g, w, 3, f"{method} {p[:12]!r}")
    assert got[0].num_accepted_tokens > 0


# ---- B15: streaming deltas under multi-token steps ----------------------------------------------------


B15_PROMPTS = [LIST, MB_CASE, MB_LINES]


@pytest.fixture(scope="module")
def b15_base(smol):
    return gen(smol, B15_PROMPTS, G(64, logprobs=1), None)


@pytest.mark.parametrize("method", METHODS)
def test_b15_streaming_deltas(smol, b15_base, method):
    """B15: greedy, 64 tokens, logprobs=1, k=8, streamed from step(): "".join(new_text) == final text
    == BASE text; logprob entries across chunks == tokens; no U+FFFD where BASE has none; chunk order
    and the single finishing chunk (checked by run_engine)."""
    prompts = B15_PROMPTS
    params = G(64, logprobs=1)
    want = b15_base
    assert any(ord(c) > 0x7F for c in want[2].text), "BASE must produce multi-byte characters"
    streams = run_engine(smol.engine, [Submission(f"b15-{i}", p, params, spec(method, 8)) for i, p in enumerate(prompts)])
    for i, (p, w) in enumerate(zip(prompts, want)):
        st = streams[f"b15-{i}"]
        joined = "".join(st.deltas)
        assert joined == st.final.text == w.text, (method, p[:12])
        assert st.final.token_ids == w.token_ids
        assert sum(len(o.new_logprobs) for o in st.outputs) == len(st.final.token_ids)
        if "\ufffd" not in w.text:
            assert "\ufffd" not in joined and not any("\ufffd" in d for d in st.deltas)
        # outputs are deltas: the joined deltas equal BASE's text, so no chunk re-sent or rewrote earlier text
    assert sum(streams[f"b15-{i}"].final.spec_stats.num_accepted_tokens for i in range(3)) > 0


# ---- B16: penalties under speculation ------------------------------------------------------------------

PENALTIES = [dict(frequency_penalty=f, presence_penalty=pp, repetition_penalty=r)
             for f in (-2.0, 0.0, 2.0) for pp in (0.0, 1.5) for r in (1.0, 1.3)]


@pytest.fixture(scope="module")
def b16_base(smol):
    params = [G(16, ignore_eos=False, **kw) for kw in PENALTIES]
    return params, gen(smol, [HELLO] * len(params), params, None)


@pytest.mark.parametrize("method", METHODS)
def test_b16_penalties_under_spec(smol, enc, b16_base, method):
    """B16: every frequency x presence x repetition setting, SPEC == BASE (greedy rule on the
    penalized logits); in BASE frequency 2 differs from -2, in its direction (fewer repeated tokens)."""
    params, want = b16_base
    by = {tuple(kw.values()): w.token_ids for kw, w in zip(PENALTIES, want)}
    plus, minus = by[(2.0, 0.0, 1.0)], by[(-2.0, 0.0, 1.0)]
    assert plus != minus, "the penalty must matter for this prompt"
    assert len(plus) - len(set(plus)) < len(minus) - len(set(minus)), (plus, minus)
    got = gen(smol, [HELLO] * len(params), params, spec(method, 4))
    for pp, w, g in zip(params, want, got):
        assert_greedy_equal(smol, enc(HELLO), g.token_ids, w.token_ids, params=pp,
                            msg=f"{method} f={pp.frequency_penalty} p={pp.presence_penalty} r={pp.repetition_penalty}")
    assert sum(g.num_accepted_tokens for g in got) > 0


# ---- B19: per-request seed under speculation ----------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_b19_seed_reproducible(smol, method):
    """B19: temperature 2.0 and 0.8, seed 42, 10 tokens: 5 identical outputs (a call alone, and 4 copies
    streamed among 3 unseeded requests and 6 other seeded ones, joining between steps); seed 43 differs on one of 3
    prompts. Guarantee (SamplingParams.seed): reproducible per profile; with one-hot drafts (ngram,
    suffix) also the same tokens as without speculation."""
    cfg = spec(method, 4)
    others = [NATURAL, CODE, HELLO]
    for temp in (2.0, 0.8):
        p42 = SamplingParams(temperature=temp, max_tokens=10, seed=42)
        runs = [gen(smol, [ROBOT], p42, cfg)[0].token_ids]
        subs = [Submission(f"s{i}", ROBOT, p42, cfg, at_step=i + (i > 2)) for i in range(4)]
        subs += [Submission(f"u{i}", o, SamplingParams(temperature=temp, max_tokens=10), cfg, at_step=i + (i > 1))
                 for i, o in enumerate(others)]
        subs += [Submission(f"p{s}-{i}", o, SamplingParams(temperature=temp, max_tokens=10, seed=s), cfg, at_step=1)
                 for s in (42, 43) for i, o in enumerate(others)]
        streams = run_engine(smol.engine, subs)
        runs += [streams[f"s{i}"].final.token_ids for i in range(4)]
        assert all(r == runs[0] for r in runs), (method, temp, runs)
        assert any(streams[f"p42-{i}"].final.token_ids != streams[f"p43-{i}"].final.token_ids for i in range(3))
        if method in ("ngram", "suffix"):
            assert gen(smol, [ROBOT], p42, None)[0].token_ids == runs[0]


# ---- B25: rejected drafts leave nothing behind --------------------------------------------------------

VARIED = ("1: I like red apples.\n2: I like green apples.\n3: I like blue apples.\n"
          "4: I like red pears.\n5: I like green pears.\n6:")


@pytest.mark.parametrize("first_right", [False, True])
def test_b25_wrong_drafts_roll_back(smol, enc, base, first_right):
    """B25: an always-wrong drafter (and right-then-wrong), k=4: output == BASE, acceptance 0 (or only
    the first draft), the next request on the freed slot == its BASE, KV back to empty."""
    eng = smol.engine
    cfg = spec("ngram", 4, prompt_lookup_min=3, prompt_lookup_max=3)  # a proposer key of its own
    prompts = [LIST, CODE]
    truth = {tuple(enc(p)): base[p].token_ids for p in prompts}
    kv_before = eng.stats()
    with eng.using_proposer(cfg, WrongProposer(truth, eng.target.config.vocab_size, first_right)):
        outs = gen(smol, prompts, G(24), cfg)
    for p, o in zip(prompts, outs):
        assert_greedy_equal(smol, enc(p), o.token_ids, base[p].token_ids[:24])
        assert o.num_draft_tokens > 0
        assert o.num_accepted_tokens == (o.num_drafts if first_right else 0)
    gauges = ("num_running", "num_waiting", "kv_cache_usage", "num_kv_tokens", "num_free_slots")
    assert {k: eng.stats()[k] for k in gauges} == {k: kv_before[k] for k in gauges}  # the rest: prefix cache counts
    assert gen(smol, [NATURAL], G(24), None)[0].token_ids == base[NATURAL].token_ids[:24]


@pytest.fixture(scope="module")
def b25_base(smol):
    return gen(smol, [VARIED, NATURAL], G(32), None)


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_b25_partial_rejections_varied_list(smol, enc, b25_base, method):
    """B25: natural drafts with k=8 on a list whose items differ in one word (frequent partial
    rejections): == BASE, a follow-up == its BASE, KV back to empty."""
    want = b25_base
    out = gen(smol, [VARIED], G(32), spec(method, 8))[0]
    assert_greedy_equal(smol, enc(VARIED), out.token_ids, want[0].token_ids, msg=method)
    assert 0 < out.num_accepted_tokens < out.num_draft_tokens  # some accepted, some rejected
    assert gen(smol, [NATURAL], G(32), spec(method, 8))[0].token_ids == want[1].token_ids
    assert_kv_idle(smol)


# ---- B26: mixed batches ---------------------------------------------------------------------------------


def test_b26_mixed_batch_random_arrivals(smol, enc, base):
    """B26: 6 requests (2 repetitive, 2 without n-gram matches, 1 seeded sampled, 1 greedy with a
    logit_bias forbidding the token its drafts keep proposing), added between steps in random order;
    2 rounds (ngram k=4; then methods and no-speculation mixed). Each greedy one == its BASE, the
    sampled one == itself solo under SPEC, the forbidden token never appears, no request fails."""
    ha_tok = enc(" ha")[0]
    assert base[HA].token_ids.count(ha_tok) > 10  # ha is what the ngram drafts propose
    greedy = {"R1": LIST, "R2": SERVING, "R3": NATURAL, "R4": ROBOT}
    p5 = SamplingParams(temperature=0.8, seed=3, max_tokens=32)
    p6 = G(32, logit_bias={ha_tok: -100.0})
    ngram = spec("ngram", 4)
    want6 = gen(smol, [HA], p6, None)[0].token_ids
    solo5 = gen(smol, [CODE], p5, ngram)[0].token_ids
    rng = random.Random(0)
    rounds = [dict.fromkeys(["R1", "R2", "R3", "R4", "R6"], ngram),
              {"R1": spec("suffix", 4), "R2": spec("draft_model", 3), "R3": None, "R4": ngram, "R6": ngram}]
    for rnd, cfgs in enumerate(rounds):
        order = ["R1", "R2", "R3", "R4", "R5", "R6"]
        rng.shuffle(order)
        at = sorted(rng.randint(0, 4) for _ in order)
        subs = []
        for name, step in zip(order, at):
            prompt, params = (CODE, p5) if name == "R5" else (HA, p6) if name == "R6" else (greedy[name], G(32))
            subs.append(Submission(f"{name}-{rnd}", prompt, params, ngram if name == "R5" else cfgs[name], at_step=step))
        streams = run_engine(smol.engine, subs)
        for name, prompt in greedy.items():
            assert_greedy_equal(smol, enc(prompt), streams[f"{name}-{rnd}"].final.token_ids,
                                base[prompt].token_ids[:32], msg=f"round {rnd} {name}")
        assert streams[f"R5-{rnd}"].final.token_ids == solo5, rnd
        r6 = streams[f"R6-{rnd}"].final.token_ids
        assert ha_tok not in r6 and r6 == want6, rnd
        assert all(st.final.finish_reason in ("length", "stop") for st in streams.values())  # none failed
    assert_kv_idle(smol)


# ---- B28: no proposer state leaks between requests; prompts shorter than n -------------------------------

A_TEXT = ("def area(w, h):\n    return w * h\n\n" * 6) + "def area(w, h):"
B_TEXT = "red blue green, red blue green, red blue green, red blue"


class LoggingProposer:
    """Wraps a proposer and logs (request_id, context, drafts) of every proposal."""

    def __init__(self, inner):
        self.inner, self.method, self.log = inner, inner.method, []

    def propose(self, inputs):
        props = self.inner.propose(inputs)
        for inp, pr in zip(inputs, props):
            self.log.append((inp.request_id, list(inp.token_ids), list(pr.token_ids)))
        return props

    def finish_request(self, request_id, token_ids):
        return self.inner.finish_request(request_id, token_ids)


def _b28_seq(eng):
    chat_ids = eng.encode_chat([{"role": "user", "content": ""}])
    return [("A", A_TEXT, 32), ("B", B_TEXT, 32), ("B2", B_TEXT, 32), ("hi", "Hi", 8), ("two", "Hi there", 8),
            ("chat", chat_ids, 8)]


@pytest.fixture(scope="module")
def b28_base(smol):
    seq = _b28_seq(smol.engine)
    return {name: o for (name, _, _), o in zip(seq, gen(smol, [p for _, p, _ in seq], [G(m) for _, _, m in seq], None))}


@pytest.mark.parametrize("cfg_kw", [dict(method="ngram", prompt_lookup_min=1, prompt_lookup_max=4),
                                    dict(method="ngram", prompt_lookup_min=8, prompt_lookup_max=8),
                                    dict(method="suffix")], ids=["ngram_1_4", "ngram_8_8", "suffix"])
def test_b28_sequence_of_requests(smol, b28_base, cfg_kw):
    """B28: one engine, one request at a time: A (long repetitive code), B (other repetitive text), B
    again, a 1-token prompt, a 2-token prompt, an empty chat message. No crash, every output == BASE,
    B's acceptance after A within 10 points of B on a fresh proposer, and (ngram) no draft for B holds
    an id that is not in B's own prompt + output so far."""
    eng = smol.engine
    tok = smol.get_tokenizer()
    cfg = SpeculativeConfig.from_dict({"num_speculative_tokens": 4, **cfg_kw})
    seq = _b28_seq(eng)
    assert len(tok.encode("Hi")) == 1 and len(tok.encode("Hi there")) == 2
    want = b28_base
    with eng.using_proposer(cfg, LoggingProposer(make_proposer(cfg, eng.proposer_context))) as fresh:
        b_fresh = gen(smol, [B_TEXT], G(32), cfg)[0]
    with eng.using_proposer(cfg, LoggingProposer(make_proposer(cfg, eng.proposer_context))) as logger:
        got = {}
        for name, prompt, m in seq:
            got[name] = gen(smol, [prompt], G(m), cfg)[0]
    for name, _, _ in seq:
        assert got[name].token_ids == want[name].token_ids, name
    assert b_fresh.token_ids == want["B"].token_ids
    rate = lambda o: o.num_accepted_tokens / o.num_draft_tokens if o.num_draft_tokens else 0.0  # noqa: E731
    assert b_fresh.num_draft_tokens > 0
    assert abs(rate(got["B"]) - rate(b_fresh)) <= 0.10, (rate(got["B"]), rate(b_fresh))
    if cfg.method == "ngram":  # stateless: B again drafts exactly as B did
        assert rate(got["B2"]) == rate(got["B"])
    else:  # suffix's global tree now holds B's own output: B again may only gain from it
        assert rate(got["B2"]) >= rate(b_fresh) - 0.10
    if cfg.method == "ngram":
        a_ids = set(tok.encode(A_TEXT)) | set(got["A"].token_ids)
        b_prompt = tok.encode(B_TEXT)
        b_logs = [(ctx, d) for rid, ctx, d in logger.log if ctx[: len(b_prompt)] == b_prompt]
        assert b_logs and any(d for _, d in b_logs)
        for ctx, drafts in b_logs:
            own = set(ctx)
            assert set(drafts) <= own, f"draft ids {set(drafts) - own} are not in B's own context"
            assert not (set(drafts) & (a_ids - own))
        assert fresh.log
    assert_kv_idle(smol)


# ---- qwen2.5-coder-0.5b: a few checks on the second architecture --------------------------------------


@pytest.fixture(scope="module")
def qwen(real_model):
    real_model(QWEN)
    return LLM(QWEN, max_model_len=256, max_num_seqs=4, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def qwen_base(qwen):
    return gen(qwen, [CODE, MB_CASE], G(24, logprobs=3), None)


@pytest.mark.parametrize("method,k", [("ngram", 5), ("draft_model", 3)])
def test_qwen_greedy_logprobs_streaming(qwen, qwen_base, method, k):
    """B01 + B12 + B15 on qwen 0.5b (ngram; the 0.5b drafting for itself): ids == BASE (greedy rule),
    logprobs == BASE within 1e-3 with the same top-3, streamed text == BASE text with multi-byte
    characters split across byte-level tokens, and drafts were accepted."""
    prompts = [CODE, MB_CASE]
    params = G(24, logprobs=3)
    want = qwen_base
    assert "東京" in want[1].text
    streams = run_engine(qwen.engine, [Submission(f"q{i}", p, params, spec(method, k, draft=QWEN))
                                       for i, p in enumerate(prompts)])
    for i, (p, w) in enumerate(zip(prompts, want)):
        st = streams[f"q{i}"]
        assert_greedy_equal(qwen, qwen.engine.encode_prompt(p), st.final.token_ids, w.token_ids, msg=method)
        _assert_logprobs_match(st.final, w, 3, f"qwen {method} {i}")
        assert "".join(st.deltas) == st.final.text
        if st.final.token_ids == w.token_ids:
            assert st.final.text == w.text
        assert "\ufffd" not in "".join(st.deltas)
    assert sum(streams[f"q{i}"].final.spec_stats.num_accepted_tokens for i in range(2)) > 0
    assert_kv_idle(qwen)
