"""How many CPU threads the engine's forward, sampler and verifier use, and keeping every thread that
runs engine steps on that number.

Default: `OMP_NUM_THREADS` when it is set to a positive integer, else every CPU the process may run on
(`os.sched_getaffinity`, so `taskset` / cgroup cpusets are respected); `EngineConfig.cpu_threads`
(`--cpu-threads`) overrides both. torch's own default counts the machine's cores, not the process's.

Why per thread: torch's intra-op pool is OpenMP's, whose thread count is per calling OS thread. The
server steps the engine on its own thread (`specserve.server.async_engine`), so the engine applies its
count at the start of every step (a no-op when it is already in force), whichever thread steps it.

Why the loading thread lets go of its pool: OpenMP (GNU libgomp, torch's) gives every OS thread that
starts parallel work its own pool of worker threads, kept for the life of that thread. The server loads
the model on its main thread and steps it on the engine thread, so two pools existed; once a process
manages more OpenMP threads than it has CPUs, libgomp stops spinning between parallel regions (100
spins instead of 300,000) and every one of the ~100 parallel kernels of a decode step waits for its
workers to be woken. The engine thread then ran at one-thread speed: on the 2-core machine, a oneDNN
projection and an SDPA call took 2x as long on the engine thread as on the main thread, and as long
as on the main thread once the main thread's pool was released (docs/cpu_performance.md). So after
loading a model the loading thread releases its pool (`release_openmp_pool`, OpenMP 5.0's
`omp_pause_resource_all`); if it computes again, a new pool is made on its next parallel region.
What it does not do: pin threads to cores (the OS schedules them) or size other libraries' pools.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re

import torch

logger = logging.getLogger(__name__)
_OPENMP_RUNTIME = re.compile(r"/lib(gomp|iomp5|omp)[-.0-9a-f]*\.so[.0-9]*$")
_omp_lib: ctypes.CDLL | None | bool = False  # False: not looked up yet


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


def _openmp_library() -> ctypes.CDLL | None:
    """The OpenMP runtime this process has loaded (torch's libgomp, or libiomp5 / libomp), or None."""
    global _omp_lib
    if _omp_lib is False:
        _omp_lib = None
        try:
            with open("/proc/self/maps") as f:
                paths = {line.split()[-1] for line in f if _OPENMP_RUNTIME.search(line.rstrip())}
            for path in sorted(paths):
                lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)  # the copy already loaded
                if hasattr(lib, "omp_pause_resource_all"):
                    _omp_lib = lib
                    break
        except (OSError, AttributeError):  # no /proc (macOS, Windows) or no RTLD_NOLOAD
            pass
    return _omp_lib


def release_openmp_pool() -> bool:
    """Release the calling thread's OpenMP worker threads (`omp_pause_resource_all(omp_pause_soft)`),
    so that the thread that steps the engine is the process's only OpenMP master (see the module
    docstring). Call it on a thread that is done computing for now, outside any parallel region.

    Returns:
        whether the runtime released them (False where the OpenMP runtime cannot be found).
    """
    lib = _openmp_library()
    if lib is None:
        return False
    ok = lib.omp_pause_resource_all(ctypes.c_int(1)) == 0  # 1 = omp_pause_soft
    if not ok:
        logger.debug("omp_pause_resource_all refused; OpenMP threads of this thread stay")
    return ok
