"""Acceptance estimates for the adaptive draft length: per request, per draft position, every step.

What it does: `AcceptanceTracker` keeps, for each running request, decayed counts of draft tokens
tested and accepted at each position j (conditional acceptance: the draft at j is tested only when
the drafts before it were accepted), and the same counts pooled over recent requests per speculative
config (the profile's prior) and per proposer (the prior of a config that has no data yet). The
estimate for position j blends the request's counts with the prior as a Beta posterior,
a_j = (accepted_j + w * prior_j) / (tested_j + w); a position nobody has tested takes the estimate of
the position before it. Proposers that know their own confidence (`Proposal.match_len`,
`Proposal.confidence`) get it calibrated against what was accepted: per confidence bucket, the log-odds
of its acceptance over the proposer's overall acceptance shifts the estimate of that draft.

Two guards keep a prior learned on other text (e.g. summaries, where drafts run long) from making a
request of different text (tool calls, where they rarely pass the first position) draft too much:
- monotone in position: the prior curve is made non-increasing (a running minimum), and the prior a
  request's position j is blended with is at most the request's estimate at position j - 1. So without
  the request's own counts at a position, its estimate does not exceed the one before it; only those
  counts can lift it above (copied code really does accept deeper positions more often, conditionally,
  than the first: ngram k=8 on the code segment 0.82, 0.96, 0.95, 1.0, ...; that is measured per
  request, not assumed from other requests). The confidence calibration is applied after, per token;
- a request-level shift: every outcome of the request is compared with what the population model
  (prior and confidence calibration, without the request's own counts) predicted for it; the log-odds
  of the request's observed rate over the predicted one, as a Beta posterior with REQUEST_SHIFT_WEIGHT
  pseudo-counts at the predicted rate, shifts the request's prior at every position, also the ones it
  has not tested. Three rejections at position 1 against a prediction of 0.7 move the prior of every
  position by about -1.8 in log-odds (0.9 -> 0.6).

Outcomes are read from the committed tokens, not from the verify step: a draft of L tokens (before
the adaptive choice cut it to k) is matched against the tokens the request commits in this and the
following steps, each position recorded as soon as its token is committed. For one-hot drafts (ngram, suffix, a greedy draft) the committed tokens do not depend
on the drafts or on k (`specserve.sample.rejection`), so this tells how far each of the L drafts would
have been accepted even where only k were verified: the estimates cover positions the schedule did
not try, and a low k never blinds them. Matching is exact for every draft: an accepted draft equals
the committed token, and a rejected one never does (the recovered token is drawn with the draft's own
token removed).

What it does not do: choose k (see `adaptive.py`) or touch a request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Hashable, Sequence

DEFAULT_ACCEPTANCE = 0.5  # prior of a position no request has tested yet
REQUEST_WEIGHT = 3.0  # pseudo-observations of the prior against the request's own counts
REQUEST_SHIFT_WEIGHT = 2.0  # pseudo-observations of the predicted rate against a request's outcomes (shift)
PROFILE_WEIGHT = 4.0  # of the proposer's counts against the config's
REQUEST_DECAY = 0.92  # per observation: a request's last ~12 drafts count most
PRIOR_DECAY = 0.995  # per observation: the last ~200 drafts of recent requests
MAX_CALIBRATION = 3.0  # largest log-odds shift from a confidence bucket
EPS = 1e-3


@dataclass
class PositionCounts:
    """Decayed counts of drafts tested / accepted at positions 1..len (index 0 = position 1)."""

    tested: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)
    decay: float = 1.0

    def observe_position(self, j: int, accepted: bool) -> None:
        """The draft token at position j + 1 (0-based j) was tested: accepted or not. Position 1 starts a
        new draft: the decay applies there, once per draft."""
        if j == 0 and self.decay < 1.0:
            for i in range(len(self.tested)):
                self.tested[i] *= self.decay
                self.accepted[i] *= self.decay
        if j >= len(self.tested):
            self.tested += [0.0] * (j + 1 - len(self.tested))
            self.accepted += [0.0] * (j + 1 - len(self.accepted))
        self.tested[j] += 1.0
        if accepted:
            self.accepted[j] += 1.0

    def observe(self, num_tested: int, num_accepted: int) -> None:
        """One whole draft: positions 1..num_accepted accepted, position num_accepted + 1 rejected when
        num_accepted < num_tested (later positions were not tested)."""
        for j in range(min(num_accepted + 1, num_tested)):
            self.observe_position(j, j < num_accepted)

    def estimates(self, k: int, prior: Sequence[float] | None, weight: float,
                  capped: bool = False) -> list[float]:
        """a_1..a_k: Beta posterior of each position with mean prior[j] and `weight` pseudo-counts; a
        position without a prior entry takes the estimate before it (DEFAULT_ACCEPTANCE for the first).
        With `capped`, the prior of position j is at most the estimate of position j - 1, so that only
        these counts at position j can make its estimate exceed the one before."""
        out: list[float] = []
        prev = DEFAULT_ACCEPTANCE
        for j in range(k):
            p = prior[j] if prior is not None and j < len(prior) else prev
            if capped and j:
                p = min(p, prev)
            if j < len(self.tested):
                p = (self.accepted[j] + weight * p) / (self.tested[j] + weight)
            out.append(p)
            prev = p
        return out


def _logit(p: float) -> float:
    p = min(max(p, EPS), 1 - EPS)
    return math.log(p / (1 - p))


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def confidence_bucket(match_len: int | None, confidence: float | None) -> Hashable | None:
    """Calibration bucket of one draft token from the proposer's own signals (None = no signal):
    match length in {1, 2, 3-4, 5-8, 9+}, confidence in quarters (1.0 on its own)."""
    if match_len is None and confidence is None:
        return None
    m = None if match_len is None else (match_len if match_len <= 2 else 3 if match_len <= 4 else 5 if match_len <= 8 else 9)
    c = None if confidence is None else (4 if confidence >= 1.0 else min(int(confidence * 4), 3))
    return (m, c)


@dataclass
class _Calibration:
    """Decayed tested/accepted counts per confidence bucket, and overall, for one proposer."""

    buckets: dict = field(default_factory=dict)
    tested: float = 0.0
    accepted: float = 0.0

    def observe(self, bucket: Hashable, accepted: bool) -> None:
        b = self.buckets.setdefault(bucket, [0.0, 0.0])
        b[0] = b[0] * PRIOR_DECAY + 1.0
        b[1] = b[1] * PRIOR_DECAY + float(accepted)
        self.tested = self.tested * PRIOR_DECAY + 1.0
        self.accepted = self.accepted * PRIOR_DECAY + float(accepted)

    def shift(self, bucket: Hashable | None) -> float:
        """Log-odds of the bucket's acceptance over the overall one (0.0 without data)."""
        if bucket is None or bucket not in self.buckets or self.tested < 1.0:
            return 0.0
        overall = (self.accepted + 1.0) / (self.tested + 2.0)
        t, a = self.buckets[bucket]
        rate = (a + 2.0 * overall) / (t + 2.0)
        return max(-MAX_CALIBRATION, min(MAX_CALIBRATION, _logit(rate) - _logit(overall)))


