"""The engine: continuous batching, the KV cache, the model runner, per-token stop handling.

Public names, importable from here: `LLMEngine`, `RequestError`, and `USE_ENGINE_DEFAULT` (pass it as
`speculative_config` to use the engine's default config; None means no speculation). They are loaded on
first use, so importing a submodule (e.g. `specserve.engine.kv_cache`) does not import the whole engine.
"""

from __future__ import annotations

_PUBLIC = ("LLMEngine", "RequestError", "USE_ENGINE_DEFAULT")
__all__ = list(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        from specserve.engine import llm_engine

        return getattr(llm_engine, name)
    raise AttributeError(f"module 'specserve.engine' has no attribute {name!r}")
