"""The engine: requests in, tokens out, one step at a time.

A step is: schedule (the scheduler decides the batch and each request's k cap, the proposers draft, the
scheduler fixes the `StepPlan`) -> one target forward over the plan -> batched verification with one
device-to-host copy -> commit per request (stop checks per token) and roll back the rejected KV
(docs/step-plan.md). Speculation is a per-request choice (each request carries its
own `SpeculativeConfig` or None), so one engine over one copy of the target serves any mix of methods
and k in one batch. Not thread-safe: a server drives it from one thread (`specserve.server`).
"""

from __future__ import annotations

import gc
import logging
import random
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any


from specserve.config import EngineConfig, SpeculativeConfig
from specserve.engine.draft_length import AdaptiveK
from specserve.engine.cpu_threads import resolve_cpu_threads, use_cpu_threads
from specserve.engine.loaded_model import LoadedModel
from specserve.engine.scheduler import Scheduler
from specserve.engine.step_cost import StepCostModel, load_or_measure
from specserve.engine.step_plan import ScheduledRequest, StepPlan
from specserve.engine.stop import commit_tokens, visible_text_len
from specserve.grammar.compiler import GrammarCompiler
from specserve.grammar.matcher import GrammarState
from specserve.inputs import ChatPrompt, Prompt
from specserve.outputs import RequestOutput, SpecStats
from specserve.request import Request, RequestStatus
from specserve.sample.batch import SamplingBatch
from specserve.sample.verifier import VerifyResult, to_host, verify
from specserve.sampling_params import SamplingParams
from specserve.spec_decode import make_proposer, proposer_key
from specserve.spec_decode.proposer import Proposal, ProposalInput, Proposer, ProposerContext
from specserve.tokenization import PromptEncoder, RequestError  # noqa: F401 - RequestError is public here

logger = logging.getLogger(__name__)

GC_GEN0_THRESHOLD_CUDA = 50_000  # allocations between young collections on CUDA (Python's default: 700)


def step_overhead_ms(cost: StepCostModel, plan: StepPlan, wall_ms: float, forward_ms: float, drafting_ms: float,
                     cuda: bool, prefill: bool = False) -> float | None:
    """A step's time outside the forward (ms) for the step-cost model's online overhead fit, or None
    for a step that must not be fitted. `wall_ms`: the whole step; `forward_ms`: the time the forward
    call took on the host; `drafting_ms`: the drafting in it (`AdaptiveK.take_drafting_ms`: the adaptive
    decision, amortised by its rest steps and priced as `draft_decide_ms`, and the proposals for
    requests of configured k, a static draft model's chain among them: fitted, it made the 1.5b's plain
    steps look 3.8 ms dearer at the start of every adaptive run that followed a static draft model's at
    16 concurrent on the H200; docs/gpu-notes.md, Session 18); `prefill`: the step held a sequence of
    more new tokens than a decode graph takes (`CudaGraphRunner.last_step_long`: a prompt chunk,
    replayed in a prefill graph or run eagerly). On a CPU the forward's time is measured (`forward_ms`). On CUDA the launch returns at once
    and the GPU's time sits in the verify's device-to-host copy, so the forward's time is the modelled
    one, which the table gives for the shapes its grid measured (decode and verify rows); a prefill step
    is not fitted: its wall time less the modelled forward is not host overhead. At 16 concurrent
    requests on the H200, where a new prompt arrives every few steps, the choice expected 16.6 ms for
    drafting steps that took 12.1, which such steps folded into the fitted per-step overhead would explain
    (the fit was not logged per decision; docs/gpu-notes.md, Session 17)."""
    if not cuda:
        return max(wall_ms - forward_ms - drafting_ms, 0.0)
    if prefill:
        return None
    return max(wall_ms - cost.forward_ms(plan.num_tokens, len(plan.scheduled)) - drafting_ms, 0.0)


