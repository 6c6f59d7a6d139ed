"""`specserve serve` as a child process: the local server a benchmark preset (the demo) runs against.

What it does: starts the server on 127.0.0.1 and a free port in its own session (retrying on a new
port if the chosen one was taken meanwhile), waits for /health, and stops it (SIGTERM to its process
group, which uvicorn answers with a graceful shutdown; SIGKILL if it lingers). On Linux the child also
dies with its parent (PR_SET_PDEATHSIG), so a killed caller leaves no server behind.
`ServerProcess.command` does the same for any server command that takes a port (an external server
for `specserve sweep --server-cmd`).
What it does not do: choose the server's options beyond host and port (the caller passes its argv).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import httpx


class ServerStartError(RuntimeError):
    """The server exited while starting or did not answer /health in time; the message has its log tail."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child between fork and exec (Linux: PR_SET_PDEATHSIG)
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))
    except (OSError, AttributeError):
        pass


class ServerProcess:
    """`specserve serve ARGS --host 127.0.0.1 --port P` as a child process, or any server command
    (`ServerProcess.command`: e.g. a vLLM server for `specserve sweep --server-cmd`).

    Args:
        serve_args: the arguments after `specserve serve` (model, profiles, ...), without host and port.
        log_path: where the server's stdout and stderr go.

    Attributes:
        proc: the `subprocess.Popen` (None before `start`). port, base_url: where it listens.
        stopped_by: "SIGTERM" (graceful), "SIGKILL", or None (it had exited by itself).
    """

    def __init__(self, serve_args: list[str], log_path: str | os.PathLike):
        argv = [sys.executable, "-m", "specserve.cli", "serve", *serve_args, "--host", "127.0.0.1"]
        self.argv_for_port: Callable[[int], list[str]] = lambda port: [*argv, "--port", str(port)]
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self.stopped_by: str | None = None

    @classmethod
    def command(cls, argv_for_port: Callable[[int], list[str]], log_path: str | os.PathLike) -> "ServerProcess":
        """Any server that serves GET /health on 127.0.0.1: `argv_for_port(port)` is its command line."""
        srv = cls([], log_path)
        srv.argv_for_port = argv_for_port
        return srv

    @property
    def base_url(self) -> str:
        """http://127.0.0.1:PORT (no /v1)."""
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, n: int = 1500) -> str:
        """The last `n` characters of the server's log."""
        try:
            return self.log_path.read_text(errors="replace")[-n:].strip()
        except OSError:
            return ""

    def start(self, timeout_s: float, timeout_flag: str | None = None) -> "ServerProcess":
        """Start and wait up to `timeout_s` seconds for /health to answer 200 (`timeout_flag`: the
        caller's option that sets it, named in the error).

        Raises:
            ServerStartError: the server exited, did not become healthy in time, or found no free port.
        """
        for _attempt in range(3):
            if self._start_once(timeout_s, f" ({timeout_flag})" if timeout_flag else ""):
                return self
        raise ServerStartError(f"server could not bind a free port; log tail:\n{self.log_tail()}")

    def _start_once(self, timeout_s: float, flag: str) -> bool:
        self.port = free_port()
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(self.argv_for_port(self.port), stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                         preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                tail = self.log_tail()
                if "address already in use" in tail.lower():
                    return False
                raise ServerStartError(f"the server exited with status {self.proc.returncode} while starting "
                                       f"(log {self.log_path}):\n{tail}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise ServerStartError(f"the server did not answer /health within {timeout_s:.0f} s{flag}; "
                                       f"log {self.log_path}:\n{self.log_tail()}")
            time.sleep(0.25)

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM the server's process group (uvicorn shuts down gracefully), SIGKILL it if it lingers."""
        if self.proc is None:
            return
        for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
            if self.proc.returncode is not None:  # reaped: its pid may belong to someone else now
                return
            try:
                os.killpg(self.proc.pid, sig)  # start_new_session: the server leads its own group
            except ProcessLookupError:
                pass
            self.stopped_by = sig.name
            try:
                self.proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                continue

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
