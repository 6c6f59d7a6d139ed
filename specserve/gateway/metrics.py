"""Prometheus metrics of the gateway, in its own registry.

Per backend: specserve:gateway_backend_requests_total{backend, profile, status, code} (every attempt,
retried ones included), specserve:gateway_backend_up{backend, profile} (1 healthy, 0 ejected),
specserve:gateway_backend_in_flight{backend} (read at scrape time), specserve:gateway_backend_latency_seconds{backend}
(attempt latency, to the last byte), specserve:gateway_retries_total{backend} (attempts on that backend
that failed and were retried elsewhere), specserve:gateway_ejections_total{backend}.
Per profile (the names the server uses, so dashboards and `specserve bench` read both alike):
specserve:requests_total{profile, status, code} (one per client request),
specserve:e2e_request_latency_seconds{profile}, specserve:time_to_first_token_seconds{profile}
(streams), specserve:prompt_tokens_total / generation_tokens_total{profile} (from usage),
specserve:spec_decode_num_drafts_total / _num_draft_tokens_total / _num_accepted_tokens_total{profile}
(from the backends' per-response `specserve` numbers, and for vLLM backends from their /metrics).
Gateway: specserve:gateway_overhead_seconds (non-streamed requests: time in the gateway minus the time
waiting for the backend), the rollout gauges (`specserve.rollout.runtime`), process metrics.
What it does not do: measure anything itself (`proxy.py` calls it).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest

_LAT = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_OVERHEAD = (0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.025, 0.05)


class GatewayMetrics:
    def __init__(self, backends: list[tuple[str, str]], profiles: list[str]):
        r = self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=r)
        self.backend_requests = Counter("specserve:gateway_backend_requests", "Attempts per backend",
                                        ["backend", "profile", "status", "code"], registry=r)
        self.backend_up = Gauge("specserve:gateway_backend_up", "1 = healthy, 0 = ejected", ["backend", "profile"],
                                registry=r)
        self.in_flight = Gauge("specserve:gateway_backend_in_flight", "Requests in flight per backend", ["backend"],
                               registry=r)
        self.backend_latency = Histogram("specserve:gateway_backend_latency_seconds", "Attempt latency per backend",
                                         ["backend"], buckets=_LAT, registry=r)
        self.retries = Counter("specserve:gateway_retries", "Failed attempts retried on another backend",
                               ["backend"], registry=r)
        self.ejections = Counter("specserve:gateway_ejections", "Backend ejections", ["backend"], registry=r)
        self.requests = Counter("specserve:requests", "Client requests by profile", ["profile", "status", "code"],
                                registry=r)
        self.e2e = Histogram("specserve:e2e_request_latency_seconds", "End-to-end latency seen by the gateway",
                             ["profile"], buckets=_LAT, registry=r)
        self.ttft = Histogram("specserve:time_to_first_token_seconds", "Time to first token (streams)", ["profile"],
                              buckets=_LAT, registry=r)
        self.prompt_tokens = Counter("specserve:prompt_tokens", "Prompt tokens", ["profile"], registry=r)
        self.generation_tokens = Counter("specserve:generation_tokens", "Generated tokens", ["profile"], registry=r)
        self.num_drafts = Counter("specserve:spec_decode_num_drafts", "Verify steps with drafts", ["profile"],
                                  registry=r)
        self.num_draft_tokens = Counter("specserve:spec_decode_num_draft_tokens", "Draft tokens proposed",
                                        ["profile"], registry=r)
        self.num_accepted = Counter("specserve:spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                    ["profile"], registry=r)
        self.overhead = Histogram("specserve:gateway_overhead_seconds", "Gateway time outside the backend "
                                  "(non-streamed)", buckets=_OVERHEAD, registry=r)
        for name, profile in backends:
            self.backend_up.labels(backend=name, profile=profile).set(1)
            self.in_flight.labels(backend=name)
            self.retries.labels(backend=name)
            self.ejections.labels(backend=name)
        for p in profiles:
            for c in (self.num_drafts, self.num_draft_tokens, self.num_accepted, self.prompt_tokens,
                      self.generation_tokens):
                c.labels(profile=p)

        self._children: dict[tuple, Any] = {}

    def child(self, metric: Any, *labels: str) -> Any:
        """metric.labels(*labels), cached (the per-request hot path)."""
        key = (id(metric), *labels)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(*labels)
        return c

    def request(self, profile: str, status: str, code: int) -> None:
        self.child(self.requests, profile, status, str(code)).inc()

    def attempt(self, backend: str, profile: str, status: str, code: int) -> None:
        self.child(self.backend_requests, backend, profile, status, str(code)).inc()

    def watch_in_flight(self, backends: list[Any]) -> None:
        """Read each backend's `in_flight` count when /metrics is scraped (nothing per request)."""
        for b in backends:
            self.in_flight.labels(backend=b.name).set_function(lambda b=b: b.in_flight)

    def finished(self, profile: str, status: str, code: int, e2e_s: float, ttft_s: float | None, prompt_tokens: int,
                 completion_tokens: int) -> None:
        """One client request's series (latencies only for successful ones)."""
        self.request(profile, status, code)
        if status != "ok":
            return
        self.child(self.e2e, profile).observe(e2e_s)
        if ttft_s is not None:
            self.child(self.ttft, profile).observe(ttft_s)
        if prompt_tokens:
            self.child(self.prompt_tokens, profile).inc(prompt_tokens)
        if completion_tokens:
            self.child(self.generation_tokens, profile).inc(completion_tokens)

    def spec(self, profile: str, drafts: int, draft_tokens: int, accepted: int) -> None:
        if drafts:
            self.child(self.num_drafts, profile).inc(drafts)
            self.child(self.num_draft_tokens, profile).inc(draft_tokens)
            self.child(self.num_accepted, profile).inc(accepted)

    def render(self) -> bytes:
        return generate_latest(self.registry)
