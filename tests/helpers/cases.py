"""Helpers for the tests of docs/speculation-cases.md.

- `assert_greedy_equal`: the greedy equality rule. SPEC ids must equal BASE ids; where they differ, the
  test passes only if BASE's top-2 logit gap at the first differing position is under 1e-4 (a true
  near-tie flipped by batched-vs-single matmul numerics), recomputed from scratch for prompt + base[:i]
  with the engine's own runner (a fresh KV slot, one forward) or with transformers.
- The forcing trick (transformers#47912): pick a token T that BASE first produced at position p (and,
  given the commit blocks of a speculative run, one that sits strictly inside an accepted block), or a
  stop string whose first occurrence is completed by such a token, so a stop inside a block is certain.
- `run_engine`: drive `LLMEngine.step()` directly, adding requests between steps, and keep every
  per-step delta (the streaming view) per request, and their sum; `assert_spec_invariants` checks a
  finished request's speculation counters against what it streamed (B10).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from specserve.outputs import OutputAccumulator, RequestOutput

TIE_GAP = 1e-4

_HF_CACHE: dict[str, Any] = {}


# ---- the greedy equality rule ---------------------------------------------------------------------


def next_token_logits(llm, token_ids: list[int], *, use_hf: bool = False) -> torch.Tensor:
    """Raw float32 logits [V] of the token after `token_ids`, computed from scratch.

    Default: the engine's own target runner in a fresh KV slot (call it while the engine is idle or has
    a free slot). `use_hf=True`: `transformers.AutoModelForCausalLM` on the model folder (cached).
    """
    eng = llm.engine if hasattr(llm, "engine") else llm
    if use_hf:
        from transformers import AutoModelForCausalLM

        path = str(eng.target.files.path)
        if path not in _HF_CACHE:
            _HF_CACHE[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.inference_mode():
            out = _HF_CACHE[path](torch.tensor([token_ids]))
        return out.logits[0, -1].float()
    from specserve.engine.model_runner import SeqInput

    kv = eng.target.kv
    slot = kv.allocate()
    try:
        logits = eng.target.runner.forward([SeqInput(slot, 0, list(token_ids), 1)])
    finally:
        kv.free(slot)
    return logits[0].float()


def top2_gap(logits: torch.Tensor) -> float:
    v = torch.topk(logits.float(), 2).values
    return float(v[0] - v[1])


def first_diff(a: list[int], b: list[int]) -> int | None:
    """First index where a and b differ (a length difference counts at min(len)); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def assert_greedy_equal(
    llm,
    prompt_ids: list[int],
    spec_ids: list[int],
    base_ids: list[int],
    *,
    params=None,
    use_hf: bool = False,
    tol: float = TIE_GAP,
    msg: str = "",
) -> int | None:
    """The greedy equality rule (docs/speculation-cases.md, Conventions).

    Passes when spec_ids == base_ids, or when BASE's top-2 logit gap at the first differing position i
    (logits of prompt + base[:i], recomputed alone) is < `tol`. With `params` (penalties, logit_bias,
    min_tokens) the gap is taken on the processed logits, as the sampler sees them.

    Returns:
        None when equal, else the first differing position (a tolerated near-tie).
    """
    i = first_diff(spec_ids, base_ids)
    if i is None:
        return None
    where = f"{msg} first difference at output position {i}: spec {spec_ids[i:i + 4]} vs base {base_ids[i:i + 4]}"
    if i >= len(base_ids) or i >= len(spec_ids):
        raise AssertionError(f"{where}: one output is a strict prefix of the other (not a near-tie)\n"
                             f"spec={spec_ids}\nbase={base_ids}")
    logits = next_token_logits(llm, list(prompt_ids) + list(base_ids[:i]), use_hf=use_hf)
    if params is not None:
        from specserve.sample.sampler import needs_processing, process_logits

        if needs_processing(params, i):
            eng = llm.engine if hasattr(llm, "engine") else llm
            stop_ids = ([] if params.ignore_eos else list(eng.eos_token_ids)) + list(params.stop_token_ids)
            logits = process_logits(logits[None], params, list(prompt_ids), list(base_ids[:i]), [], stop_ids)[0]
    gap = top2_gap(logits)
    if gap >= tol:
        raise AssertionError(f"{where}: BASE top-2 logit gap there is {gap:.3g} >= {tol:g} (a real divergence)\n"
                             f"spec={spec_ids}\nbase={base_ids}")
    return i


