"""Batched verification: every request of a step in a few tensor ops, one device-to-host copy.

What it does, for B requests with R rows (request b: n_b drafts, rows j = 0..n_b; docs/step-plan.md):
1. logits processors for all rows (`specserve.sample.processors`);
2. a candidate token per row: greedy rows take the argmax; sampled rows without q (one-hot drafts or
   none) draw from p by inverse CDF with the row's uniform u(seed, output position, SAMPLE)
   (`specserve.sample.uniforms`; computed on the host with the batch, they are input data);
3. which drafts pass: greedy and one-hot drafts (n-gram, suffix, a greedy draft) pass while the
   candidate equals the draft (for sampled rows this is the coupled rule: the committed tokens do not
   depend on the drafts); drafts with a q pass when u(seed, position, ACCEPT) * q(d) < p(d) (accept with
   min(1, p/q); Leviathan et al. 2023, Chen et al. 2023);
4. the accepted count a_b = index of the first row that does not pass (the last row never passes),
   a segment-wise cumulative product done as a scatter-min; a request with q then draws its one
   token at row a_b: from the residual norm(max(0, p - q)) after a rejection, from p (bonus) after
   all n_b drafts passed; the committed tokens of request b are rows 0..a_b of
   `where(j < a_b, draft, candidate)`: the accepted drafts, then the recovered or bonus token;
5. one copy to the host of the committed tokens, counts, failure flags (a sampled row whose
   distribution is not a distribution: NaN or all zero) and raw logprobs when asked.
The per-request reference (`specserve.sample.sampler.sample_request`) gives the same tokens; the
tests check it (tests/unit/test_verifier.py).
What it does not do: stop checks or KV rollback (the engine commits per request on the CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.outputs import TokenLogprob
from specserve.sample.batch import SamplingBatch
from specserve.sample.inverse_cdf import inverse_cdf
from specserve.sample.processors import apply_processors, sampling_probs


@dataclass
class VerifyOutput:
    """Device tensors of one verification.

    Attributes:
        tokens: int64 [R], row j of request b holds its j-th committed token if j <= a_b.
        num_accepted: int64 [B], a_b.
        failed: bool [B], a sampled row of the request had no valid distribution; None when no row
            was sampled.
        logprob_chosen: float32 [Rl] raw logprob of `tokens` on `batch.logprob_rows`; logprob_top_ids,
            logprob_top: int64 / float32 [Rl, top_n]; None when no request asked.
    """

    tokens: torch.Tensor
    num_accepted: torch.Tensor
    failed: torch.Tensor | None
    logprob_chosen: torch.Tensor | None = None
    logprob_top_ids: torch.Tensor | None = None
    logprob_top: torch.Tensor | None = None


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) up to normalization, row-wise: p, q [N, V] -> [N, V]. A row where p <= q
    everywhere (p == q up to rounding: a rejection there has probability 0) falls back to p."""
    r = torch.clamp(p - q, min=0.0)
    return torch.where((r.sum(-1, keepdim=True) > 0.0), r, p)


@torch.inference_mode()
def verify(logits: torch.Tensor, batch: SamplingBatch) -> VerifyOutput:
    """Verify every request of the batch (see the module docstring).

    Args:
        logits: float32 [R, V] raw target logits, rows in the batch's order.

    Returns:
        VerifyOutput on the logits' device.
    """
    x = apply_processors(logits, batch)
    failed = None
    probs = None
    if batch.sampled_rows is None:
        cand = x.argmax(-1)
        passed = cand == batch.row_draft  # a request's last row has draft -1: never passes
    else:
        failed = torch.zeros(batch.num_requests, dtype=torch.bool, device=logits.device)
        cand, passed, probs = _sampled_candidates(x, batch, failed)
    a = accepted_counts(passed, batch)
    if batch.q is None:
        tokens = cand  # greedy and one-hot rows: an accepted draft equals its row's candidate
    else:
        _draw_recovered_or_bonus(probs, a, cand, failed, batch)
        tokens = torch.where(batch.row_idx < a[batch.row_req], batch.row_draft, cand)
    out = VerifyOutput(tokens, a, failed)
    if batch.logprob_rows is not None:
        lp = torch.log_softmax(logits[batch.logprob_rows].float(), dim=-1)
        out.logprob_chosen = lp.gather(1, tokens[batch.logprob_rows].unsqueeze(1)).squeeze(1)
        if batch.top_n > 0:
            out.logprob_top, out.logprob_top_ids = torch.topk(lp, batch.top_n, dim=-1)
    return out


