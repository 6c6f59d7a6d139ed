"""The sweep's interleaved runs on one server (`sweep._run_interleaved`) without a server: the requests
are cut into rounds of `concurrency`, every round is primed and run by each profile in turn (the order
rotated by one per round), and a profile's metrics are those of its rounds together."""

import asyncio
from types import SimpleNamespace

import pytest

from specserve.bench import sweep


class Bar:
    def __init__(self):
        self.n = 0

    def update(self, k):
        self.n += k

    def set_description(self, _):
        pass


def test_profiles_take_turns_per_round_and_their_rounds_are_summed(monkeypatch):
    calls = []

    async def prime(cl, base_url, samples, model, *, concurrency, profile):
        calls.append(("prime", profile, tuple(samples)))
        return 1 if profile == "b" else 0

    async def run_load(cl, base_url, samples, model, *, concurrency, profile, on_done=None):
        calls.append(("run", profile, tuple(samples)))
        for s in samples:
            on_done(s)
        return [SimpleNamespace(id=f"{profile}:{s}", sample_id=f"s{s}", output_tokens=9, error=None)
                for s in samples], 0.5 * len(samples)

    monkeypatch.setattr(sweep.bclient, "prime_prompts", prime)
    monkeypatch.setattr(sweep.bclient, "run_load", run_load)
    monkeypatch.setattr(sweep.metrics, "summarize", lambda records, wall: {"records": [r.id for r in records], "wall": wall})
    monkeypatch.setattr(sweep.metrics, "tpot_ms", lambda r: 10.0 if r.id.startswith("base") else 5.0)
    bar = Bar()
    out = asyncio.run(sweep._run_interleaved(None, "u", "m", [1, 2, 3, 4, 5], ["base", "a", "b"], 2, bar))
    runs = [(p, s) for kind, p, s in calls if kind == "run"]
    assert runs == [("base", (1, 2)), ("a", (1, 2)), ("b", (1, 2)),
                    ("a", (3, 4)), ("b", (3, 4)), ("base", (3, 4)),
                    ("b", (5,)), ("base", (5,)), ("a", (5,))]
    # each run right after the priming of the same requests by the same profile
    assert all(calls[2 * i] == ("prime",) + run for i, run in enumerate(runs))
    assert out["a"]["records"] == ["a:1", "a:2", "a:3", "a:4", "a:5"] and out["a"]["wall"] == 2.5
    assert out["b"]["prime_failed"] == 3 and out["base"]["prime_failed"] == 0
    # each request's TPOT, by sample, in the order sent: a speedup paired per prompt can be computed later
    assert out["a"]["per_request"] == [{"sample_id": f"s{i}", "tpot_ms": 5.0, "output_tokens": 9} for i in range(1, 6)]
    assert [r["tpot_ms"] for r in out["base"]["per_request"]] == [10.0] * 5
    assert bar.n == 15


def test_requests_per_run_is_at_least_min_waves_per_stream(monkeypatch, tmp_path):
    """A run sends --num-prompts requests, raised to --min-waves x its concurrency: at concurrency 8 with 4
    prompts it would otherwise never reach 8 streams. samples_for draws that many, and the progress total
    counts them."""
    cfg = sweep.SweepConfig(num_prompts=4, concurrency=[1, 4, 8], segments=["code"], repeats=2)
    assert [sweep.requests_per_run(cfg, c) for c in (1, 4, 8)] == [4, 4, 8]
    cfg.min_waves = 2
    assert [sweep.requests_per_run(cfg, c) for c in (1, 4, 8)] == [4, 8, 16]
    asked = []
    monkeypatch.setattr(sweep.datasets, "load_samples",
                        lambda seg, n, seed, mt, mc: (asked.append(n) or [SimpleNamespace(max_tokens=99)] * n, []))
    assert len(sweep.samples_for(cfg, "code", 0, 4)) == 8 and asked == [8]
    assert sweep._total_requests(cfg, 3) == 2 * 3 * (4 + 8 + 16)
    cfg.min_waves, cfg.base_url = 0, "http://127.0.0.1:9/v1"
    with pytest.raises(ValueError, match="^--min-waves must be >= 1, got 0$"):  # names the flag at fault
        sweep.run_sweep(cfg, tmp_path)
    cfg.min_waves, cfg.ks = 1, [2, 0]
    with pytest.raises(ValueError, match="^--k must be >= 1, got 0$"):
        sweep.run_sweep(cfg, tmp_path)
