"""specserve vs vLLM on the same CPU cores: the same `specserve bench` command against both servers.

Installs and starts nothing: give it the base URLs of a running specserve server and a running vLLM
server (docs/benchmarks/README.md shows how to start both on one converted model folder). Each repeat
runs the bench against both servers, alternating which goes first, records the load average and the
CPU seconds each server's process tree used during each run (found from the URL's port in /proc, or
given with --*-pid), how many prompt tokens each server took from its prefix cache (their /metrics, which
share vLLM's counter names; the bench sends the same prompts at c=1, at c=4 and in every repeat), and whether
the greedy texts are identical. `--section` names a run other than the method's default one (e.g. a vLLM
server started with --no-enable-prefix-caching).

Each measured run is one (repeat, concurrency level) against one server: the bench is called once per
concurrency level. The same prompts come back at every concurrency level and in every repeat (so both
servers' prefix caches see repeats, as they would in production), but a suffix proposer must not: its
global tree keeps the outputs of finished requests, and with greedy decoding a tree that has seen a
prompt's answer drafts the whole answer again (acceptance length 7.4 of a possible 9 on the second
sight, against 1.3-4.8 on the first, in the run before this fix). So for --method ngram every measured
run of specserve's suffix profiles (`suffix`, `suffix_adaptive`) goes to a new profile
(`suffix.r<repeat>c<concurrency>`, the server's profile's config with its own `suffix_decoding_max_cached_requests`, which only makes it a
proposer of its own) added through the admin API (`--admin-token`, or SPECSERVE_ADMIN_TOKEN): its tree
starts empty and sees only that run's warm-up outputs (prompts that are not measured) and the outputs
of that run's earlier requests. ngram keeps no state across requests. Results go into one JSON file that
holds one section per `--method` (run it once with the vLLM baseline server and --method baseline,
once with vLLM's ngram server and --method ngram); its `summary` is recomputed from every section.

Ratios are specserve / vLLM, medians over the repeats of each repeat's ratio: a TPOT or TTFT ratio
below 1 and a tokens/s ratio above 1 mean specserve is ahead.

    python benchmarks/cpu_vs_vllm.py --specserve http://127.0.0.1:8001/v1 --vllm http://127.0.0.1:8002/v1 \\
        --method baseline --repeats 2 --out docs/benchmarks/cpu_vs_vllm.json
    SPECSERVE_ADMIN_TOKEN=... python benchmarks/cpu_vs_vllm.py --specserve http://127.0.0.1:8001/v1 \\
        --vllm http://127.0.0.1:8003/v1 --method ngram --repeats 2 --out docs/benchmarks/cpu_vs_vllm.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlparse

DIRECTION = ("ratios are specserve / vLLM (median over repeats of the per-repeat ratio, both servers measured "
             "in the same repeat): *_tpot_ratio and *_ttft_ratio < 1 and *_tps_ratio > 1 mean specserve is ahead")
# specserve profiles measured against vLLM's server of each --method (the first one names the summary keys)
PROFILES = {"baseline": ["baseline"], "ngram": ["ngram", "suffix", "ngram_adaptive", "suffix_adaptive"]}
# profiles whose suffix trees keep outputs across requests: each measured run gets a fresh copy
SUFFIX_PROFILES = ("suffix", "suffix_adaptive")


def _listening_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # 0A = LISTEN
                inodes.add(f[9])
    return inodes


def pid_for_port(port: int) -> int | None:
    """The pid of the process listening on TCP `port` (Linux /proc; None when not found)."""
    targets = {f"socket:[{i}]" for i in _listening_inodes(port)}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            for fd in (d / "fd").iterdir():
                if os.readlink(fd) in targets:
                    return int(d.name)
        except OSError:
            continue
    return None


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds user + system) of one process, or None if it is gone."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(f[1]), (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(pid: int | None) -> float | None:
    """CPU seconds used so far by `pid` and all its descendants (vLLM runs its engine in a child)."""
    if pid is None:
        return None
    stats = {int(d.name): s for d in Path("/proc").iterdir() if d.name.isdigit() and (s := _stat(int(d.name)))}
    tree, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        for p, (ppid, _) in stats.items():
            if ppid == parent and p not in tree:
                tree.add(p)
                frontier.append(p)
    return sum(stats[p][1] for p in tree if p in stats)


def prefix_cache_tokens(url: str, server: str) -> tuple[float, float] | None:
    """(queried, hit) prompt tokens of a server's prefix cache so far, from its /metrics (None if absent);
    `server` is "specserve" or "vllm" (the metric namespace)."""
    from specserve.bench.prom import prefix_cache_tokens as scrape

    return scrape(url, server)


def fresh_suffix_profile(url: str, token: str | None, name: str, base_profile: str = "suffix") -> str:
    """Add profile `name` to the specserve server at `url`: the config of its `base_profile` profile with a
    `suffix_decoding_max_cached_requests` no other suffix profile there has, so that the engine gives it a
    proposer of its own whose global tree is empty (`spec_decode.proposer_key`). Returns `name`.

    Raises:
        SystemExit: the admin API refused (no or a wrong token, overrides off) or `base_profile` is not a
            suffix profile there.
    """
    import httpx

    root = url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    r = httpx.get(root + "/admin/profiles", headers=headers, timeout=30)
    if r.status_code != 200:
        raise SystemExit(f"GET {root}/admin/profiles answered {r.status_code}: start the specserve server with "
                         "an admin token (SPECSERVE_ADMIN_TOKEN) and pass the same one here (--admin-token)")
    profiles = r.json()["profiles"]
    base = (profiles.get(base_profile) or {}).get("config")
    if not base or base.get("method") != "suffix":
        raise SystemExit(f"the server at {root} has no suffix profile {base_profile!r} "
                         "(serve benchmarks/cpu_vs_vllm_profiles.json)")
    used = {(p.get("effective_config") or {}).get("suffix_decoding_max_cached_requests")
            for p in profiles.values() if p.get("method") == "suffix"}
    cached = (profiles[base_profile].get("effective_config") or {}).get("suffix_decoding_max_cached_requests", 10000)
    while cached in used:  # one fewer cached request (of 10k) changes nothing in a 100-request run
        cached -= 1
    r = httpx.post(root + "/admin/profiles", headers=headers, timeout=1800,
                   json={"name": name, "config": {**base, "suffix_decoding_max_cached_requests": cached}, "weight": 0})
    if r.status_code != 201:
        raise SystemExit(f"the server refused profile {name}: HTTP {r.status_code}: {r.text[:300]}")
    return name


def run_bench(url: str, profiles: list[str] | None, concurrency: str, args,
              out_dir: Path) -> tuple[dict, list[dict], list[str]]:
    """One `specserve bench` run against `url`; returns (summary, request rows, the command)."""
    cmd = [sys.executable, "-m", "specserve.cli", "bench", "--base-url", url, "--dataset", args.dataset,
           "--num-prompts", str(args.num_prompts), "--max-tokens", str(args.max_tokens),
           "--concurrency", concurrency, "--warmup", str(args.warmup), "--seed", str(args.seed),
           "--output-dir", str(out_dir), "--no-html", "--no-progress"]
    if profiles:
        cmd += ["--profile", *profiles]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"bench against {url} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    summary = json.loads((out_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (out_dir / "requests.jsonl").read_text().splitlines() if line.strip()]
    return summary, rows, cmd


def figures(summary: dict) -> dict:
    """{profile: {load: {"overall": {...}, "segments": {seg: {...}}}}} with TPOT / TTFT / tokens/s."""
    keys = ("tpot_ms_mean", "ttft_ms_mean", "output_tps", "mean_acceptance_length", "num_errors")
    out: dict = {}
    for g in summary["groups"]:
        pick = lambda m: {k: m.get(k) for k in keys}  # noqa: E731
        out.setdefault(g["profile"], {})[g["load"]] = {
            "overall": pick(g["overall"]), "segments": {s: pick(m) for s, m in g["segments"].items()}}
    return out


def texts(rows: list[dict]) -> dict:
    return {(r["profile"], r["load"], r["sample_id"]): r.get("text") for r in rows}


def _add(a, b):
    return a + b if a is not None and b is not None else None


def one_repeat(args, rep: int, scratch: Path) -> dict:
    """One repeat: for each concurrency level, the bench against both servers (order alternating by repeat).

    Per server, the figures of its runs are merged ({profile: {load: ...}}), and wall time, CPU seconds and
    prefix-cache counts summed over them; `runs` keeps each run's own."""
    servers = {"specserve": (args.specserve, PROFILES[args.method]), "vllm": (args.vllm, None)}
    order = ["specserve", "vllm"] if rep % 2 == 0 else ["vllm", "specserve"]
    pids = {"specserve": args.specserve_pid or pid_for_port(urlparse(args.specserve).port),
            "vllm": args.vllm_pid or pid_for_port(urlparse(args.vllm).port)}
    result: dict = {"repeat": rep, "order": order, "servers": {}}
    all_texts: dict = {"specserve": {}, "vllm": {}}
    for conc in args.concurrency.split(","):
        for name in order:
            url, profiles = servers[name]
            served = {p: p for p in profiles or []}
            for p in SUFFIX_PROFILES:  # a fresh suffix tree for every measured run
                if name == "specserve" and p in served:
                    served[p] = fresh_suffix_profile(url, args.admin_token, f"{p}.r{rep}c{conc}", p)
            cpu0 = {n: tree_cpu_seconds(p) for n, p in pids.items()}
            load0, t0 = os.getloadavg(), time.monotonic()
            pc0 = prefix_cache_tokens(url, name)
            summary, rows, cmd = run_bench(url, list(served.values()) or None, conc, args,
                                           scratch / f"{args.method}-{rep}-c{conc}-{name}")
            wall = time.monotonic() - t0
            pc1 = prefix_cache_tokens(url, name)
            cpu1 = {n: tree_cpu_seconds(p) for n, p in pids.items()}
            cpu = {n: (cpu1[n] - cpu0[n]) if cpu0[n] is not None and cpu1[n] is not None else None for n in pids}
            back = {v: k for k, v in served.items()}  # served profile name -> the name the summary uses
            figs = {back.get(p, p): f for p, f in figures(summary).items()}
            run = {"concurrency": conc, "command": " ".join(cmd[1:]), "wall_s": wall, "loadavg_before": load0,
                   "loadavg_after": os.getloadavg(), "cpu_seconds": cpu,
                   "server_cores": cpu[name] / wall if cpu[name] is not None else None,
                   "served_profiles": served or None}
            if pc0 is not None and pc1 is not None:  # prompt tokens taken from the server's prefix cache in this run
                run["prefix_cache"] = {"queried_tokens": pc1[0] - pc0[0], "hit_tokens": pc1[1] - pc0[1]}
            srv = result["servers"].setdefault(name, {"runs": [], "figures": {}})
            srv["runs"].append(run)
            for p, by_load in figs.items():
                srv["figures"].setdefault(p, {}).update(by_load)
            all_texts[name].update({(back.get(p, p), load, sid): t for (p, load, sid), t in texts(rows).items()})
    for name, srv in result["servers"].items():
        runs = srv["runs"]
        srv["wall_s"] = sum(r["wall_s"] for r in runs)
        srv["loadavg_before"], srv["loadavg_after"] = runs[0]["loadavg_before"], runs[-1]["loadavg_after"]
        srv["cpu_seconds"] = {n: functools.reduce(_add, (r["cpu_seconds"][n] for r in runs)) for n in pids}
        own = srv["cpu_seconds"][name]
        srv["server_cores"] = own / srv["wall_s"] if own is not None else None
        if all("prefix_cache" in r for r in runs):
            srv["prefix_cache"] = {k: sum(r["prefix_cache"][k] for r in runs) for k in ("queried_tokens", "hit_tokens")}
    # greedy texts: every specserve profile against vLLM, request by request
    v = {(load, sid): t for (_, load, sid), t in all_texts["vllm"].items()}
    same = [t == v.get((load, sid)) for (_, load, sid), t in all_texts["specserve"].items()]
    result["greedy_identical"] = [sum(same), len(same)]
    return result