@dataclass
class RequestShift:
    """How a request's outcomes compare with what the population model predicted for them: decayed
    sums of outcomes tested, accepted, and predicted (the sum of the predicted acceptance of each
    tested draft token), decayed by `decay` once per draft."""

    tested: float = 0.0
    accepted: float = 0.0
    predicted: float = 0.0
    decay: float = 1.0

    def observe(self, j: int, predicted: float, accepted: bool) -> None:
        """Draft position j + 1 (0-based j) was tested; the population model had predicted acceptance
        `predicted` in [0, 1] for it. Position 1 starts a new draft (the decay applies once per draft)."""
        if j == 0 and self.decay < 1.0:
            self.tested *= self.decay
            self.accepted *= self.decay
            self.predicted *= self.decay
        self.tested += 1.0
        self.accepted += float(accepted)
        self.predicted += min(max(predicted, 0.0), 1.0)

    def delta(self, weight: float = REQUEST_SHIFT_WEIGHT) -> float:
        """Log-odds shift of this request's acceptance over the predicted one, in
        [-MAX_CALIBRATION, MAX_CALIBRATION]: logit((accepted + w p) / (tested + w)) - logit(p) for the
        mean prediction p and w = `weight` (0.0 without outcomes)."""
        if self.tested <= 0.0:
            return 0.0
        p = min(max(self.predicted / self.tested, EPS), 1 - EPS)
        rate = (self.accepted + weight * p) / (self.tested + weight)
        return max(-MAX_CALIBRATION, min(MAX_CALIBRATION, _logit(rate) - _logit(p)))


