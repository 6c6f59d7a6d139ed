"""Structured output: grammars compiled from a request's constraint, and the per-request grammar state
whose token masks the batched verifier applies to every sampled row (docs/structured-output.md).

What it does: `compiler.GrammarCompiler` compiles a `StructuredOutputsParams` (JSON schema, any JSON
object, regex, choice) with xgrammar into a reusable compiled grammar (cached; thread-safe, so the
server compiles on its tokenizer thread); `matcher.GrammarState` tracks one request's position in it,
fills the token bitmask of each of its rows (verify rows with the drafts tentatively accepted), and
advances by committed tokens only.
What it does not do: apply masks to logits (`specserve.sample.processors.apply_grammar`) or decide
what a request's constraint is (`specserve.server.protocol`).
"""

from types import ModuleType


def xgrammar() -> ModuleType:
    """The `xgrammar` module, imported on first use so that serving without structured output never loads it.

    Raises:
        RuntimeError: xgrammar is not installed (it is a dependency in pyproject.toml; an environment
            that skipped it can serve everything except `response_format` / `structured_outputs`).
    """
    try:
        import xgrammar as xgr
    except ImportError as e:  # pragma: no cover - xgrammar is a declared dependency
        raise RuntimeError("structured output needs the xgrammar package (pip install xgrammar==0.2.9)") from e
    return xgr