def ratio(a, b):
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def summarize(sections: dict) -> dict:
    """The summary over every method section: medians of per-repeat ratios, and the conditions."""
    out: dict = {"direction": DIRECTION}
    for section, sec in sections.items():
        method = sec.get("method", section)
        vprof = "default"
        for profile in PROFILES[method]:
            name = f"{section}" if profile == PROFILES[method][0] else f"{profile}_vs_vllm_{section}"
            for load in ("c=1", "c=4"):
                per: dict[str, list] = {}
                for rep in sec["repeats"]:
                    s = rep["servers"]["specserve"]["figures"].get(profile, {}).get(load)
                    w = rep["servers"]["vllm"]["figures"].get(vprof, {}).get(load)
                    if not s or not w:
                        continue
                    for key, metric in (("tpot", "tpot_ms_mean"), ("tps", "output_tps"), ("ttft", "ttft_ms_mean")):
                        per.setdefault(f"{key}_ratio", []).append(ratio(s["overall"][metric], w["overall"][metric]))
                        for seg in s["segments"]:
                            per.setdefault(f"{seg}_{key}_ratio", []).append(
                                ratio(s["segments"][seg][metric], w["segments"].get(seg, {}).get(metric)))
                c = load.replace("=", "")
                first = sec["repeats"][0]["servers"] if sec["repeats"] and load == "c=1" else None
                if first and profile == PROFILES[method][0]:
                    # repeat 0 at c=1: both servers see these prompts for the first time (no prefix hit); not
                    # for the later profiles of one bench call (suffix runs after ngram: its prompts are cached)
                    s = first["specserve"]["figures"].get(profile, {}).get(load)
                    w = first["vllm"]["figures"].get(vprof, {}).get(load)
                    if s and w:
                        out[f"{name}_c1_first_sight_ttft_ratio"] = ratio(s["overall"]["ttft_ms_mean"],
                                                                        w["overall"]["ttft_ms_mean"])
                        for seg in s["segments"]:
                            out[f"{name}_c1_first_sight_{seg}_ttft_ratio"] = ratio(
                                s["segments"][seg]["ttft_ms_mean"], w["segments"].get(seg, {}).get("ttft_ms_mean"))
                for k, vals in per.items():
                    vals = [x for x in vals if x is not None]
                    if vals:
                        out[f"{name}_{c}_{k}"] = statistics.median(vals)
        reps = sec["repeats"]
        share = lambda h: round(h["hit_tokens"] / h["queried_tokens"], 3) if h and h["queried_tokens"] else None  # noqa: E731
        out.setdefault("conditions", {})[section] = {
            "repeats": len(reps),
            "loadavg_1min": [round(r["servers"][n]["loadavg_before"][0], 2) for r in reps for n in r["order"]],
            "server_cores": {n: [round(r["servers"][n]["server_cores"], 2) for r in reps
                                 if r["servers"][n]["server_cores"] is not None] for n in ("specserve", "vllm")},
            "cpu_seconds_of_each_server_during_its_runs": {
                n: [round(r["servers"][n]["cpu_seconds"][n], 1) for r in reps
                    if r["servers"][n]["cpu_seconds"][n] is not None] for n in ("specserve", "vllm")},
            "cpu_seconds_of_the_idle_server": {
                n: [round(r["servers"][o]["cpu_seconds"][n], 1) for r in reps
                    if r["servers"][o]["cpu_seconds"][n] is not None]
                for n, o in (("specserve", "vllm"), ("vllm", "specserve"))},
            "greedy_identical": [sum(r["greedy_identical"][0] for r in reps), sum(r["greedy_identical"][1] for r in reps)],
            "prefix_cache_hit_share": {n: [share(r["servers"][n].get("prefix_cache")) for r in reps]
                                       for n in ("specserve", "vllm")},
            "runs": sec.get("runs"),
            "vllm_server": sec.get("vllm_server"), "specserve_server": sec.get("specserve_server")}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--specserve", required=True, help="specserve base URL (ends in /v1), serving the profiles "
                                                       "baseline, ngram and suffix with --allow-profile-override")
    ap.add_argument("--vllm", required=True, help="vLLM base URL (ends in /v1); for --method ngram, its ngram server")
    ap.add_argument("--method", choices=sorted(PROFILES), required=True,
                    help="baseline: vLLM without speculation vs specserve's baseline profile; ngram: vLLM's ngram "
                         "server vs specserve's ngram and suffix profiles")
    ap.add_argument("--section", default=None,
                    help="name of this run's section and of its summary keys (default: the method), e.g. "
                         "baseline_no_prefix_cache for a vLLM server started with --no-enable-prefix-caching")
    ap.add_argument("--specserve-pid", type=int, help="server pid (default: found from the URL's port)")
    ap.add_argument("--vllm-pid", type=int, help="server pid (default: found from the URL's port)")
    ap.add_argument("--admin-token", default=os.environ.get("SPECSERVE_ADMIN_TOKEN"),
                    help="the specserve server's admin token (default: env SPECSERVE_ADMIN_TOKEN); --method ngram "
                         "adds a fresh suffix profile through the admin API for every measured run")
    ap.add_argument("--dataset", default="code,edit,chat")
    ap.add_argument("--num-prompts", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--describe-vllm", default="", help="how the vLLM server was started (recorded)")
    ap.add_argument("--describe-specserve", default="", help="how the specserve server was started (recorded)")
    ap.add_argument("--out", default="docs/benchmarks/cpu_vs_vllm.json")
    args = ap.parse_args()

    out = Path(args.out)
    data = json.loads(out.read_text()) if out.is_file() else {}
    sections = data.get("sections", {})
    with tempfile.TemporaryDirectory(prefix="cpu_vs_vllm-") as tmp:
        reps = []
        for rep in range(args.repeats):
            reps.append(one_repeat(args, rep, Path(tmp)))
            r = reps[-1]
            print(f"{args.method} repeat {rep}: " + ", ".join(
                f"{n} {r['servers'][n]['wall_s']:.0f} s ({r['servers'][n]['server_cores'] or 0:.2f} cores, "
                f"load {r['servers'][n]['loadavg_before'][0]:.2f})" for n in r["order"])
                + f"; greedy identical {r['greedy_identical'][0]}/{r['greedy_identical'][1]}", file=sys.stderr)
    sections[args.section or args.method] = {
        "method": args.method,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
        "bench": {k: getattr(args, k) for k in ("dataset", "num_prompts", "max_tokens", "concurrency", "warmup", "seed")},
        "specserve_profiles": PROFILES[args.method],
        "runs": "one bench call per (repeat, concurrency level, server); the same prompts at every level and in "
                "every repeat (prefix caches see repeats); " + (
                    "specserve's suffix profiles: a new profile with an empty global tree for every measured run"
                    if "suffix" in PROFILES[args.method] else "no cross-request proposer state"),
        "vllm_server": args.describe_vllm,
        "specserve_server": args.describe_specserve, "repeats": reps}
    data = {"benchmark": "cpu_vs_vllm", "direction": DIRECTION, "summary": summarize(sections), "sections": sections}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(json.dumps(data["summary"], indent=1))


if __name__ == "__main__":
    main()
