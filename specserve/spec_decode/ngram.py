"""N-gram (prompt lookup) proposer: drafts by copying what followed an earlier occurrence of the
context's last n tokens in the request's own prompt + output.

What it does: for n from `prompt_lookup_max` down to `prompt_lookup_min`, look for an earlier
occurrence of the last n tokens of `token_ids` and propose up to k tokens that followed it
(prompt lookup decoding, Saxena 2023, https://github.com/apoorvumang/prompt-lookup-decoding; the
same idea as vLLM's `ngram` method and transformers' `prompt_lookup_num_tokens`). Drafts are
deterministic, so `Proposal.draft_probs` is None (one-hot q for the rejection sampler).

What it does not do: learn across requests. The drafts of a call depend only on the `token_ids` it
is given, so nothing can leak from one request into another (docs/speculation-cases.md B28: llama.cpp's
per-slot n-gram cache did), and a proposer instance can be shared by any number of requests and
profiles. The one thing `NgramProposer` keeps per request is a numpy copy of its context, extended by
the tokens committed since the last call (`_ContextArrays`), because converting the whole list at every
step was most of the cost (below); a copy that does not match the list it mirrors is rebuilt, and
`finish_request` drops it. It does not cap k by max_tokens or the context length either: the engine
does that before calling (`ProposalInput.num_speculative_tokens`, docs/speculation-cases.md B07/B08);
here k is only a hard cap on the list returned.

Which occurrence: the MOST RECENT one of the longest matching n-gram (vLLM takes the earliest).
Reasons: (1) when the output repeats itself (lists, loops, a block being rewritten line by line)
the latest occurrence carries the latest edits (a renamed identifier, an incremented counter),
while the earliest one still carries the prompt's original text; (2) it is the occurrence a
"copy from the recent past" model predicts (the LZ77 view of prompt lookup). A recent occurrence
can sit so close to the end that fewer than k tokens follow it (a loop of period p < k); the
draft then continues periodically, copying its own drafts (draft[i] = draft[i - p]), as an LZ77
copy with overlap does, so repetitive output still gets k drafts.

Speed (measured on this 2-core CPU, numpy 2.4, list input, k=8, n in 1..4): 4000-token context
~55-65 us per request per call (~50 us of it converting the list to an array); 400 tokens ~8 us.
The search is vectorized: one numpy comparison over the context for the last token, then the
(few) candidate positions are filtered one token further back per n; no Python loop over L. With the
per-request copy only the new tokens are converted (`benchmarks/spec_methods.py` has no figure for it;
docs/gpu-notes.md has the H200 measurement).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from specserve.config import ConfigError
from specserve.spec_decode.proposer import Proposal, ProposalInput


def _as_array(token_ids: Sequence[int]) -> np.ndarray:
    if isinstance(token_ids, np.ndarray):
        return token_ids.reshape(-1)
    if isinstance(token_ids, (list, tuple)):
        return np.fromiter(token_ids, dtype=np.int64, count=len(token_ids))
    if hasattr(token_ids, "numpy"):  # a CPU torch tensor
        return token_ids.numpy().reshape(-1)
    return np.asarray(list(token_ids), dtype=np.int64)


def ngram_lookup(token_ids: Sequence[int], k: int, n_min: int, n_max: int) -> tuple[list[int], int]:
    """Prompt lookup over one context.

    Args:
        token_ids: prompt + committed output, length L (a list, tuple, numpy array or CPU tensor).
        k: the most drafts to return (<= 0 returns none).
        n_min, n_max: n-gram sizes tried, longest first (1 <= n_min <= n_max).

    Returns:
        (drafts, n): 0..k token ids and the n-gram size that matched (0 when nothing matched).
        A context shorter than n_min + 1 tokens matches nothing (it has no earlier occurrence).
    """
    L = len(token_ids)
    if k <= 0 or L < n_min + 1:
        return [], 0
    arr = _as_array(token_ids)
    # `ends` = end index e of each earlier occurrence of the last n tokens: arr[e-n+1 : e+1] equals
    # arr[L-n : L] and e <= L-2, so at least one token follows the occurrence.
    ends = np.flatnonzero(arr[: L - 1] == arr[L - 1])
    best_ends, best_n, n = None, 0, 1
    if ends.size and n_min <= 1:
        best_ends, best_n = ends, 1
    while ends.size and n < n_max:
        ends = ends[ends >= n]  # the occurrence needs a token n positions before its end
        ends = ends[arr[ends - n] == arr[L - 1 - n]]
        n += 1
        if ends.size and n >= n_min:
            best_ends, best_n = ends, n
    if best_ends is None:
        return [], 0
    e = int(best_ends[-1])  # the most recent occurrence of the longest match (see module docstring)
    drafts = arr[e + 1 : e + 1 + k].tolist()
    period = L - 1 - e
    while len(drafts) < k:  # the copy ran into the end of the context: continue it periodically
        drafts.append(drafts[len(drafts) - period])
    return drafts, best_n


class _ContextArrays:
    """Per request id, an int64 numpy copy of its context list, grown by what was appended since the
    last call (amortised O(new tokens) instead of O(L) per call).

    The copy is trusted only while it still mirrors the list: its length is at most the list's and its
    first and last copied tokens equal the list's; otherwise (a request id reused, a context that
    shrank) it is rebuilt from the list. Drafts are proposals only, so even a stale copy could cost
    acceptance, never correctness.
    """

    def __init__(self) -> None:
        self._arrays: dict[str, tuple[np.ndarray, int]] = {}

    def get(self, request_id: str, token_ids: Sequence[int]) -> np.ndarray:
        """The context as an int64 array [L] (a view of the request's buffer)."""
        if not isinstance(token_ids, list):
            return _as_array(token_ids)
        L = len(token_ids)
        buf, n = self._arrays.get(request_id, (None, 0))
        if buf is None or n > L or (n and (buf[0] != token_ids[0] or buf[n - 1] != token_ids[n - 1])):
            buf, n = np.empty(max(64, 2 * L), dtype=np.int64), 0
        elif L > buf.size:
            grown = np.empty(2 * L, dtype=np.int64)
            grown[:n] = buf[:n]
            buf = grown
        if L > n:
            buf[n:L] = np.fromiter(token_ids[n:L], dtype=np.int64, count=L - n) if L - n > 8 else token_ids[n:L]
        self._arrays[request_id] = (buf, L)
        return buf[:L]

    def drop(self, request_id: str) -> None:
        self._arrays.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._arrays)


