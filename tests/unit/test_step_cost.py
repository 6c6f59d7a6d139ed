"""The target's step cost model: the fit (fastest timing, non-decreasing curves), interpolation,
measurement on a fake clock and on a tiny model, and the cache."""

import json
import math

import pytest

from specserve.engine import step_cost
from specserve.engine.step_cost import (
    StepCostModel, fit, load_or_measure, measure, measure_model, qlen_grid, seq_grid, token_grid,
)


def cpu_like(t: int) -> float:
    """A CPU-shaped forward: steps up every 3 rows (GEMM blocks), 100 ms per block."""
    return 100.0 * math.ceil(t / 3)


def test_fit_keeps_the_fastest_timing():
    tokens = {t: [cpu_like(t) + 50, cpu_like(t), cpu_like(t) + 7] for t in range(1, 17)}
    tokens[4] = [60.0, 70.0, 65.0]  # a kernel switch: 4 tokens cheaper than 2 or 3, kept as measured
    seqs = {2: [cpu_like(2) + 10, cpu_like(2) + 12], 4: [60.0 + 30, 60.0 + 25]}
    cm = fit(tokens, seqs)
    for t in range(1, 17):
        assert cm.forward_ms(t) == pytest.approx(60.0 if t == 4 else cpu_like(t)), t
    assert cm.seqs == [1, 2, 4] and cm.seq_extra_ms == pytest.approx([0.0, 10.0, 25.0])
    # 4 sequences of 2 tokens each: f(8) + e(4)
    assert cm.forward_ms(8, 4) == pytest.approx(cpu_like(8) + 25.0)
    assert cm.relative(4, 4) == pytest.approx(1.0) and cm.relative(3) == pytest.approx(1.0)
    assert cm.relative(7) == pytest.approx(3.0)
    assert cm.forward_ms(3.5) == pytest.approx((100 + 60) / 2)  # linear between measured points


def test_interpolation_and_extrapolation():
    cm = StepCostModel([1, 2, 16, 32], [10.0, 12.0, 40.0, 72.0], [1, 4], [0.0, 8.0])
    assert cm.forward_ms(0) == 0.0
    assert cm.forward_ms(9) == pytest.approx(12.0 + 7 * 2.0)  # linear between 2 and 16
    assert cm.forward_ms(64) == pytest.approx(72.0 + 32 * 2.0)  # last slope continued
    assert cm.forward_ms(8, 2) == pytest.approx(cm.forward_ms(8) + 8.0 / 3)  # e(B) interpolated
    assert cm.forward_ms(8, 16) == pytest.approx(cm.forward_ms(8) + 8.0 * 5)  # e(B) extrapolated
    flat = StepCostModel([1, 2], [10.0, 9.0])
    assert flat.forward_ms(10) == pytest.approx(9.0)  # beyond the grid never downwards
    cm.observe_overhead(10.0, weight=0.5)  # the first step is the mean so far
    cm.observe_overhead(20.0, weight=0.5)  # then a running mean while 1/n > weight
    assert cm.overhead_ms == pytest.approx(15.0) and cm.step_ms(1) == pytest.approx(25.0)
    cm.observe_overhead(-1.0)
    assert cm.overhead_ms == pytest.approx(15.0)
    with pytest.raises(ValueError):
        StepCostModel([2, 3], [1.0, 2.0])
    with pytest.raises(ValueError):
        StepCostModel([1, 1], [1.0, 2.0])


def test_roundtrip_and_schema():
    cm = StepCostModel([1, 2], [10.0, 11.0], [1, 2], [0.0, 1.0], 3.0, {"model": "m"})
    back = StepCostModel.from_dict(json.loads(json.dumps(cm.to_dict())))
    assert back.tokens == cm.tokens and back.token_ms == cm.token_ms and back.seq_extra_ms == cm.seq_extra_ms
    assert back.overhead_ms == 0.0  # online state is not cached
    with pytest.raises(ValueError):
        StepCostModel.from_dict({"schema": "other"})


