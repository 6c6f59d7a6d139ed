"""The model runner on CUDA: fused forward, CUDA graphs captured at start-up, eager for the rest.

What it does: the same job and interface as `ModelRunner` (`forward(seqs) -> logits`, KV lengths
extended), on a CUDA device. At construction it captures one CUDA graph of `FusedForward` per shape
bucket (`step_buckets.BucketSet`: token count x sequence count x longest sequence), all sharing one
memory pool and one set of static input/output buffers. A step that fits a bucket (decodes, verify
blocks, prompt chunks of up to `prefill_tokens` with the decodes beside them, the draft model's steps
and catch-ups) is packed into the bucket's padded layout on the host, copied to the device in one
transfer, and replayed; a step outside every bucket (a longer prompt chunk) runs the same fused forward
eagerly, which on the H200 costs 12-15 ms of kernel launches whatever its size. Nothing is compiled or planned per shape after start-up: every kernel reads the
step's shape from device tensors, so the first time a shape is seen costs what the hundredth does.
The logits returned for a graph step are a view of the static output buffer, valid until the next
forward of this runner.
What it does not do: schedule, sample or roll back (the engine truncates the KV cache after verification).
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from specserve.engine.kv_cache import KVCache
from specserve.engine.model_runner import SeqInput
from specserve.engine.step_buckets import Bucket, BucketSet, StepLayout, pack_step
from specserve.model.fused_forward import FusedForward, StepTensors
from specserve.model.triton_ops import SPLIT_MAX_QLEN
from specserve.model.llama import CausalLM

logger = logging.getLogger(__name__)


class CudaGraphRunner:
    """`forward(seqs)` -> float32 logits [sum(num_logits), vocab], like `ModelRunner`, on CUDA.

    Args:
        model: the loaded `CausalLM` (on `device`); kv: its `KVCache`.
        max_num_seqs: most sequences in one step (sizes the graph buckets).
        batch_invariant: every matmul in fixed reduction order (`FusedForward`); a verify block's logits
            are then bit-identical to one-token decodes.
        cuda_graphs: capture graphs (False: every step eager, e.g. to debug or compare).
        max_qlen: most new tokens of one sequence in a decode bucket (1 + largest k).
        max_graph_tokens: most tokens of a decode bucket.
        prefill_tokens: most tokens of a prefill bucket (a step with a longer sequence, up to this many
            tokens in all; 0: such steps run eagerly).

    Attributes:
        capture_seconds: time the start-up capture took; num_graph_steps / num_eager_steps: counters;
        last_step_long: the last step held a sequence of more than `max_qlen` (`short_qlen`) new tokens
        (a prefill chunk, replayed in a prefill graph or eager); the step-cost table does not model such
        steps (`llm_engine.step_overhead_ms`).
    """

    def __init__(self, model: CausalLM, kv: KVCache, device: torch.device, max_num_seqs: int,
                 batch_invariant: bool = False, cuda_graphs: bool = True, max_qlen: int = SPLIT_MAX_QLEN,
                 max_graph_tokens: int = 512, prefill_tokens: int = 512):
        self.model = model
        self.kv = kv
        self.device = device
        self.fwd = FusedForward(model, batch_invariant)
        self.short_qlen = max_qlen
        self.buckets = BucketSet(max_num_seqs, max_qlen, min(max_graph_tokens, max_num_seqs * max_qlen), prefill_tokens)
        self.layout = StepLayout(self.buckets.max_tokens, self.buckets.max_seqs)
        self._host = [torch.zeros(self.layout.size, dtype=torch.int32, pin_memory=True) for _ in range(2)]
        self._host_np = [h.numpy() for h in self._host]
        self._copied = [torch.cuda.Event() for _ in range(2)]  # set when a host buffer's copy has run
        self._flip = 0
        self._dev = torch.zeros(self.layout.size, dtype=torch.int32, device=device)
        vocab = model.config.vocab_size
        self._out = torch.empty((self.layout.max_tokens, vocab), dtype=torch.float32, device=device)
        self._graphs: dict[Bucket, torch.cuda.CUDAGraph] = {}
        self.num_graph_steps = 0
        self.num_eager_steps = 0
        self.last_step_long = False
        self.capture_seconds = 0.0
        if cuda_graphs:
            self._capture_all()

    @property
    def graph_max_qlen(self) -> int | None:
        """The most new tokens one sequence may have in a step that replays a graph (longer: eager);
        None when no graphs were captured."""
        return self.buckets.max_qlen if self._graphs else None

    @property
    def graph_max_tokens(self) -> int | None:
        """The most tokens of a graph step that holds a sequence of `graph_max_qlen` new tokens (the
        largest prefill bucket, or decode bucket without them); None when no graphs were captured."""
        return self.buckets.max_tokens_at_max_qlen if self._graphs else None

    def fits_graph(self, qlens: list[int]) -> bool:
        """Whether a step whose sequences have `qlens` new tokens each would replay a graph."""
        return bool(self._graphs) and self.buckets.fits(qlens)

    def _static_step(self, b: Bucket) -> StepTensors:
        f = lambda name, n: self.layout.field(self._dev, name, n)  # noqa: E731
        return StepTensors(f("input_ids", b.num_tokens), f("positions", b.num_tokens), f("token_slots", b.num_tokens),
                           f("logits_rows", b.num_tokens), f("seq_qstart", b.num_seqs), f("seq_qlen", b.num_seqs),
                           f("seq_ctx", b.num_seqs), f("seq_slot", b.num_seqs),
                           min(b.num_tokens, b.max_qlen))

    @torch.inference_mode()
    def _capture_all(self) -> None:
        t0 = time.perf_counter()
        # Capture with an all-padding step (no KV writes, no attention work): graphs record kernels, not data.
        h = self._host_np[0]
        h[:] = 0
        self.layout.field(h, "token_slots", self.layout.max_tokens)[:] = -1
        self._dev.copy_(self._host[0])
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        for b in sorted(self.buckets.buckets, reverse=True):  # largest first: the pool is sized once
            step = self._static_step(b)
            out = self._out[: b.num_tokens]
            with torch.cuda.stream(stream):
                self.fwd(step, self.kv, out=out)  # warm-up: compiles kernels, sets up cuBLAS for this shape
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool, stream=stream):
                self.fwd(step, self.kv, out=out)
            self._graphs[b] = g
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - t0
        logger.info("captured %d CUDA graphs in %.1f s", len(self._graphs), self.capture_seconds)

    def forward(self, seqs: list[SeqInput]) -> torch.Tensor:
        """Run the model once over all `seqs` and extend each slot's valid length.

        Returns:
            logits [R, vocab] with R = sum(s.num_logits), rows in `seqs` order (for a graph step a view of
            the static output buffer, overwritten by the next forward).

        Raises:
            RuntimeError: a sequence's start is not its slot's KV length.
        """
        return self.run([s.slot for s in seqs], [s.start for s in seqs], [s.token_ids for s in seqs],
                        [s.num_logits for s in seqs])

    def execute(self, inp) -> torch.Tensor:
        """`run` for the step plan's `ModelInput`: the graphs are packed from its host-side lists
        (slots, start_positions, token_ids, num_rows); its device tensors are not needed here."""
        return self.run(inp.slots, inp.start_positions, inp.token_ids, inp.num_rows)

    def run(self, slots: list[int], starts: list[int], token_ids: list[list[int]],
            num_logits: list[int], device_ids: torch.Tensor | None = None) -> torch.Tensor:
        """`forward` for a step given as per-sequence lists (slot, first position, new tokens, logits rows).

        Args:
            device_ids: optional [T] token ids already on the device (a draft model's previous argmax);
                they replace the flat `token_ids` (which then only give each sequence's length) after the
                host-to-device copy, in stream order: chained forwards need no device-to-host copy.
        """
        lengths = self.kv.lengths
        for slot, start in zip(slots, starts):
            if lengths[slot] != start:
                raise RuntimeError(f"slot {slot}: KV length {lengths[slot]} != step start {start}")
        qlens = [len(t) for t in token_ids]
        qmax, T, B = max(qlens), sum(qlens), len(slots)
        bucket = self.buckets.pick(B, T, qmax) if self._graphs else None
        self.last_step_long = qmax > self.short_qlen
        if bucket is not None:
            self._flip ^= 1  # two host buffers: never refill one whose copy may still be in flight
            i = self._flip
            self._copied[i].synchronize()  # returns at once unless the host ran two steps ahead of the GPU
            R = pack_step(self._host_np[i], self.layout, slots, starts, token_ids, num_logits, bucket.num_tokens,
                          bucket.num_seqs)
            self._dev.copy_(self._host[i], non_blocking=True)
            self._copied[i].record()
            if device_ids is not None:
                self.layout.field(self._dev, "input_ids", T).copy_(device_ids)
            self._graphs[bucket].replay()
            self.num_graph_steps += 1
            logits = self._out[:R]
        else:
            layout = StepLayout(T, B)
            host = np.empty(layout.size, dtype=np.int32)
            R = pack_step(host, layout, slots, starts, token_ids, num_logits, T, B)
            dev = torch.from_numpy(host).to(self.device, non_blocking=False)
            if device_ids is not None:
                layout.field(dev, "input_ids", T).copy_(device_ids)
            f = lambda name, n: layout.field(dev, name, n)  # noqa: E731
            step = StepTensors(f("input_ids", T), f("positions", T), f("token_slots", T), f("logits_rows", R),
                               f("seq_qstart", B), f("seq_qlen", B), f("seq_ctx", B), f("seq_slot", B), qmax,
                               has_short=min(qlens) <= SPLIT_MAX_QLEN)
            self.num_eager_steps += 1
            logits = self.fwd(step, self.kv)
        for slot, start, q in zip(slots, starts, qlens):
            self.kv.extend(slot, start + q)
        return logits
