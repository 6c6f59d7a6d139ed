"""Shared pytest fixtures: tiny random-weight model folders (fast) and pulled real models (skip if absent)."""

from __future__ import annotations

import pytest

from specserve.engine import step_cost
from tests.helpers.tiny_model import make_tiny_model

MACHINE_BUSY = step_cost.machine_busy  # the real check, for the test of it


@pytest.fixture(autouse=True)
def _machine_never_busy(monkeypatch):
    """Whether a step cost is cached must not depend on the CI machine's load (`machine_busy`, the load
    average): every test sees an idle machine unless it puts MACHINE_BUSY back."""
    monkeypatch.setattr(step_cost, "machine_busy", lambda measured=None: None)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random qwen2 model folder (tied embeddings, q/k/v biases), vocab ~400, fp32."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), arch="qwen2", tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A tiny random llama model folder (untied lm_head), vocab ~400, fp32."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), arch="llama", tie_word_embeddings=False)


@pytest.fixture(scope="session")
def real_model():
    """`real_model(name) -> ModelFiles` for a pulled catalog model; skips the test if it is not pulled.

    Never downloads: the test script pulls the models first (`specserve pull NAME`).
    """
    from specserve.hub import ModelError, resolve_model

    def get(name: str):
        try:
            return resolve_model(name, pull_if_missing=False)
        except ModelError as e:
            pytest.skip(f"real model {name} is not available: {e}")

    return get


@pytest.fixture(scope="module")
def torch_threads():
    """Run a module's models with SPECSERVE_TEST_THREADS torch threads (default 1): on a shared 2-core
    machine a second thread mostly spins and makes the real-model tests several times slower. Engines
    take their thread count from OMP_NUM_THREADS (`specserve.engine.cpu_threads`), so it is set too."""
    import os

    import torch

    n, env = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    threads = os.environ.get("SPECSERVE_TEST_THREADS", "1")
    torch.set_num_threads(int(threads))
    os.environ["OMP_NUM_THREADS"] = threads
    yield
    torch.set_num_threads(n)
    if env is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = env
