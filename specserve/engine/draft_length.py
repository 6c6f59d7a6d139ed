"""The adaptive schedule as the step plan's k policy (`AdaptiveK`, a `DraftingKPolicy`): drafts for
every request whose config says `"num_speculative_tokens_schedule": "adaptive"`, cut to the k chosen
for the whole batch; requests of other configs get their configured k (`ConfiguredK`).

What it does, per step (docs/step-plan.md): `choose` wants the configured maximum (the batch-size table
or num_speculative_tokens); the scheduler caps it (max_tokens, context end, token budget); then `draft`,
for the decoding requests of adaptive configs:
1. proposers whose time does not grow with k (ngram, suffix) propose up to the cap; every draft is
   recorded in the `AcceptanceTracker` at full length (its outcome is read from the committed tokens
   later). When drafting itself costs a noticeable part of the step (measured per proposer: on a fast
   GPU a Python suffix tree can), requests that would get k = 0 anyway skip it: explorers draft every
   PROBE_EVERY-th step all the same, the others are retired (below);
2. `choose_draft_lengths` picks k per request from the acceptance estimates (with the proposer's own
   confidence), the target's measured step cost (`StepCostModel`) over the whole step (the other
   requests' tokens and the prefill chunks included) and, for a draft model, its own measured forward
   time per drafted position; any drafts at all only when they are expected to gain at least MIN_GAIN
   (5%) over k = 0 for everyone;
3. free drafts are cut to k; a draft model drafts exactly k.
When a step's choice is k = 0 for every adaptive request and deciding it cost a noticeable part of the
step (its own measured time against REST_SHARE of the plain step: on a fast GPU at 16 concurrent
requests proposing, tracking and choosing took about as long as the step itself), the next steps are
plain decodes for the adaptive requests without proposing or choosing, as many as keep that cost
below REST_SHARE of the time (at most MAX_REST_STEPS, ~80 ms on the H200 at 16 concurrent requests;
a request that joins meanwhile is decided for when the rest ends). On a CPU, where a step is ~100x the
decision, this never rests. The decision's own time is reported to the engine (`take_drafting_ms`), which
leaves it out of the step overhead it fits against the draft tokens (the decision happens in the steps
that may draft, so it would otherwise be priced as a cost of the drafts themselves), and so is the
proposing for requests of configured k (a static draft model's chain is no host cost of every step).
Drafting is charged for the decision itself too: the measured time of decisions that proposed
(`draft_decide_ms`) is added to the cost of every choice with drafts (`speculate_ms`), not to k = 0 for
everyone, since steps that do not speculate can rest without deciding. On the H200 at 16 concurrent a
suffix decision that proposed took ~5 ms against a 1.5 ms plain step (`docs/benchmarks/
gpu_adaptive_diag_run3.json`), which the forward-only cost had hidden; on a CPU (~1 ms against 100+ ms
steps) it changes nothing.
Holds: a decision that drafted holds its k for the next steps, as many as keep the decision under
HOLD_SHARE (10%) of their time, at most MAX_HOLD_STEPS: those steps propose only for the requests held
with k > 0, cut the drafts to the held k and record them in the tracker, without estimating or
choosing (`_held_drafts`); a request that joins during a hold decodes plainly until the next decision.
The price of drafting charged to the next decisions (`drafting_step_ms`) is the average host time
over a decision and its hold. On the H200 at 16 concurrent a decision for 16 ngram requests took
~0.6-1.1 ms against ~0.25 ms for a hold step (`docs/benchmarks/gpu_h200_c16_final.json`); on a CPU a
decision is far below 10% of a step and nothing is held.
The draft chain's price: a draft model drafts after the choice, k forwards in a chain, and the choice
prices position j as one draft forward over the n_j requests drafting that deep, one token each (the
draft's measured `StepCostModel`, `chain_ms`). The chain's first forward feeds what the draft has not
seen: everything since its last draft for a request that was given k = 0 meanwhile, and the whole
prompt for a new request, which can fall outside the draft's CUDA graphs. The prompt and the catch-up are not a price of this step's k: every committed token has to
be fed to the draft once, whatever k is chosen, before the request drafts again (a request retired for
good would save them, which the choice does not weigh). In the steady state a chain's first forward
feeds one or two tokens per request (the draft keeps its own drafts in its cache, so only the recovered
or bonus token, and the last draft when all were accepted, are new), which the table prices well; what
it misses is the rest of the chain's wall time on the device it runs on (host work per position, graph
misses, the per-request bookkeeping). So every steady chain (no request fed more than STEADY_FEED
tokens, as the proposer's `last_max_feed` says) is timed (wall clock: the chain ends with its
device-to-host copy), and the modelled price is multiplied by `chain_scale`, the median realised over
modelled ms of the last CHAIN_SAMPLES steady chains (a median: one chain slowed by a pause does not move
it). A draft model learns only from drafts it made, so estimates or a scale that keep all its requests at k
= 0 would never be measured again: after DRAFT_PROBE_EVERY decisions in a row that give all its
requests k = 0 it is probed (`_probe`; the interval backs off, below): where the scale is what stops drafting, two decisions priced at the
table (the second's chain is steady and is timed), else one token for one request. On the CPU of session 16 (the 1.5b target, the 0.5b drafting, batch 1) a 2-token verify cost
1.2-1.5x a decode (docs/benchmarks/step_cost_cpu_s16.json), so from the 0.5 prior no k paid and the adaptive draft model drafted nothing (1.06x on
code against 1.99x for static k 5) until these probes let it learn. A chain that feeds a prompt or a catch-up is not
timed into it: one 1000-token prompt on a CPU costs as much as a dozen steady chains, and counting it
would make a lone request stop drafting. One scale multiplies every position: host work per chain that
does not grow with k is spread over the positions (a fit of a fixed part plus a scale, as the overhead
fit does for the target, would separate them; not done). The rest of such a decision's time (estimates, the choice, bookkeeping) is its
`draft_decide_ms`, as for a free proposer; the chain itself is not (it is priced by the scale).
Probes back off: a probe's first chain feeds everything its requests missed, so each probe not followed
by drafting doubles the draft model's probe interval (up to DRAFT_PROBE_MAX_EVERY decisions); drafting
on its own brings it back to DRAFT_PROBE_EVERY, and so does a scale probe whose timed chain came out
below PROBE_CHEAPER of the scale it was priced against (a scale raised by a pause then recovers as fast as before).
Feeds are gathered (`_gather_feeds`): on a GPU a chain whose first forward feeds a prompt or a long
catch-up leaves the draft's CUDA graphs and runs eagerly, at a cost that grows far less than its tokens
(launch-bound: a median 27.5 ms for 940 tokens against 21.8 ms for 320 in the runs below). On the H200 at 16 concurrent requests (the 1.5b target, the 0.5b drafting, 96 requests)
such chains took a median 21.8 ms against 6.5 ms for a steady k = 5 chain, and with one per new request
they were 1.27 s of a 4.2 s run (60 chains). So a request the draft is behind on
decodes plainly until FEED_BATCH requests are behind or it waited FEED_WAIT decisions (`_gather_feeds`;
"behind": more than the draft's graphs took per sequence, `graph_max_feed`, 16 tokens then). In a second
diagnosis run that gave 19 feeding chains (0.52 s), and in the paired c16 reps the adaptive draft model
went from 0.97x to 1.01x of the baseline's throughput (docs/benchmarks/gpu_h200_c16_s17.json; that
version held back requests more than 2 tokens behind). On a CPU there are no graphs and a forward's
time follows its tokens: nothing is gathered (`graph_max_feed` is None).
Since session 18 the runner captures prefill graphs (a sequence of up to 512 new tokens) and the draft
feeds a longer catch-up ahead of its chain in up to 4 such graph forwards
(`DraftModelProposer._feed_ahead`, 512 tokens in all per forward), so one request alone feeds up to
5 x 512 tokens in graphs (`graph_max_feed`); only a feed beyond that (none in the c16 workload, whose
longest prompt has 1327 tokens) is held back and gathered. The threshold is per request: several long
feeds in one step share the 4 x 512 tokens fed ahead, and what is left can still make the chain's first
forward eager; that is not gathered. Nor are requests in step with the draft counted: their 1-2
tokens share that first forward, so a feed within a few tokens of the threshold can still run eagerly.
At 16 concurrent requests on the H200 a feeding chain then took a median 6.3 ms against 5.1 ms for a
steady one in run A (was 21.8 against 6.5), and the static draft model went from 0.98-1.01x to
1.11-1.14x of the baseline in three runs (docs/gpu-notes.md, Session 18).
After each commit (`observe`, every decode step, also those without drafts) the tracker matches pending
drafts against the committed tokens.
Drafting counts as costly (`_costly`) when one request's proposer call takes at least COSTLY_SHARE of
the step and, for a proposer without `prepare`, more than the optimistic re-check of `_hopeless` per
request (measured per proposer, re-timed every RECHECK_EVERY-th decision): a re-check that costs more
than the call it may save is not made (for a suffix tree, retiring also saves its ingestion).
Retiring: where drafting is costly (the 1% rule of step 1), a request whose optimistic choice is k = 0
does not only skip the proposer: it is *retired* and its proposer does no work for it at all, not even
between steps (`wants_prepare` is False: a suffix tree does not ingest its prompt or its new tokens).
Probing a request needs its proposer state up to date, and keeping that state is the cost (on the
H200 at 16 concurrent requests the Python suffix trees' ingestion took ~0.5 ms of a 1.6 ms step while
the schedule rested in 1031 of 1094 decisions, `docs/benchmarks/gpu_adaptive_diag_random05.json`).
So only explorers probe: every EXPLORE_EVERY-th request of a config (the first included) is never
retired and keeps the probing above; its outcomes feed the profile's prior, from which the retired
requests' estimates come. When an explorer finishes, the config's oldest running non-explorer becomes
one, so a config with running requests keeps probing. A retired request drafts nothing, so its own
evidence would stay as it was when it was retired; instead it ages at every re-check (weighed by
REQUEST_DECAY, as one more draft would weigh it, `AcceptanceTracker.age`), and its estimates drift
to the profile's prior, which the explorers keep current: text that turns repetitive late in a retired
request is seen only through that prior. A request retired because its proposer offered nothing is tried
again after RETRY_EVERY re-checks (the checks assume the cap for it until its next proposal). Its output does not reach the suffix proposer's global tree either (that proposer caches the
outputs of requests it drafted for). Every decision re-checks the retired requests (no proposer work: their
estimates only); one whose optimistic choice is k > 0 again (a smaller batch, a better prior) is
un-retired, skips drafting in that step, and the `prepare` that follows (overlapped with the GPU)
ingests what it missed. A new request is checked the same way before its
first `prepare`, so a prompt that would never be drafted for is never ingested. On a CPU drafting is
never costly by that rule and nothing is retired.
The optimistic choice assumes the draft length the request's proposer has offered it lately (an EMA of
its proposal lengths; the cap before it has any), since a suffix tree without a match offers nothing
whatever the prior says, and charges each request it would be proposed for its share of a drafting
decision's measured time (`decide_ms_per_request`), as the decision itself charges the whole. Without
that share the checks kept 8614 of 8629 request-steps' `prepare` on the H200 at 16 concurrent while 557
of 625 decisions drafted nothing (`docs/benchmarks/gpu_adaptive_diag_real05_s9.json`).
What it does not do: change which tokens are committed (verification does not depend on k for one-hot
drafts, and is lossless for any k), schedule, or run the target.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict, deque
from dataclasses import replace
from typing import Any, Callable, Sequence

from specserve.engine.k_policy import ConfiguredK
from specserve.engine.step_cost import StepCostModel
from specserve.request import Request
from specserve.spec_decode import proposer_key
from specserve.spec_decode.acceptance import AcceptanceTracker
from specserve.spec_decode.adaptive import Choice, DraftOption, choose_draft_lengths
from specserve.spec_decode.proposer import Proposal, Proposer

ProposeFn = Callable[[Sequence[tuple[Request, int]]], Sequence[Proposal]]


PROBE_EVERY = 4  # an explorer that skips drafting still drafts every 4th step, to keep learning
MIN_GAIN = 0.05  # speculate only when the expected gain over k = 0 is at least 5% of the step's token rate
REST_SHARE = 0.03  # deciding "no drafts" may cost at most ~3% of the time of the steps it covers
MAX_REST_STEPS = 32  # plain steps in a row after such a decision, at most
EXPLORE_EVERY = 8  # where drafting is costly, one request in 8 per config is never retired (it probes)
COSTLY_SHARE = 0.01  # drafting is costly when a proposer call takes >= 1% of the step (and more than the re-check)
OFFERED_WEIGHT = 0.3  # EMA weight of a request's newest proposal length (the draft its proposer offers)
HOLD_SHARE = 0.1  # a decision that drafted holds its k for as many steps as keep it below ~10% of their time
MAX_HOLD_STEPS = 8  # steps after such a decision that reuse its k, at most
RECHECK_EVERY = 16  # a re-check found dearer than proposing is timed again every 16th decision
RETRY_EVERY = 16  # a retired request whose proposer offered nothing is tried again after this many re-checks
PROPOSE_SAMPLES = 15  # proposer calls whose median time per request is the drafting time
MIN_PROPOSE_SAMPLES = 3  # calls measured before drafting can count as costly
CHAIN_SAMPLES = 16  # chain_scale: the median realised/modelled ratio of this many recent steady chains
DRAFT_PROBE_EVERY = 16  # a draft model whose requests all got k = 0 this many decisions in a row drafts a probe
DRAFT_PROBE_MAX_EVERY = 256  # ... an interval that doubles after each probe not followed by drafting, up to this
PROBE_CHEAPER = 0.9  # ... unless the scale probe's chain came out below this fraction of the scale it was priced at
STEADY_FEED = 2  # a steady chain feeds each request at most this many tokens (see the module docstring)
FEED_BATCH = 4  # a draft model feeds prompts and catch-ups to this many requests at once (see `_gather_feeds`)
FEED_WAIT = 8  # ... or to those that waited this many decisions for the others


def draft_forward_ms(cost: StepCostModel, scale: float = 1.0) -> Callable[[int], float]:
    """A draft group's `draft_cost_ms`: ms of one draft forward over n sequences of one token each, from
    the draft model's measured `cost`, times `scale` (its `chain_scale`)."""
    return lambda n: scale * cost.forward_ms(n, n)


