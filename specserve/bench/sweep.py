"""`specserve sweep`: benchmark methods x k (and the adaptive schedule) x concurrency x workload
segments, and recommend a profile per (segment, concurrency).

Two ways to reach servers:
- one running specserve server (`--base-url`, `--admin-token`): every profile of the sweep is added at
  run time through `POST /admin/profiles` (weight 0, so no user traffic reaches it) and chosen per
  request with the `profile` field (the server needs --allow-profile-override); no restart.
- external servers (`--server-cmd TEMPLATE`), e.g. one vLLM server per config: for each profile the
  template is started in a shell with {port}, {speculative_config} (JSON, or empty for the baseline)
  and {speculative_config_arg} (`--speculative-config '<json>'`, or empty) filled in, polled until
  GET /health answers (`bench.server_process`), benchmarked with the server's default profile, and stopped.

What a sweep runs: for every repeat, segment and concurrency, every profile (the baseline first in the
list, the order rotated from run to run so that machine noise hits every profile alike) sends the same
requests of that segment alone (a homogeneous batch: the recommendation is for that workload at that
concurrency), greedy, closed loop, each run after an untimed request per prompt with max_tokens 1
(`client.prime_prompts`): every profile meets the prefix cache in the same state (the prompts cached),
where the first profile to send a prompt would otherwise pay its prefill inside its TPOT. On one running
server at concurrency 1 the profiles take turns request by request (`interleave`, the default;
`--no-interleave` runs each profile's requests back to back): every request is run by each profile in
turn (`_run_interleaved`, the order rotated per request), so noise that drifts over minutes hits all of
them alike; a profile's metrics are those of its requests together. At a higher concurrency a round of
c requests would start together and drain to one, a burst rather than the closed loop the
recommendation is for, so those runs stay back to back (with the default 4 prompts at c = 4 a run is one
such round anyway). The engine-wide state of the adaptive schedule (its step-cost fit, its decision
times) then passes from profile to profile once per request instead of once per run. Each (repeat, concurrency) draws its own prompts (seeded), so a
suffix tree never holds the answer of a prompt it is asked again; on one server each suffix profile also
gets its own proposer (its `suffix_decoding_max_cached_requests` is lowered by a few, which only makes
it a different proposer key), so one profile's outputs never feed another's tree. Metrics per run are
the bench runner's (`bench.metrics.summarize`); `sweep_select` turns them into speedups, medians,
spreads and the recommendation.
Pruning (opt-in, `prune_margin` > 0, one running server only): after the first repeat of a (segment,
concurrency), profiles more than `prune_margin` below the best speedup there are not run again there
(`sweep_select.prune`): the later repeats measure only the contenders, which cuts a sweep's time where
the profiles differ most. It is off by default because one repeat cannot tell a slow profile from a
noisy run: on the 2-core CPU a profile's two repeats differed by up to 70% of its median (a relative
half-range of 35%),
and in two re-run checks of the issue's grid with the pooled band (`benchmarks/sweep_repro.py`, margin
0.25) the one recommendation of each that did not reproduce was a profile the first run had cut after
one repeat, while every (segment, concurrency) left whole reproduced (docs/benchmarks/sweep_cpu.json). Unpruned, that grid is
108 runs of ~10-14 s on that machine (18-25 minutes), and an unpruned pair on a quiet machine reproduced
6 of 6 (docs/benchmarks/sweep_cpu_unpruned.json).
With --server-cmd every server runs all its repeats before the next starts, so there is nothing to cut.
What it does not do: print or write files (`sweep_cli.py`), or draw (`sweep_report.py`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from tqdm import tqdm

from specserve.bench import client as bclient
from specserve.bench import datasets, metrics, prom
from specserve.bench.sweep_select import BASELINE, prune, recommend, recommended_profiles, summarize_runs

SCHEMA = "specserve.sweep/1"
METHOD_DEFAULTS = {"ngram": {"prompt_lookup_min": 2, "prompt_lookup_max": 4}}  # as the demo's ngram profile


class SweepError(RuntimeError):
    """The sweep cannot go on (a server refused a profile, did not start, or requests failed)."""


@dataclass
class SweepConfig:
    """What to sweep and against what (see the module docstring; `specserve sweep --help`)."""

    base_url: str | None = None
    admin_token: str | None = None
    server_cmd: str | None = None
    server_timeout_s: float = 600.0
    model: str | None = None
    methods: list[str] = field(default_factory=lambda: ["ngram", "suffix"])
    ks: list[int] = field(default_factory=lambda: [2, 4, 6, 8])
    adaptive: bool = True
    method_options: dict[str, dict] = field(default_factory=dict)
    concurrency: list[int] = field(default_factory=lambda: [1, 4])
    segments: list[str] = field(default_factory=lambda: ["code", "edit", "chat"])
    num_prompts: int = 4
    min_waves: int = 1  # each run sends at least min_waves x concurrency requests (`requests_per_run`)
    max_tokens: int = 64
    max_prompt_chars: int = 1500
    repeats: int = 2
    seed: int = 0
    warmup: int = 1
    min_noise: float = 0.02
    prune_margin: float = 0.0  # 0: off (see the module docstring); > 0 with base_url only
    interleave: bool = True  # one running server, concurrency 1: the profiles take turns request by request
    timeout_s: float = 600.0
    progress: bool = True


def requests_per_run(cfg: SweepConfig, concurrency: int) -> int:
    """Requests of one run at `concurrency`: `num_prompts`, raised to `min_waves` x concurrency. A
    closed-loop run of fewer requests than its concurrency never reaches it, and one of a single wave
    is a burst whose TPOT rests on as many requests as there are streams (at c = 4 with 4 prompts, the
    code segment's best suffix k moved between re-runs: docs/sweep-reproduction.md)."""
    return max(cfg.num_prompts, cfg.min_waves * concurrency)


def _total_requests(cfg: SweepConfig, num_profiles: int) -> int:
    return cfg.repeats * len(cfg.segments) * num_profiles * sum(requests_per_run(cfg, c) for c in cfg.concurrency)


def plan_profiles(cfg: SweepConfig) -> dict[str, dict | None]:
    """name -> speculative config dict: baseline, `<method>_k<k>` for every method and k, and
    `<method>_adaptive` (k = the largest k) when `cfg.adaptive`."""
    from specserve.config import SpeculativeConfig

    out: dict[str, dict | None] = {BASELINE: None}
    for m in cfg.methods:
        extra = {**METHOD_DEFAULTS.get(m, {}), **cfg.method_options.get(m, {})}
        for k in cfg.ks:
            out[f"{m}_k{k}"] = {"method": m, "num_speculative_tokens": k, **extra}
        if cfg.adaptive:
            out[f"{m}_adaptive"] = {"method": m, "num_speculative_tokens": max(cfg.ks), **extra,
                                    "num_speculative_tokens_schedule": "adaptive"}
    for name, c in out.items():  # a bad method or option fails here, before any server work
        SpeculativeConfig.from_dict(c)
    return out


def served_configs(profiles: dict[str, dict | None], tag: str) -> dict[str, dict | None]:
    """The configs as added to one shared server: each suffix profile its own proposer (see the module
    docstring). The offsets depend on the sweep's tag, so a second sweep on the same server gets new ones."""
    out = {}
    base = int(hashlib.sha256(tag.encode()).hexdigest(), 16) % 4000
    for i, (name, c) in enumerate(profiles.items()):
        if c and c["method"] == "suffix":
            c = {**c, "suffix_decoding_max_cached_requests":
                 max(1, c.get("suffix_decoding_max_cached_requests", 10000) - 1 - base - i)}
        out[name] = c
    return out


def samples_for(cfg: SweepConfig, segment: str, repeat: int, concurrency: int) -> list:
    """The requests of one (segment, repeat, concurrency): greedy, seeded, fresh per repeat and concurrency."""
    seed = cfg.seed + 1000 * repeat + concurrency
    samples, _ = datasets.load_samples(segment, requests_per_run(cfg, concurrency), seed, cfg.max_tokens,
                                       cfg.max_prompt_chars)
    for s in samples:
        s.temperature = 0.0
        s.max_tokens = min(s.max_tokens, cfg.max_tokens)
    return samples


def rotated(names: list[str], shift: int) -> list[str]:
    shift %= len(names)
    return names[shift:] + names[:shift]


# ---- one running specserve server -------------------------------------------------------------------------


async def add_profiles(cl: httpx.AsyncClient, root: str, token: str | None, configs: dict[str, dict | None]) -> None:
    """POST /admin/profiles for each (speculative) config; checks overrides are allowed.

    Raises:
        SweepError: the admin API is off, the token is wrong, overrides are off, or a profile is refused.
    """
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    r = await cl.get(root + "/admin/profiles", headers=headers)
    if r.status_code != 200:
        raise SweepError(f"GET {root}/admin/profiles answered {r.status_code}: {_err(r)} "
                         "(start the server with --admin-token and pass the same --admin-token here)")
    state = r.json()
    if not state.get("allow_profile_override"):
        raise SweepError(f"the server at {root} does not allow choosing a profile per request; "
                         "start it with --allow-profile-override")
    for name, c in configs.items():
        if name in state["profiles"]:
            continue
        r = await cl.post(root + "/admin/profiles", headers=headers, json={"name": name, "config": c, "weight": 0},
                          timeout=1800)
        if r.status_code != 201:
            raise SweepError(f"the server refused profile {name}: HTTP {r.status_code}: {_err(r)}")


def _err(r: httpx.Response) -> str:
    try:
        return r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return r.text[:300]


def _run_metrics(records: list, wall: float, prime_failed: int) -> dict:
    """`metrics.summarize` of a run's records (wall: its seconds), with the failed primes, the first error
    and each request's TPOT (`per_request`: sample_id, tpot_ms, output_tokens, in the order sent), so
    that a speedup paired per prompt can be computed from a recorded sweep."""
    m = metrics.summarize(records, wall)
    m["prime_failed"] = prime_failed
    m["per_request"] = [{"sample_id": r.sample_id, "tpot_ms": metrics.tpot_ms(r), "output_tokens": r.output_tokens}
                        for r in records]
    errors = [r.error for r in records if r.error]
    if errors:
        m["first_error"] = errors[0]
    return m


async def _run_one(cl, cfg: SweepConfig, base_url: str, model: str, samples: list, profile: str | None,
                   concurrency: int, bar) -> dict:
    murl = prom.metrics_url(base_url)
    prime_failed = await bclient.prime_prompts(cl, base_url, samples, model, concurrency=concurrency, profile=profile)
    before = await prom.scrape(cl, murl)
    records, wall = await bclient.run_load(cl, base_url, samples, model, concurrency=concurrency, profile=profile,
                                           on_done=(lambda _r: bar.update(1)) if bar else None)
    after = await prom.scrape(cl, murl)
    m = _run_metrics(records, wall, prime_failed)
    if "acceptance_source" not in m:  # not a specserve server: acceptance from /metrics deltas, if any
        m.update(prom.acceptance_from_delta(prom.delta(before, after), profile))
    return m


async def _run_interleaved(cl, base_url: str, model: str, samples: list, profiles: list[str], concurrency: int,
                           bar) -> dict[str, dict]:
    """The runs of several profiles of one running specserve server over the same `samples`, taking
    turns: the samples are cut into rounds of `concurrency` requests, and every round is run by each
    profile in turn (the order rotated by one per round), each after priming that round's prompts. The
    sweep uses it at concurrency 1 only (see the module docstring: a round of c > 1 requests is a burst
    that drains, not a closed loop).
    A profile's metrics are those of its rounds together (records concatenated, walls added). Machine
    noise that drifts over a sweep (on a shared 2-core host the same baseline run read a TPOT of 51 ms
    in one sweep and 30 ms in the next) then hits every profile of a (segment, concurrency) alike, at
    the scale of one round instead of one whole run per profile. Acceptance comes from the server's
    per-request usage (a specserve server). Returns profile -> metrics."""
    acc = {n: ([], 0.0, 0) for n in profiles}
    rounds = [samples[j:j + concurrency] for j in range(0, len(samples), concurrency)]
    for r, chunk in enumerate(rounds):
        for n in rotated(profiles, r):
            failed = await bclient.prime_prompts(cl, base_url, chunk, model, concurrency=concurrency, profile=n)
            records, wall = await bclient.run_load(cl, base_url, chunk, model, concurrency=concurrency, profile=n,
                                                   on_done=lambda _r: bar.update(1))
            recs, w, pf = acc[n]
            acc[n] = (recs + records, w + wall, pf + failed)
    return {n: _run_metrics(*acc[n]) for n in profiles}


async def sweep_server(cfg: SweepConfig, profiles: dict[str, dict | None], tag: str,
                       pruned: dict | None = None) -> list[dict]:
    """Run the sweep against one running specserve server (profiles added through the admin API); the
    profiles pruned after the first repeat go into `pruned` ({(segment, concurrency): {profile: speedup}})."""
    base_url = cfg.base_url.rstrip("/")
    root = base_url[:-3] if base_url.endswith("/v1") else base_url
    names = [f"sweep{tag}.{n}" if n != BASELINE else BASELINE for n in profiles]
    served = dict(zip(names, served_configs(profiles, tag).values()))
    limits = httpx.Limits(max_connections=max(cfg.concurrency) + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout_s, connect=30.0), limits=limits) as cl:
        from specserve.bench.runner import discover_model

        model = cfg.model or await discover_model(cl, base_url)
        await add_profiles(cl, root, cfg.admin_token, {n: c for n, c in served.items() if n != BASELINE})
        return await _sweep_loop(cl, cfg, base_url, model, dict(zip(names, profiles)), pruned=pruned)