def accepted_counts(passed: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """a_b = the first row j of request b whose draft did not pass (a request's last row has no draft
    and must not pass): the segment-wise cumulative product of `passed` [R], as one scatter-min. -> [B]."""
    R = batch.num_rows
    first_fail = torch.where(passed, R + 1, batch.row_idx)
    a = torch.full((batch.num_requests,), R + 1, dtype=torch.int64, device=passed.device)
    return a.scatter_reduce_(0, batch.row_req, first_fail, "amin")


def _sampled_candidates(x: torch.Tensor, batch: SamplingBatch, failed: torch.Tensor):
    """Candidates [R] (argmax on greedy rows, a draw from p on rows without q; rows with q are filled
    later) and passed [R]; returns (cand, passed, probs [Rs, V] of the sampled rows)."""
    cand = torch.zeros(batch.num_rows, dtype=torch.int64, device=x.device)
    if batch.greedy_rows is not None:
        cand[batch.greedy_rows] = x[batch.greedy_rows].argmax(-1)
    s_rows = batch.sampled_rows
    probs = sampling_probs(x if batch.all_sampled else x[s_rows], batch)
    if batch.coupled_rows is not None:  # one-hot drafts (or none): every row draws its own token
        c = batch.coupled_rows
        tok, bad = inverse_cdf(probs if batch.all_coupled else probs[c],
                               batch.u_sample if batch.all_coupled else batch.u_sample[c])
        cand[s_rows[c]] = tok
        failed.scatter_reduce_(0, batch.row_req[s_rows[c]], bad, "amax")
    passed = cand == batch.row_draft
    if batch.q is not None:  # accept tests u * q(d) < p(d) on every verify row of a draft model's request
        qr = batch.q_rows
        d = batch.row_draft[s_rows[qr]]
        ar = torch.arange(d.shape[0], device=x.device)
        passed[s_rows[qr]] = batch.u_accept * batch.q[ar, d].double() < probs[qr, d].double()
    return cand, passed, probs


def _draw_recovered_or_bonus(probs, a, cand, failed, batch: SamplingBatch) -> None:
    """A draft model's request draws one token, at row a: the recovered token from the residual
    norm(max(0, p - q)) after a rejection, the bonus token from p after its last draft."""
    aq = a[batch.q_req]
    row = batch.q_first + aq  # index into the sampled rows
    p_row = probs[row]
    q_row = batch.q[batch.q_offset + torch.minimum(aq, batch.q_num - 1)]
    dist = torch.where((aq < batch.q_num).unsqueeze(1), residual(p_row, q_row), p_row)
    tok, bad = inverse_cdf(dist, batch.u_sample[row])
    cand[batch.sampled_rows[row]] = tok
    failed[batch.q_req] |= bad


@dataclass
class VerifyResult:
    """Host copy of a `VerifyOutput`, read by the engine's per-request commit.

    Attributes:
        tokens: R ints (see VerifyOutput.tokens); num_accepted: B ints; failed: B bools.
        logprobs: per row of `batch.logprob_rows`: (chosen logprob, [(token id, logprob), ...]).
    """

    tokens: list[int]
    num_accepted: list[int]
    failed: list[bool]
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None
    logprob_offset: dict[int, int]

    def committed(self, b: int, row_offset: int, top_n: int | None) -> tuple[list[int], int, list[TokenLogprob] | None]:
        """Request b's (tokens to commit, accepted drafts, logprobs or None); `top_n` = its own
        `SamplingParams.logprobs`."""
        a = self.num_accepted[b]
        toks = self.tokens[row_offset : row_offset + a + 1]
        if top_n is None or self.logprobs is None:
            return toks, a, None
        o = self.logprob_offset[b]
        lps = [TokenLogprob(t, c, top[:top_n]) for t, (c, top) in zip(toks, self.logprobs[o : o + a + 1])]
        return toks, a, lps


def to_host(out: VerifyOutput, batch: SamplingBatch) -> VerifyResult:
    """The step's one device-to-host copy (a single packed tensor)."""
    R, B = batch.num_rows, batch.num_requests
    failed = out.failed if out.failed is not None else torch.zeros(B, dtype=torch.bool, device=out.tokens.device)
    if out.logprob_chosen is None:
        if out.failed is None:
            flat = torch.cat([out.tokens, out.num_accepted]).tolist()
            return VerifyResult(flat[:R], flat[R:], [False] * B, None, {})
        flat = torch.cat([out.tokens, out.num_accepted, failed.to(torch.int64)]).tolist()
        return VerifyResult(flat[:R], flat[R : R + B], [bool(f) for f in flat[R + B :]], None, {})
    n, Rl = batch.top_n, out.logprob_chosen.shape[0]
    parts = [out.tokens, out.num_accepted, failed, out.logprob_chosen]
    if n:
        parts += [out.logprob_top_ids.flatten(), out.logprob_top.flatten()]
    flat = torch.cat([t.to(torch.float64) for t in parts]).tolist()  # ids < 2^53 and float32 values are exact
    toks = [int(t) for t in flat[:R]]
    acc = [int(t) for t in flat[R : R + B]]
    failed = [bool(f) for f in flat[R + B : R + 2 * B]]
    o = R + 2 * B
    chosen = flat[o : o + Rl]
    ids, vals = flat[o + Rl : o + Rl + Rl * n], flat[o + Rl + Rl * n :]
    lps = [(chosen[i], [(int(t), v) for t, v in zip(ids[i * n : (i + 1) * n], vals[i * n : (i + 1) * n])])
           for i in range(Rl)]
    return VerifyResult(toks, acc, failed, lps, batch.logprob_offset or {})