def chain_ms(cost: StepCostModel, ks: Sequence[int]) -> float:
    """The modelled time (ms) of one draft chain that drafts ks[i] tokens for request i: position j is one
    draft forward over the requests with k >= j, one token each (`cost.forward_ms(n_j, n_j)`), the price
    `choose_draft_lengths` gives a draft group before `chain_scale`."""
    return sum(cost.forward_ms(n, n) for n in (sum(1 for k in ks if k >= j) for j in range(1, max(ks, default=0) + 1))
               if n)


class AdaptiveK(ConfiguredK):
    """The adaptive schedule's k policy (see the module docstring).

    Args:
        step_cost: the target's measured step cost.
        proposer_of: the proposer of a SpeculativeConfig (to see whether its time grows with k).
        objective, min_gain: passed to `choose_draft_lengths`. `min_gain` (default MIN_GAIN = 0.05) is
            the margin: drafts are verified only when the chosen ks are expected to beat k = 0 for every
            request by at least this fraction of the step's tokens per ms (for "fair", of the geometric
            mean of the per-request rates): acceptance estimates are noisy, and a step that speculates
            for an expected +2% loses when they are slightly optimistic.

    Attributes:
        tracker: the acceptance estimates.
        last_choice: the most recent `Choice` (for inspection).
        chosen_k: per speculative config, how many times each k was chosen (index = k).
    """

    def __init__(self, step_cost: StepCostModel, proposer_of: Callable[[Any], Proposer], *,
                 objective: str = "throughput", min_gain: float = MIN_GAIN):
        self.step_cost = step_cost
        self.proposer_of = proposer_of
        self.objective = objective
        self.min_gain = min_gain
        self.tracker = AcceptanceTracker()
        self.last_choice: Choice | None = None
        self.chosen_k: dict[Any, list[int]] = defaultdict(list)
        # per proposer key: the drafting time per request (ms), the median of the last PROPOSE_SAMPLES calls
        # once there are MIN_PROPOSE_SAMPLES (a call that ingests a new prompt on the CPU, ~5 ms for 2000
        # tokens, must not make drafting look costly for the next steps: it is a one-off)
        self.propose_ms: dict[Any, float] = {}
        self._propose_samples: dict[Any, deque] = defaultdict(lambda: deque(maxlen=PROPOSE_SAMPLES))
        self._skipped: dict[str, int] = {}  # request id -> steps in a row it did not draft
        self._retired: set[str] = set()  # request ids whose proposer does no work (see the module docstring)
        self._explorers: set[str] = set()  # request ids that are never retired
        self._checked: set[str] = set()  # request ids checked for retiring at least once
        self._added: dict[Any, int] = defaultdict(int)  # config -> requests added (explorer choice)
        self._running: dict[Any, dict[str, None]] = defaultdict(dict)  # config -> running request ids, oldest first
        # drafts offered (proposal lengths before the cut to k, after the cap): EMA per request and per config
        self._offered: dict[str, float] = {}
        self._offered_cfg: dict[Any, float] = {}
        self._offer_checks: dict[str, int] = {}  # retired request id -> re-checks since it was offered nothing
        self._retry: set[str] = set()  # request ids to try again: the checks assume the cap until they propose
        self.decide_ms = 0.0  # EMA of the time one full decision takes (proposing included, a draft chain not), ms
        self.draft_decide_ms = 0.0  # EMA of the time of decisions that proposed: the price of drafting, ms
        self.decide_ms_per_request = 0.0  # EMA of such a decision's time per request it proposed for, ms
        self.rest_steps = 0  # plain steps left before the next decision
        self.hold_steps = 0  # steps left that draft the last decision's k (see `_held_drafts`)
        self.hold_ms = 0.0  # EMA of the host time of such a step (proposing and tracking), ms
        self._held: dict[str, int] = {}  # request id -> k of the last decision that drafted
        self._last_hold = 0  # the hold that decision set (steps)
        # per proposer key: `_hopeless`'s re-check time per request checked (median of recent checks), ms
        self.check_ms: dict[Any, float] = {}
        self._check_samples: dict[Any, deque] = defaultdict(lambda: deque(maxlen=PROPOSE_SAMPLES))
        self._decisions = 0  # decisions that reached `_hopeless` (for RECHECK_EVERY)
        self._drafting_ms_step = 0.0  # proposing and deciding since the engine last asked (take_drafting_ms)
        # per costly proposer key (a draft model): realised / modelled ms of its recent steady chains, and
        # the decisions in a row in which every request of it got k = 0 (see `_probe`)
        self._chain_ratios: dict[Any, deque] = defaultdict(lambda: deque(maxlen=CHAIN_SAMPLES))
        self._chain_idle: dict[Any, int] = defaultdict(int)
        self._probe_every: dict[Any, int] = defaultdict(lambda: DRAFT_PROBE_EVERY)  # see `_probe`
        self._probe_next: set = set()  # draft models whose next decision is priced at the table (see `_probe`)
        self._probe_scale: dict[Any, float] = {}  # draft model -> the scale its current scale probe started from
        self._feed_wait: dict[str, int] = {}  # request id -> decisions it waited to be fed (see `_gather_feeds`)

    def add_request(self, req: Request) -> None:
        """Track a request of an adaptive config (every EXPLORE_EVERY-th of its config, the first
        included, is an explorer: never retired)."""
        cfg = req.spec_config
        self.tracker.add_request(req.request_id, cfg, proposer_key(cfg))
        if self._added[cfg] % EXPLORE_EVERY == 0:
            self._explorers.add(req.request_id)
        self._added[cfg] += 1
        self._running[cfg][req.request_id] = None

    def wants_prepare(self, req: Request, num_seqs: int, num_tokens: int | None = None) -> bool:
        """Whether the proposer should keep `req`'s state up to date between steps (its `prepare`):
        False for a retired request. A request not checked yet is checked here (`num_seqs`, `num_tokens`:
        the step's sequences and new tokens, prefill chunks included; tokens default to one per
        sequence), so one that would never be drafted for is retired before its prompt is ingested."""
        rid = req.request_id
        if rid in self._retired:
            return False
        if rid in self._checked or rid in self._explorers or not req.spec_config.adaptive:
            return True
        key = proposer_key(req.spec_config)
        num_tokens = max(num_seqs if num_tokens is None else num_tokens, num_seqs)
        step = self.step_cost.step_ms(num_tokens, num_seqs)
        if not self._costly(key, step, self.proposer_of(req.spec_config)):
            return True  # drafting is cheap (or not measured yet): nothing to save
        self._checked.add(rid)
        k_cap = self._optimistic_k(req, max(req.spec_config.k_for_batch_size(num_seqs), 1))
        if k_cap == 0:  # its config's proposer has offered nothing lately
            self._retired.add(rid)
            return False
        pre = choose_draft_lengths([DraftOption(self.tracker.estimates(rid, k_cap))], self.step_cost.step_ms,
                                   num_other_tokens=num_tokens - 1, num_other_seqs=num_seqs - 1,
                                   objective=self.objective, draft_token_ms=self.step_cost.draft_overhead_ms,
                                   speculate_ms=self.drafting_ms_per_request)
        if pre.ks[0] == 0:
            self._retired.add(rid)
            return False
        return True

    @property
    def num_retired(self) -> int:
        """Running requests whose proposer does no work now."""
        return len(self._retired)

    def draft(self, asks: Sequence[tuple[Request, int]], propose: ProposeFn, *, num_other_tokens: int,
              num_other_seqs: int) -> list[Proposal]:
        """Drafts for the step's asks, those of adaptive configs cut to the k chosen for each.

        Args:
            asks: (request, k cap) pairs, k cap >= 1 (the scheduler's caps applied).
            propose: the engine's drafting callback (`Scheduler.schedule`'s `propose`).
            num_other_tokens: new tokens of the rest of the step (decodes without drafts, prefill chunks).
            num_other_seqs: sequences in the rest of the step.

        Returns:
            one Proposal per ask, in order; an adaptive one with 0..cap drafts (0: a plain decode this step).
        """
        out: list[Proposal] = [Proposal([])] * len(asks)
        fixed = [i for i, (r, _) in enumerate(asks) if not r.spec_config.adaptive]
        # their proposing time and their drafts' host overhead (ms): the whole step waits for both, whatever
        # the adaptive requests draft, so every option's step time holds them (`_adaptive`)
        fixed_ms = 0.0
        if fixed:  # configured k: drafted as they are; they are part of the step the others wait for
            t0 = time.perf_counter()
            static_drafts = 0
            for i, p in zip(fixed, propose([asks[i] for i in fixed])):
                out[i] = p
                n = min(len(p.token_ids), asks[i][1])
                static_drafts += n
                num_other_tokens += 1 + n
                num_other_seqs += 1
            # not host overhead of every step: a static draft model's chain (~4 ms at 16 concurrent on the
            # H200) fitted as such priced the next adaptive run's plain steps 3.8 ms too high
            proposing_ms = 1000 * (time.perf_counter() - t0)
            self._drafting_ms_step += proposing_ms
            fixed_ms = proposing_ms + self.step_cost.draft_overhead_ms * static_drafts
        idx = [i for i, (r, _) in enumerate(asks) if r.spec_config.adaptive]
        if not idx:
            return out
        mine = [asks[i] for i in idx]
        if self.rest_steps > 0:
            self.rest_steps -= 1
            by_config: dict[Any, list[Request]] = {}
            for r, _ in mine:  # a plain decode step for each (out[i] stays empty)
                by_config.setdefault(r.spec_config, []).append(r)
            for rs in by_config.values():
                self._count_k(rs[0], 0, len(rs))
            return out
        if self.hold_steps > 0 and any(self._held.get(r.request_id, 0) > 0 and r.request_id not in self._retired
                                       for r, _ in mine):  # a request that joined meanwhile decodes plainly
            self.hold_steps -= 1
            t0 = time.perf_counter()
            props = self._held_drafts(mine, propose)
            ms = 1000 * (time.perf_counter() - t0)
            self.hold_ms = ms if not self.hold_ms else 0.9 * self.hold_ms + 0.1 * ms
            self._drafting_ms_step += ms
            for i, p in zip(idx, props):
                out[i] = p
            return out
        self.hold_steps = 0  # over, or every request held with drafts has left: decide
        t0 = time.perf_counter()
        props, proposed, chain_ms_step = self._adaptive(mine, propose, num_other_tokens, num_other_seqs, fixed_ms)
        ms = 1000 * (time.perf_counter() - t0)
        host = ms - chain_ms_step  # a draft chain is priced by chain_scale, not as deciding
        self.decide_ms = host if not self.decide_ms else 0.9 * self.decide_ms + 0.1 * host
        if proposed:  # the price of drafting: the decision's own time
            self.draft_decide_ms = host if not self.draft_decide_ms else 0.9 * self.draft_decide_ms + 0.1 * host
            per = host / proposed
            self.decide_ms_per_request = (per if not self.decide_ms_per_request
                                          else 0.9 * self.decide_ms_per_request + 0.1 * per)
        self._drafting_ms_step += ms
        self.rest_steps = 0
        if not any(p.token_ids for p in props):
            plain_ms = self.step_cost.step_ms(num_other_tokens + len(mine), num_other_seqs + len(mine)) + fixed_ms
            self.rest_steps = min(MAX_REST_STEPS, int(self.decide_ms / max(REST_SHARE * plain_ms, 1e-9)))
        elif not any(hasattr(self.proposer_of(cfg), "draft_step_cost") for cfg in {r.spec_config for r, _ in mine}):
            # hold the chosen k for the next steps, as many as keep a decision (its EMA: one slow decision,
            # e.g. a suffix tree ingesting a long prompt, must not set a long hold) below HOLD_SHARE of
            # them; not with a draft model in the batch, whose drafting time is charged by its own cost
            step = self.last_choice.step_ms if self.last_choice is not None else 0.0
            self.hold_steps = self._last_hold = min(MAX_HOLD_STEPS,
                                                    int(self.draft_decide_ms / max(HOLD_SHARE * step, 1e-9)))
            self._held = {r.request_id: len(p.token_ids) for (r, _), p in zip(mine, props)}
        for i, p in zip(idx, props):
            out[i] = p
        return out

    def _held_drafts(self, asks: Sequence[tuple[Request, int]], propose: ProposeFn) -> list[Proposal]:
        """A step inside a hold: each request drafts the k of the last decision (at most its cap now);
        k = 0 requests are not proposed for. Drafts are recorded at the length the proposer offered, as
        in a decision, so the estimates keep learning."""
        out = [Proposal([])] * len(asks)
        todo = [i for i, (r, cap) in enumerate(asks)
                if self._held.get(r.request_id, 0) > 0 and r.request_id not in self._retired]
        for i, p in zip(todo, propose([asks[i] for i in todo]) if todo else ()):
            r, cap = asks[i]
            k = min(self._held[r.request_id], cap)
            self._note_offered(r, min(len(p.token_ids), cap))
            self.tracker.add_draft(r.request_id, len(r.all_token_ids), p.token_ids[:cap], p.match_len, p.confidence)
            self._count_k(r, min(k, len(p.token_ids)))
            if p.token_ids:
                out[i] = Proposal(p.token_ids[:k], p.draft_probs[:k] if p.draft_probs is not None else None,
                                  p.match_len, p.confidence[:k] if p.confidence else None)
        held = set(todo)
        for i, (r, _) in enumerate(asks):
            if i not in held:
                self._count_k(r, 0)
        return out

    def _unretire(self, rid: str) -> None:
        """`rid`'s proposer works for it again (its retry count, kept only while retired, starts over)."""
        self._retired.discard(rid)
        self._offer_checks.pop(rid, None)

    def _note_offered(self, r: Request, n: int) -> None:
        """Fold the length of the draft `r`'s proposer offered (0: none) into its and its config's EMA."""
        rid, cfg = r.request_id, r.spec_config
        self._retry.discard(rid)
        old = self._offered.get(rid)
        self._offered[rid] = n if old is None else (1 - OFFERED_WEIGHT) * old + OFFERED_WEIGHT * n
        old = self._offered_cfg.get(cfg)
        self._offered_cfg[cfg] = n if old is None else (1 - OFFERED_WEIGHT) * old + OFFERED_WEIGHT * n

    def _optimistic_k(self, r: Request, cap: int) -> int:
        """The draft length the retiring checks assume for `r`: the cap, or fewer where its proposer has
        offered shorter drafts (EMA of its proposal lengths, else its config's, rounded: a request whose
        proposer offered nothing lately gets 0); the cap for a request being tried again (RETRY_EVERY)."""
        if r.request_id in self._retry:
            return cap
        offered = self._offered.get(r.request_id, self._offered_cfg.get(r.spec_config))
        return cap if offered is None else min(cap, round(offered))

    @property
    def drafting_step_ms(self) -> float:
        """Host time per step that drafting costs (ms): a decision that proposed, and the steps of the
        hold that follows it, averaged over that cycle (the decision's time alone before any hold)."""
        h = self._last_hold
        if not h or not self.hold_ms:
            return self.draft_decide_ms
        return (self.draft_decide_ms + h * self.hold_ms) / (h + 1)

    @property
    def drafting_ms_per_request(self) -> float:
        """`drafting_step_ms` per request proposed for (ms): what the retiring checks charge each request
        they would keep drafting, at the same price the decision charges the whole (holds included)."""
        if not self.draft_decide_ms:
            return self.decide_ms_per_request
        return self.decide_ms_per_request * self.drafting_step_ms / self.draft_decide_ms

    def _costly(self, key: Any, step_ms: float, proposer: Any) -> bool:
        """Whether proposing for one request of proposer `key` costs enough to be worth skipping: at
        least COSTLY_SHARE of the step, and, for a proposer without between-step work, more than
        checking whether to skip it (the optimistic re-check of `_hopeless`, the median of its recent
        times per request for this proposer; a check that costs more than the call it may save is not
        made, and is timed again every RECHECK_EVERY-th decision). A proposer with a `prepare` (a
        suffix tree's ingestion) saves that too when a request is retired, so its share alone decides."""
        ms = self.propose_ms.get(key, 0.0)
        if ms < COSTLY_SHARE * step_ms:
            return False
        return hasattr(proposer, "prepare") or ms > self.check_ms.get(key, 0.0)

    def take_drafting_ms(self) -> float:
        """ms spent drafting since the last call (resets it): the adaptive decisions, proposing for their
        requests included, and the proposals for requests of configured k. The engine leaves it out of the
        step overhead it fits (`llm_engine.step_overhead_ms`): the decision is priced by
        `draft_decide_ms` and amortised by its rest steps, and another config's proposer (a static draft
        model's chain) is no cost of every step."""
        ms, self._drafting_ms_step = self._drafting_ms_step, 0.0
        return ms

    def _count_k(self, r: Request, k: int, n: int = 1) -> None:
        """Count `n` choices of k for `r`'s config (the `chosen_k` histogram of /metrics)."""
        counts = self.chosen_k[r.spec_config]
        if k >= len(counts):
            counts += [0] * (k + 1 - len(counts))
        counts[k] += n

    def _adaptive(self, asks: Sequence[tuple[Request, int]], propose: ProposeFn, other_tokens: int,
                  other_seqs: int, fixed_ms: float = 0.0) -> tuple[list[Proposal], int, float]:
        """The decision for the adaptive asks: their proposals cut to the chosen k, and how many requests
        were proposed for (a free proposer called, or a draft model drafting k > 0; if any, the decision's
        time less the draft chains' counts as the price of drafting), and the draft chains' wall ms.
        `fixed_ms` is this step's proposing for requests of configured k and their drafts' host overhead
        (ms): every option's step pays it, so it is added to the step time the choice and the retire
        check price (it is left out of the overhead fit). The throughput objective still counts each
        such request as one committed token (its expected accepted drafts are not estimated here), which
        in a mixed step leans the choice towards drafting."""
        free: dict[Any, list[int]] = defaultdict(list)  # proposer key -> indices into asks
        costly: dict[Any, list[int]] = defaultdict(list)
        by_config: dict[Any, list[int]] = defaultdict(list)
        for i, (r, _cap) in enumerate(asks):
            by_config[r.spec_config].append(i)
        for cfg, group in by_config.items():
            (costly if hasattr(self.proposer_of(cfg), "draft_step_cost") else free)[proposer_key(cfg)].extend(group)
        cm = self.step_cost
        step_ms = cm.step_ms if not fixed_ms else (lambda t, n: cm.step_ms(t, n) + fixed_ms)
        skip = self._hopeless(asks, free, other_tokens, other_seqs, step_ms)
        full: dict[int, Proposal] = {i: Proposal([]) for i in skip}
        for key, all_idx in free.items():
            idx = [i for i in all_idx if i not in skip]
            if not idx:
                continue
            t0 = time.perf_counter()
            props = propose([asks[i] for i in idx])
            ms = 1000 * (time.perf_counter() - t0) / len(idx)
            samples = self._propose_samples[key]
            samples.append(ms)
            if len(samples) >= MIN_PROPOSE_SAMPLES:  # before that drafting counts as not measured (cheap)
                self.propose_ms[key] = statistics.median(samples)
            for i, p in zip(idx, props):
                r, cap = asks[i]
                p = Proposal(list(p.token_ids[:cap]), p.draft_probs, p.match_len, p.confidence)
                full[i] = p
                self._note_offered(r, len(p.token_ids))
                self.tracker.add_draft(r.request_id, len(r.all_token_ids), p.token_ids, p.match_len, p.confidence)
        chosen, options = [], []
        for i, p in full.items():
            if p.token_ids:
                chosen.append(i)
                options.append(DraftOption(self.tracker.estimates(asks[i][0].request_id, len(p.token_ids),
                                                                  p.match_len, p.confidence)))
            else:
                other_tokens, other_seqs = other_tokens + 1, other_seqs + 1
        drafters: dict[Any, Proposer] = {}  # costly proposer key -> its proposer (a draft model)
        probe_second: set = set()  # draft models whose decision this is the second of a scale probe
        chain_cost: dict[Any, StepCostModel] = {}  # costly proposer key -> its draft model's StepCostModel
        for key, idx in costly.items():
            drafter = drafters[key] = self.proposer_of(asks[idx[0]][0].spec_config)
            cost = chain_cost[key] = drafter.draft_step_cost()
            # the decision after a scale probe is priced at the table too: its chain is steady and is timed
            if key in self._probe_next:  # the second decision of a scale probe
                probe_second.add(key)
            scale = 1.0 if key in self._probe_next else self.chain_scale(key)
            self._probe_next.discard(key)
            for i in idx:
                r, cap = asks[i]
                chosen.append(i)
                options.append(DraftOption(self.tracker.estimates(r.request_id, cap), draft_group=key,
                                           draft_cost_ms=draft_forward_ms(cost, scale)))

        def choose(opts: list[DraftOption]) -> Choice:
            return choose_draft_lengths(opts, step_ms, num_other_tokens=other_tokens,
                                        num_other_seqs=other_seqs, objective=self.objective, min_gain=self.min_gain,
                                        draft_token_ms=self.step_cost.draft_overhead_ms,
                                        speculate_ms=self.drafting_step_ms)

        choice = choose(options)
        if chain_cost:
            rids = [asks[i][0].request_id for i in chosen]
            tokens = [asks[i][0].all_token_ids for i in chosen]
            choice, options = self._gather_feeds(choice, options, rids, tokens, drafters, choose, probe_second)
            choice = self._probe(choice, options, rids, chain_cost, choose, probe_second)
        self.last_choice = choice
        ks = dict(zip(chosen, choice.ks))
        out: list[Proposal] = []
        for i, (r, _cap) in enumerate(asks):
            k = ks.get(i, 0)
            self._count_k(r, k)
            p = full.get(i)
            if p is None or not k:
                out.append(Proposal([]))
            else:
                out.append(Proposal(p.token_ids[:k], p.draft_probs[:k] if p.draft_probs is not None else None,
                                    p.match_len, p.confidence[:k] if p.confidence else None))
        chain_ms_step = 0.0  # realised ms of this decision's draft chains
        drafted = 0
        for key, idx in costly.items():  # a draft model drafts exactly the chosen k, one chain per model
            todo = [i for i in idx if ks.get(i, 0) > 0]
            if not todo:
                continue
            t0 = time.perf_counter()
            props = propose([(asks[i][0], ks[i]) for i in todo])
            real_ms = 1000 * (time.perf_counter() - t0)
            chain_ms_step += real_ms
            feed = getattr(drafters[key], "last_max_feed", None)
            if feed is None or feed <= STEADY_FEED:  # a steady chain: no prompt, no catch-up
                model_ms = chain_ms(chain_cost[key], [ks[i] for i in todo])
                self._observe_chain(key, real_ms, model_ms)
                before = self._probe_scale.pop(key, None) if key in probe_second else None
                if before is not None and model_ms > 0 and real_ms / model_ms < PROBE_CHEAPER * before:
                    self._probe_every[key] = DRAFT_PROBE_EVERY  # the probe found the chain cheaper: probe again soon
            drafted += len(todo)
            for i, p in zip(todo, props):
                r = asks[i][0]
                self._feed_wait.pop(r.request_id, None)  # fed: it is in the draft's cache now
                drafts = list(p.token_ids[: ks[i]])
                out[i] = Proposal(drafts, p.draft_probs[: len(drafts)] if p.draft_probs is not None else None)
                self.tracker.add_draft(r.request_id, len(r.all_token_ids), drafts)
        return out, len(full.keys() - skip) + drafted, chain_ms_step

    def _gather_feeds(self, choice: Choice, options: list[DraftOption], rids: list[str], tokens: list,
                      drafters: dict[Any, Proposer], choose: Callable[[list[DraftOption]], Choice],
                      probe_second: set) -> tuple[Choice, list[DraftOption]]:
        """Hold back draft-model requests whose feed would make the chain leave the draft's CUDA graphs,
        until several of them can share one eager forward. A request the draft is behind on by more than
        the drafter's `graph_max_feed` tokens (a prompt it has not seen, or a long catch-up after k = 0
        steps: its `pending_feed`) makes the chain's first forward run eagerly, and an eager forward is
        launch-bound on a GPU: about as dear for several prompts as for one. So where the choice gives
        k > 0 both to such requests and to requests the draft is in step with (whose chain would replay
        graphs), the ones behind get k = 0 (a plain decode) until FEED_BATCH of them want to draft, or
        one of them has waited FEED_WAIT decisions; then all of them draft together. Where only requests
        behind want to draft (a lone request, a batch that just started), the chain is eager anyway and
        nobody waits. In the second decision of a scale probe the ones behind always wait, so that its
        chain is steady and measures the scale. The counts are per request (`_feed_wait`); a request
        the choice gives k = 0 is not waiting. `rids`, `tokens`: the options' request ids and tokens.
        Returns the choice (made again without the held requests' drafts, which count as plain decodes)
        and the options it was made from. Drafters without `pending_feed` or graphs are left alone."""
        held: set[int] = set()
        for key, drafter in drafters.items():
            pending, limit = getattr(drafter, "pending_feed", None), getattr(drafter, "graph_max_feed", None)
            if pending is None or limit is None:
                continue
            mine = [p for p, o in enumerate(options) if o.draft_group == key]
            drafting = [p for p in mine if choice.ks[p]]
            for p in mine:
                if not choice.ks[p]:
                    self._feed_wait.pop(rids[p], None)
            behind = [p for p in drafting if pending(rids[p], tokens[p]) > limit]
            if not behind or len(behind) == len(drafting):
                continue
            if key not in probe_second and (len(behind) >= FEED_BATCH
                                            or max(self._feed_wait.get(rids[p], 0) for p in behind) >= FEED_WAIT):
                continue
            for p in behind:
                self._feed_wait[rids[p]] = self._feed_wait.get(rids[p], 0) + 1
            held.update(behind)
        if not held:
            return choice, options
        options = [replace(o, acceptance=()) if p in held else o for p, o in enumerate(options)]
        return choose(options), options

    def chain_scale(self, key: Any) -> float:
        """How much longer proposer `key`'s draft chains take than its table says: the median of the
        realised over the modelled ms of its last CHAIN_SAMPLES steady chains (a draft model's k forwards
        per drafting decision, no prompt or catch-up fed); 1.0 before any. A median, so one chain slowed
        by something else (a pause, a compile) does not move it. The choice multiplies the modelled
        draft forwards by it (see the module docstring, and `_probe` for how a scale that stopped
        all drafting is measured again)."""
        ratios = self._chain_ratios.get(key)
        return statistics.median(ratios) if ratios else 1.0

    def _observe_chain(self, key: Any, real_ms: float, model_ms: float) -> None:
        """One steady chain's realised wall time against its modelled time (ms, unscaled)."""
        if model_ms > 0.0:
            self._chain_ratios[key].append(real_ms / model_ms)

    def _probe(self, choice: Choice, options: list[DraftOption], rids: list[str],
               chain_cost: dict[Any, StepCostModel], choose: Callable[[list[DraftOption]], Choice],
               probe_second: set = frozenset()) -> Choice:
        """Probes for draft models that drafted nothing lately. A draft model learns only from drafts it
        made (unlike a free proposer, whose drafts are recorded at full length even when cut to k = 0),
        so estimates or a chain scale that keep all its requests at k = 0 would never be measured again.
        Counts, per draft model, the decisions in a row that gave all of its requests k = 0 (whatever
        the other requests got); when they reach its probe interval (DRAFT_PROBE_EVERY at first) it is probed:
        - if its chain scale is above 1.0 and the choice with its table's price alone (scale 1.0) would
          draft for it, that choice is made, and so is the next decision's (`_probe_next`): this chain
          feeds the tokens missed meanwhile (not steady, not timed), the next one is steady and measures
          the scale again;
        - otherwise one of its requests (an explorer where one is in the batch) drafts one token, whose
          outcome updates the acceptance estimates (the request's and its profile's prior; an untested
          deeper position takes the one before it, so an accepted probe can lead to longer drafts).
        A probe's first chain feeds every token its requests missed (at 16 concurrent requests on a GPU,
        one eager forward over ~1000 tokens), so a probe that only confirms k = 0 is not free: each one
        doubles the draft model's probe interval, up to DRAFT_PROBE_MAX_EVERY; a decision that drafts for
        it on its own (not a probe's) brings the interval back to DRAFT_PROBE_EVERY, and so does a scale
        probe whose timed chain came out below PROBE_CHEAPER of the scale it started from (`_adaptive`).
        `rids` are the options' request ids; `probe_second` the draft models whose decision this is the
        second of a scale probe (counted neither as idle nor as drafting on its own). Returns the choice
        to make; with one-token probes added, its value, step_ms and expected_tokens are still those of
        the choice it started from."""
        groups = {key: [p for p, o in enumerate(options) if o.draft_group == key] for key in chain_cost}
        due = []
        for key, mine in groups.items():
            if key in probe_second:
                continue
            if any(choice.ks[p] for p in mine):
                self._chain_idle[key] = 0
                self._probe_every[key] = DRAFT_PROBE_EVERY
                continue
            self._chain_idle[key] += 1
            if self._chain_idle[key] >= self._probe_every[key]:
                self._chain_idle[key] = 0
                self._probe_every[key] = min(2 * self._probe_every[key], DRAFT_PROBE_MAX_EVERY)
                due.append(key)
        if not due:
            return choice
        scaled = [key for key in due if self.chain_scale(key) > 1.0]
        if scaled:
            unscaled = [replace(o, draft_cost_ms=draft_forward_ms(chain_cost[o.draft_group]))
                        if o.draft_group in scaled else o for o in options]
            again = choose(unscaled)
            drafted = [key for key in scaled if any(again.ks[p] for p in groups[key])]
            if drafted:
                choice = again
                self._probe_next.update(drafted)
                for key in drafted:  # what the probe's timed chain is compared with
                    self._probe_scale[key] = self.chain_scale(key)
        ks = list(choice.ks)
        for key in due:
            mine = groups[key]
            if not any(ks[p] for p in mine):
                pick = next((p for p in mine if rids[p] in self._explorers), mine[0])
                ks[pick] = 1
        return choice if ks == list(choice.ks) else Choice(ks, choice.value, choice.step_ms, choice.expected_tokens)

    def _hopeless(self, asks, free: dict[Any, list[int]], other_tokens: int, other_seqs: int,
                  step_ms: Callable[[int, int], float]) -> set[int]:
        """Requests of free proposers that should not even draft this step: when drafting costs time that
        matters (at least COSTLY_SHARE of the step per request, as on a fast GPU), a request for which
        k = 0 is chosen even with the most optimistic estimates its history allows (no confidence signal,
        the cap's full length) skips the proposer. An explorer still drafts every PROBE_EVERY-th step, so
        that its estimates can learn (`_skipped` counts the steps in a row); any other such request is
        retired (no proposer work until a later decision un-retires it, see the module docstring).
        `step_ms(tokens, seqs)` prices a step for the re-check as the choice does (the step cost, plus
        any proposing for requests of configured k); whether drafting is costly at all is judged on the
        step cost alone, so that one slow static chain does not un-retire everyone."""
        idx = [i for group in free.values() for i in group]
        if not idx:
            return set()
        step = self.step_cost.step_ms(other_tokens + len(asks), other_seqs + len(asks))
        self._decisions += 1
        remeasure = self._decisions % RECHECK_EVERY == 0  # a check found dearer than proposing is timed again now and then
        costly_keys = {k for k, group in free.items()
                       if self._costly(k, step, self.proposer_of(asks[group[0]][0].spec_config))
                       or (remeasure and self.propose_ms.get(k, 0.0) >= COSTLY_SHARE * step)}
        if self._retired:  # drafting that became cheap (e.g. a refreshed step cost) retires nobody
            for k, group in free.items():
                if k not in costly_keys:
                    self._retired.difference_update(asks[i][0].request_id for i in group)
        idx = [i for i in idx if proposer_key(asks[i][0].spec_config) in costly_keys]
        if not idx:
            return set()
        t0 = time.perf_counter()
        out = self._check_hopeless(asks, idx, other_tokens, other_seqs, step_ms)
        per = 1000 * (time.perf_counter() - t0) / len(idx)
        for k in costly_keys:
            samples = self._check_samples[k]
            samples.append(per)
            self.check_ms[k] = statistics.median(samples)
        return out

    def _check_hopeless(self, asks, idx: list[int], other_tokens: int, other_seqs: int,
                        step_ms: Callable[[int, int], float]) -> set[int]:
        """`_hopeless` for the requests `idx` of costly proposers: age, re-check, retire or skip."""
        for i in idx:  # a retired request's own evidence ages at every re-check (towards the prior)
            r = asks[i][0]
            if r.request_id in self._retired:
                self.tracker.age(r.request_id)
                if self._optimistic_k(r, 1) == 0:  # its proposer offered nothing: retry now and then
                    n = self._offer_checks[r.request_id] = self._offer_checks.get(r.request_id, 0) + 1
                    if n >= RETRY_EVERY:  # checks assume the cap until its next proposal says otherwise
                        self._offered.pop(r.request_id, None)
                        self._retry.add(r.request_id)
                        self._offer_checks.pop(r.request_id, None)
        options = [DraftOption(self.tracker.estimates(asks[i][0].request_id, self._optimistic_k(asks[i][0], asks[i][1])))
                   for i in idx]
        # proposing for all of them costs each one's share of a drafting decision (measured), as it would
        pre = choose_draft_lengths(options, step_ms, num_other_tokens=other_tokens + len(asks) - len(idx),
                                   num_other_seqs=other_seqs + len(asks) - len(idx), objective=self.objective,
                                   draft_token_ms=self.step_cost.draft_overhead_ms,
                                   speculate_ms=self.drafting_ms_per_request * len(idx))
        out = set()
        for i, k in zip(idx, pre.ks):
            rid = asks[i][0].request_id
            self._checked.add(rid)
            if k > 0:
                self._skipped[rid] = 0
                if rid in self._retired:  # no draft this step: `prepare` ingests what it missed (overlapped)
                    self._unretire(rid)
                    out.add(i)
            elif rid not in self._explorers:
                self._retired.add(rid)
                out.add(i)
            elif self._skipped.get(rid, 0) < PROBE_EVERY - 1:
                self._skipped[rid] = self._skipped.get(rid, 0) + 1
                out.add(i)
            else:
                self._skipped[rid] = 0
        return out

    def choose(self, requests: Sequence[Request], max_draft_tokens: int) -> list[int]:
        """The configured k (an adaptive config's is its maximum: `draft` chooses within it)."""
        return super().choose(requests, max_draft_tokens)

    def observe(self, request: Request, num_draft_tokens: int, num_accepted: int) -> None:
        """A decode step of `request` committed: resolve its pending drafts against the committed tokens
        (drafts cut to a smaller k, or not verified at all, are resolved too: their counterfactual
        outcome is what the committed tokens say)."""
        if request.spec_config is not None and request.spec_config.adaptive:
            self.tracker.on_commit(request.request_id, request.all_token_ids)

    def finish_request(self, req: Request) -> None:
        """The request left the engine."""
        rid = req.request_id
        self.tracker.finish_request(rid)
        self._skipped.pop(rid, None)
        self._feed_wait.pop(rid, None)
        self._offered.pop(rid, None)
        self._retry.discard(rid)
        self._unretire(rid)
        self._checked.discard(rid)
        running = self._running.get(req.spec_config, {})
        running.pop(rid, None)
        if rid in self._explorers:  # keep the config's explorers: the oldest running non-explorer takes over
            self._explorers.discard(rid)
            heir = next((r for r in running if r not in self._explorers), None)
            if heir is not None:
                self._explorers.add(heir)
                self._unretire(heir)  # the next `prepare` ingests what it missed


