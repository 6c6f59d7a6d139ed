"""A model-free engine for fast server tests: the REAL `LLMEngine` (scheduler, ngram/suffix proposers,
sampler, verification, stop handling, deltas) over a toy target whose logits are a fixed function of
the context, and the real `AsyncEngine` on top.

What it does: `ByteTokenizer` (ids 0..255 are UTF-8 bytes, 256 is EOS; chat renders `<role>content`
lines); `ToyLM` has `CausalLM`'s forward signature and no weights: the logits at a position depend
only on the tokens up to it, like a causal LM's, so greedy output is identical with and without
speculation and a seed reproduces sampled output. `toy_logits` puts +5 on `greedy_next(context)` and 0
on every lowercase letter, digit and space (so sampling at temperature 1 varies); `greedy_next` spells
"abcdefghi" and then a digit counting the periods, so n-gram and suffix drafts are mostly accepted and
a stop string with a digit first occurs late. `fake_engine()` / `fake_client()` build the engine / the
server's EngineClient. `ToyLM.step_delay_s` slows every step (disconnect and queueing tests); clearing `ToyLM.gate` hangs every
forward until it is set (watchdog tests). `scripted_logits(answer)` makes the greedy answer to a chat a
given text (tool-call tests).
What it does not do: anything a real model does. Never use it to serve.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from specserve.config import EngineConfig
from specserve.engine.llm_engine import LLMEngine
from specserve.engine.loaded_model import LoadedModel
from specserve.hub import ModelFiles
from specserve.model.config import ModelConfig
from specserve.server.async_engine import AsyncEngine

EOS = 256
VOCAB_SIZE = 260
MODEL_NAME = "fake-model"
_SAMPLEABLE = [ord(c) for c in "abcdefghijklmnopqrstuvwxyz0123456789 "]


class ByteTokenizer:
    """The tokenizer calls the engine makes, over bytes (no BOS; EOS = 256)."""

    eos_token_id = EOS
    chat_template = "<role>content lines, then <assistant>"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True, **_: Any) -> str:
        out = bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return out if skip_special_tokens else out + "<eos>" * sum(1 for i in ids if i == EOS)

    def grammar_vocab(self) -> list[bytes]:
        """Each id's bytes for the grammar library (ids 0..255 one byte each; EOS special)."""
        return [bytes([i]) for i in range(256)] + [b""]

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            add_generation_prompt: bool = True, tokenize: bool = False, **_: Any) -> str:
        head = f"<tools>{json.dumps(tools)}\n" if tools else ""
        lines = "".join(f"<{m['role']}>{m.get('content') or ''}{json.dumps(m['tool_calls']) if m.get('tool_calls') else ''}"
                        f"\n" for m in messages)
        return head + lines + ("<assistant>" if add_generation_prompt else "")


def greedy_next(context: Sequence[int]) -> int:
    """The toy LM's most likely token after `context`: letter p % 10 of "abcdefghi", or at p % 10 == 9
    the digit (p // 10) % 10, with p = len(context) + sum of the first 4 tokens."""
    p = len(context) + sum(context[:4])
    return ord(str(p // 10 % 10)) if p % 10 == 9 else ord("a") + p % 10


def toy_logits(context: Sequence[int]) -> torch.Tensor:
    """float32 [VOCAB_SIZE]: 5 for greedy_next(context), 0 for letters, digits and space, -1e4 elsewhere."""
    row = torch.full((VOCAB_SIZE,), -1e4)
    row[_SAMPLEABLE] = 0.0
    row[greedy_next(context)] = 5.0
    return row


def scripted_logits(answer: str, marker: bytes = b"<assistant>") -> Callable[[Sequence[int]], torch.Tensor]:
    """A logits function whose greedy output after the last `marker` in the context is `answer` (as
    UTF-8 bytes) and then EOS; before any marker, `toy_logits`."""
    script = list(answer.encode("utf-8")) + [EOS]

    def logits(context: Sequence[int]) -> torch.Tensor:
        ctx = bytes(t for t in context if t < 256)
        at = ctx.rfind(marker)
        if at < 0:
            return toy_logits(context)
        done = len(ctx) - at - len(marker)
        row = torch.full((VOCAB_SIZE,), -1e4)
        row[script[min(done, len(script) - 1)]] = 5.0
        return row

    return logits


class ToyLM(torch.nn.Module):
    """`CausalLM.forward`'s signature with no weights: each slot's token history stands in for its KV
    entries (written at the step's positions, so rolled-back drafts are overwritten as in the cache).

    Args:
        logits_fn: context (the tokens up to and including a position) -> float32 logits [VOCAB_SIZE].
        step_delay_s: sleep this long in every forward (s).
    """

    def __init__(self, logits_fn: Callable[[Sequence[int]], torch.Tensor] = toy_logits, step_delay_s: float = 0.0):
        super().__init__()
        self.logits_fn = logits_fn
        self.step_delay_s = step_delay_s
        self.history: dict[int, list[int]] = {}
        self.gate = threading.Event()  # cleared: every forward waits until it is set again (a hung device)
        self.gate.set()

    def forward(self, input_ids, meta, kv, logits_rows):
        self.gate.wait()
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        slots, positions = meta.slots.tolist(), meta.positions.tolist()
        for t, slot, pos in zip(input_ids.tolist(), slots, positions):
            h = self.history.setdefault(slot, [])
            del h[pos:]
            assert len(h) == pos, f"slot {slot}: token at {pos} after {len(h)} known"
            h.append(t)
        rows = [self.logits_fn(self.history[slots[r]][: positions[r] + 1]) for r in logits_rows.tolist()]
        return torch.stack(rows) if rows else torch.empty(0, VOCAB_SIZE)


def fake_engine(*, max_model_len: int = 256, max_num_seqs: int = 8, lm: ToyLM | None = None) -> LLMEngine:
    """An LLMEngine over ToyLM and ByteTokenizer (fp32, CPU, seed 0), with prefix caching off: ToyLM's
    per-slot token history stands in for the KV entries, and `KVCache.copy_prefix` copies K/V tensors,
    not that history (prefix caching is tested on real tiny models, tests/unit/test_prefix_cache.py)."""
    cfg = ModelConfig(family="llama", vocab_size=VOCAB_SIZE, hidden_size=1, intermediate_size=1, num_layers=0,
                      num_heads=1, num_kv_heads=1, head_dim=1, rms_norm_eps=1e-6, rope_theta=1e4,
                      max_position_embeddings=max_model_len, tie_word_embeddings=False, attention_bias=False,
                      eos_token_ids=(EOS,))
    files = ModelFiles(MODEL_NAME, Path("."), "fake-checksum", "folder")
    target = LoadedModel.from_parts(files, cfg, lm or ToyLM(), ByteTokenizer(), dtype=torch.float32,
                                    device=torch.device("cpu"), max_model_len=max_model_len, num_slots=max_num_seqs)
    config = EngineConfig(model=MODEL_NAME, dtype="float32", device="cpu", max_model_len=max_model_len,
                          max_num_seqs=max_num_seqs, enable_prefix_caching=False)
    return LLMEngine(config, target=target)


def fake_client(**kw: Any) -> AsyncEngine:
    """The server's EngineClient over `fake_engine(**kw)`."""
    return AsyncEngine(fake_engine(**kw))