class _UseEngineDefault:
    """Type of `USE_ENGINE_DEFAULT`."""

    def __repr__(self) -> str:
        return "USE_ENGINE_DEFAULT"


USE_ENGINE_DEFAULT: Any = _UseEngineDefault()
"""Pass as `speculative_config` to use the engine's default speculative config (None means "no speculation")."""


class LLMEngine:
    """Continuous-batching engine with per-request speculative decoding.

    Args:
        config: EngineConfig (model, dtype, device, max_model_len, max_num_seqs, token budget, default
            speculative config, seed, CPU threads and linear backend).
        target: the target already loaded, with `config.max_num_seqs` KV slots (tests pass a model-free
            one, tests/helpers/fake_engine.py); default: load `config.model`.

    Attributes:
        cpu_threads: torch threads every step runs with on the CPU (None on CUDA); see
            `specserve.engine.cpu_threads`.
        spec_stats: speculation counters summed over every request this engine ran (running and
            finished), by method name ("ngram", "suffix", "draft_model"); the per-request ones are on
            each RequestOutput.spec_stats.

    Raises:
        specserve.hub.ModelError, ModelConfigError, WeightLoadError: the model cannot be loaded.
        ConfigError: invalid speculative config (e.g. a draft model with another vocabulary).
    """

    def __init__(self, config: EngineConfig, *, target: LoadedModel | None = None):
        self.config = config
        self.target = target if target is not None else LoadedModel(
            config.model, config.dtype, config.device, config.max_model_len, config.max_num_seqs,
            enforce_eager=config.enforce_eager, batch_invariant=config.batch_invariant, cpu_linear=config.cpu_linear,
        )
        # threads of the CPU forward / sampler / verifier, applied on whichever thread steps the engine
        self.cpu_threads = resolve_cpu_threads(config.cpu_threads) if self.target.device.type == "cpu" else None
        if self.cpu_threads is not None:
            use_cpu_threads(self.cpu_threads)
        self.tokenizer = self.target.tokenizer
        self.model_name = self.target.files.name
        self.model_checksum = self.target.files.checksum
        self.max_model_len = self.target.max_model_len
        self.device = self.target.device
        self.eos_token_ids = tuple(self.target.config.eos_token_ids) or (
            (self.tokenizer.eos_token_id,) if self.tokenizer.eos_token_id is not None else ()
        )
        self.scheduler = Scheduler(self.target.kv, config.max_num_batched_tokens, self.max_model_len,
                                   enable_prefix_caching=config.enable_prefix_caching,
                                   prefix_cache_min_tokens=config.prefix_cache_min_tokens,
                                   prefix_cache_recompute_tokens=config.prefix_cache_recompute_tokens)
        self.requests: dict[str, Request] = {}
        self._aborted: list[Request] = []
        self._proposers: dict[Any, Proposer] = {}
        # proposers' `prepare` runs between a step's launches and its device-to-host copy: on CUDA the
        # launches return at once, so it overlaps the GPU; on a CPU the forward has already run (tests
        # turn it on there to check that it changes no output)
        self.overlap_host_work = self.device.type == "cuda"
        self.proposer_context = ProposerContext(
            device=self.device,
            dtype=str(self.target.dtype).removeprefix("torch."),
            max_model_len=self.max_model_len,
            num_slots=config.max_num_seqs,
            vocab_size=self.target.config.vocab_size,
            tokenizer=self.tokenizer,
            num_target_params=sum(p.numel() for p in self.target.model.parameters()),
            enable_prefix_caching=config.enable_prefix_caching,
            prefix_cache_min_tokens=config.prefix_cache_min_tokens,
        )
        self.prompt_encoder = PromptEncoder(self.tokenizer, vocab_size=self.target.config.vocab_size,
                                            max_model_len=self.max_model_len, model_name=self.model_name,
                                            size_check=False)
        self._seed_stream = random.Random(config.seed)
        self._grammar_compiler: GrammarCompiler | None = None
        self._grammar_lock = threading.Lock()
        self.spec_stats: dict[str, SpecStats] = {}  # by method, over finished and running requests
        self.adaptive: AdaptiveK | None = None  # the scheduler's k policy from the first adaptive config on
        if config.speculative_config is not None:
            self.prepare_speculative_config(config.speculative_config)
        if self.device.type == "cuda":
            # Everything loaded so far (model, tokenizer, CUDA graphs) lives as long as the engine: move it
            # out of the cyclic collector's reach, as vLLM does after start-up, so that the full collections
            # a proposer's allocations trigger (the suffix trees) do not walk it. Measured on the H200: GC
            # pauses of 300-600 ms per 16-concurrent run of the suffix profile, 60-100 ms frozen
            # (docs/gpu-notes.md). CUDA only: freezing is process-wide, and a frozen object that later
            # becomes cyclic garbage is never freed (CPU test processes build and drop many engines).
            gc.collect()
            gc.freeze()
            # A young collection every 700 allocations (the default) runs several times per 16-concurrent
            # step of the suffix proposer and promotes its tree nodes towards the costly full collections;
            # its trees hold no reference cycles, so collecting rarely loses nothing.
            gen0, gen1, gen2 = gc.get_threshold()
            gc.set_threshold(max(gen0, GC_GEN0_THRESHOLD_CUDA), gen1, gen2)

    # ---- requests -------------------------------------------------------------------------------

    def encode(self, prompt: str | Sequence[int] | Prompt) -> list[int]:
        """The checked token ids of a prompt (`specserve.tokenization.PromptEncoder.encode`: text through
        the tokenizer, chat messages through the chat template, token ids as given).

        Raises:
            RequestError: an empty prompt, token ids outside the vocabulary, a prompt that leaves no room
                for one output token within max_model_len (code "context_length_exceeded"), or a chat the
                template cannot render; `param` is "messages" for a ChatPrompt, else "prompt".
        """
        return self.prompt_encoder.encode(prompt)

    def encode_prompt(self, text: str) -> list[int]:
        """Tokenize a raw completion prompt (the tokenizer adds BOS where the model expects one)."""
        return self.tokenizer.encode(text)

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Apply the model's chat template with a generation prompt, then tokenize.

        Raises:
            RequestError: no chat template, the template refuses the messages, or the result is too long.
        """
        return self.prompt_encoder.encode(ChatPrompt(tuple(messages), tuple(tools) if tools is not None else None))

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """The structured-output compiler for this model's vocabulary (`grammar_compiler_from`)."""
        return self.grammar_compiler_from(self.tokenizer)

    def grammar_compiler_from(self, tokenizer: Any) -> GrammarCompiler:
        """The structured-output compiler, built on first use from `tokenizer` (a copy of the engine's
        when called from another thread: tokenizers are not shared between threads; about 1 s for a
        150k vocabulary). The compiler itself is thread-safe: the server compiles on its tokenizer thread."""
        with self._grammar_lock:
            if self._grammar_compiler is None:
                self._grammar_compiler = GrammarCompiler(tokenizer, self.target.config.vocab_size, self.eos_token_ids)
            return self._grammar_compiler

    def prepare_speculative_config(self, spec_config: SpeculativeConfig) -> Proposer:
        """Create (once) the proposer for `spec_config`; profiles differing only in k share it.

        Raises:
            ConfigError: no proposer for the method, or the proposer cannot be built (e.g. a draft model
                with another vocabulary).
        """
        key = proposer_key(spec_config)
        if key not in self._proposers:
            self._proposers[key] = make_proposer(spec_config, self.proposer_context)
        if spec_config.adaptive:
            self.step_cost()
            if hasattr(self._proposers[key], "draft_step_cost"):
                self._proposers[key].draft_step_cost()  # measured now, not in the first step that needs it
        return self._proposers[key]

    def step_cost(self, refresh: bool = False) -> StepCostModel:
        """The target's measured step cost on this device (`specserve.engine.step_cost`): cached per model,
        dtype and device under $SPECSERVE_HOME/step_cost, measured (a few seconds to a minute on a CPU)
        when absent or when `refresh` (or `EngineConfig.refresh_step_cost`) asks. Uses free KV slots.

        Raises:
            RuntimeError: it must be measured and every KV slot is in use.
        """
        if self.adaptive is None or refresh:
            cm = load_or_measure(self.target, max_tokens=min(32, self.config.max_num_batched_tokens),
                                 max_seqs=min(self.config.max_num_seqs, 16),
                                 refresh=refresh or self.config.refresh_step_cost)
            if self.adaptive is None:
                self.adaptive = AdaptiveK(cm, lambda cfg: self._proposers[proposer_key(cfg)],
                                          objective=self.config.adaptive_objective)
                self.scheduler.k_policy = self.adaptive  # it gives other configs their configured k
            else:
                self.adaptive.step_cost = cm
        return self.adaptive.step_cost

    def set_proposer(self, spec_config: SpeculativeConfig, proposer: Proposer) -> Proposer | None:
        """Use `proposer` for every request whose config shares `spec_config`'s proposer key (tests and
        benchmarks swap in instrumented or deliberately wrong proposers). Returns the one it replaces.

        Raises:
            RuntimeError: a running request drafts with the proposer being replaced (its state would be lost).
        """
        key = proposer_key(spec_config)
        self._check_no_running(key)
        previous = self._proposers.get(key)
        self._proposers[key] = proposer
        return previous

    @contextmanager
    def using_proposer(self, spec_config: SpeculativeConfig, proposer: Proposer) -> Iterator[Proposer]:
        """`set_proposer` for the duration of a `with` block; the previous proposer (or none) comes back
        afterwards, also when the block raises."""
        key = proposer_key(spec_config)
        previous = self.set_proposer(spec_config, proposer)
        try:
            yield proposer
        finally:
            self._check_no_running(key)
            if previous is None:
                self._proposers.pop(key, None)
            else:
                self._proposers[key] = previous

    def reset_proposers(self) -> None:
        """Drop every proposer (and its state, e.g. the suffix proposer's global tree); the next request
        of each config builds a fresh one.

        Raises:
            RuntimeError: while any request is running or waiting.
        """
        if self.scheduler.has_work():
            raise RuntimeError("reset_proposers() needs an idle engine: requests are still running or waiting")
        self._proposers.clear()

    def proposers(self) -> list[Proposer]:
        """The proposers built so far (one per proposer key), for inspection."""
        return list(self._proposers.values())

    def _check_no_running(self, key: Any) -> None:
        if any(proposer_key(r.spec_config) == key for r in self.requests.values()):
            raise RuntimeError("cannot replace a proposer while a request drafting with it is in flight")

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int] | Prompt,
        params: SamplingParams,
        *,
        speculative_config: SpeculativeConfig | None = USE_ENGINE_DEFAULT,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request.

        Args:
            prompt: text (tokenized with `encode_prompt`), token ids, or a typed prompt (see `encode`).
            speculative_config: omit (or USE_ENGINE_DEFAULT) for the engine default; None turns speculation off
                for this request.

        Raises:
            RequestError: a duplicate id, or a prompt `encode` refuses.
            SamplingParamsError: `params.structured_outputs` cannot be compiled into a grammar (the
                server compiles it before, on its tokenizer thread, so here it is a cache hit).
        """
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        grammar = None
        if params.structured_outputs is not None:
            grammar = GrammarState(self.grammar_compiler.compile(params.structured_outputs))
        ids = self.encode(prompt)
        spec_config = self.config.speculative_config if speculative_config is USE_ENGINE_DEFAULT else speculative_config
        if spec_config is not None:
            self.prepare_speculative_config(spec_config)
        seed = params.seed if params.seed is not None else self._seed_stream.getrandbits(63)
        req = Request(request_id, ids, params, spec_config, seed, grammar=grammar)
        if arrival_time is not None:
            req.arrival_time = arrival_time
        self.requests[request_id] = req
        if spec_config is not None and spec_config.adaptive:
            self.adaptive.add_request(req)
        self.scheduler.add(req)

    def abort_request(self, request_id: str) -> None:
        """Cancel a request and free its KV slot now; the next step() reports it with finish_reason
        "abort". Unknown or finished ids are ignored."""
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return
        req.finish_reason = "abort"
        self._finish(req)
        self._aborted.append(req)

    def has_unfinished_requests(self) -> bool:
        """True while any request waits, runs, or has an abort not yet reported by step()."""
        return self.scheduler.has_work() or bool(self._aborted)

    def stats(self) -> dict:
        """Live gauges: running/waiting requests, KV cache usage (0..1) and tokens held by running
        requests, free slots (empty or cached), the prefix cache's entries and tokens, and the counters
        prefix_cache_queries / prefix_cache_hits (prompt tokens admitted / of those found in the prefix
        cache, since start; vLLM's names)."""
        kv = self.target.kv
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_cache_usage": kv.usage,
            "num_kv_tokens": kv.num_used_tokens,
            "num_free_slots": kv.num_free_slots,
            "num_cached_slots": kv.num_cached_slots,
            "num_cached_tokens": kv.num_cached_tokens,
            "prefix_cache_queries": self.scheduler.prefix_cache_queries,
            "prefix_cache_hits": self.scheduler.prefix_cache_hits,
        }

    def speculation_stats(self) -> dict:
        """The adaptive schedule's state for /metrics: the measured step costs, keyed (model name, role)
        with role "target" or "draft" (a model drafting for itself has both), each draft model's chain
        scale (`AdaptiveK.chain_scale`: realised over modelled draft-chain ms) and, per adaptive
        SpeculativeConfig, how often each k was chosen and its acceptance estimates."""
        if self.adaptive is None:
            return {}
        costs = {(self.model_name, "target"): self.adaptive.step_cost}
        chain_scale = {}
        for key, prop in self._proposers.items():
            if hasattr(prop, "draft_step_cost") and getattr(prop, "_step_cost", None) is not None:
                costs[(prop.draft.files.name, "draft")] = prop._step_cost
                chain_scale[prop.draft.files.name] = self.adaptive.chain_scale(key)
        configs = []
        for cfg, counts in list(self.adaptive.chosen_k.items()):
            est = self.adaptive.tracker.config_summary(cfg, proposer_key(cfg), cfg.num_speculative_tokens)
            configs.append({"config": cfg, "chosen_k": list(counts), "acceptance": est})
        return {"step_cost": costs, "chain_scale": chain_scale, "configs": configs}

    # ---- the step -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step (docs/step-plan.md): plan (with drafting) -> one forward -> batched verify ->
        per-request commit and KV rollback. Returns an output for every request that advanced or finished."""
        t_step = time.perf_counter()
        if self.cpu_threads is not None:
            use_cpu_threads(self.cpu_threads)
        outputs = [self._make_output(r) for r in self._aborted]
        self._aborted.clear()
        plan = self.scheduler.schedule(self._propose)
        if not plan:
            return outputs
        now = time.monotonic()
        for s in plan.scheduled:
            if s.request.first_scheduled_time is None:
                s.request.first_scheduled_time = now
        try:
            t_fwd = time.perf_counter()
            logits = self.target.runner.execute(plan.model_input(self.device))
            t_fwd = time.perf_counter() - t_fwd
            result = None
            overlap = self.overlap_host_work
            if plan.sampled:
                batch = SamplingBatch.build(plan.sampled, self.target.config.vocab_size, self.eos_token_ids, self.device)
                verified = verify(logits, batch)
                if overlap:
                    self._prepare_proposers(plan)
                result = to_host(verified, batch)
            elif overlap:
                self._prepare_proposers(plan)
        except Exception:
            kv = self.target.kv
            for s in plan.scheduled:  # leave every request as it was before the step
                kv.truncate(s.request.slot, min(s.start, kv.lengths[s.request.slot]))
            raise
        outputs += self._commit(plan, result)
        if self.adaptive is not None:
            cm = self.adaptive.step_cost
            wall_ms = 1000 * (time.perf_counter() - t_step)
            # drafting (the adaptive decision, amortised by its rest steps, and other configs' proposers) is
            # not per-step overhead; a prefill step's forward is a shape the step-cost table does not model
            over = step_overhead_ms(cm, plan, wall_ms, 1000 * t_fwd, self.adaptive.take_drafting_ms(),
                                    self.device.type == "cuda", getattr(self.target.runner, "last_step_long", False))
            if over is not None:
                cm.observe_overhead(over, plan.num_draft_tokens)
        return outputs

    def _prepare_proposers(self, plan: StepPlan) -> None:
        """While the device runs the step (CUDA): each proposer's host work that needs no new tokens
        (its optional `prepare`, spec_decode/proposer.py): a suffix tree ingests a new prompt, or a
        finished request's output, here instead of in the next step's drafting. Only requests whose
        config may draft at this batch size are passed (a batch-size table's k = 0 never ingests), and
        of adaptive configs only those the schedule has not retired (`AdaptiveK.wants_prepare`)."""
        preparers = {key: prop.prepare for key, prop in self._proposers.items() if hasattr(prop, "prepare")}
        if not preparers:  # ngram and draft-model proposers have no such work: nothing to do per step
            return
        groups: dict[Any, list[Request]] = {}
        n = len(plan.scheduled)
        for s in plan.scheduled:
            cfg = s.request.spec_config
            if cfg is None or cfg.k_for_batch_size(n) <= 0:
                continue
            if cfg.adaptive and not self.adaptive.wants_prepare(s.request, n, plan.num_tokens):
                continue
            groups.setdefault(proposer_key(cfg), []).append(s.request)
        for key, prepare in preparers.items():
            prepare([ProposalInput(r.request_id, r.all_token_ids, r.num_prompt_tokens, 0, r.params, r.seed)
                     for r in groups.get(key, ())])

    def _propose(self, asks: Sequence[tuple[Request, int]]) -> list[Proposal]:
        """The scheduler's `propose` callback: one Proposal per (request, k cap), grouped by proposer."""
        groups: dict[Any, list[int]] = {}
        for i, (r, _) in enumerate(asks):
            groups.setdefault(proposer_key(r.spec_config), []).append(i)
        out: list[Proposal] = [Proposal([])] * len(asks)
        for key, idx in groups.items():
            inputs = [ProposalInput(r.request_id, r.all_token_ids, r.num_prompt_tokens, k, r.params, r.seed)
                      for r, k in (asks[i] for i in idx)]
            props = self._proposers[key].propose(inputs)
            if len(props) != len(inputs):
                raise RuntimeError(f"proposer {key[0]!r} returned {len(props)} proposals for {len(inputs)} requests")
            for i, prop in zip(idx, props):
                out[i] = prop
        return out

    def _commit(self, plan: StepPlan, result: VerifyResult | None) -> list[RequestOutput]:
        """Per request, on the CPU: advance prefills; commit verified tokens with every per-token stop
        check; count speculation; truncate the KV cache to what was committed (the rollback)."""
        outputs, b = [], 0
        for s in plan.scheduled:
            r = s.request
            if s.is_prefill:
                r.num_computed_tokens += s.num_new_tokens
            if not s.num_rows:
                continue
            i, b = b, b + 1
            try:
                if result.failed[i]:
                    raise ValueError("cannot sample from an all-zero distribution (NaN or no mass left in the "
                                     "target's probabilities)")
                tokens, a, lps = result.committed(i, s.row_offset, r.params.logprobs)
                outputs.append(self._commit_request(s, tokens, a, lps))
            except Exception as e:  # one request's failure must not take the batch (or the server) down
                logger.exception("request %s failed in verification or commit; finishing it with finish_reason "
                                 "'error'", r.request_id)
                r.finish_reason, r.stop_reason = "error", f"{type(e).__name__}: {e}"
                self._finish(r)
                outputs.append(self._make_output(r))
        return outputs

    def _commit_request(self, s: ScheduledRequest, tokens: list[int], num_accepted: int,
                        logprobs: list | None) -> RequestOutput:
        r = s.request
        before = len(r.all_token_ids)
        n = commit_tokens(r, tokens, logprobs, self.tokenizer, self.eos_token_ids, self.max_model_len)
        if r.grammar is not None:  # the grammar advances by the committed tokens only (its rollback undid the drafts)
            r.grammar.accept(r.all_token_ids[before:])
        if r.first_token_time is None:
            r.first_token_time = time.monotonic()
        if not s.is_prefill:
            if s.num_drafts:
                # Stats (docs/speculation-cases.md B10): a step's last emitted token is its own (recovered/bonus) token, also
                # when a stop ends the request on an accepted draft; so 1 + accepted / drafts stays equal to
                # the tokens emitted per verify step.
                self._count_spec(r, s.num_drafts, min(num_accepted, n - 1), n)
            r.num_computed_tokens += 1 + min(num_accepted, n)  # drafts after a stop are not committed
            self.target.kv.truncate(r.slot, r.num_computed_tokens)  # roll back the rejected drafts
            if r.spec_config is not None:  # every decode step, also one without drafts (k = 0)
                self.scheduler.k_policy.observe(r, s.num_drafts, num_accepted)
        if r.finish_reason is not None:
            self._finish(r)
        return self._make_output(r)

    def _count_spec(self, r: Request, num_draft: int, accepted: int, committed: int) -> None:
        step = SpecStats(1, num_draft, accepted, (1,) * accepted + (0,) * (num_draft - accepted), committed)
        r.spec_stats = r.spec_stats + step  # a new snapshot: outputs already emitted keep theirs
        method = r.spec_config.method
        self.spec_stats[method] = self.spec_stats.get(method, SpecStats()) + step

    def _finish(self, r: Request) -> None:
        r.status = RequestStatus.FINISHED
        r.finished_time = time.monotonic()
        self.scheduler.remove(r, cache=r.finish_reason != "error")  # an error leaves nothing to reuse
        if r.spec_config is not None:
            self._proposers[proposer_key(r.spec_config)].finish_request(r.request_id, r.all_token_ids)
            if r.spec_config.adaptive:
                self.adaptive.finish_request(r)
        self.requests.pop(r.request_id, None)

    def _make_output(self, r: Request) -> RequestOutput:
        """What is new since the request's previous output: O(new tokens), never a copy of the history."""
        new_ids = r.all_token_ids[r.num_prompt_tokens + r.emitted_token_len :]
        new_lps = r.logprobs[r.emitted_token_len :] if r.logprobs is not None else None
        vis = visible_text_len(r)
        if vis < r.emitted_text_len:  # a stop cut text already sent: the stream and the text disagree
            logger.warning("request %s: its text was cut below what was already streamed", r.request_id)
        new_text = r.text[r.emitted_text_len : vis] if vis > r.emitted_text_len else ""
        r.emitted_token_len += len(new_ids)
        r.emitted_text_len = max(vis, r.emitted_text_len)
        return RequestOutput(
            request_id=r.request_id,
            prompt_token_ids=r.prompt_token_ids,
            new_token_ids=new_ids,
            new_text=new_text,
            new_logprobs=new_lps,
            finished=r.finished,
            finish_reason=r.finish_reason,
            stop_reason=r.stop_reason,
            spec_stats=r.spec_stats,
            metrics={
                "arrival": r.arrival_time,
                "first_scheduled": r.first_scheduled_time,
                "first_token": r.first_token_time,
                "finished": r.finished_time,
            },
        )
