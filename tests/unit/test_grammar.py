"""Structured output on tiny random-weight models (docs/structured-output.md): schema-valid JSON under
greedy and seeded sampling, with and without speculation (ngram, suffix, draft_model); greedy (and, with
one-hot drafts, seeded) speculation equal to the baseline with the same grammar; verify-row masking (a
forbidden draft is rejected, the grammar state rolled back); compile errors name the parameter."""

import json

import jsonschema
import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.config import SpeculativeConfig
from specserve.engine.step_plan import ScheduledRequest, StepPlan
from specserve.grammar.compiler import GrammarCompiler
from specserve.grammar.matcher import GrammarRejected, GrammarState, allocate_bitmask
from specserve.request import Request
from specserve.sample.batch import SamplingBatch
from specserve.sample.verifier import to_host, verify
from specserve.sampling_params import SamplingParamsError, StructuredOutputsParams
from specserve.spec_decode.proposer import Proposal

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["a", "b", "c"],
          "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                         "b": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                         "c": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}}}
PROMPTS = ["The quick brown fox", "def add(a, b):", '{"name": "get_weather", "arguments": {"city": "Paris"}}']
MAX_TOKENS = 80


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), max_model_len=256, max_num_seqs=16)


@pytest.fixture(scope="module")
def other_tiny_dir(tmp_path_factory):
    from tests.helpers.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-other-grammar"), arch="qwen2", seed=1)


def configs(tiny_model_dir, other_tiny_dir, k=4):
    return {
        "ngram": SpeculativeConfig("ngram", k, prompt_lookup_min=1, prompt_lookup_max=4),
        "suffix": SpeculativeConfig("suffix", k),
        "draft_self": SpeculativeConfig("draft_model", k, model=str(tiny_model_dir)),
        "draft_other": SpeculativeConfig("draft_model", k, model=str(other_tiny_dir)),
    }


def params(**kw):
    return SamplingParams(max_tokens=MAX_TOKENS, structured_outputs=StructuredOutputsParams(json=SCHEMA), **kw)


def assert_valid(out):
    assert out.finish_reason == "stop", (out.finish_reason, out.text)
    jsonschema.validate(json.loads(out.text), SCHEMA)


def test_greedy_json_schema_valid_and_speculation_equals_baseline(llm, tiny_model_dir, other_tiny_dir):
    base = [o.outputs[0] for o in llm.generate(PROMPTS, params(temperature=0), speculative_config=None)]
    for out in base:
        assert_valid(out)
    drafted = 0
    for name, cfg in configs(tiny_model_dir, other_tiny_dir).items():
        outs = [o.outputs[0] for o in llm.generate(PROMPTS, params(temperature=0), speculative_config=cfg)]
        for b, o in zip(base, outs):
            assert o.token_ids == b.token_ids, (name, b.text, o.text)
            drafted += o.num_drafts
    assert drafted > 0
    # the grammar changed the output: without it the same greedy requests are not this JSON
    free = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), speculative_config=None)
    assert [o.outputs[0].text for o in free] != [b.text for b in base]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_seeded_sampling_valid_with_and_without_speculation(llm, tiny_model_dir, other_tiny_dir, seed):
    sp = params(temperature=1.0, seed=seed)
    base = [o.outputs[0] for o in llm.generate(PROMPTS, sp, speculative_config=None)]
    for out in base:
        assert_valid(out)
    for name, cfg in configs(tiny_model_dir, other_tiny_dir).items():
        outs = [o.outputs[0] for o in llm.generate(PROMPTS, sp, speculative_config=cfg)]
        for b, o in zip(base, outs):
            assert_valid(o)
            if name in ("ngram", "suffix"):  # one-hot drafts: the seed gives the target-alone tokens
                assert o.token_ids == b.token_ids, (name, b.text, o.text)


def test_regex_choice_and_json_object(llm):
    cases = [(StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}"), lambda t: len(t) == 6 and t[3] == "-"),
             (StructuredOutputsParams(choice=["yes", "no", "maybe later"]), lambda t: t in ("yes", "no", "maybe later")),
             (StructuredOutputsParams(json_object=True), lambda t: isinstance(json.loads(t), dict))]
    for so, check in cases:
        for temp in (0.0, 1.0):
            out = llm.generate(PROMPTS[0], SamplingParams(temperature=temp, seed=7, max_tokens=120, structured_outputs=so),
                               speculative_config=None)[0].outputs[0]
            if out.finish_reason == "length":  # any JSON object may be long; a random model may not close it
                assert so.json_object, out.text
                continue
            assert out.finish_reason == "stop" and check(out.text), (so, out.text)


def test_max_tokens_inside_the_grammar_ends_with_length(llm):
    out = llm.generate(PROMPTS[0], params(temperature=0).clone(max_tokens=3), speculative_config=None)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3 and out.text.startswith("{")


class _ForbiddenFirstDraft:
    """Proposes `bad` (a token the grammar forbids at the first output position) then the truth."""

    method = "ngram"

    def __init__(self, bad: int):
        self.bad = bad
        self.calls = 0

    def propose(self, inputs):
        self.calls += len(inputs)
        return [Proposal([self.bad] * inp.num_speculative_tokens, None) for inp in inputs]

    def finish_request(self, request_id, token_ids):
        pass


