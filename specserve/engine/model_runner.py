"""Runs one forward pass of a model over a step's scheduled tokens.

What it does: flattens the step (prefill chunks, and last token + drafts per decoding request) into
one ragged batch, builds the attention metadata, runs the model, records the written positions in the
KV cache, and returns logits for the rows that will be sampled. The same runner serves the target and a
draft model (each with its own model and cache).
What it does not do: sampling, stop checks, or rollback (the engine truncates after verification).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.engine.kv_cache import KVCache
from specserve.model.attention import AttentionMetadata
from specserve.model.llama import CausalLM


@dataclass
class SeqInput:
    """One sequence's part of a forward.

    Attributes:
        slot: its KV cache slot.
        start: position of the first new token (= valid KV length before the step).
        token_ids: the new tokens.
        num_logits: how many of the last new tokens need logits (0 for a non-final prefill chunk).
    """

    slot: int
    start: int
    token_ids: list[int]
    num_logits: int


class ModelRunner:
    """Owns a model and its KV cache; `forward(seqs)` -> float32 logits [sum(num_logits), vocab]."""

    def __init__(self, model: CausalLM, kv: KVCache, device: torch.device):
        self.model = model
        self.kv = kv
        self.device = device

    def forward(self, seqs: list[SeqInput]) -> torch.Tensor:
        """Run the model once over all `seqs` and extend each slot's valid length.

        Returns:
            logits [R, vocab] with R = sum(s.num_logits), rows in `seqs` order.
        """
        ids: list[int] = []
        rows: list[int] = []
        for s in seqs:
            if self.kv.lengths[s.slot] != s.start:
                raise RuntimeError(f"slot {s.slot}: KV length {self.kv.lengths[s.slot]} != step start {s.start}")
            ids += s.token_ids
            rows += range(len(ids) - s.num_logits, len(ids))
        meta = AttentionMetadata.build(
            [s.slot for s in seqs], [s.start for s in seqs], [len(s.token_ids) for s in seqs], self.device
        )
        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        logits_rows = torch.tensor(rows, dtype=torch.int64, device=self.device)
        logits = self.model(input_ids, meta, self.kv, logits_rows)
        for s in seqs:
            self.kv.extend(s.slot, s.start + len(s.token_ids))
        return logits