# ---- the forcing trick ----------------------------------------------------------------------------


def block_ends(blocks: list[list[int]]) -> set[int]:
    """Output positions that end a commit block (the last token each step committed)."""
    ends, pos = set(), 0
    for b in blocks:
        pos += len(b)
        if b:
            ends.add(pos - 1)
    return ends


def pick_forced_token(
    base_ids: list[int],
    lo: int,
    hi: int,
    *,
    blocks: list[list[int]] | None = None,
    avoid: set[int] = frozenset(),
    exact: int | None = None,
) -> tuple[int, int]:
    """The forcing trick: (p, T) with T = base_ids[p] first produced at p (T not in base_ids[:p]).

    Args:
        lo, hi: lo < p < hi.
        blocks: per-step committed token lists of a speculative run of the same request; when given,
            p must lie strictly inside a block (not its last token), so a stop at T is met in the middle
            of an accepted block and the rest of that block must be dropped.
        avoid: token ids not to pick (e.g. EOS ids).
        exact: require p == exact.

    Raises:
        LookupError: no such position (the test's prompt does not give one).
    """
    ends = block_ends(blocks) if blocks is not None else set()
    total = sum(len(b) for b in blocks) if blocks is not None else len(base_ids)
    for p in range(lo + 1, min(hi, len(base_ids))):
        if exact is not None and p != exact:
            continue
        t = base_ids[p]
        if t in base_ids[:p] or t in avoid:
            continue
        if blocks is not None and (p in ends or p >= total):
            continue
        return p, t
    raise LookupError(f"no token first produced at a position in ({lo}, {hi})"
                      + (" strictly inside an accepted block" if blocks is not None else ""))


def text_offsets(tokenizer, prompt_ids: list[int], out_ids: list[int]) -> list[int]:
    """ends[j] = len(text of out_ids[:j + 1]), decoded the way the engine does (no special tokens)."""
    def dec(ids):
        return tokenizer.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)

    pre = len(dec(prompt_ids))
    return [len(dec(list(prompt_ids) + list(out_ids[: j + 1]))) - pre for j in range(len(out_ids))]


def pick_forced_stop_string(
    tokenizer,
    prompt_ids: list[int],
    base_ids: list[int],
    base_text: str,
    lo: int,
    hi: int,
    *,
    blocks: list[list[int]] | None = None,
    span: int = 2,
) -> tuple[str, int, int]:
    """The forcing trick for stop strings: (S, j, c) where S is a substring of BASE's text whose first
    occurrence starts at char c and is completed by output token j (lo < j < hi), j strictly inside a
    commit block when `blocks` are given. S = the text of `span`+1 tokens ending at j, grown to the left
    until its first occurrence is the one ending at token j.

    Raises:
        LookupError: no such string.
    """
    ends = text_offsets(tokenizer, prompt_ids, base_ids)
    bends = block_ends(blocks) if blocks is not None else set()
    for j in range(lo + 1, min(hi, len(base_ids))):
        if blocks is not None and j in bends:
            continue
        if ends[j] == ends[j - 1] or "\ufffd" in base_text[: ends[j]]:
            continue  # token j adds no complete character
        for start in range(j - span, -1, -1):
            c0 = ends[start - 1] if start > 0 else 0
            s = base_text[c0 : ends[j]]
            if not s.strip():
                continue
            c = base_text.find(s)  # <= c0; its end <= ends[j]
            if c + len(s) > ends[j - 1]:  # the first occurrence is completed by token j itself
                return s, j, c
    raise LookupError(f"no stop string completed by a token in ({lo}, {hi})")


# ---- driving the engine step by step (the streaming view) -----------------------------------------


@dataclass
class Submission:
    """One request for `run_engine`: added before step number `at_step` (0 = before the first)."""

    rid: str
    prompt: str | list[int]
    params: Any
    spec_config: Any = None  # SpeculativeConfig or None (explicit: no speculation)
    at_step: int = 0