class NgramProposer:
    """Prompt lookup decoding (Saxena 2023; vLLM's `ngram` method), stateless.

    Args:
        prompt_lookup_min: smallest n-gram tried (>= 1).
        prompt_lookup_max: largest n-gram tried, tried first (>= prompt_lookup_min).

    Raises:
        ConfigError: for sizes outside 1 <= prompt_lookup_min <= prompt_lookup_max.
    """

    method = "ngram"

    def __init__(self, prompt_lookup_min: int = 1, prompt_lookup_max: int = 4) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ConfigError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {prompt_lookup_min}, {prompt_lookup_max}"
            )
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max
        self._contexts = _ContextArrays()

    def propose(self, inputs: list[ProposalInput]) -> list[Proposal]:
        """One Proposal per input, in order: 0..inp.num_speculative_tokens drafts each, draft_probs None (one-hot),
        match_len = the n-gram size that matched."""
        out = []
        for inp in inputs:
            context = self._contexts.get(inp.request_id, inp.token_ids)
            drafts, n = ngram_lookup(context, inp.num_speculative_tokens, self.prompt_lookup_min, self.prompt_lookup_max)
            out.append(Proposal(drafts, None, match_len=n or None))
        return out

    def finish_request(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Drop the request's context copy (the only per-request state)."""
        self._contexts.drop(request_id)
