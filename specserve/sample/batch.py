"""The batched verifier's inputs, built once per step from the plan's sampled requests (host side).

What it does: turns B sampled requests with R logits rows (request b owns rows
[row_offset_b, row_offset_b + num_drafts_b + 1); docs/step-plan.md) into tensors: which request,
row index and draft each row has, which rows are greedy or sampled, each sampled row's temperature /
top-k / top-p / min-p, its uniforms (computed here, on the host: they depend only on the request's
seed and the output position, `specserve.sample.uniforms`), the draft model's q rows, and the
sparse edits of the logits processors, each verify row with its own history (output so far + the
drafts before it): penalty counts, logit_bias entries, min_tokens masks. The integer metadata travels
to the device in one copy.
What it does not do: any math on logits (`specserve.sample.processors`, `specserve.sample.verifier`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from specserve.sample.sampler import needs_processing
from specserve.sample.uniforms import Purpose, uniform

if TYPE_CHECKING:
    from specserve.engine.step_plan import ScheduledRequest


@dataclass
class Penalties:
    """Repetition / frequency / presence penalties of Rp rows.

    Attributes:
        rows: int64 [Rp], row indices (into the step's R rows).
        counts: float32 [Rp, V], occurrences of each token in the row's history (output + drafts before it).
        prompt_seen: bool [Rp, V], prompt tokens, or None when no row has a repetition penalty.
        repetition, frequency, presence: float32 [Rp, 1].
    """

    rows: torch.Tensor
    counts: torch.Tensor
    prompt_seen: torch.Tensor | None
    repetition: torch.Tensor
    frequency: torch.Tensor
    presence: torch.Tensor


@dataclass
class SamplingBatch:
    """Everything the batched verifier needs besides the logits (all tensors on the logits' device).

    Attributes:
        num_requests, num_rows, vocab_size: B, R, V.
        row_req, row_idx, row_draft: int64 [R]: the row's request (0..B-1), its index j within the
            request (0..n), and the draft it verifies (d_{j+1}), -1 on each request's last row.
        greedy_rows, sampled_rows: int64 [Rg], [Rs] row indices (None when empty); all_sampled: the
            sampled rows are all R rows in order (no gather needed).
        temperature, top_p, min_p: float32 [Rs, 1]; top_k: int64 [Rs] (V when off), per sampled row.
        any_top_k: whether any sampled row uses top-k, top_k_max the largest k used; top_p_rows, min_p_rows: int64 indices into the
            sampled rows that use top-p / min-p (None when none does).
        u_sample: float64 [Rs], u(seed, output position, SAMPLE) of each sampled row; u_accept: float64
            [Rq], u(seed, output position, ACCEPT) of each q row (None without q).
        coupled_rows: int64 [Rc] indices into the sampled rows of requests without q (one-hot drafts
            or none): each needs its own sample. None when there are none.
        q: float32 [Rq, V] draft distributions of the Bq sampled requests with a sampling draft model
            (their n_i rows each, in order), or None; q_rows: int64 [Rq] their verify rows as indices
            into the sampled rows; q_req, q_first, q_offset, q_num: int64 [Bq] each such request's
            index, its row 0 as an index into the sampled rows, its first row in q, its n_i.
        penalties: `Penalties` or None; bias: (rows, token ids, values) or None; min_tokens: (rows,
            token ids) masked to -inf, or None.
        logprob_rows: int64 [Rl] rows of requests that asked for logprobs (None if none), top_n the
            largest number of alternatives asked; logprob_offset: request index -> its first position
            in logprob_rows.
    """

    num_requests: int
    num_rows: int
    vocab_size: int
    row_req: torch.Tensor
    row_idx: torch.Tensor
    row_draft: torch.Tensor
    greedy_rows: torch.Tensor | None = None
    sampled_rows: torch.Tensor | None = None
    all_sampled: bool = False
    all_coupled: bool = False
    temperature: torch.Tensor | None = None
    top_k: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    any_top_k: bool = False
    top_k_max: int = 0
    top_p_rows: torch.Tensor | None = None
    min_p_rows: torch.Tensor | None = None
    u_sample: torch.Tensor | None = None
    u_accept: torch.Tensor | None = None
    q: torch.Tensor | None = None
    q_rows: torch.Tensor | None = None
    coupled_rows: torch.Tensor | None = None
    q_req: torch.Tensor | None = None
    q_first: torch.Tensor | None = None
    q_offset: torch.Tensor | None = None
    q_num: torch.Tensor | None = None
    penalties: Penalties | None = None
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    min_tokens: tuple[torch.Tensor, torch.Tensor] | None = None
    logprob_rows: torch.Tensor | None = None
    top_n: int = 0
    logprob_offset: dict[int, int] | None = None

    @property
    def needs_processing(self) -> bool:
        return self.penalties is not None or self.bias is not None or self.min_tokens is not None

    @classmethod
    def build(
        cls, sampled: Sequence["ScheduledRequest"], vocab_size: int, eos_token_ids: Sequence[int], device: torch.device
    ) -> "SamplingBatch":
        """From the plan's sampled requests (`StepPlan.sampled`, rows in that order)."""
        V = vocab_size
        ints = _Pack()
        row_req, row_idx, row_draft, g_rows, s_rows, lp_rows = [], [], [], [], [], []
        s_reqs = []  # (b, s, index of its row 0 among the sampled rows)
        lp_off: dict[int, int] = {}
        for b, s in enumerate(sampled):
            n, o, p = s.num_rows, s.row_offset, s.request.params
            row_req += [b] * n
            row_idx += range(n)
            row_draft += s.draft_token_ids
            row_draft.append(-1)
            if p.greedy:
                g_rows += range(o, o + n)
            else:
                s_reqs.append((b, s, len(s_rows)))
                s_rows += range(o, o + n)
            if p.logprobs is not None:
                lp_off[b] = len(lp_rows)
                lp_rows += range(o, o + n)
        for name, values in (("row_req", row_req), ("row_idx", row_idx), ("row_draft", row_draft),
                             ("greedy_rows", g_rows), ("sampled_rows", s_rows), ("logprob_rows", lp_rows)):
            ints.add(name, values)
        floats, us = _sampled_rows(ints, s_reqs, V) if s_reqs else ([], [])
        t = ints.send(device)
        out = cls(len(sampled), len(row_req), V, **t, logprob_offset=lp_off,
                  top_n=max((sampled[b].request.params.logprobs for b in lp_off), default=0),
                  all_sampled=len(s_rows) == len(row_req),
                  all_coupled=t.get("coupled_rows") is not None and len(t["coupled_rows"]) == len(s_rows))
        if s_reqs:
            ks = [s.request.params.top_k for _, s, _ in s_reqs if 0 < s.request.params.top_k < V]
            out.any_top_k, out.top_k_max = bool(ks), max(ks, default=0)
            Rs = len(s_rows)
            f = torch.tensor(floats, dtype=torch.float32).to(device, non_blocking=True).view(3, Rs, 1)
            out.temperature, out.top_p, out.min_p = f[0], f[1], f[2]
            u = torch.tensor(us, dtype=torch.float64).to(device, non_blocking=True)
            out.u_sample, out.u_accept = u[:Rs], (u[Rs:] if len(us) > Rs else None)
            qs = [s.draft_probs for _, s, _ in s_reqs if s.draft_probs is not None]
            if qs:
                out.q = torch.cat(qs).to(device=device, dtype=torch.float32)
        proc = [s for s in sampled if needs_processing(s.request.params, s.request.num_output_tokens)]
        if proc:
            _processor_edits(out, proc, V, list(eos_token_ids), device)
        return out


class _Pack:
    """Named int64 lists sent to the device as one tensor (one host-to-device copy)."""

    def __init__(self) -> None:
        self.items: list[tuple[str, list[int]]] = []

    def add(self, name: str, values: list[int]) -> None:
        self.items.append((name, values))

    def send(self, device: torch.device) -> dict[str, torch.Tensor | None]:
        """name -> int64 tensor on `device`, or None for an empty list."""
        flat = torch.tensor([v for _, vals in self.items for v in vals], dtype=torch.int64).to(device, non_blocking=True)
        parts = flat.split([len(vals) for _, vals in self.items])
        return {name: t if len(vals) else None for (name, vals), t in zip(self.items, parts)}


def _sampled_rows(ints: _Pack, s_reqs, V: int) -> tuple[list[float], list[float]]:
    """Per sampled row: top_k; the rows using top-p / min-p; coupled rows; the q bookkeeping (added to
    `ints`). Returns (temperature + top_p + min_p per row, u_sample per row + u_accept per q row)."""
    top_k, tp_rows, mp_rows, c_rows, q_rows = [], [], [], [], []
    q_req, q_first, q_offset, q_num = [], [], [], []
    temp, top_p, min_p, u_sample, u_accept = [], [], [], [], []
    for b, s, first in s_reqs:
        r, p, n = s.request, s.request.params, s.num_rows
        top_k += [p.top_k if 0 < p.top_k < V else V] * n
        m, key = r.num_output_tokens, r.rng_key
        u_sample += [uniform(key, m + j, Purpose.SAMPLE) for j in range(n)]
        temp += [p.temperature] * n
        top_p += [p.top_p] * n
        min_p += [p.min_p] * n
        if s.draft_probs is not None:
            q_req.append(b)
            q_first.append(first)
            q_offset.append(len(q_rows))
            q_num.append(s.num_drafts)
            q_rows += range(first, first + s.num_drafts)
            u_accept += [uniform(key, m + j, Purpose.ACCEPT) for j in range(s.num_drafts)]
        else:
            c_rows += range(first, first + n)
        if p.top_p < 1.0:
            tp_rows += range(first, first + n)
        if p.min_p > 0.0:
            mp_rows += range(first, first + n)
    for name, values in (("top_k", top_k), ("top_p_rows", tp_rows), ("min_p_rows", mp_rows), ("coupled_rows", c_rows), ("q_rows", q_rows), ("q_req", q_req),
                         ("q_first", q_first), ("q_offset", q_offset), ("q_num", q_num)):
        ints.add(name, values)
    return temp + top_p + min_p, u_sample + u_accept


def _processor_edits(out: SamplingBatch, proc: Sequence["ScheduledRequest"], V: int, eos: list[int], device) -> None:
    """Fill out.penalties / out.bias / out.min_tokens for the requests that need processing
    (the batched form of `specserve.sample.sampler.process_logits`)."""
    pen = [s for s in proc if s.request.params.has_penalties]
    if pen:
        rows, row_local, out_ids, out_req, pair_row, pair_tok = [], [], [], [], [], []
        rep, freq, pres = [], [], []
        prompt_ids, prompt_req = [], []
        for i, s in enumerate(pen):
            r, p, n = s.request, s.request.params, s.num_rows
            ids = r.output_token_ids
            out_ids += ids
            out_req += [i] * len(ids)
            for j in range(n):
                pair_row += [len(rows)] * j  # row j also counts the drafts before it
                pair_tok += s.draft_token_ids[:j]
                rows.append(s.row_offset + j)
                row_local.append(i)
            rep += [p.repetition_penalty] * n
            freq += [p.frequency_penalty] * n
            pres += [p.presence_penalty] * n
            if p.repetition_penalty != 1.0:
                prompt_ids += r.prompt_token_ids
                prompt_req += [i] * r.num_prompt_tokens
        t = torch.tensor(rows + row_local + out_req + out_ids + pair_row + pair_tok + prompt_req + prompt_ids,
                         dtype=torch.int64).to(device, non_blocking=True)
        n_rows, n_out, n_pair, n_prompt = len(rows), len(out_ids), len(pair_row), len(prompt_ids)
        rows_t, local_t, oreq, oids, prow, ptok, preq, pids = t.split(
            [n_rows, n_rows, n_out, n_out, n_pair, n_pair, n_prompt, n_prompt])
        counts = torch.zeros(len(pen), V, dtype=torch.float32, device=device)
        counts.index_put_((oreq, oids), torch.ones(n_out, device=device), accumulate=True)
        counts = counts[local_t]
        counts.index_put_((prow, ptok), torch.ones(n_pair, device=device), accumulate=True)
        seen = None
        if n_prompt:
            seen = torch.zeros(len(pen), V, dtype=torch.bool, device=device)
            seen[preq, pids] = True
            seen = seen[local_t]
        f = torch.tensor(rep + freq + pres, dtype=torch.float32).to(device, non_blocking=True).view(3, n_rows, 1)
        out.penalties = Penalties(rows_t, counts, seen, f[0], f[1], f[2])
    b_rows, b_toks, b_vals = [], [], []
    m_rows, m_toks = [], []
    for s in proc:
        r, p = s.request, s.request.params
        if p.logit_bias:
            toks = [t for t in p.logit_bias if 0 <= t < V]
            vals = [p.logit_bias[t] for t in toks]
            for j in range(s.num_rows):
                b_rows += [s.row_offset + j] * len(toks)
                b_toks += toks
                b_vals += vals
        if p.min_tokens:
            stop_ids = [t for t in ([] if p.ignore_eos else eos) + p.stop_token_ids if 0 <= t < V]
            for j in range(s.num_rows):
                if stop_ids and r.num_output_tokens + j < p.min_tokens:
                    m_rows += [s.row_offset + j] * len(stop_ids)
                    m_toks += stop_ids
    if b_rows or m_rows:
        t = torch.tensor(b_rows + b_toks + m_rows + m_toks, dtype=torch.int64).to(device, non_blocking=True)
        br, bt, mr, mt = t.split([len(b_rows), len(b_rows), len(m_rows), len(m_rows)])
        if b_rows:
            out.bias = (br, bt, torch.tensor(b_vals, dtype=torch.float32).to(device, non_blocking=True))
        if m_rows:
            out.min_tokens = (mr, mt)
