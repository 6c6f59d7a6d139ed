"""The engine's CPU thread count: explicit > OMP_NUM_THREADS > CPUs the process may use; applied on the
thread that steps the engine (the server's engine thread), not only where the engine was built."""

from __future__ import annotations

import threading

import pytest
import torch

from specserve.cli import main as cli_main
from specserve.config import ConfigError, EngineConfig
from specserve.engine.cpu_threads import available_cpus, resolve_cpu_threads
from specserve.engine.llm_engine import LLMEngine
from specserve.sampling_params import SamplingParams


def test_resolution_order(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert resolve_cpu_threads(None) == available_cpus() >= 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert resolve_cpu_threads(None) == 3 and resolve_cpu_threads(5) == 5
    monkeypatch.setenv("OMP_NUM_THREADS", "not-a-number")
    assert resolve_cpu_threads(None) == available_cpus()
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match="positive integer"):
            resolve_cpu_threads(bad)
    with pytest.raises(ConfigError, match="cpu_threads must be a positive integer"):
        EngineConfig(model="x", cpu_threads=0)
    with pytest.raises(ConfigError, match="cpu_linear must be auto, panel, onednn or torch"):
        EngineConfig(model="x", cpu_linear="mkl")


def test_engine_steps_with_its_thread_count_on_any_thread(tiny_model_dir):
    before = torch.get_num_threads()
    try:
        eng = LLMEngine(EngineConfig(model=str(tiny_model_dir), device="cpu", max_model_len=64, max_num_seqs=2,
                                     cpu_threads=1))
        assert eng.cpu_threads == 1 and torch.get_num_threads() == 1
        eng.add_request("a", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        seen = []

        def engine_thread():
            torch.set_num_threads(2)  # e.g. a thread whose pool was sized before the engine existed
            while eng.has_unfinished_requests():
                eng.step()
                seen.append(torch.get_num_threads())

        t = threading.Thread(target=engine_thread)
        t.start()
        t.join(60)
        assert seen and set(seen) == {1}
    finally:
        torch.set_num_threads(before)


def test_cli_rejects_a_bad_thread_count_in_one_line(capsys):
    assert cli_main(["generate", "--model", "x", "--prompt", "hi", "--cpu-threads", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cpu_threads must be a positive integer" in err


def test_releasing_the_openmp_pool_ends_its_worker_threads():
    """After loading, the loading thread lets its OpenMP workers go, so that the engine thread's pool is the
    only one (libgomp stops spinning when it manages more threads than CPUs)."""
    import os
    import sys
    import time

    from specserve.engine.cpu_threads import release_openmp_pool

    if not sys.platform.startswith("linux"):
        pytest.skip("counts threads in /proc")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        big = torch.randn(3_000_000)
        torch.add(big, 1.0)  # a parallel region: this thread now has a pool of 2 workers
        with_pool = len(os.listdir("/proc/self/task"))
        assert release_openmp_pool()
        deadline = time.monotonic() + 5
        while len(os.listdir("/proc/self/task")) > with_pool - 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(os.listdir("/proc/self/task")) == with_pool - 2
        torch.add(big, 1.0)  # computing again makes a new pool
        assert len(os.listdir("/proc/self/task")) == with_pool
    finally:
        torch.set_num_threads(before)
