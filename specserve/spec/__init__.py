"""Proposer registry: `make_proposer(config, engine=...)` builds the draft source for a SpeculativeConfig.

Methods: "ngram" (prompt lookup), "suffix" (SuffixDecoding), "draft_model" (a second model; needs the
engine). `proposer_key(config)` is the identity under which one proposer instance is shared: profiles
whose configs differ only in k share it, since k is passed per request (ProposalInput.k).
"""

from __future__ import annotations

from typing import Any, Callable, Hashable

from specserve.config import ConfigError, SpeculativeConfig
from specserve.spec.proposer import Proposal, ProposalInput, Proposer

_FACTORIES: dict[str, Callable[..., Proposer]] = {}


def register_proposer_factory(method: str, factory: Callable[..., Proposer]) -> None:
    """Make `make_proposer` build `method` with `factory(config, **engine_objects)`."""
    _FACTORIES[method] = factory


def proposer_key(config: SpeculativeConfig | None) -> Hashable:
    """The sharing key: the config with num_speculative_tokens (and the per-batch-size k table) left out."""
    if config is None:
        return None
    d = config.to_dict()
    d.pop("num_speculative_tokens", None)
    d.pop("num_speculative_tokens_per_batch_size", None)
    return tuple(sorted((k, repr(v)) for k, v in d.items()))


def make_proposer(config: SpeculativeConfig, **engine_objects: Any) -> Proposer:
    """Build the proposer for `config`.

    Raises:
        ConfigError: no factory for the method.
    """
    factory = _FACTORIES.get(config.method)
    if factory is None:
        raise ConfigError(f"no proposer for speculative method {config.method!r}; available: {sorted(_FACTORIES)}")
    return factory(config, **engine_objects)


def _ngram(config: SpeculativeConfig, **_: Any) -> Proposer:
    from specserve.spec.ngram import NgramProposer

    return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)


def _suffix(config: SpeculativeConfig, **_: Any) -> Proposer:
    from specserve.spec.suffix import SuffixProposer

    return SuffixProposer(config)


def _draft_model(config: SpeculativeConfig, engine=None, **_: Any) -> Proposer:
    if engine is None:
        raise ConfigError('method "draft_model" needs the engine (device, dtype, target tokenizer)')
    from specserve.spec.draft_model import DraftModelProposer

    return DraftModelProposer(config, engine)


register_proposer_factory("ngram", _ngram)
register_proposer_factory("suffix", _suffix)
register_proposer_factory("draft_model", _draft_model)

__all__ = [
    "Proposal",
    "ProposalInput",
    "Proposer",
    "make_proposer",
    "proposer_key",
    "register_proposer_factory",
]
