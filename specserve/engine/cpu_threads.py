"""How many CPU threads the engine's forward, sampler and verifier use, and keeping every thread that
runs engine steps on that number.

Default: `OMP_NUM_THREADS` when it is set to a positive integer, else every CPU the process may run on
(`os.sched_getaffinity`, so `taskset` / cgroup cpusets are respected); `EngineConfig.cpu_threads`
(`--cpu-threads`) overrides both. torch's own default counts the machine's cores, not the process's.

Why per thread: torch's intra-op pool is OpenMP's, whose thread count is per calling OS thread. The
server steps the engine on its own thread (`specserve.server.async_engine`), so the engine applies its
count at the start of every step (a no-op when it is already in force), whichever thread steps it.
What it does not do: pin threads to cores (the OS schedules them) or size other libraries' pools.
"""

from __future__ import annotations

import os

import torch


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one, else os.cpu_count())."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no sched_getaffinity (macOS, Windows)
        return os.cpu_count() or 1


def resolve_cpu_threads(requested: int | None) -> int:
    """The engine's CPU thread count: `requested`, else OMP_NUM_THREADS, else `available_cpus()`.

    Raises:
        ValueError: `requested` is not a positive integer.
    """
    if requested is not None:
        if not isinstance(requested, int) or requested < 1:
            raise ValueError(f"cpu_threads must be a positive integer, got {requested!r}")
        return requested
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    return available_cpus()


def use_cpu_threads(n: int) -> None:
    """Make torch's intra-op pool on the calling thread have `n` threads (cheap when it already has)."""
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
