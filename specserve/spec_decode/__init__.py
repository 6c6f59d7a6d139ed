"""Speculation proposers and the registry that builds one from a SpeculativeConfig.

What it does: maps `SpeculativeConfig.method` to a factory (`ngram` -> NgramProposer, `suffix` ->
SuffixProposer, `draft_model` -> DraftModelProposer, which needs the engine passed as `engine=`; other
methods can be added with `register_proposer_factory`), and gives `proposer_key`, the identity under which one proposer
instance may be shared by several profiles. What it does not do: decide k (per request, in
`ProposalInput.num_speculative_tokens`) or verify drafts (the engine and `specserve.sample.rejection` do).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Callable, Hashable

from specserve.config import ConfigError, SpeculativeConfig
from specserve.spec_decode.ngram import NgramProposer
from specserve.spec_decode.proposer import Proposal, ProposalInput, Proposer
from specserve.spec_decode.suffix import SuffixProposer

ProposerFactory = Callable[..., Proposer]

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


def _make_ngram(config: SpeculativeConfig, **_: Any) -> Proposer:
    return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)


def _make_suffix(config: SpeculativeConfig, **_: Any) -> Proposer:
    return SuffixProposer(config)


def _make_draft_model(config: SpeculativeConfig, engine: Any = None, **_: Any) -> Proposer:
    if engine is None:
        raise ConfigError('method "draft_model" needs the engine (device, dtype, the target tokenizer)')
    from specserve.spec_decode.draft_model import DraftModelProposer  # imports the engine's model loading

    return DraftModelProposer(config, engine)


_FACTORIES: dict[str, ProposerFactory] = {
    "ngram": _make_ngram,
    "suffix": _make_suffix,
    "draft_model": _make_draft_model,
}


def register_proposer_factory(method: str, factory: ProposerFactory) -> None:
    """Register (or replace) the factory for `method`.

    `factory(config, **engine_objects)` must return a Proposer; it receives whatever keyword
    arguments the caller passes to `make_proposer` (e.g. the target model, device, dtype).
    """
    _FACTORIES[method] = factory


def make_proposer(config: SpeculativeConfig, **engine_objects: Any) -> Proposer:
    """Build the proposer for `config.method`.

    Args:
        config: a validated SpeculativeConfig.
        **engine_objects: passed through to the factory (ngram and suffix ignore them).

    Raises:
        ConfigError: no factory is registered for the method, naming the methods that have one.
    """
    factory = _FACTORIES.get(config.method)
    if factory is None:
        raise ConfigError(
            f"no proposer is available for speculative method {config.method!r} here; "
            f"available: {', '.join(sorted(_FACTORIES))}"
        )
    return factory(config, **engine_objects)


def proposer_key(config: SpeculativeConfig | None) -> Hashable:
    """A hashable key equal for configs that can share one proposer instance.

    Two configs get the same key when they differ only in the per-request k settings
    (`num_speculative_tokens`, `num_speculative_tokens_per_batch_size`) or in keys their method does
    not use (e.g. `prompt_lookup_*` for suffix). Returns a tuple (method, (name, value), ...), or
    None for None (no speculation).
    """
    if config is None:
        return None
    unused = {k for m, keys in _METHOD_KEYS.items() if m != config.method for k in keys}
    items = tuple(
        (f.name, getattr(config, f.name))
        for f in fields(config)
        if f.name != "method" and f.name not in _PER_REQUEST_KEYS and f.name not in unused
    )
    return (config.method,) + items


__all__ = [
    "NgramProposer",
    "Proposal",
    "ProposalInput",
    "Proposer",
    "ProposerFactory",
    "SuffixProposer",
    "make_proposer",
    "proposer_key",
    "register_proposer_factory",
]