def graph_like(per_seq: list[int]) -> float:
    """A CUDA-shaped forward: decode/verify shapes (<= 16 tokens per sequence) replay a graph, about
    1 ms plus a little per sequence and token; one sequence of more tokens runs eagerly at 11 ms."""
    if max(per_seq) > 16:
        return 11.0 + 0.01 * sum(per_seq)
    return 1.0 + 0.02 * len(per_seq) + 0.002 * sum(per_seq)


def test_uniform_batch_grid_models_graph_shapes():
    seqs, qlens = [1, 2, 4, 8, 16], qlen_grid(16)
    cm = measure(graph_like, token_grid(32), seqs, repeats=1, target_s=0.0, qlens=qlens)
    assert cm.batch_seqs == [2, 4, 8, 16] and cm.batch_qlens == [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16]
    # 16 sequences of 2 tokens: the graph's cost, not one 32-token sequence's eager forward plus e(16)
    assert cm.forward_ms(32, 16) == pytest.approx(graph_like([2] * 16))
    assert cm.forward_ms(16 * 5, 16) == pytest.approx(graph_like([5] * 16))
    assert cm.forward_ms(24, 16) == pytest.approx((graph_like([1] * 16) + graph_like([2] * 16)) / 2)  # q = 1.5
    assert cm.forward_ms(12 * 3, 12) == pytest.approx((graph_like([3] * 8) + graph_like([3] * 16)) / 2)  # B between
    assert cm.forward_ms(32 * 2, 32) > cm.forward_ms(16 * 2, 16)  # beyond the grid's B: the last slope
    assert cm.forward_ms(32) == pytest.approx(graph_like([32]))  # one sequence: the token curve
    assert cm.forward_ms(4 * 40, 4) == pytest.approx(cm._interp(cm.tokens, cm.token_ms, 160) + cm.seq_extra_ms[2])
    back = StepCostModel.from_dict(json.loads(json.dumps(cm.to_dict())))
    assert back.batch_ms == cm.batch_ms and back.forward_ms(32, 16) == pytest.approx(cm.forward_ms(32, 16))
    with pytest.raises(ValueError, match="batch_ms"):
        StepCostModel([1], [1.0], batch_seqs=[2, 4], batch_qlens=[1], batch_ms=[[1.0]])
    with pytest.raises(ValueError, match="batch grid"):
        StepCostModel([1], [1.0], batch_seqs=[1, 4], batch_qlens=[1], batch_ms=[[1.0], [2.0]])
    # without the grid (a CPU measurement) the same query is f(32) + e(16)
    cpu = measure(graph_like, token_grid(32), seqs, repeats=1, target_s=0.0)
    assert not cpu.batch_ms and cpu.forward_ms(32, 16) > 11.0
    with pytest.raises(ValueError, match="step_cost/2"):  # a table of the old schema is measured again
        StepCostModel.from_dict({**cpu.to_dict(), "schema": "specserve.step_cost/1"})


def test_grids():
    assert qlen_grid(5) == [1, 2, 3, 4, 5] and qlen_grid(16)[-3:] == [9, 12, 16]
    assert token_grid(4) == [1, 2, 3, 4]
    assert token_grid(32) == list(range(1, 17)) + [24, 32]
    assert token_grid(100)[-1] == 100 and all(b > a for a, b in zip(token_grid(100), token_grid(100)[1:]))
    assert seq_grid(1) == [1] and seq_grid(4) == [1, 2, 4] and seq_grid(6) == [1, 2, 4, 6]


def test_measure_rotates_and_recovers_a_known_cost():
    calls = []
    points = len(token_grid(20)) + 2

    def forward(per_seq):
        calls.append(tuple(per_seq))
        rnd = (len(calls) - 4) // points  # noise hits every point in rounds 0 and 2, none in round 1
        t = sum(per_seq)
        return cpu_like(t) + 5.0 * (len(per_seq) - 1) + (0.0 if rnd == 1 else 60.0 + 10 * (t % 4))

    cm = measure(forward, token_grid(20), seq_grid(4), repeats=3, target_s=0.0)
    assert cm.meta["repeats"] == 3
    assert len(calls) == 3 + 3 * points  # warm-up, then 3 rounds over every point
    assert calls[3] != calls[3 + points]  # the second round starts elsewhere (rotated order)
    for t in range(1, 17):
        assert cm.forward_ms(t) == pytest.approx(cpu_like(t))
    assert cm.forward_ms(4, 4) == pytest.approx(cpu_like(4) + 15.0)


