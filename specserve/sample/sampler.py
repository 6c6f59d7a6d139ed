"""Turns target logits into committed tokens for each request of a step.

What it does, per request, over its rows (1 row for a plain decode or a prompt's last chunk, n + 1
rows for a verify block of n drafts):
1. raw logprobs (if asked): log_softmax of the model logits, before any processing (vLLM's default).
2. logits processors, row by row with that row's own history (output so far + the drafts before it),
   so penalties and min_tokens act on a verify row exactly as they would without speculation:
   repetition penalty (CTRL, Keskar et al. 2019; prompt + output), frequency/presence penalties (OpenAI;
   output only), logit_bias, min_tokens (EOS and stop ids masked).
3. greedy: argmax; sampled: temperature, top-k, top-p, min-p, softmax -> probabilities.
4. verification of the drafts (`specserve.sample.rejection`), or a plain sample when there are none.

What it does not do: stop handling (the engine commits the returned tokens one by one and stops at
the first EOS / stop / length condition).

This is the readable per-request REFERENCE. The engine runs the batched verifier
(`specserve.sample.verifier`), which is tested to give exactly these tokens (tests/unit/test_verifier.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.outputs import TokenLogprob
from specserve.sample.rejection import greedy_verify, rejection_sample, sample_and_match
from specserve.sample.uniforms import uniform as counter_uniform
from specserve.sampling_params import SamplingParams


@dataclass
class SampleResult:
    """What verification of one request produced.

    Attributes:
        token_ids: accepted drafts followed by the recovered or bonus token (len = num_accepted + 1).
        num_accepted: drafts accepted.
        logprobs: one TokenLogprob per token in token_ids, or None when not asked.
    """

    token_ids: list[int]
    num_accepted: int
    logprobs: list[TokenLogprob] | None


def needs_processing(params: SamplingParams, num_output: int) -> bool:
    """True when any logits processor changes this request's logits."""
    return bool(params.has_penalties or params.logit_bias or num_output < params.min_tokens)


def process_logits(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt_ids: list[int],
    output_ids: list[int],
    drafts: list[int],
    stop_ids: list[int],
) -> torch.Tensor:
    """Apply penalties, logit_bias and min_tokens to each row with its own history.

    Args:
        logits: [n + 1, V] float32 rows; row j follows output_ids + drafts[:j].
        stop_ids: EOS ids (unless ignore_eos) + stop_token_ids, masked while below min_tokens.

    Returns:
        A new [n + 1, V] tensor.
    """
    out = logits.clone()
    V = out.shape[1]
    dev = out.device
    if params.has_penalties:
        hist = torch.tensor(output_ids + drafts, dtype=torch.int64, device=dev)
        base = len(output_ids)
        prompt_mask = None
        if params.repetition_penalty != 1.0:
            prompt_mask = torch.zeros(V, dtype=torch.bool, device=dev)
            if prompt_ids:
                prompt_mask[torch.tensor(prompt_ids, device=dev)] = True
        for j in range(out.shape[0]):
            counts = torch.bincount(hist[: base + j], minlength=V)[:V].to(out.dtype)
            row = out[j]
            if prompt_mask is not None:
                seen = prompt_mask | (counts > 0)
                pen = params.repetition_penalty
                row[seen] = torch.where(row[seen] > 0, row[seen] / pen, row[seen] * pen)
            row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(out.dtype)
    if params.logit_bias:
        ids = torch.tensor([t for t in params.logit_bias if 0 <= t < V], dtype=torch.int64, device=dev)
        if len(ids):
            bias = torch.tensor([params.logit_bias[int(t)] for t in ids.tolist()], dtype=out.dtype, device=dev)
            out[:, ids] += bias
    if params.min_tokens and stop_ids:
        ids = torch.tensor([t for t in stop_ids if 0 <= t < V], dtype=torch.int64, device=dev)
        for j in range(out.shape[0]):
            if len(output_ids) + j < params.min_tokens:
                out[j, ids] = float("-inf")
    return out


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p, then softmax. logits [R, V] -> probs [R, V] (float32).

    top-p (nucleus, Holtzman et al. 2020) keeps the most likely tokens until the mass before the next
    one reaches top_p: over the probabilities p sorted in descending order, position i is kept while
    cumsum(p)_i - p_i < top_p, and every token at least as likely as the last kept one is kept (so a
    tie at the cut does not depend on how a sort orders equal values).
    """
    x = logits / params.temperature
    V = x.shape[-1]
    if params.top_k and 0 < params.top_k < V:
        kth = torch.topk(x, params.top_k).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        p = torch.softmax(x, dim=-1)
        s = torch.sort(p, dim=-1, descending=True).values
        kept = (torch.cumsum(s, dim=-1) - s) < params.top_p  # the mass before each sorted position
        n_keep = torch.cumprod(kept, dim=-1).sum(-1, keepdim=True)  # positions before the first cut (>= 1)
        x = x.masked_fill(p < s.gather(-1, n_keep - 1), float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.min_p > 0.0:
        cut = probs.max(dim=-1, keepdim=True).values * params.min_p
        probs = probs.masked_fill(probs < cut, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def make_logprobs(logits: torch.Tensor, token_ids: list[int], top_n: int) -> list[TokenLogprob]:
    """Raw target logprobs of the chosen tokens (row j -> token_ids[j]) with the top_n alternatives."""
    lp = torch.log_softmax(logits[: len(token_ids)].float(), dim=-1)
    chosen = lp[torch.arange(len(token_ids), device=lp.device), torch.tensor(token_ids, device=lp.device)].tolist()
    tops: list[list[tuple[int, float]]] = [[] for _ in token_ids]
    if top_n > 0:
        vals, idx = torch.topk(lp, top_n, dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
    return [TokenLogprob(t, c, top) for t, c, top in zip(token_ids, chosen, tops)]


def sample_request(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt_ids: list[int],
    output_ids: list[int],
    drafts: list[int],
    draft_probs: torch.Tensor | None,
    stop_ids: list[int],
    key: int,
) -> SampleResult:
    """Verify `drafts` (possibly none) against the target rows of one request.

    Args:
        logits: [len(drafts) + 1, V] raw target logits.
        draft_probs: [len(drafts), V] q for sampled drafts, or None (one-hot).
        key: the request's stream key (`specserve.sample.uniforms.seed_key(seed)`); row j's uniforms are
            u(key, len(output_ids) + j, purpose).

    Returns:
        SampleResult.
    """
    processed = needs_processing(params, len(output_ids))
    x = process_logits(logits, params, prompt_ids, output_ids, drafts, stop_ids) if processed else logits
    base = len(output_ids)

    def uniform(j: int, purpose: int) -> float:
        return counter_uniform(key, base + j, purpose)

    if params.greedy:
        tokens, a = greedy_verify(drafts, x.argmax(-1).tolist())
    elif draft_probs is None:  # one-hot drafts: the committed tokens do not depend on the drafts
        tokens, a = sample_and_match(drafts, logits_to_probs(x, params), uniform)
    else:
        tokens, a = rejection_sample(drafts, logits_to_probs(x, params), draft_probs, uniform)
    lps = make_logprobs(logits, tokens, params.logprobs) if params.logprobs is not None else None
    return SampleResult(tokens, a, lps)
