"""Runs one forward pass of a model over a step's scheduled tokens.

What it does: takes a `ModelInput` (the step's tokens as flat tensors, built once per step from the
`StepPlan`; docs/step-plan.md), checks that every sequence starts where its KV slot ends, builds the
attention metadata, runs the model, records the written positions in the KV cache, and returns logits
for the rows that will be sampled. The same runner serves the target and a draft model (each with its
own model and cache); `forward(seqs)` builds the `ModelInput` from a list of `SeqInput` for callers
without a plan (a draft model, tests, benchmarks).
What it does not do: scheduling, sampling, stop checks, or rollback (the engine truncates after
verification).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from specserve.engine.kv_cache import KVCache
from specserve.model.attention import AttentionMetadata
from specserve.model.llama import CausalLM


@dataclass
class SeqInput:
    """One sequence's part of a forward (for callers without a StepPlan).

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


@dataclass
class ModelInput:
    """One forward's inputs as flat tensors: B sequences, T = sum(query_lens) new tokens, R logits rows.

    Sequence b feeds tokens [query_start_loc[b], query_start_loc[b + 1]) of the flat step, at positions
    start_positions[b] ... into KV slot slots[b]; its logits rows are its last num_rows[b] tokens, in
    sequence order. All tensors are int64 views of one buffer on the device (one host-to-device copy).

    Attributes:
        input_ids: [T] token ids.
        positions: [T] position of each token in its sequence.
        slot_mapping: [T] KV slot of each token.
        query_start_loc: [B + 1] cumulative new-token offsets (query_start_loc[0] = 0).
        seq_lens: [B] context length of each sequence after the step (start + new tokens).
        logits_indices: [R] flat token index of each logits row.
        slots, start_positions, query_lens, num_rows: the same per sequence as host lists (KV
            bookkeeping and attention metadata).
        token_ids: the new tokens per sequence as host lists (the CUDA runner packs its graph inputs
            from these; `specserve.engine.cuda_graph_runner`).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    logits_indices: torch.Tensor
    slots: list[int]
    start_positions: list[int]
    query_lens: list[int]
    num_rows: list[int]
    token_ids: list[list[int]]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @classmethod
    def build(
        cls,
        slots: Sequence[int],
        starts: Sequence[int],
        token_ids: Sequence[Sequence[int]],
        num_rows: Sequence[int],
        device: torch.device,
    ) -> "ModelInput":
        """The one place the flat layout is computed (the StepPlan and `SeqInput` callers both use it).

        Raises:
            ValueError: a sequence with no new tokens, or more logits rows than new tokens.
        """
        ids: list[int] = []
        pos: list[int] = []
        slot_map: list[int] = []
        qsl = [0]
        rows: list[int] = []
        qlens = []
        for slot, start, toks, nr in zip(slots, starts, token_ids, num_rows):
            n = len(toks)
            if n == 0 or not 0 <= nr <= n:
                raise ValueError(f"slot {slot}: {n} new tokens and {nr} logits rows")
            ids += toks
            pos += range(start, start + n)
            slot_map += [slot] * n
            end = qsl[-1] + n
            rows += range(end - nr, end)
            qsl.append(end)
            qlens.append(n)
        seq_lens = [s + q for s, q in zip(starts, qlens)]
        T, B = len(ids), len(qlens)
        flat = torch.tensor(ids + pos + slot_map + qsl + seq_lens + rows, dtype=torch.int64)
        flat = flat.to(device, non_blocking=True)
        parts = flat.split([T, T, T, B + 1, B, len(rows)])
        return cls(*parts, list(slots), list(starts), qlens, list(num_rows), list(token_ids))


class ModelRunner:
    """Owns a model and its KV cache; `execute(model_input)` -> float32 logits [R, vocab]."""

    def __init__(self, model: CausalLM, kv: KVCache, device: torch.device):
        self.model = model
        self.kv = kv
        self.device = device

    def execute(self, inp: ModelInput) -> torch.Tensor:
        """Run the model once over the step and extend each slot's valid length.

        Returns:
            logits [R, vocab], rows in `inp.logits_indices` order.

        Raises:
            RuntimeError: a sequence does not start at its slot's valid KV length.
        """
        lengths = self.kv.lengths
        for slot, start in zip(inp.slots, inp.start_positions):
            if lengths[slot] != start:
                raise RuntimeError(f"slot {slot}: KV length {lengths[slot]} != step start {start}")
        meta = AttentionMetadata.build(inp.slots, inp.start_positions, inp.query_lens, self.device)
        logits = self.model(inp.input_ids, meta, self.kv, inp.logits_indices)
        for slot, start, q in zip(inp.slots, inp.start_positions, inp.query_lens):
            self.kv.extend(slot, start + q)
        return logits

    def forward(self, seqs: list[SeqInput]) -> torch.Tensor:
        """`execute` for a list of `SeqInput`: logits [sum(s.num_logits), vocab], rows in `seqs` order."""
        return self.execute(ModelInput.build([s.slot for s in seqs], [s.start for s in seqs],
                                             [s.token_ids for s in seqs], [s.num_logits for s in seqs], self.device))