async def _sweep_loop(cl, cfg: SweepConfig, base_url: str, model: str, name_map: dict[str, str],
                      only: str | None = None, bar=None, pruned: dict | None = None) -> list[dict]:
    """Every repeat x segment x concurrency x profile of `name_map` (served name -> sweep name); with
    `only`, one profile (external servers, where the server is the profile). With `pruned` (a dict to
    fill) and a prune margin, the first repeat's losers of each (segment, concurrency) are not run again."""
    served_names = list(name_map) if only is None else [only]
    margin = cfg.prune_margin
    kept: dict[tuple[str, int], list[str]] = {}
    own_bar = bar is None
    if own_bar:
        total = _total_requests(cfg, len(served_names))
        bar = tqdm(total=total, desc="sweep", unit="req", file=sys.stderr, disable=not cfg.progress)
    runs = []
    try:
        if cfg.warmup > 0:
            warm, _ = datasets.load_samples(",".join(cfg.segments), cfg.warmup, cfg.seed + 1_000_003,
                                            min(cfg.max_tokens, 16), cfg.max_prompt_chars)
            for n in served_names:
                bar.set_description(f"warm-up {name_map[n]}")
                await bclient.run_load(cl, base_url, warm, model, concurrency=1, profile=None if only else n)
        i = 0
        for rep in range(cfg.repeats):
            for seg in cfg.segments:
                for conc in cfg.concurrency:
                    samples = samples_for(cfg, seg, rep, conc)
                    group = kept.get((seg, conc), served_names)
                    turns = cfg.interleave and only is None and conc == 1
                    if turns:
                        bar.set_description(f"#{rep} {seg} c={conc}")
                        order = rotated(group, i)  # the first round's; each next round rotates it by one
                        ms = await _run_interleaved(cl, base_url, model, samples, order, conc, bar)
                        runs += [{"repeat": rep, "segment": seg, "concurrency": conc, "profile": name_map[n],
                                  "metrics": ms[n]} for n in order]
                    for n in rotated(group, i) if not turns else ():
                        bar.set_description(f"#{rep} {seg} c={conc} {name_map[n]}")
                        m = await _run_one(cl, cfg, base_url, model, samples, None if only else n, conc, bar)
                        runs.append({"repeat": rep, "segment": seg, "concurrency": conc, "profile": name_map[n],
                                     "metrics": m})
                    i += 1
                    if rep == 0 and margin > 0 and cfg.repeats > 1 and pruned is not None and only is None:
                        first = [r for r in runs if (r["repeat"], r["segment"], r["concurrency"]) == (0, seg, conc)]
                        cut = prune(first, margin).get((seg, conc), {})
                        if cut:
                            pruned[(seg, conc)] = cut
                            kept[(seg, conc)] = [n for n in served_names if name_map[n] not in cut]
                            bar.total -= len(cut) * (cfg.repeats - 1) * requests_per_run(cfg, conc)
                            bar.refresh()
    finally:
        if own_bar:
            bar.close()
    return runs