def test_forbidden_drafts_are_rejected_in_the_engine(llm):
    tok = llm.engine.tokenizer
    bad = tok.encode("}")[0]  # never allowed at the start of an object, nor after most prefixes
    base = llm.generate(PROMPTS[0], params(temperature=0), speculative_config=None)[0].outputs[0]
    cfg = SpeculativeConfig("ngram", 3, prompt_lookup_min=1, prompt_lookup_max=4)
    prop = _ForbiddenFirstDraft(bad)
    with llm.engine.using_proposer(cfg, prop):
        out = llm.generate(PROMPTS[0], params(temperature=0), speculative_config=cfg)[0].outputs[0]
    assert prop.calls > 0 and out.token_ids == base.token_ids
    assert out.num_accepted_tokens <= base.token_ids.count(bad)  # only where "}" really comes next


def _tiny_grammar_batch(compiler, spec, drafts, logits_row):
    """One decode request with `drafts` under `spec`, verified greedily against `logits_row` on every row."""
    r = Request("g", [0], SamplingParams(temperature=0, structured_outputs=spec), None, 1,
                grammar=GrammarState(compiler.compile(spec)))
    r.all_token_ids.append(0)
    r.num_computed_tokens = 1
    plan = StepPlan.build([ScheduledRequest.decode(r, drafts, None)])
    V = logits_row.shape[0]
    batch = SamplingBatch.build(plan.sampled, V, (), torch.device("cpu"))
    return r, batch, to_host(verify(logits_row.repeat(plan.num_rows, 1), batch), batch)


class _Bytes:
    """A tokenizer stand-in: ids 0..3 are b"a", b"b", b"c" and EOS."""

    def grammar_vocab(self):
        return [b"a", b"b", b"c", b""]


def test_verify_rows_masked_forbidden_draft_rejected_state_rolled_back():
    comp = GrammarCompiler(_Bytes(), 4, [3])
    spec = StructuredOutputsParams(regex="a[ab]c")
    logits = torch.tensor([1.0, 3.0, 2.0, 0.0])  # unmasked argmax is "b" everywhere
    # drafts a, c (forbidden after "a"), b: row 0 allows only a; row 1 allows a, b; row 2 repeats row 1
    r, batch, res = _tiny_grammar_batch(comp, spec, [0, 2, 1], logits)
    rows, bm = batch.grammar
    allowed = [[t for t in range(4) if (int(bm[i, 0]) >> t) & 1] for i in range(4)]
    assert rows == [0, 1, 2, 3] and allowed[0] == [0] and allowed[1] == [0, 1] and allowed[2] == allowed[1]
    toks, a, _ = res.committed(0, 0, None)
    assert a == 1 and toks == [0, 1]  # "a" accepted, "c" rejected, the masked argmax "b" recovered
    assert r.grammar.num_accepted == 0  # building the masks left the state where it was (rolled back)
    r.grammar.accept(toks)
    assert not r.grammar.completed
    with pytest.raises(GrammarRejected):
        r.grammar.accept([1])  # "ab" must be followed by "c"
    # EOS only once complete: drafts a, b, c, EOS all pass and the bonus row allows nothing else but EOS
    r, batch, res = _tiny_grammar_batch(comp, spec, [0, 1, 2, 3], torch.tensor([0.0, 1.0, 2.0, 5.0]))
    toks, a, _ = res.committed(0, 0, None)
    assert a == 4 and toks[:4] == [0, 1, 2, 3]
    r, batch, res = _tiny_grammar_batch(comp, spec, [], torch.tensor([0.0, 0.0, 0.0, 5.0]))
    assert res.committed(0, 0, None)[0] == [0]  # EOS is the most likely token but not allowed yet


def test_fill_rows_leaves_state_and_handles_eos_draft():
    comp = GrammarCompiler(_Bytes(), 4, [3])
    st = GrammarState(comp.compile(StructuredOutputsParams(choice=["ab"])))
    bm = allocate_bitmask(4, 4)
    assert st.fill_rows([0, 1, 3], bm, 0) == 3  # a, b, EOS all allowed
    assert [int(bm[i, 0]) & 0xF for i in range(4)] == [1, 2, 8, 8]  # row 3 (after EOS) repeats row 2
    assert st.num_accepted == 0 and not st.terminated and not st.completed


def test_compile_errors_name_the_parameter(llm):
    comp = llm.engine.grammar_compiler
    for spec, param in [(StructuredOutputsParams(json={"type": "bogus"}, param="response_format.json_schema.schema"),
                         "response_format.json_schema.schema"),
                        (StructuredOutputsParams(regex="a(", param="structured_outputs.regex"), "structured_outputs.regex"),
                        (StructuredOutputsParams(json="{not json"), "structured_outputs")]:
        with pytest.raises(SamplingParamsError) as ei:
            comp.compile(spec)
        assert ei.value.param == param and "could not be compiled" in str(ei.value) and "/project/" not in str(ei.value)
    with pytest.raises(SamplingParamsError) as ei:
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(regex="[a")))
    assert ei.value.param == "structured_outputs" and not llm.engine.has_unfinished_requests()
    for kw, param in [({}, "structured_outputs"), ({"regex": "a", "choice": ["a"]}, "structured_outputs"),
                      ({"choice": []}, "structured_outputs"), ({"json": 5}, "structured_outputs")]:
        with pytest.raises(SamplingParamsError) as ei:
            StructuredOutputsParams(**kw)
        assert ei.value.param == param
    with pytest.raises(SamplingParamsError) as ei:
        SamplingParams(ignore_eos=True, structured_outputs=StructuredOutputsParams(regex="a"))
    assert ei.value.param == "ignore_eos"


def test_engine_and_server_import_without_loading_xgrammar():
    """xgrammar is imported on first structured-output use only (specserve.grammar.xgrammar)."""
    import subprocess
    import sys
    code = ("import sys; import specserve.engine.llm_engine, specserve.sample.processors, specserve.server.api; "
            "assert 'xgrammar' not in sys.modules, 'xgrammar loaded at import'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
