"""Speculation proposers and the registry that builds one from a SpeculativeConfig.

What it does: maps `SpeculativeConfig.method` to a factory (`ngram` -> NgramProposer, `suffix` ->
SuffixProposer, `draft_model` -> DraftModelProposer, which needs a `ProposerContext`; other methods can
be added with `register_proposer_factory`), and gives `proposer_key`, the identity under which one
proposer instance may be shared by several profiles. What it does not do: decide k (per request, in
`ProposalInput.num_speculative_tokens`) or verify drafts (the engine and `specserve.sample.rejection` do).
"""

from __future__ import annotations

import functools
from dataclasses import fields
from typing import Callable, Hashable

from specserve.config import ConfigError, SpeculativeConfig
from specserve.spec_decode.ngram import NgramProposer
from specserve.spec_decode.proposer import Proposal, ProposalInput, Proposer, ProposerContext
from specserve.spec_decode.suffix import SuffixProposer

ProposerFactory = Callable[[SpeculativeConfig, "ProposerContext | None"], Proposer]

# Config keys that do not change what a proposer does: k is per request (ProposalInput.num_speculative_tokens).
_PER_REQUEST_KEYS = ("num_speculative_tokens", "num_speculative_tokens_per_batch_size", "num_speculative_tokens_schedule")
# Keys that only matter to one method; for the others they are left out of the key.
_METHOD_KEYS = {
    "ngram": ("prompt_lookup_min", "prompt_lookup_max"),
    "suffix": (
        "suffix_decoding_max_tree_depth",
        "suffix_decoding_max_cached_requests",
        "suffix_decoding_max_spec_factor",
        "suffix_decoding_min_token_prob",
    ),
}


def _make_ngram(config: SpeculativeConfig, context: ProposerContext | None) -> Proposer:
    return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)


def _make_suffix(config: SpeculativeConfig, context: ProposerContext | None) -> Proposer:
    return SuffixProposer(config)


def _make_draft_model(config: SpeculativeConfig, context: ProposerContext | None) -> Proposer:
    if context is None:
        raise ConfigError('method "draft_model" needs a ProposerContext (device, dtype, the target tokenizer)')
    from specserve.spec_decode.draft_model import DraftModelProposer  # imports the engine's model loading

    return DraftModelProposer(config, context)


_FACTORIES: dict[str, ProposerFactory] = {
    "ngram": _make_ngram,
    "suffix": _make_suffix,
    "draft_model": _make_draft_model,
}


def register_proposer_factory(method: str, factory: ProposerFactory | None) -> ProposerFactory | None:
    """Register (or replace, or with None remove) the factory for `method`; returns the previous one.

    `factory(config, context)` must return a Proposer; `context` is the engine's ProposerContext (None
    when a caller builds a proposer without an engine).
    """
    previous = _FACTORIES.pop(method, None)
    if factory is not None:
        _FACTORIES[method] = factory
    return previous


def make_proposer(config: SpeculativeConfig, context: ProposerContext | None = None) -> Proposer:
    """Build the proposer for `config.method`.

    Args:
        config: a validated SpeculativeConfig.
        context: what the proposer may know of the engine (ngram and suffix ignore it).

    Raises:
        ConfigError: no factory is registered for the method (naming the methods that have one), or the
            factory needs a context and got none.
    """
    factory = _FACTORIES.get(config.method)
    if factory is None:
        raise ConfigError(
            f"no proposer is available for speculative method {config.method!r} here; "
            f"available: {', '.join(sorted(_FACTORIES))}"
        )
    return factory(config, context)


def proposer_key(config: SpeculativeConfig | None) -> Hashable:
    """A hashable key equal for configs that can share one proposer instance.

    Two configs get the same key when they differ only in the per-request k settings
    (`num_speculative_tokens`, `num_speculative_tokens_per_batch_size`) or in keys their method does
    not use (e.g. `prompt_lookup_*` for suffix). Returns a tuple (method, (name, value), ...), or
    None for None (no speculation).
    """
    if config is None:
        return None
    try:  # every engine step asks for it per request: cached per config
        return _cached_proposer_key(config)
    except TypeError:  # an unhashable field value (e.g. a list-valued batch-size table): not cached
        return _proposer_key(config)


def _proposer_key(config: SpeculativeConfig) -> Hashable:
    unused = {k for m, keys in _METHOD_KEYS.items() if m != config.method for k in keys}
    items = tuple(
        (f.name, getattr(config, f.name))
        for f in fields(config)
        if f.name != "method" and f.name not in _PER_REQUEST_KEYS and f.name not in unused
    )
    return (config.method,) + items



_cached_proposer_key = functools.lru_cache(maxsize=1024)(_proposer_key)

__all__ = [
    "NgramProposer",
    "Proposal",
    "ProposalInput",
    "Proposer",
    "ProposerContext",
    "ProposerFactory",
    "SuffixProposer",
    "make_proposer",
    "proposer_key",
    "register_proposer_factory",
]
