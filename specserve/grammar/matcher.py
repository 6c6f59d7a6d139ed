"""One request's position in its grammar: the token masks of its rows, and advancing by committed tokens.

What it does: `GrammarState` wraps an xgrammar `GrammarMatcher`. For a step's rows it fills one bitmask
row per logits row: row j (the token after the committed tokens and drafts[:j]) gets the grammar's
allowed set after tentatively accepting drafts[:j]. A draft the grammar forbids ends the tentative walk:
its row's mask excludes it (so the verifier rejects it: p = 0), and the rows after it repeat that mask
(they are never committed; any valid mask would do). The walk is then undone with `rollback` (the
grammar's one rollback primitive, as `KVCache.truncate` is the cache's), so building a step's masks
leaves the state unchanged; after verification the engine calls `accept` with the committed tokens
only. EOS (the compiler's stop tokens) is allowed only where the grammar is complete; after it the
matcher is terminated and allows nothing more.
What it does not do: apply masks (`specserve.sample.processors.apply_grammar`) or compile grammars
(`specserve.grammar.compiler`). Not thread-safe: the engine thread owns it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from specserve.grammar import xgrammar

if TYPE_CHECKING:
    import xgrammar as xgr


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """int32 [num_rows, ceil(vocab_size / 32)] token bitmask (bit t % 32 of word t // 32: token t allowed)."""
    return xgrammar().allocate_token_bitmask(num_rows, vocab_size)


class GrammarRejected(ValueError):
    """A committed token the grammar does not allow (cannot happen when every row was masked)."""


class GrammarState:
    """A request's grammar matcher (see the module docstring).

    Args:
        compiled: the request's compiled grammar (`GrammarCompiler.compile`).
    """

    def __init__(self, compiled: xgr.CompiledGrammar):
        self._matcher = xgrammar().GrammarMatcher(compiled)
        self.num_accepted = 0  # committed tokens accepted so far

    @property
    def terminated(self) -> bool:
        """True once a stop token (EOS) was accepted."""
        return self._matcher.is_terminated()

    @property
    def completed(self) -> bool:
        """True where the output so far is a complete match (EOS allowed)."""
        return self._matcher.is_completed()

    def fill_rows(self, drafts: Sequence[int], bitmask: torch.Tensor, first: int) -> int:
        """Fill rows first .. first + len(drafts) of `bitmask` (int32 [N, W]) with the masks of this
        request's rows, the state unchanged afterwards. Returns how many drafts the grammar allows in a
        row (the drafts after the first forbidden one are not looked at)."""
        m = self._matcher
        m.fill_next_token_bitmask(bitmask, first)
        walked = 0
        for j, d in enumerate(drafts):
            if m.is_terminated() or not m.accept_token(d):
                break
            walked += 1
            if m.is_terminated():  # an accepted EOS draft: nothing may follow it
                break
            m.fill_next_token_bitmask(bitmask, first + j + 1)
        last = first + walked if not m.is_terminated() else first + walked - 1
        if last + 1 <= first + len(drafts):
            bitmask[last + 1: first + len(drafts) + 1] = bitmask[last]
        if walked:
            m.rollback(walked)
        return walked

    def accept(self, tokens: Sequence[int]) -> None:
        """Advance by committed tokens.

        Raises:
            GrammarRejected: a token the grammar does not allow here (the state keeps the tokens before it).
        """
        m = self._matcher
        for t in tokens:
            if m.is_terminated() or not m.accept_token(t):
                raise GrammarRejected(f"token {t} is not allowed by the request's grammar after "
                                      f"{self.num_accepted} output tokens")
            self.num_accepted += 1
