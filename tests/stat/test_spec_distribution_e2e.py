"""docs/speculation-cases.md B22 (2), end to end on tiny random-weight models: speculative sampling through the whole
engine (proposer -> verify -> rejection sampler -> commit) keeps the target's exact distribution.

2000 requests per setting, submitted in one batch (max_num_seqs=64), no per-request seed (the engine's
seed stream makes the run reproducible). Settings: temperature 1.0; 0.7 with top_k=20; 0.7 with
top_p=0.9. Methods: draft_model with the target as its own draft (accept path, acceptance ~1), with a
different random model of the same tokenizer (residual path), and ngram on a repetitive prompt (one-hot
drafts). The exact target distribution comes from transformers (`AutoModelForCausalLM` on the same
folder, processed with transformers' own temperature/top-k/top-p warpers), never from the engine.

Why max_tokens=3 and not 2: the first token is sampled in the prefill step, which has no drafts, and
the engine caps k so a step cannot pass max_tokens (k + 1 <= tokens left): with max_tokens=2 the one
decode step has k=0 and nothing is ever speculated. With 3, the decode step verifies one draft: token 2
is the accepted draft or the recovered token (residual path), token 3 the bonus token (or a plain
decode after a rejection). Asserted, chi-square p > 0.01 (bins with expected count < 5 pooled into
"other"): token 1's distribution; the joint (token 1, token 2) over the 20 most likely pairs + other;
the joint (1, 2, 3) over the 20 most likely triples + other (the bonus path). The test has power: the
same counts against the distribution at another temperature, and a rejection sampler with the classic
bug (sampling the target instead of the residual after a rejection), are both rejected.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from specserve import LLM, SamplingParams
from specserve.config import SpeculativeConfig

N = 2000
MAX_TOKENS = 3
SETTINGS = {
    "t1.0": dict(temperature=1.0),
    "t0.7_topk20": dict(temperature=0.7, top_k=20),
    "t0.7_topp0.9": dict(temperature=0.7, top_p=0.9),
}
PROMPT = "The server batches requests continuously"

pytestmark = pytest.mark.usefixtures("torch_threads")




# The session's `tiny_model_dir` (init_std 0.1) is nearly uniform over its ~400 tokens (top p ~ 0.02):
# at N = 2000 no (t1, t2) pair reaches an expected count of 5, so a joint test would have no bins. The
# same tiny qwen2 model with weights drawn at std 0.3 has top next-token probabilities ~0.1-0.35.
INIT_STD = 0.3


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    from tests.helpers.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-target-std03"), arch="qwen2", seed=0, init_std=INIT_STD)


@pytest.fixture(scope="module")
def other_draft_dir(tmp_path_factory):
    from tests.helpers.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-draft-std03-seed1"), arch="qwen2", seed=1, init_std=INIT_STD)


@pytest.fixture(scope="module")
def near_draft_dir(tmp_path_factory):
    """The target's own random draws at a smaller scale: a correlated but different draft, so that both
    the accept path and the residual path run often."""
    from tests.helpers.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-draft-std022-seed0"), arch="qwen2", seed=0, init_std=0.22)


@pytest.fixture(scope="module")
def llm(target_dir):
    return LLM(str(target_dir), max_model_len=64, max_num_seqs=64, dtype="float32", device="cpu")


class Exact:
    """Exact target probabilities from transformers, with transformers' warpers."""

    def __init__(self, path, tokenizer):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        self.tok = tokenizer
        self._logits: dict[tuple, torch.Tensor] = {}

    def logits(self, prefixes: list[list[int]]) -> torch.Tensor:
        """Raw next-token logits [len(prefixes), V] (cached; equal-length prefixes batched)."""
        todo = [p for p in prefixes if tuple(p) not in self._logits]
        by_len: dict[int, list[list[int]]] = {}
        for p in todo:
            by_len.setdefault(len(p), []).append(p)
        with torch.inference_mode():
            for group in by_len.values():
                for i in range(0, len(group), 512):
                    chunk = group[i : i + 512]
                    out = self.model(torch.tensor(chunk)).logits[:, -1].float()
                    for p, row in zip(chunk, out):
                        self._logits[tuple(p)] = row
        return torch.stack([self._logits[tuple(p)] for p in prefixes])

    @staticmethod
    def process(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
        from transformers.generation.logits_process import (
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        x = TemperatureLogitsWarper(temperature)(None, logits.clone())
        if top_k:
            x = TopKLogitsWarper(top_k)(None, x)
        if top_p < 1.0:
            x = TopPLogitsWarper(top_p)(None, x)
        return torch.softmax(x.double(), dim=-1)

    def dists(self, prompt_ids, sp: dict, max_pairs: int = 40):
        """p1 [V]; the joint p(t1, t2) [V, V]; and p(t1, t2, t3) for the triples under the `max_pairs`
        most likely pairs (a dict)."""
        p1 = self.process(self.logits([prompt_ids]), **sp)[0]
        support = torch.nonzero(p1 > 0).flatten().tolist()
        V = p1.shape[0]
        p2 = torch.zeros(V, V, dtype=torch.float64)
        p2[support] = self.process(self.logits([prompt_ids + [t] for t in support]), **sp)
        joint = p1[:, None] * p2
        flat = torch.topk(joint.flatten(), max_pairs)
        pairs = [divmod(int(i), V) for i in flat.indices]
        p3 = self.process(self.logits([prompt_ids + list(pr) for pr in pairs]), **sp)
        triples = {}
        for pr, row, pj in zip(pairs, p3, flat.values.tolist()):
            for t3 in torch.nonzero(row > 0).flatten().tolist():
                triples[pr + (t3,)] = pj * float(row[t3])
        return p1, joint, triples


def chi2_pvalue(counts: Counter, probs: dict, n: int, top: int | None = None) -> float:
    """Chi-square goodness of fit of `counts` (outcome -> count, n in all) to `probs` (outcome ->
    exact probability; outcomes missing from `probs` have the remaining mass): bins are the outcomes
    (the `top` most likely when given) with expected count >= 5, plus "other"."""
    ranked = sorted(probs.items(), key=lambda kv: -kv[1])
    if top is not None:
        ranked = ranked[:top]
    bins = [o for o, p in ranked if p * n >= 5]
    obs = [counts.get(o, 0) for o in bins]
    exp = [probs[o] * n for o in bins]
    obs.append(n - sum(obs))
    exp.append(n - sum(exp))
    if exp[-1] < 1e-9 * n:  # no "other" mass (e.g. top-k)
        if obs[-1] > 0:
            return 0.0  # samples outside the support: impossible under `probs`
        obs, exp = obs[:-1], exp[:-1]
    assert len(obs) >= 3, "too few bins for a meaningful test"
    return float(chisquare(obs, exp).pvalue)


@pytest.fixture(scope="module")
def exact(target_dir, llm):
    return Exact(target_dir, llm.get_tokenizer())


@pytest.fixture(scope="module")
def repeat_prompt(exact):
    """The repetitive prompt for ngram: PROMPT + token a 4 times, a = the token the target most likely
    repeats next (a random model does not copy; with this prompt, t1 == a makes ngram draft a again)."""
    S = exact.tok.encode(PROMPT)
    V = exact.model.config.vocab_size
    with torch.inference_mode():
        p = torch.softmax(exact.model(torch.tensor([S + [a] * 4 for a in range(V)])).logits[:, -1], -1)
    a = int(p[torch.arange(V), torch.arange(V)].argmax())
    return S + [a] * 4


def run(llm, prompt, sp, cfg):
    prompts = [prompt] * N if isinstance(prompt, str) else [list(prompt)] * N
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **sp), speculative_config=cfg)
    comps = [o.outputs[0] for o in outs]
    assert all(len(c.token_ids) == MAX_TOKENS for c in comps)
    return comps


