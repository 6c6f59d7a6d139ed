"""Scrape a server's Prometheus /metrics before and after a run, and turn the deltas into numbers.

What it does: parses the Prometheus text format (samples only: `name{labels} value`), takes the
difference of two scrapes, and reads the speculation counters of docs/design.md section 5
(`specserve:spec_decode_*`; vLLM's `vllm:spec_decode_*` are read the same way when ours are absent)
and `process_resident_memory_bytes`. What it does not do: attribute counters to segments (a scrape
covers the whole server), or fail a run when /metrics is missing (it returns None instead).
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import httpx

# httpx and specserve.bench.metrics (numpy) are imported where they are used: the gateway imports `parse`
# for its vLLM health checks and should not load an HTTP client and numpy it does not use

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
PREFIXES = ("specserve:spec_decode_", "vllm:spec_decode_")

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    """{(name, sorted label pairs): value} for every sample line; comments and junk are skipped."""
    out: Samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            continue
        try:
            val = float(m.group(4))
        except ValueError:
            continue
        labels = tuple(sorted(_LABEL.findall(m.group(3) or "")))
        out[(m.group(1), labels)] = val
    return out


def metrics_url(base_url: str) -> str:
    """http://host:port/v1 -> http://host:port/metrics."""
    root = base_url.rstrip("/")
    if root.endswith("/v1"):
        root = root[:-3]
    return root + "/metrics"


async def scrape(client: httpx.AsyncClient, url: str) -> Samples | None:
    """One scrape, or None when the server has no usable /metrics."""
    import httpx

    try:
        r = await client.get(url, timeout=10)
    except httpx.HTTPError:
        return None
    return parse(r.text) if r.status_code == 200 else None


def delta(before: Samples | None, after: Samples | None) -> Samples | None:
    """after - before for every sample present after (a sample new in `after` counts from 0)."""
    if before is None or after is None:
        return None
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def _sum(samples: Samples, name: str, profile: str | None, **match) -> float | None:
    hit = None
    for (n, labels), v in samples.items():
        if n != name:
            continue
        lab = dict(labels)
        if profile is not None and lab.get("profile", profile) != profile:
            continue
        if any(lab.get(k) != str(x) for k, x in match.items()):
            continue
        hit = (hit or 0.0) + v
    return hit


def acceptance_from_delta(d: Samples | None, profile: str | None = None) -> dict:
    """Acceptance metrics from a /metrics delta, for one `profile` label (None: all); {} if no counters."""
    if not d:
        return {}
    from specserve.bench.metrics import acceptance_from_counts

    for prefix in PREFIXES:
        drafts = _sum(d, prefix + "num_drafts_total", profile)
        if drafts is None:
            continue
        tokens = _sum(d, prefix + "num_draft_tokens_total", profile) or 0.0
        acc = _sum(d, prefix + "num_accepted_tokens_total", profile) or 0.0
        positions = sorted({int(dict(lab)["position"]) for (n, lab) in d
                            if n == prefix + "num_accepted_tokens_per_pos_total" and "position" in dict(lab)
                            and (profile is None or dict(lab).get("profile", profile) == profile)})
        per_pos = [_sum(d, prefix + "num_accepted_tokens_per_pos_total", profile, position=p) or 0.0
                   for p in range(max(positions) + 1 if positions else 0)]
        return acceptance_from_counts(drafts, tokens, acc, per_pos, "metrics_delta")
    return {}


def memory_bytes(samples: Samples | None) -> float | None:
    """Server resident memory (bytes) from `process_resident_memory_bytes`, summed over processes."""
    if not samples:
        return None
    return _sum(samples, "process_resident_memory_bytes", None)


def prefix_cache_tokens(base_url: str, namespace: str = "specserve") -> tuple[float, float] | None:
    """(queried, hit) prompt tokens of a server's prefix cache so far, from one synchronous scrape of
    /metrics: `{namespace}:prefix_cache_queries_total` and `..._hits_total`, summed over label sets
    ("specserve" or "vllm", which share vLLM's names). None when /metrics or either counter is missing."""
    import httpx

    try:
        r = httpx.get(metrics_url(base_url), timeout=10)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    samples = parse(r.text)
    queries = _sum(samples, f"{namespace}:prefix_cache_queries_total", None)
    hits = _sum(samples, f"{namespace}:prefix_cache_hits_total", None)
    return None if queries is None or hits is None else (queries, hits)