@dataclass
class _Pending:
    """A draft whose outcome is not known yet: it was proposed for position `start` of the request's
    token ids; `matched` of its tokens are known to equal committed tokens; `predicted` is the
    population model's acceptance of each token (for the request-level shift)."""

    start: int
    tokens: list[int]
    buckets: list
    predicted: list[float]
    matched: int = 0


@dataclass
class _RequestState:
    config_key: Hashable
    proposer_key: Hashable
    counts: PositionCounts
    shift: RequestShift
    pending: list[_Pending] = field(default_factory=list)


class AcceptanceTracker:
    """Per-request and per-config acceptance estimates (see the module docstring).

    Keys are opaque hashables: `config_key` for the profile-level prior (the request's
    SpeculativeConfig) and `proposer_key` for the proposer-level one (shared by configs whose drafts
    are the same, e.g. profiles that differ only in k). Not thread-safe (the engine thread owns it).
    """

    def __init__(self) -> None:
        self._requests: dict[str, _RequestState] = {}
        self._configs: dict[Hashable, PositionCounts] = {}
        self._proposers: dict[Hashable, PositionCounts] = {}
        self._calibration: dict[Hashable, _Calibration] = {}
        self._memo: dict = {}  # priors and calibration shifts, valid until the next observation

    def add_request(self, request_id: str, config_key: Hashable, proposer_key: Hashable) -> None:
        """Start tracking a request (idempotent)."""
        if request_id not in self._requests:
            self._requests[request_id] = _RequestState(config_key, proposer_key, PositionCounts(decay=REQUEST_DECAY),
                                                       RequestShift(decay=REQUEST_DECAY))
            self._configs.setdefault(config_key, PositionCounts(decay=PRIOR_DECAY))
            self._proposers.setdefault(proposer_key, PositionCounts(decay=PRIOR_DECAY))
            self._calibration.setdefault(proposer_key, _Calibration())

    def prior(self, config_key: Hashable, proposer_key: Hashable, k: int) -> list[float]:
        """The config's estimates a_1..a_k (its counts over the proposer's prior)."""
        key = ("prior", config_key, proposer_key, k)
        if key not in self._memo:
            base = self._proposers.get(proposer_key, PositionCounts()).estimates(k, None, 1.0)
            self._memo[key] = self._configs.get(config_key, PositionCounts()).estimates(k, base, PROFILE_WEIGHT)
        return self._memo[key]

    def monotone_prior(self, config_key: Hashable, proposer_key: Hashable, k: int) -> list[float]:
        """`prior` made non-increasing in position (running minimum): the prior a request starts from."""
        key = ("mono", config_key, proposer_key, k)
        if key not in self._memo:
            out, low = [], 1.0
            for a in self.prior(config_key, proposer_key, k):
                low = min(low, a)
                out.append(low)
            self._memo[key] = out
        return self._memo[key]

    def request_shift(self, request_id: str) -> float:
        """The request-level log-odds shift of its prior (0.0 before any outcome; see the module docstring).

        Raises:
            KeyError: the request is not tracked.
        """
        return self._requests[request_id].shift.delta()

    def estimates(self, request_id: str, k: int, match_len: int | None = None,
                  confidence: Sequence[float] | None = None) -> list[float]:
        """Conditional acceptance a_1..a_k for the next draft of this request, in [0, 1]: the monotone
        prior shifted by the request-level shift, then the request's own per-position counts (Beta
        posterior, each position's prior capped by the estimate before it), then the confidence
        bucket's calibration shift.

        Args:
            k: positions wanted.
            match_len, confidence: the proposer's own signals for this draft (Proposal fields), if any.

        Raises:
            KeyError: the request is not tracked.
        """
        st = self._requests[request_id]
        prior = self.monotone_prior(st.config_key, st.proposer_key, k)
        delta = st.shift.delta()
        if delta:
            prior = [_sigmoid(_logit(a) + delta) for a in prior]
        est = st.counts.estimates(k, prior, REQUEST_WEIGHT, capped=True)
        return self._calibrated(st, est, match_len, confidence)

    def _calibrated(self, st: _RequestState, est: list[float], match_len: int | None,
                    confidence: Sequence[float] | None) -> list[float]:
        """`est` with each position shifted by its confidence bucket's calibration."""
        if match_len is None and confidence is None:
            return est
        shifts = self._memo.get(("shift", st.proposer_key))  # bucket -> shift, until the next observation
        if shifts is None:
            shifts = self._memo[("shift", st.proposer_key)] = {}
        cal = self._calibration[st.proposer_key]
        out = []
        for j, a in enumerate(est):
            c = confidence[j] if confidence is not None and j < len(confidence) else None
            bucket = confidence_bucket(match_len, c)
            shift = shifts.get(bucket)
            if shift is None:
                shift = shifts[bucket] = cal.shift(bucket)
            out.append(_sigmoid(_logit(a) + shift) if shift else a)
        return out

    def add_draft(self, request_id: str, start: int, tokens: Sequence[int], match_len: int | None = None,
                  confidence: Sequence[float] | None = None) -> None:
        """Record a draft proposed for position `start` of the request's token ids (prompt + output)
        before any cut to k; its outcome is read from the committed tokens (`on_commit`)."""
        st = self._requests.get(request_id)
        if st is None or not tokens:
            return
        if confidence is None:  # one bucket per draft: the buckets and the prediction depend on (L, match_len) only
            key = ("predicted", st.config_key, st.proposer_key, len(tokens), match_len)
            memo = self._memo.get(key)
            if memo is None:
                memo = self._memo[key] = self._population(st, len(tokens), match_len, None)
            buckets, predicted = memo
        else:
            buckets, predicted = self._population(st, len(tokens), match_len, confidence)
        st.pending.append(_Pending(start, list(tokens), buckets, predicted))

    def _population(self, st: _RequestState, n: int, match_len: int | None,
                    confidence: Sequence[float] | None) -> tuple[list, list[float]]:
        """The calibration buckets of a draft of n tokens, and what the population model (monotone prior
        and calibration, not the request's own counts) predicts for each of its tokens."""
        buckets = [confidence_bucket(match_len, confidence[j] if confidence is not None and j < len(confidence) else None)
                   for j in range(n)]
        predicted = self._calibrated(st, self.monotone_prior(st.config_key, st.proposer_key, n), match_len, confidence)
        return buckets, predicted

    def on_commit(self, request_id: str, token_ids: Sequence[int]) -> None:
        """The request's token ids after a commit: record every draft position whose outcome is now
        known (as soon as it is known: a draft of 8 tokens after a plain decode step tells position 1 at
        once, position 2 after the next step, ...); a draft is done at its first mismatch or its end."""
        st = self._requests.get(request_id)
        if st is None or not st.pending:
            return
        n = len(token_ids)
        keep = []
        for p in st.pending:
            done = False
            while p.start + p.matched < n:
                j = p.matched
                ok = token_ids[p.start + j] == p.tokens[j]
                self._observe(st, p, j, ok)
                if not ok:
                    done = True
                    break
                p.matched += 1
                if p.matched == len(p.tokens):
                    done = True
                    break
            if not done:
                keep.append(p)
        st.pending = keep

    def age(self, request_id: str, factor: float = REQUEST_DECAY) -> None:
        """Weigh the request's own evidence (its per-position counts and its request-level shift) by
        `factor` in (0, 1], as one more draft would, without an observation: its estimates move towards
        the prior. For a request nobody drafts for (the adaptive schedule's retired requests), whose
        evidence would otherwise stay as it was when drafting for it stopped. Unknown ids are ignored."""
        st = self._requests.get(request_id)
        if st is None:
            return
        c, sh = st.counts, st.shift
        c.tested = [x * factor for x in c.tested]
        c.accepted = [x * factor for x in c.accepted]
        sh.tested, sh.accepted, sh.predicted = sh.tested * factor, sh.accepted * factor, sh.predicted * factor

    def finish_request(self, request_id: str) -> None:
        """Stop tracking (positions already recorded stay recorded; the rest of a pending draft is unknown)."""
        self._requests.pop(request_id, None)

    def _observe(self, st: _RequestState, p: _Pending, j: int, accepted: bool) -> None:
        self._memo.clear()
        st.counts.observe_position(j, accepted)
        st.shift.observe(j, p.predicted[j], accepted)
        self._configs[st.config_key].observe_position(j, accepted)
        self._proposers[st.proposer_key].observe_position(j, accepted)
        if p.buckets[j] is not None:
            self._calibration[st.proposer_key].observe(p.buckets[j], accepted)

    @property
    def num_requests(self) -> int:
        """Requests tracked now."""
        return len(self._requests)

    def config_summary(self, config_key: Hashable, proposer_key: Hashable, k: int) -> list[float]:
        """The profile-level estimates a_1..a_k (for /metrics and reports)."""
        return self.prior(config_key, proposer_key, k)