# ---- external servers (one per profile, from a command template) ----------------------------------------


def format_command(template: str, port: int, config: dict | None) -> str:
    """Fill {port}, {speculative_config} and {speculative_config_arg} (empty for the baseline)."""
    text = json.dumps(config) if config else ""
    arg = f"--speculative-config {shlex.quote(text)}" if config else ""
    return template.format(port=port, speculative_config=text, speculative_config_arg=arg)


async def sweep_external(cfg: SweepConfig, profiles: dict[str, dict | None], log_dir: Path) -> list[dict]:
    """Run the sweep with one external server per profile (`cfg.server_cmd`)."""
    from specserve.bench.runner import discover_model
    from specserve.bench.server_process import ServerProcess, ServerStartError

    total = _total_requests(cfg, len(profiles))
    bar = tqdm(total=total, desc="sweep", unit="req", file=sys.stderr, disable=not cfg.progress)
    runs = []
    try:
        for name, c in profiles.items():
            srv = ServerProcess.command(lambda port, c=c: ["bash", "-c", format_command(cfg.server_cmd, port, c)],
                                        log_dir / f"server-{name}.log")
            bar.set_description(f"starting {name}")
            try:
                srv.start(cfg.server_timeout_s, "--server-timeout")
            except ServerStartError as e:
                raise SweepError(f"the server of profile {name} did not start: {e}") from None
            try:
                base_url = srv.base_url + "/v1"
                async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout_s, connect=30.0)) as cl:
                    model = cfg.model or await discover_model(cl, base_url)
                    runs += await _sweep_loop(cl, cfg, base_url, model, {name: name}, only=name, bar=bar)
            finally:
                srv.stop()
    finally:
        bar.close()
    return runs