@dataclass
class Stream:
    """Everything one request's step outputs carried (`outputs`, deltas in order) and their sum
    (`final`: cumulative token_ids, text, logprobs, and the last finish reason and counters)."""

    outputs: list[RequestOutput] = field(default_factory=list)
    final: OutputAccumulator = field(default_factory=OutputAccumulator)

    @property
    def blocks(self) -> list[list[int]]:
        return [list(o.new_token_ids) for o in self.outputs]

    @property
    def deltas(self) -> list[str]:
        return [o.new_text for o in self.outputs]

    @property
    def drafted_blocks(self) -> list[list[int]]:
        """Blocks committed by steps that verified at least one draft."""
        out, prev = [], 0
        for o in self.outputs:
            if o.spec_stats.num_drafts > prev:
                out.append(list(o.new_token_ids))
            prev = o.spec_stats.num_drafts
        return out

    @property
    def num_steps(self) -> int:
        """Steps that committed at least one token."""
        return sum(1 for o in self.outputs if o.new_token_ids)


def run_engine(engine, subs: list[Submission], max_steps: int = 100_000) -> dict[str, Stream]:
    """Add each submission before its `at_step`, step until all finish; return each request's Stream.

    Asserts the streaming contract on the way: one logprobs entry per new token, exactly one output
    is finished and it is the request's last one.
    """
    from specserve.config import SpeculativeConfig

    pending = sorted(subs, key=lambda s: s.at_step)
    streams = {s.rid: Stream() for s in subs}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0].at_step <= step:
            s = pending.pop(0)
            spec_config = SpeculativeConfig.from_dict(s.spec_config) if isinstance(s.spec_config, dict) else s.spec_config
            engine.add_request(s.rid, s.prompt, s.params, speculative_config=spec_config)
        for o in engine.step():
            if o.request_id not in streams:
                continue
            st = streams[o.request_id]
            assert not st.final.finished, f"{o.request_id}: output after the finished one"
            if o.new_logprobs is not None:
                assert len(o.new_logprobs) == len(o.new_token_ids), f"{o.request_id}: logprob entries != new tokens"
            st.outputs.append(o)
            st.final.add(o)
        step += 1
        assert step < max_steps, "engine did not finish"
    for rid, st in streams.items():
        assert st.outputs and st.final.finished, f"{rid}: never finished"
        assert sum(o.finished for o in st.outputs) == 1
    return streams


def assert_spec_invariants(st: Stream, k: int, where: str = "") -> None:
    """The counter invariants of docs/speculation-cases.md B10 for one finished request's Stream:
    emitted tokens == the streamed blocks; accepted + steps >= emitted (every emitted token is an
    accepted draft or its step's own token; plain decodes and the prefill step count as steps);
    accepted <= emitted - 1 and <= draft tokens; per-position counts sum to accepted and never grow
    with the position; mean acceptance length == tokens of drafted steps / drafted steps <= k + 1."""
    out = st.final
    s = out.spec_stats
    emitted = len(out.token_ids)
    assert emitted == sum(len(b) for b in st.blocks), where  # == usage.completion_tokens
    assert s.num_accepted_tokens + st.num_steps >= emitted, where
    assert s.num_accepted_tokens <= emitted - 1, where
    assert s.num_accepted_tokens <= s.num_draft_tokens, where
    assert sum(s.num_accepted_tokens_per_pos) == s.num_accepted_tokens, where
    assert all(a >= b for a, b in zip(s.num_accepted_tokens_per_pos, s.num_accepted_tokens_per_pos[1:])), where
    assert s.num_drafts > 0, where
    drafted = st.drafted_blocks
    assert len(drafted) == s.num_drafts, where
    decode_tokens = sum(len(b) for b in drafted)
    assert s.num_decode_tokens == decode_tokens, where
    assert s.mean_acceptance_length == pytest.approx(decode_tokens / s.num_drafts), (
        f"{where}: mean acceptance length {s.mean_acceptance_length:.4f} != emitted/steps "
        f"{decode_tokens}/{s.num_drafts} = {decode_tokens / s.num_drafts:.4f}")
    assert s.mean_acceptance_length <= k + 1, where