def test_measure_model_on_a_tiny_model_and_cache(tiny_model_dir, tmp_path, monkeypatch):
    from specserve import LLM

    monkeypatch.setenv("SPECSERVE_HOME", str(tmp_path))
    llm = LLM(str(tiny_model_dir), max_model_len=128, max_num_seqs=4)
    target = llm.engine.target
    cm = measure_model(target, max_tokens=20, max_seqs=4, context=32, repeats=2, target_s=0.0)
    assert cm.tokens == token_grid(20) and cm.seqs == [1, 2, 4]
    assert min(cm.token_ms) > 0 and cm.meta["clock"] == "process cpu time x cpu_time_to_wall"
    assert cm.meta["cpu_time_to_wall"] > 0  # its value depends on the machine's load; see the fake-clock test
    assert target.kv.num_free_slots == 4 and target.kv.num_used_tokens == 0  # slots given back
    assert cm.meta["device"] == "cpu" and cm.meta["context"] == 32 and cm.meta["checksum"]

    first = load_or_measure(target, max_tokens=8, max_seqs=2, context=16, repeats=1)
    path = tmp_path / "step_cost"
    files = list(path.glob("*.json"))
    assert len(files) == 1 and first.meta["cache"] == str(files[0])
    files[0].write_text(json.dumps({**json.loads(files[0].read_text()), "token_ms": [1.0] * 8}))
    assert load_or_measure(target, max_tokens=8, max_seqs=2, context=16).token_ms == [1.0] * 8  # read, not measured
    again = load_or_measure(target, max_tokens=8, max_seqs=2, context=16, repeats=1, refresh=True)
    assert again.token_ms != [1.0] * 8
    files[0].write_text("not json")
    assert load_or_measure(target, max_tokens=8, max_seqs=2, context=16, repeats=1).token_ms[0] > 0  # re-measured

    # every slot busy: a clear error, nothing leaked
    slots = [target.kv.allocate() for _ in range(4)]
    with pytest.raises(RuntimeError, match="KV slot"):
        measure_model(target, max_tokens=4, max_seqs=2, repeats=1)
    for s in slots:
        target.kv.free(s)


def test_overhead_fit_separates_base_and_per_draft_token_cost():
    """Steps verifying 0, 8 or 32 drafts with overhead 2 + 0.25 ms per draft (+ noise): the online fit finds
    base and slope; step_ms adds the slope per draft token; nothing of it is cached."""
    import random

    rng = random.Random(1)
    cm = StepCostModel([1, 64], [1.0, 1.5])
    for i in range(600):
        d = (0, 8, 32)[i % 3]
        cm.observe_overhead(2.0 + 0.25 * d + rng.uniform(-0.2, 0.2), d)
    assert cm.overhead_ms == pytest.approx(2.0, abs=0.15)
    assert cm.draft_overhead_ms == pytest.approx(0.25, abs=0.02)
    assert cm.step_ms(33, 1, 32) == pytest.approx(cm.forward_ms(33) + cm.overhead_ms + 32 * cm.draft_overhead_ms)
    assert "draft_overhead_ms" not in cm.to_dict() and "_moments" not in cm.to_dict()
    assert StepCostModel.from_dict(cm.to_dict()).draft_overhead_ms == 0.0


def test_overhead_fit_needs_varying_drafts_and_keeps_slope_non_negative():
    cm = StepCostModel([1, 2], [1.0, 1.1])
    for _ in range(50):  # every step the same drafts: no slope can be told apart from the base
        cm.observe_overhead(5.0, 16)
    assert cm.draft_overhead_ms == 0.0 and cm.overhead_ms == pytest.approx(5.0)
    for i in range(200):  # more drafts, less overhead: noise, not a negative cost
        cm.observe_overhead(5.0 - 0.01 * (i % 2) * 16, (i % 2) * 16)
    assert cm.draft_overhead_ms == 0.0


