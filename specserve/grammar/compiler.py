"""Compile a request's output constraint into an xgrammar grammar, once per distinct constraint.

What it does: `GrammarCompiler` builds xgrammar's tokenizer description of the model's vocabulary
once (from a Hugging Face tokenizer, or from `tokenizer.grammar_vocab()` for a tokenizer that lists its
tokens' bytes itself), with the model's EOS ids as the grammar's stop tokens, and compiles
`StructuredOutputsParams` (JSON schema, any JSON object, regex, choice as a regex of escaped
alternatives) into an `xgrammar.CompiledGrammar`. Results are cached by the constraint's canonical
text (LRU, `cache_size` entries); `compile` is thread-safe and holds its lock only for the cache
lookup, so the server compiles on its tokenizer thread and the engine thread only finds the result in
the cache, never waiting behind another request's compile. A constraint xgrammar cannot compile
is a `SamplingParamsError` naming the request field that set it (a 400 at the server, never a 500).
What it does not do: track a request's position in the grammar (`specserve.grammar.matcher`).
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from specserve.grammar import xgrammar
from specserve.sampling_params import SamplingParamsError, StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar as xgr

_CPP_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def _library_message(e: BaseException) -> str:
    """xgrammar's error text without its C++ time/file prefix, on one line, cut to 300 characters."""
    text = _CPP_PREFIX.sub("", str(e).strip()).splitlines()
    msg = " ".join(x.strip() for x in text if x.strip())
    return msg[:300]


def choice_regex(choices: Sequence[str]) -> str:
    """A regex matching exactly one of `choices` (each escaped literally)."""
    return "(" + "|".join(re.escape(c) for c in choices) + ")"


class GrammarCompiler:
    """Constraint -> compiled grammar, cached (see the module docstring).

    Args:
        tokenizer: a Hugging Face tokenizer, or an object with `grammar_vocab() -> list[bytes]` (the bytes
            of each token id; special tokens as b"").
        vocab_size: the target's vocabulary size (its logits' width; ids past the tokenizer's are never
            allowed by a mask).
        stop_token_ids: the ids that end the output (the model's EOS): allowed by a mask only where the
            grammar is complete.
        cache_size: compiled grammars kept (LRU).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int], cache_size: int = 64):
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        xgr = xgrammar()
        if hasattr(tokenizer, "grammar_vocab"):
            info = xgr.TokenizerInfo(tokenizer.grammar_vocab(), xgr.VocabType.RAW, vocab_size=vocab_size,
                                     stop_token_ids=self.stop_token_ids)
        else:
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                      stop_token_ids=self.stop_token_ids)
        self.tokenizer_info = info
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[str, xgr.CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """The compiled grammar of `spec` (from the cache when compiled before).

        Raises:
            SamplingParamsError: xgrammar cannot compile it (`param` is `spec.param`; the message
                carries xgrammar's reason).
        """
        key = spec.key()
        with self._lock:  # held only for the lookup: a compile never blocks another thread's cache hit
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        try:
            compiled = self._compile(spec)
        except (RuntimeError, ValueError, TypeError) as e:
            what = spec.kinds()[0]
            raise SamplingParamsError(spec.param, f"could not be compiled into a grammar ({what}): "
                                      f"{_library_message(e)}") from None
        with self._lock:
            self._cache[key] = compiled
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        c = self._compiler
        if spec.json is not None:
            return c.compile_json_schema(spec.json, any_whitespace=False, strict_mode=True)
        if spec.json_object:
            return c.compile_json_schema({"type": "object"}, any_whitespace=False, strict_mode=False)
        if spec.regex is not None:
            return c.compile_regex(spec.regex)
        return c.compile_regex(choice_regex(spec.choice))
