"""Prometheus metrics of one server, in their own CollectorRegistry (never the process-global one).

Series (every per-request series is labelled by `profile`):
- specserve:requests_total{profile, status, code}     status "ok" | "error" | "cancelled", code = HTTP status
- specserve:prompt_tokens_total, specserve:generation_tokens_total
- specserve:time_to_first_token_seconds, specserve:inter_token_latency_seconds (per token: the gap
  between two token-bearing engine outputs, divided over the tokens the later one carries),
  specserve:e2e_request_latency_seconds   (histograms, measured in the server from request arrival)
- specserve:num_requests_running, specserve:num_requests_waiting, specserve:kv_cache_usage_perc (0..1),
  specserve:num_requests_in_flight (server side, includes requests not yet handed to the engine)
- prefix caching (vLLM's names): specserve:prefix_cache_queries_total (prompt tokens of the requests the
  engine admitted), specserve:prefix_cache_hits_total (of those, tokens whose K/V came from the prefix
  cache; docs/prefix_caching.md), taken from the engine's counters at each scrape
- speculation counters (docs/design.md section 5, names mirroring vLLM's):
  specserve:spec_decode_num_drafts_total, specserve:spec_decode_num_draft_tokens_total,
  specserve:spec_decode_num_accepted_tokens_total, specserve:spec_decode_num_accepted_tokens_per_pos_total{position}
  They are added when a request finishes (ok, error or cancelled), from the same `SpecStats` the
  response body reports, so the counters equal the sum of the per-response numbers.
- the adaptive schedule (`SpeculationCollector`): measured step costs, steps by chosen k and the
  acceptance estimates per profile (profiles with identical configs report the same numbers).
What it does not do: per-step engine timings (the engine owns those) or HTTP (api.py serves `render()`).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from specserve.outputs import SpecStats

_LAT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    """All metrics of one server (see the module docstring), including the process's own
    (`process_resident_memory_bytes`, CPU seconds), which the benchmark reports as server memory."""

    def __init__(self, profiles: list[str] | tuple[str, ...] = (), model_name: str = ""):
        r = self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=r)
        self.requests = Counter("specserve:requests", "Finished completion requests", ["profile", "status", "code"],
                                registry=r)
        self.prompt_tokens = Counter("specserve:prompt_tokens", "Prompt tokens processed", ["profile"], registry=r)
        self.generation_tokens = Counter("specserve:generation_tokens", "Tokens generated", ["profile"], registry=r)
        self.ttft = Histogram("specserve:time_to_first_token_seconds", "Time to first token", ["profile"],
                              buckets=_LAT_BUCKETS, registry=r)
        self.itl = Histogram("specserve:inter_token_latency_seconds", "Inter-token latency (per token)",
                             ["profile"], buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("specserve:e2e_request_latency_seconds", "End-to-end request latency", ["profile"],
                             buckets=_E2E_BUCKETS, registry=r)
        self.running = Gauge("specserve:num_requests_running", "Requests in the engine's running batch", registry=r)
        self.waiting = Gauge("specserve:num_requests_waiting", "Requests waiting for an engine slot", registry=r)
        self.kv_usage = Gauge("specserve:kv_cache_usage_perc", "KV cache usage, 0..1", registry=r)
        self.prefix_cache_queries = Counter("specserve:prefix_cache_queries",
                                            "Prompt tokens of admitted requests (prefix cache queries, in tokens)",
                                            registry=r)
        self.prefix_cache_hits = Counter("specserve:prefix_cache_hits",
                                         "Prompt tokens found in the prefix cache (prefix cache hits, in tokens)",
                                         registry=r)
        self._prefix_seen = (0, 0)  # the engine's (queries, hits) already added to the counters
        self.in_flight = Gauge("specserve:num_requests_in_flight", "Engine requests held by the server", registry=r)
        self.step_age = Gauge("specserve:engine_last_step_age_seconds",
                              "Seconds since the engine last finished a step while work is pending (0 when idle)",
                              registry=r)
        self.healthy = Gauge("specserve:engine_healthy", "1 while the engine runs and its watchdog is quiet, else 0",
                             registry=r)
        self.draining = Gauge("specserve:server_draining", "1 while the server drains before shutting down",
                              registry=r)
        self.num_drafts = Counter("specserve:spec_decode_num_drafts", "Verify steps that carried drafts",
                                  ["profile"], registry=r)
        self.num_draft_tokens = Counter("specserve:spec_decode_num_draft_tokens", "Draft tokens proposed",
                                        ["profile"], registry=r)
        self.num_accepted_tokens = Counter("specserve:spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                           ["profile"], registry=r)
        self.num_accepted_per_pos = Counter("specserve:spec_decode_num_accepted_tokens_per_pos",
                                            "Draft tokens accepted at each draft position",
                                            ["profile", "position"], registry=r)
        self.speculation = SpeculationCollector()
        r.register(self.speculation)
        info = Gauge("specserve:model_info", "Served model", ["model"], registry=r)
        info.labels(model=model_name).set(1)
        for p in profiles:  # make every profile's series exist from the start (at zero)
            for c in (self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                      self.prompt_tokens, self.generation_tokens):
                c.labels(profile=p)

    def observe_first_token(self, profile: str, ttft_s: float) -> None:
        self.ttft.labels(profile=profile).observe(max(0.0, ttft_s))

    def observe_tokens(self, profile: str, gap_s: float, num_tokens: int) -> None:
        """A token-bearing output came `gap_s` after the previous one and carried `num_tokens` tokens."""
        if num_tokens <= 0:
            return
        h = self.itl.labels(profile=profile)
        per = max(0.0, gap_s) / num_tokens
        for _ in range(num_tokens):
            h.observe(per)

    def observe_finished(
        self,
        *,
        profile: str,
        status: str,
        code: int,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
        e2e_s: float | None = None,
        spec_stats: SpecStats | None = None,
    ) -> None:
        self.requests.labels(profile=profile, status=status, code=str(code)).inc()
        if prompt_tokens:
            self.prompt_tokens.labels(profile=profile).inc(prompt_tokens)
        if completion_tokens:
            self.generation_tokens.labels(profile=profile).inc(completion_tokens)
        if e2e_s is not None:
            self.e2e.labels(profile=profile).observe(max(0.0, e2e_s))
        if spec_stats is not None:
            self.num_drafts.labels(profile=profile).inc(spec_stats.num_drafts)
            self.num_draft_tokens.labels(profile=profile).inc(spec_stats.num_draft_tokens)
            self.num_accepted_tokens.labels(profile=profile).inc(spec_stats.num_accepted_tokens)
            for pos, c in enumerate(spec_stats.num_accepted_tokens_per_pos):
                self.num_accepted_per_pos.labels(profile=profile, position=str(pos)).inc(c)

    def set_health(self, step_age_s: float, healthy: bool, draining: bool) -> None:
        """The watchdog's gauges (see `specserve.server.api`, /health)."""
        self.step_age.set(step_age_s)
        self.healthy.set(1 if healthy else 0)
        self.draining.set(1 if draining else 0)

    def set_engine_stats(self, stats: dict | None, in_flight: int) -> None:
        if stats:
            self.running.set(stats.get("num_running", 0))
            self.waiting.set(stats.get("num_waiting", 0))
            self.kv_usage.set(stats.get("kv_cache_usage", 0.0))
            q, h = stats.get("prefix_cache_queries"), stats.get("prefix_cache_hits")
            if q is not None and h is not None:  # the engine's totals since start: add what is new
                q0, h0 = self._prefix_seen
                self.prefix_cache_queries.inc(max(q - q0, 0))
                self.prefix_cache_hits.inc(max(h - h0, 0))
                self._prefix_seen = (max(q, q0), max(h, h0))
        self.in_flight.set(in_flight)

    def set_speculation(self, stats: dict | None, profiles: dict) -> None:
        """The engine's `speculation_stats()` and the profiles (name -> Profile), for the adaptive
        schedule's series (see `SpeculationCollector`)."""
        self.speculation.update(stats or {}, profiles)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class SpeculationCollector:
    """The adaptive schedule's state, exported at scrape time from the engine's last `speculation_stats()`:

    - specserve:step_cost_forward_seconds{model, role, num_tokens}: measured forward time of one sequence
      with that many new tokens, of the target (role "target") and of each draft model in use (role
      "draft": a model that drafts for itself has both), `specserve.engine.step_cost`;
    - specserve:step_cost_seq_extra_seconds{model, role, num_seqs}: what that many sequences add over one;
    - specserve:step_cost_overhead_seconds{model, role}: the step time outside the forward (online fit;
      fitted for the target only, 0 for a draft);
    - specserve:step_cost_draft_overhead_seconds{model, role}: the extra step time outside the forward per
      verified draft token (online fit, the target only);
    - specserve:step_cost_draft_chain_scale{model}: a draft model's realised draft-chain time over the
      time its table models (`AdaptiveK.chain_scale`; 1.0 until a few chains were timed);
    - specserve:spec_decode_adaptive_steps_total{profile, k}: decode steps in which the adaptive schedule
      chose k drafts for a request of the profile (k = 0: a plain decode);
    - specserve:spec_decode_acceptance_estimate{profile, position}: the profile's current estimate of
      the conditional acceptance at each draft position (1-based).
    """

    def __init__(self) -> None:
        self._stats: dict = {}
        self._profiles: dict = {}

    def update(self, stats: dict, profiles: dict) -> None:
        self._stats, self._profiles = stats, dict(profiles)

    def describe(self):
        return []

    def collect(self):
        stats = self._stats
        fwd = GaugeMetricFamily("specserve:step_cost_forward_seconds",
                                "Measured forward time of one sequence with num_tokens new tokens",
                                labels=["model", "role", "num_tokens"])
        extra = GaugeMetricFamily("specserve:step_cost_seq_extra_seconds",
                                  "Measured extra forward time of num_seqs sequences over one",
                                  labels=["model", "role", "num_seqs"])
        over = GaugeMetricFamily("specserve:step_cost_overhead_seconds",
                                 "Step time outside the forward of a step without drafts (online fit)",
                                 labels=["model", "role"])
        draft_over = GaugeMetricFamily("specserve:step_cost_draft_overhead_seconds",
                                       "Extra step time outside the forward per verified draft token (online fit)",
                                       labels=["model", "role"])
        for (model, role), cm in (stats.get("step_cost") or {}).items():
            for t, ms in zip(cm.tokens, cm.token_ms):
                fwd.add_metric([model, role, str(t)], ms / 1000)
            for b, ms in zip(cm.seqs, cm.seq_extra_ms):
                extra.add_metric([model, role, str(b)], ms / 1000)
            over.add_metric([model, role], cm.overhead_ms / 1000)
            draft_over.add_metric([model, role], cm.draft_overhead_ms / 1000)
        chain = GaugeMetricFamily("specserve:step_cost_draft_chain_scale",
                                  "Realised over modelled time of a draft model's draft chains (recent chains)",
                                  labels=["model"])
        for model, scale in (stats.get("chain_scale") or {}).items():
            chain.add_metric([model], scale)
        steps = CounterMetricFamily("specserve:spec_decode_adaptive_steps",
                                    "Decode steps in which the adaptive schedule chose k drafts", labels=["profile", "k"])
        est = GaugeMetricFamily("specserve:spec_decode_acceptance_estimate",
                                "Current estimate of the conditional acceptance at each draft position",
                                labels=["profile", "position"])
        for c in stats.get("configs") or []:
            for name, p in self._profiles.items():
                if p.spec_config != c["config"]:
                    continue
                for k, n in enumerate(c["chosen_k"]):
                    steps.add_metric([name, str(k)], n)
                for j, a in enumerate(c["acceptance"], start=1):
                    est.add_metric([name, str(j)], a)
        yield from (fwd, extra, over, draft_over, chain, steps, est)