def check_distribution(exact, prompt_ids, sp, comps):
    p1, joint, triples = exact.dists(prompt_ids, sp)
    V = p1.shape[0]
    c1 = Counter(c.token_ids[0] for c in comps)
    c12 = Counter(tuple(c.token_ids[:2]) for c in comps)
    c123 = Counter(tuple(c.token_ids[:3]) for c in comps)
    pv1 = chi2_pvalue(c1, {t: float(p1[t]) for t in range(V) if p1[t] > 0}, N)
    nz = torch.nonzero(joint > 0)
    pv12 = chi2_pvalue(c12, {(int(a), int(b)): float(joint[a, b]) for a, b in nz}, N, top=20)
    pv123 = chi2_pvalue(c123, triples, N, top=20)
    return pv1, pv12, pv123, (p1, joint)


def spec_cfg(method, path=None):
    d = {"method": method, "num_speculative_tokens": 2}
    if path is not None:
        d["model"] = str(path)
    return SpeculativeConfig.from_dict(d)


CASES = [(m, s) for m in ("draft_self", "draft_other", "draft_near", "ngram") for s in SETTINGS]


@pytest.mark.parametrize("method,setting", CASES, ids=[f"{m}-{s}" for m, s in CASES])
def test_spec_sampling_matches_exact_target(llm, exact, target_dir, other_draft_dir, near_draft_dir, repeat_prompt,
                                            method, setting):
    sp = SETTINGS[setting]
    prompt_ids = repeat_prompt if method == "ngram" else llm.engine.encode_prompt(PROMPT)
    cfg = {"draft_self": spec_cfg("draft_model", target_dir), "draft_other": spec_cfg("draft_model", other_draft_dir),
           "draft_near": spec_cfg("draft_model", near_draft_dir),
           "ngram": SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2,
                                                 "prompt_lookup_min": 1, "prompt_lookup_max": 4})}[method]
    comps = run(llm, prompt_ids, sp, cfg)
    pv1, pv12, pv123, (p1, joint) = check_distribution(exact, prompt_ids, sp, comps)
    drafted = sum(c.num_draft_tokens for c in comps)
    accepted = sum(c.num_accepted_tokens for c in comps)
    rate = accepted / drafted if drafted else None
    info = (f"{method} {setting}: p-values t1={pv1:.3g} (t1,t2)={pv12:.3g} (t1,t2,t3)={pv123:.3g}; "
            f"acceptance {accepted}/{drafted}")
    assert pv1 > 0.01 and pv12 > 0.01 and pv123 > 0.01, info
    # the paths under test were really exercised (one draft per request: the decode step has k = 1)
    if method == "draft_self":
        assert drafted >= 0.99 * N and rate > 0.98, info
    elif method == "draft_other":  # nearly disjoint: the residual path almost every time
        assert drafted >= 0.99 * N and rate < 0.5 and drafted - accepted > 500, info
    elif method == "draft_near":  # both paths often
        assert drafted >= 0.99 * N and 0.2 < rate < 0.9 and accepted > 200 and drafted - accepted > 200, info
    else:  # one-hot drafts, accepted when the target samples the drafted token
        assert drafted > 100 and accepted > 5 and drafted - accepted > 50, info
    # power: the same counts are rejected against the distribution at another temperature
    wrong = dict(sp, temperature=sp["temperature"] * 0.7)
    p1w, jointw, _ = exact.dists(prompt_ids, wrong, max_pairs=1)
    c12 = Counter(tuple(c.token_ids[:2]) for c in comps)
    nz = torch.nonzero(jointw > 0)
    pv_wrong = chi2_pvalue(c12, {(int(a), int(b)): float(jointw[a, b]) for a, b in nz}, N, top=20)
    print(f"{info}; wrong temperature: p={pv_wrong:.3g}")
    assert pv_wrong < 1e-3, f"{info}; wrong-temperature p-value {pv_wrong:.3g} (the test has no power)"


def test_power_buggy_rejection_sampler_is_caught(llm, exact, near_draft_dir, monkeypatch):
    """A rejection sampler that resamples the plain target after a rejection (instead of the residual
    norm(max(0, p - q))) skews token 2 toward the draft's choices; the joint test must reject it."""
    import specserve.sample.verifier as verifier_mod

    monkeypatch.setattr(verifier_mod, "residual", lambda p, q: p)
    sp = SETTINGS["t1.0"]
    comps = run(llm, PROMPT, sp, spec_cfg("draft_model", near_draft_dir))
    _, pv12, _, _ = check_distribution(exact, llm.engine.encode_prompt(PROMPT), sp, comps)
    print(f"buggy rejection sampler: joint p={pv12:.3g}")
    assert pv12 < 1e-3, f"a biased sampler passed the joint test (p = {pv12:.3g})"
