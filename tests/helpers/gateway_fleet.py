"""Start stub backends and a gateway over them in threads (for the gateway tests)."""

from __future__ import annotations

import time
from contextlib import contextmanager

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
