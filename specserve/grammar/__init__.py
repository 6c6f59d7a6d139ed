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
