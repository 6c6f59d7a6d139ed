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
from specserve.model.attention import AttentionMetadata, sdpa_rows_match_decodes
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


class ModelInput:
    """One forward's inputs: B sequences, T = sum(query_lens) new tokens, R logits rows.

    Sequence b feeds tokens [query_start_loc[b], query_start_loc[b + 1]) of the flat step, at positions
    start_positions[b] ... into KV slot slots[b]; its logits rows are its last num_rows[b] tokens, in
    sequence order. The per-sequence host lists are always there; the flat device tensors are built on
    first use (int64 views of one buffer, one host-to-device copy), so a runner that packs its own
    layout from the host lists (`specserve.engine.cuda_graph_runner`) pays nothing for them.

    Attributes:
        slots, start_positions, query_lens, num_rows: per sequence, host lists.
        token_ids: the new tokens per sequence, host lists.
        input_ids: [T] token ids (device).
        positions: [T] position of each token in its sequence.
        slot_mapping: [T] KV slot of each token.
        query_start_loc: [B + 1] cumulative new-token offsets (query_start_loc[0] = 0).
        seq_lens: [B] context length of each sequence after the step (start + new tokens).
        logits_indices: [R] flat token index of each logits row.
    """

    _FIELDS = ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "logits_indices")

    def __init__(self, slots: Sequence[int], starts: Sequence[int], token_ids: Sequence[Sequence[int]],
                 num_rows: Sequence[int], device: torch.device):
        qlens = []
        for slot, toks, nr in zip(slots, token_ids, num_rows):
            n = len(toks)
            if n == 0 or not 0 <= nr <= n:
                raise ValueError(f"slot {slot}: {n} new tokens and {nr} logits rows")
            qlens.append(n)
        self.slots, self.start_positions, self.query_lens = list(slots), list(starts), qlens
        self.num_rows, self.token_ids, self.device = list(num_rows), list(token_ids), device
        self._tensors: tuple[torch.Tensor, ...] | None = None

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @classmethod
    def build(
        cls,
        slots: Sequence[int],
        starts: Sequence[int],
        token_ids: Sequence[Sequence[int]],
        num_rows: Sequence[int],
        device: torch.device,
    ) -> "ModelInput":
        """The one place the flat layout is defined (the StepPlan and `SeqInput` callers both use it).

        Raises:
            ValueError: a sequence with no new tokens, or more logits rows than new tokens.
        """
        return cls(slots, starts, token_ids, num_rows, device)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """(input_ids, positions, slot_mapping, query_start_loc, seq_lens, logits_indices), built once."""
        if self._tensors is None:
            ids: list[int] = []
            pos: list[int] = []
            slot_map: list[int] = []
            qsl = [0]
            rows: list[int] = []
            for slot, start, toks, nr in zip(self.slots, self.start_positions, self.token_ids, self.num_rows):
                n = len(toks)
                ids += toks
                pos += range(start, start + n)
                slot_map += [slot] * n
                end = qsl[-1] + n
                rows += range(end - nr, end)
                qsl.append(end)
            seq_lens = [s + q for s, q in zip(self.start_positions, self.query_lens)]
            T, B = len(ids), len(self.query_lens)
            flat = torch.tensor(ids + pos + slot_map + qsl + seq_lens + rows, dtype=torch.int64)
            flat = flat.to(self.device, non_blocking=True)
            self._tensors = tuple(flat.split([T, T, T, B + 1, B, len(rows)]))
        return self._tensors

    input_ids = property(lambda self: self.tensors()[0])
    positions = property(lambda self: self.tensors()[1])
    slot_mapping = property(lambda self: self.tensors()[2])
    query_start_loc = property(lambda self: self.tensors()[3])
    seq_lens = property(lambda self: self.tensors()[4])
    logits_indices = property(lambda self: self.tensors()[5])


class ModelRunner:
    """Owns a model and its KV cache; `execute(model_input)` -> float32 logits [R, vocab]."""

    def __init__(self, model: CausalLM, kv: KVCache, device: torch.device):
        self.model = model
        self.kv = kv
        self.device = device
        # a verify block attended row by row where this machine's SDPA would give its rows other bits
        # than one-token decodes (specserve.model.attention, module docstring); a model without a
        # transformer config (a test's toy model) has no such attention to probe, and the fused CPU
        # kernels (specserve.model.cpu_layer_ops) attend every row on its own by construction
        cfg = getattr(model, "config", None)
        self.fused_cpu_layers = getattr(model, "cpu_layer_ops", None) is not None  # attention reads slots/positions only
        self.verify_by_row = (cfg is not None and not self.fused_cpu_layers
                              and not sdpa_rows_match_decodes(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                                              next(model.parameters()).dtype, device))

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
        by_row = None
        if self.verify_by_row:  # verify blocks: every row sampled, after cached positions
            by_row = [q > 1 and nr == q and p0 > 0
                      for q, nr, p0 in zip(inp.query_lens, inp.num_rows, inp.start_positions)]
        meta = AttentionMetadata.build(inp.slots, inp.start_positions, inp.query_lens, self.device, by_row,
                                       masks=not self.fused_cpu_layers)
        logits = self.model(inp.input_ids, meta, self.kv, inp.logits_indices)
        for slot, start, q in zip(inp.slots, inp.start_positions, inp.query_lens):
            self.kv.extend(slot, start + q)
        return logits

    def forward(self, seqs: list[SeqInput]) -> torch.Tensor:
        """`execute` for a list of `SeqInput`: logits [sum(s.num_logits), vocab], rows in `seqs` order."""
        return self.run([s.slot for s in seqs], [s.start for s in seqs], [s.token_ids for s in seqs],
                        [s.num_logits for s in seqs])

    def run(self, slots: list[int], starts: list[int], token_ids: list[list[int]], num_logits: list[int],
            device_ids: torch.Tensor | None = None) -> torch.Tensor:
        """`forward` for a step given as per-sequence lists (slot, first position, new tokens, logits rows).

        Args:
            device_ids: optional [T] token ids already on the device (e.g. a draft model's previous
                argmax); they replace the flat `token_ids` (which then only give each sequence's length),
                so a caller can chain forwards without a device-to-host copy in between.
        """
        inp = ModelInput.build(slots, starts, token_ids, num_logits, self.device)
        if device_ids is not None:
            inp.input_ids.copy_(device_ids)
        return self.execute(inp)
