"""Start stub backends and a gateway over them in threads (for the gateway tests)."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import httpx

from specserve.gateway.app import create_gateway_app
from specserve.gateway.config import fleet_from_dict
from specserve.server.launcher import ServerThread
from tests.helpers.stub_backend import StubState, make_stub_app

TOKEN = "gw-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}


@contextmanager
def fleet(spec: dict[str, str], config: dict | None = None, *, seed: int = 0, **stub_kw):
    """spec: backend name -> profile. Yields (gateway ServerThread, {name: StubState}, {name: ServerThread})."""
    states = {n: StubState(name=n, **stub_kw) for n in spec}
    stubs = {n: ServerThread(make_stub_app(s)).start() for n, s in states.items()}
    cfg = {"backends": [{"name": n, "url": stubs[n].base_url, "profile": p} for n, p in spec.items()],
           "admin_token": TOKEN, "health": {"interval_s": 0.2, "timeout_s": 0.5}}
    for k, v in (config or {}).items():
        if k == "backends_extra":
            for b in cfg["backends"]:
                b.update(v.get(b["name"], {}))
        else:
            cfg[k] = v
    gw = ServerThread(create_gateway_app(fleet_from_dict(cfg), seed=seed)).start()
    try:
        yield gw, states, stubs
    finally:
        gw.stop()
        for s in stubs.values():
            s.stop()


def wait_for(pred, timeout_s: float = 10.0, step_s: float = 0.02):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(step_s)
    raise AssertionError("condition not met in time")


class Traffic:
    """Background clients sending greedy completions to `url` (every other one streamed) until the
    `with` block ends; `codes` collects the HTTP statuses."""

    def __init__(self, url: str, prompts: list[str] | None = None, *, max_tokens: int = 4, n_threads: int = 2,
                 timeout_s: float = 20.0):
        self.url, self.max_tokens, self.timeout_s = url, max_tokens, timeout_s
        self.prompts = prompts or [f"p{i}" for i in range(7)]
        self.stop, self.codes = threading.Event(), []
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(n_threads)]

    def _run(self, i: int) -> None:
        with httpx.Client(timeout=self.timeout_s) as c:
            k = 0
            while not self.stop.is_set():
                body = {"prompt": self.prompts[k % len(self.prompts)], "max_tokens": self.max_tokens,
                        "temperature": 0, "stream": (k + i) % 2 == 0}
                self.codes.append(c.post(self.url + "/v1/completions", json=body).status_code)
                k += 1

    def __enter__(self) -> "Traffic":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(self.timeout_s + 30)