def test_overhead_slope_from_a_few_slow_early_steps_fades():
    """A few early draft steps that were slow for another reason (a kernel compile), then only plain
    steps: the slope must not stay (it would price every draft out forever, so no step would draft
    again to correct it)."""
    cm = StepCostModel([1, 2], [1.0, 1.1])
    for i in range(30):
        cm.observe_overhead(300.0 if i in (3, 7) else 0.3, 8 if i in (3, 7) else 0)
    assert cm.draft_overhead_ms > 1.0
    for _ in range(200):
        cm.observe_overhead(0.3, 0)
    assert cm.draft_overhead_ms < 0.01 and cm.overhead_ms == pytest.approx(0.3, abs=0.05)


def test_a_step_cost_measured_on_a_busy_machine_is_used_but_not_cached(tiny_model_dir, tmp_path, monkeypatch, caplog):
    from specserve import LLM

    monkeypatch.setenv("SPECSERVE_HOME", str(tmp_path))
    llm = LLM(str(tiny_model_dir), max_model_len=128, max_num_seqs=4)
    target = llm.engine.target
    from tests.conftest import MACHINE_BUSY

    monkeypatch.setattr(step_cost, "machine_busy", MACHINE_BUSY)
    monkeypatch.setattr(step_cost.os, "getloadavg", lambda: (99.0, 1.0, 1.0))
    with caplog.at_level("WARNING", logger=step_cost.logger.name):
        cm = load_or_measure(target, max_tokens=8, max_seqs=2, context=16, repeats=1)
    assert cm.token_ms[0] > 0 and "load average 99.0" in cm.meta["busy"]
    assert not list(tmp_path.glob("step_cost/*.json"))
    assert "busy" in caplog.text and "not cached" in caplog.text
    monkeypatch.setattr(step_cost.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    monkeypatch.setattr(step_cost, "UNPARALLEL_WALL_PER_CPU", 99.0)  # the tiny model hardly uses its threads
    again = load_or_measure(target, max_tokens=8, max_seqs=2, context=16, repeats=1)
    assert "busy" not in again.meta and len(list((tmp_path / "step_cost").glob("*.json"))) == 1


def test_threads_that_did_not_run_side_by_side_make_a_cpu_measurement_busy(monkeypatch):
    from tests.conftest import MACHINE_BUSY

    monkeypatch.setattr(step_cost.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    monkeypatch.setattr(step_cost, "parallel_probe", lambda: 0.97)  # a matmul that spreads did not either
    cm = fit({1: [10.0]}, {})
    cm.meta.update(threads=2, cpu_time_to_wall=0.96)
    assert "did not run side by side" in MACHINE_BUSY(cm) and cm.meta["probe_cpu_time_to_wall"] == 0.97
    cm.meta.update(cpu_time_to_wall=0.5)
    assert MACHINE_BUSY(cm) is None
    # a model too small to spread its forwards, on idle cores: the probe ran side by side, not busy
    monkeypatch.setattr(step_cost, "parallel_probe", lambda: 0.52)
    cm.meta.update(cpu_time_to_wall=0.99)
    assert MACHINE_BUSY(cm) is None and cm.meta["probe_cpu_time_to_wall"] == 0.52
    cm.meta.update(threads=1, cpu_time_to_wall=1.0)  # one thread: 1 wall ms per CPU-ms is its normal
    assert MACHINE_BUSY(cm) is None and MACHINE_BUSY() is None


def test_parallel_probe_reads_wall_ms_per_cpu_ms(monkeypatch):
    """The probe's arithmetic on fake clocks: each matmul takes 1 wall ms and 2 CPU-ms (two threads side
    by side) -> 0.5; 1 and 1 (one thread at a time) -> 1.0. Its real reading is at least 1 / threads."""
    import types

    import torch

    class Clocks:
        def __init__(self, cpu_per_wall):
            self.wall = self.cpu = 0.0
            self.cpu_per_wall = cpu_per_wall

        def perf_counter(self):
            return self.wall

        def process_time(self):
            return self.cpu

    for cpu_per_wall, want in ((2.0, 0.5), (1.0, 1.0)):
        c = Clocks(cpu_per_wall)
        real_mm = torch.mm

        def mm(a, b, c=c):
            c.wall += 0.001
            c.cpu += 0.001 * c.cpu_per_wall
            return real_mm(a, b)

        monkeypatch.setattr(step_cost, "time", types.SimpleNamespace(perf_counter=c.perf_counter,
                                                                    process_time=c.process_time))
        monkeypatch.setattr(torch, "mm", mm)
        assert step_cost.parallel_probe(20.0) == pytest.approx(want)
        monkeypatch.undo()
    assert step_cost.parallel_probe(20.0) >= 0.9 / torch.get_num_threads()


def test_scaled_multiplies_every_measured_time():
    cm = fit({1: [10.0], 2: [12.0]}, {2: [15.0]}, {"x": 1}, {(2, 1): [16.0], (2, 2): [20.0]})
    half = cm.scaled(0.5)
    assert half.token_ms == [5.0, 6.0] and half.batch_ms == [[8.0, 10.0]] and half.meta == {"x": 1}
    assert half.forward_ms(1) == pytest.approx(cm.forward_ms(1) / 2)
    assert half.forward_ms(4, 2) == pytest.approx(cm.forward_ms(4, 2) / 2)
    assert half.seq_extra_ms == [x / 2 for x in cm.seq_extra_ms] and cm.seq_extra_ms[1] > 0


def test_a_cpu_table_is_converted_to_wall_ms(tiny_model_dir, monkeypatch):
    """CPU time on 2 busy threads runs twice as fast as the wall clock: a fake clock pair where every
    forward takes 1 CPU-ms and 0.5 wall ms gives a table of 0.5 ms per forward, cpu_time_to_wall 0.5."""
    import time as real_time
    import types

    from specserve import LLM

    llm = LLM(str(tiny_model_dir), max_model_len=128, max_num_seqs=4)
    clock = {"cpu": 0.0, "wall": 0.0}

    def process_time():
        clock["cpu"] += 0.001
        return clock["cpu"]

    def perf_counter():
        clock["wall"] += 0.0005
        return clock["wall"]

    monkeypatch.setattr(step_cost, "time", types.SimpleNamespace(process_time=process_time, perf_counter=perf_counter,
                                                                 strftime=real_time.strftime))
    cm = measure_model(llm.engine.target, max_tokens=4, max_seqs=2, context=8, repeats=1, target_s=0.0)
    assert cm.meta["cpu_time_to_wall"] == pytest.approx(0.5)
    assert cm.token_ms == pytest.approx([0.5] * 4)  # 1 CPU-ms per forward read as 0.5 wall ms


def test_step_overhead_is_fitted_only_where_the_forward_time_is_known():
    """The overhead fit's sample: on a CPU the wall time less the measured forward and the decision; on
    CUDA the wall time less the modelled forward and the decision, and none for a step with a sequence
    longer than a decode graph takes (a prompt chunk, in a prefill graph or eager: the table does not
    model it)."""
    from types import SimpleNamespace

    from specserve.engine.llm_engine import step_overhead_ms

    cm = StepCostModel([1, 2, 4], [1.0, 1.0, 1.0], [1, 4], [0.0, 0.5])
    decode = SimpleNamespace(has_prefill=False, num_tokens=4, scheduled=[0] * 4)
    prefill = SimpleNamespace(has_prefill=True, num_tokens=300, scheduled=[0] * 4)
    assert step_overhead_ms(cm, decode, 10.0, 6.0, 1.0, cuda=False) == pytest.approx(3.0)
    assert step_overhead_ms(cm, prefill, 30.0, 25.0, 1.0, cuda=False) == pytest.approx(4.0)
    assert step_overhead_ms(cm, decode, 3.0, 0.1, 0.5, cuda=True) == pytest.approx(3.0 - cm.forward_ms(4, 4) - 0.5)
    assert step_overhead_ms(cm, prefill, 30.0, 0.1, 0.5, cuda=True, prefill=True) is None
    short = SimpleNamespace(has_prefill=True, num_tokens=8, scheduled=[0] * 4)  # a short chunk: a decode-graph replay
    assert step_overhead_ms(cm, short, 3.0, 0.1, 0.5, cuda=True) == pytest.approx(3.0 - cm.forward_ms(8, 4) - 0.5)
    assert step_overhead_ms(cm, decode, 1.0, 0.1, 5.0, cuda=True) == 0.0