# ---- the whole sweep --------------------------------------------------------------------------------------


def run_sweep(cfg: SweepConfig, log_dir: Path) -> dict:
    """Run the sweep; returns the result dict (schema specserve.sweep/1): config, profiles, runs, rows,
    recommendations, recommended_profiles, wall_s.

    Raises:
        SweepError, httpx.HTTPError, ValueError (bad segment or config), wheels.DatasetUnavailable.
    """
    if not cfg.base_url and not cfg.server_cmd:
        raise ValueError("give --base-url (one running specserve server) or --server-cmd (external servers)")
    if cfg.base_url and cfg.server_cmd:
        raise ValueError("give --base-url or --server-cmd, not both")
    for flag, low in (("--k", min(cfg.ks, default=0)), ("--concurrency", min(cfg.concurrency, default=0)),
                      ("--repeats", cfg.repeats), ("--num-prompts", cfg.num_prompts), ("--min-waves", cfg.min_waves)):
        if low < 1:
            raise ValueError(f"{flag} must be >= 1, got {low}")
    if not 0 <= cfg.prune_margin < 1:
        raise ValueError(f"--prune-margin must be in [0, 1), got {cfg.prune_margin}")
    if not 0 <= cfg.min_noise < 1:
        raise ValueError(f"--min-noise must be in [0, 1) (a fraction of the best's speedup), got {cfg.min_noise}")
    if cfg.server_cmd and cfg.prune_margin:
        raise ValueError("--prune-margin works with --base-url only: with --server-cmd each server runs all its "
                         "repeats before the next one starts, so no profile can be dropped after the first repeat")
    datasets.parse_dataset_arg(",".join(cfg.segments))
    profiles = plan_profiles(cfg)
    t0 = time.perf_counter()
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    tag = hashlib.sha256(f"{started}{os.getpid()}".encode()).hexdigest()[:6]
    pruned: dict[tuple[str, int], dict[str, float]] = {}
    if cfg.base_url:
        runs = asyncio.run(sweep_server(cfg, profiles, tag, pruned))
    else:
        runs = asyncio.run(sweep_external(cfg, profiles, log_dir))
    rows = summarize_runs(runs)
    for r in rows:
        r["pruned"] = r["profile"] in pruned.get((r["segment"], r["concurrency"]), {})
    recs = recommend(rows, profiles, cfg.min_noise)
    cfg_d = asdict(cfg)
    cfg_d.pop("admin_token", None)
    cfg_d["interleave"] = cfg.interleave and not cfg.server_cmd  # external servers run one profile at a time
    return {"schema": SCHEMA, "started": started, "config": cfg_d, "profiles": profiles, "runs": runs, "rows": rows,
            "recommendations": recs, "recommended_profiles": recommended_profiles(recs, profiles),
            "pruned": [{"segment": seg, "concurrency": conc, "profile": p, "first_repeat_speedup": sp}
                       for (seg, conc), cut in pruned.items() for p, sp in cut.items()],
            "errors": sum(int(r["metrics"].get("num_errors") or 0) for r in runs),
            "wall_s": round(time.perf_counter() - t0, 1)}
