"""How long one forward of a model takes, as a function of the tokens and sequences in the step.

What it does: `measure_step_cost` times real forwards through a model's own runner on the device it
runs on (so CPU threading, huge-page weights or CUDA graphs are all in the numbers): one sequence with
T = 1..16 new tokens (and a sparser grid above), and B sequences of one token each; every point is
timed `repeats` times in rotating order after a short warm-up (on a CPU by the process's CPU time, on
CUDA by the wall clock), and the fastest timing kept (`fit`). On a CPU the table is then converted to
wall-clock ms: a forward on T threads spends up to T CPU-ms per wall ms (the 0.5b's decode read 140
"ms" of CPU time on 2 threads against ~80 ms of wall time), so the CPU times are scaled by the lower
quartile of the measured wall / CPU-time ratios (`meta["cpu_time_to_wall"]`; the lower quartile, as
other processes only ever add wall time). `StepCostModel` interpolates those points: forward_ms(T, B) = f(T) + e(B), where f is the one-sequence curve
(piecewise linear between measured points, linear beyond the last) and e(B) the extra cost of B
sequences over one sequence of the same token count (attention and metadata per sequence).
On CUDA that sum does not describe the device: steps run as CUDA graphs bucketed by (sequences, tokens
per sequence), so a step's cost does not follow its token count alone: 16 sequences of 2 tokens replay a
decode graph (~1.3 ms for the 0.5b on the H200), one sequence of 32 new tokens a prefill graph whose
attention grid is sized for a long sequence, and a prefill chunk past the largest prefill graph runs
eagerly (~11 ms). There the measurement also times uniform batches, B
sequences of q new tokens each (the shapes decode and verify steps have), and forward_ms(T, B) for B >= 2
interpolates that grid at q = T / B (bilinear; beyond the grid's B, linear), falling back to f + e only
for steps with more tokens per sequence than the grid (a prefill chunk is in them). The step
time outside the forward (proposing, sampling, stop checks, detokenizing) is fitted online as
overhead_ms + draft_overhead_ms x (draft tokens verified in the step), and `step_ms` adds it: on a fast
GPU at 16 concurrent requests the host work that grows with the drafts (more rows to sample and commit)
can cost more than the forward's own growth. On CUDA the engine derives a step's overhead as its wall
time minus the modelled forward (the launch returns before the GPU finishes). `load_or_measure` caches the measurement as JSON under `$SPECSERVE_HOME/step_cost/`, keyed
by model checksum, dtype, device, torch version and threads, and a fingerprint of the model code, so a
new build of the forward is re-measured; `refresh=True` measures again. A measurement taken while the
machine was busy (`machine_busy`: the 1-minute load average above BUSY_LOAD_PER_CPU per CPU, before
or after measuring, or a multi-threaded CPU measurement whose threads did not run side by side) is
used for this run but not cached, with a warning: on a shared 2-core machine a table measured beside
a test suite read ~5x the idle figures and, cached, was reused until cleared.
What it does not do: choose k (see `specserve.spec_decode.adaptive`), or model the context length
(the measurement uses one context, `context` tokens already in the KV cache).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from bisect import bisect_right
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

logger = logging.getLogger(__name__)

SCHEMA = "specserve.step_cost/2"  # /2: the uniform-batch grid (CUDA); /1 tables are measured again
RIDGE_TOKENS2 = 4.0  # the overhead fit's ridge term (draft tokens squared), see observe_overhead
BUSY_LOAD_PER_CPU = 1.5  # machine_busy: more runnable threads than this per CPU distort timings
UNPARALLEL_WALL_PER_CPU = 0.8  # machine_busy: a multi-threaded CPU forward this close to 1 wall ms per CPU-ms
DENSE_TOKENS = 16  # T = 1..16 are all measured: CPU GEMM kernels step up every few rows


@dataclass
class StepCostModel:
    """Measured forward time of a step.

    Attributes:
        tokens: grid of new-token counts T measured with one sequence, ascending, starting at 1.
        token_ms: median ms of one forward with T new tokens (one sequence), same length as `tokens`.
        seqs: grid of sequence counts B, ascending, starting at 1.
        seq_extra_ms: ms that B sequences of one token cost over one sequence of B tokens (0.0 at B=1).
        overhead_ms: step time outside the forward (ms) of a step without drafts, fitted online
            (`observe_overhead`).
        meta: how and where it was measured (model, dtype, device, threads, context, repeats, time).
        draft_overhead_ms: extra step time outside the forward per draft token verified (ms), fitted
            online together with overhead_ms; never negative.
        batch_seqs, batch_qlens, batch_ms: the uniform-batch grid (empty when not measured, as on a CPU):
            batch_ms[i][j] = ms of one forward over batch_seqs[i] (>= 2) sequences of batch_qlens[j] new
            tokens each; both grids ascending.
    """

    tokens: list[int]
    token_ms: list[float]
    seqs: list[int] = field(default_factory=lambda: [1])
    seq_extra_ms: list[float] = field(default_factory=lambda: [0.0])
    overhead_ms: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)
    draft_overhead_ms: float = 0.0
    batch_seqs: list[int] = field(default_factory=list)
    batch_qlens: list[int] = field(default_factory=list)
    batch_ms: list[list[float]] = field(default_factory=list)
    # online fit state: steps seen, and weighted means E[d], E[o], E[d*d], E[d*o] (d drafts, o overhead ms)
    _n: int = field(default=0, repr=False, compare=False)
    _moments: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0, 0.0], repr=False, compare=False)
    _memo: dict[tuple[int, int], float] = field(default_factory=dict, repr=False, compare=False)  # forward_ms

    def __post_init__(self) -> None:
        if not self.tokens or self.tokens[0] != 1 or len(self.tokens) != len(self.token_ms):
            raise ValueError("StepCostModel needs token_ms for a token grid that starts at 1")
        if any(b <= a for a, b in zip(self.tokens, self.tokens[1:])) or any(b <= a for a, b in zip(self.seqs, self.seqs[1:])):
            raise ValueError("StepCostModel grids must be strictly ascending")
        if not self.seqs or self.seqs[0] != 1 or len(self.seqs) != len(self.seq_extra_ms):
            raise ValueError("StepCostModel needs seq_extra_ms for a sequence grid that starts at 1")
        if self.batch_seqs or self.batch_qlens or self.batch_ms:
            bs, qs = self.batch_seqs, self.batch_qlens
            if (not bs or not qs or bs[0] < 2 or qs[0] < 1 or any(b <= a for a, b in zip(bs, bs[1:]))
                    or any(b <= a for a, b in zip(qs, qs[1:]))):
                raise ValueError("StepCostModel's batch grid needs ascending batch_seqs >= 2 and batch_qlens >= 1")
            if len(self.batch_ms) != len(bs) or any(len(row) != len(qs) for row in self.batch_ms):
                raise ValueError("StepCostModel's batch_ms must be len(batch_seqs) rows of len(batch_qlens) values")

    @staticmethod
    def _interp(xs: Sequence[int], ys: Sequence[float], x: float) -> float:
        if len(xs) == 1:
            return ys[0]
        i = min(max(bisect_right(xs, x) - 1, 0), len(xs) - 2)
        x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
        slope = (y1 - y0) / (x1 - x0)
        if x > x1:  # beyond the grid: continue the last segment, never downwards
            return y1 + max(slope, 0.0) * (x - x1)
        return y0 + slope * (x - x0)

    def forward_ms(self, num_tokens: int, num_seqs: int = 1) -> float:
        """Estimated ms of one forward over `num_tokens` new tokens in `num_seqs` sequences (0 tokens: 0)."""
        if num_tokens <= 0:
            return 0.0
        ms = self._memo.get((num_tokens, num_seqs))  # the adaptive schedule asks for the same points every step
        if ms is None:
            q = num_tokens / max(num_seqs, 1)
            if self.batch_ms and num_seqs >= self.batch_seqs[0] and q <= self.batch_qlens[-1]:
                by_seqs = [self._interp(self.batch_qlens, row, q) for row in self.batch_ms]
                ms = self._interp(self.batch_seqs, by_seqs, num_seqs)
            else:
                extra = self._interp(self.seqs, self.seq_extra_ms, max(num_seqs, 1)) if num_seqs > 1 else 0.0
                ms = self._interp(self.tokens, self.token_ms, num_tokens) + extra
            ms = self._memo[(num_tokens, num_seqs)] = max(ms, 0.0)
        return ms

    def step_ms(self, num_tokens: int, num_seqs: int = 1, num_draft_tokens: int = 0) -> float:
        """forward_ms plus the step time outside the forward (ms) for a step that verifies
        `num_draft_tokens` draft tokens (part of `num_tokens`)."""
        return self.forward_ms(num_tokens, num_seqs) + self.overhead_ms + self.draft_overhead_ms * num_draft_tokens

    def relative(self, num_tokens: int, num_seqs: int = 1) -> float:
        """forward_ms(num_tokens, num_seqs) / forward_ms(num_seqs, num_seqs): the cost of a verify step
        against the plain decode step of the same batch (1.0 = free drafts)."""
        return self.forward_ms(num_tokens, num_seqs) / max(self.forward_ms(num_seqs, num_seqs), 1e-9)

    def observe_overhead(self, ms: float, num_draft_tokens: int = 0, weight: float = 0.05) -> None:
        """Fold one step's time outside the forward (`ms`) and the draft tokens it verified into the fit
        overhead = overhead_ms + draft_overhead_ms x draft tokens: exponentially weighted ridge
        regression (a plain running mean over the first 1/weight steps, then `weight` per step; the
        slope is cov(d, o) / (var(d) + RIDGE_TOKENS2), kept >= 0). The ridge term pulls the slope to 0
        while the draft tokens per step hardly vary: a run of identical steps cannot tell base from
        slope, and a slope learnt from a few early, slow draft steps (on the H200, the first verify
        steps included a Triton compile: 0.85 ms per draft token, after which no step drafted again and
        the slope stayed) fades as the evidence ages instead of holding forever. A negative `ms` is
        ignored."""
        if ms < 0:
            return
        self._n += 1
        w = max(weight, 1.0 / self._n)
        d = float(num_draft_tokens)
        m = self._moments
        for i, v in enumerate((d, ms, d * d, d * ms)):
            m[i] += w * (v - m[i])
        var = max(m[2] - m[0] * m[0], 0.0)
        self.draft_overhead_ms = max((m[3] - m[0] * m[1]) / (var + RIDGE_TOKENS2), 0.0)
        self.overhead_ms = max(m[1] - self.draft_overhead_ms * m[0], 0.0)

    def scaled(self, factor: float) -> "StepCostModel":
        """The same table with every measured ms (token_ms, seq_extra_ms, batch_ms) times `factor`, e.g.
        CPU-time ms to wall ms; the online overhead fit starts anew."""
        return StepCostModel(list(self.tokens), [x * factor for x in self.token_ms], list(self.seqs),
                             [x * factor for x in self.seq_extra_ms], 0.0, dict(self.meta),
                             batch_seqs=list(self.batch_seqs), batch_qlens=list(self.batch_qlens),
                             batch_ms=[[x * factor for x in row] for row in self.batch_ms])

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for online in ("_n", "_moments", "_memo", "draft_overhead_ms"):
            d.pop(online)
        d["schema"] = SCHEMA
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "StepCostModel":
        """Inverse of to_dict. Raises ValueError for another schema or a malformed table."""
        if d.get("schema") != SCHEMA:
            raise ValueError(f"not a {SCHEMA} table")
        return cls(list(d["tokens"]), [float(x) for x in d["token_ms"]], list(d["seqs"]),
                   [float(x) for x in d["seq_extra_ms"]], 0.0, dict(d.get("meta") or {}),
                   batch_seqs=list(d.get("batch_seqs") or []), batch_qlens=list(d.get("batch_qlens") or []),
                   batch_ms=[[float(x) for x in row] for row in d.get("batch_ms") or []])

    def summary(self) -> str:
        """One line: decode ms and the cost of 1 + k tokens relative to it, e.g. for the serve log."""
        base = self.forward_ms(1)
        ks = [k for k in (1, 2, 3, 4, 5, 8, 12, 16) if 1 + k <= self.tokens[-1] + 1]
        rel = " ".join(f"k={k}:{self.forward_ms(1 + k) / base:.2f}x" for k in ks)
        return f"decode {base:.1f} ms (wall); verify 1+k tokens vs decode: {rel}"


def token_grid(max_tokens: int) -> list[int]:
    """T = 1..16, then ~1.5x steps (multiples of 8) up to max_tokens."""
    grid = list(range(1, min(DENSE_TOKENS, max_tokens) + 1))
    t = DENSE_TOKENS
    while t < max_tokens:
        t = min(max_tokens, max(t + 8, int(t * 1.5) // 8 * 8))
        grid.append(t)
    return grid


def seq_grid(max_seqs: int) -> list[int]:
    """B = 1, 2, 4, 8, ... up to max_seqs (max_seqs itself included)."""
    grid, b = [1], 2
    while b < max_seqs:
        grid.append(b)
        b *= 2
    if max_seqs > 1:
        grid.append(max_seqs)
    return grid


def qlen_grid(max_qlen: int) -> list[int]:
    """q = 1..9 (1 + k for the usual k), then 12 and 16, up to max_qlen."""
    return [q for q in (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16) if q <= max_qlen]


def fit(token_points: dict[int, list[float]], seq_points: dict[int, list[float]], meta: dict | None = None,
        batch_points: dict[tuple[int, int], list[float]] | None = None) -> StepCostModel:
    """Build the model from repeated timings (ms): `token_points[T]` = forwards of one sequence with T
    tokens, `seq_points[B]` = forwards of B sequences of one token each (B >= 2), and optionally
    `batch_points[(B, q)]` = forwards of B sequences (>= 2) of q tokens each, a full grid.

    Each point keeps its fastest timing: on a shared machine noise only ever adds time, and the fastest
    of a few rotated rounds is the forward's own cost. No shape is imposed: more tokens can cost less
    (on the CPU measured here, 4 new tokens took less time than 2 or 3: the GEMM library switches
    kernels with the row count). e(B) = fastest(B sequences) - f(B), at least 0.
    """
    tokens = sorted(token_points)
    token_ms = [min(token_points[t]) for t in tokens]
    partial = StepCostModel(tokens, token_ms)
    seqs, extra = [1], [0.0]
    for b in sorted(seq_points):
        if b >= 2:
            seqs.append(b)
            extra.append(max(min(seq_points[b]) - partial.forward_ms(b), 0.0))
    bs = sorted({b for b, _ in batch_points or {}})
    qs = sorted({q for _, q in batch_points or {}})
    grid = [[min(batch_points[(b, q)]) for q in qs] for b in bs] if bs else []
    return StepCostModel(tokens, token_ms, seqs, extra, 0.0, dict(meta or {}), batch_seqs=bs, batch_qlens=qs,
                         batch_ms=grid)


def measure(run_forward: Callable[[list[int]], float], tokens: list[int], seqs: list[int], repeats: int = 3,
            target_s: float = 3.0, max_repeats: int = 15, qlens: Sequence[int] = ()) -> StepCostModel:
    """Time `run_forward(new_tokens_per_seq)` (returns ms of one forward) over the grids and fit; with
    `qlens`, also B sequences of q tokens each for every B >= 2 of `seqs` and q of `qlens`.

    Three warm-up forwards (dropped), then at least `repeats` rounds, more (up to `max_repeats`) while
    they fit in about `target_s` seconds (fast devices get more samples against jitter). Each round
    visits every point in an order rotated by one per round, so that slow phases of a shared machine
    hit every point alike; `fit` keeps the fastest timing of each point.
    """
    uniform = [(b, q) for b in seqs if b >= 2 for q in qlens]
    points: list[tuple[str, Any]] = ([("t", t) for t in tokens] + [("b", b) for b in seqs if b >= 2]
                                     + [("u", bq) for bq in uniform])
    tok: dict[int, list[float]] = {t: [] for t in tokens}
    seq: dict[int, list[float]] = {b: [] for b in seqs if b >= 2}
    batch: dict[tuple[int, int], list[float]] = {bq: [] for bq in uniform}

    def shape(kind: str, n: Any) -> list[int]:
        return [n] if kind == "t" else [1] * n if kind == "b" else [n[1]] * n[0]

    def store(kind: str, n: Any) -> list[float]:
        return tok[n] if kind == "t" else seq[n] if kind == "b" else batch[n]

    for kind, n in (points[0], points[0], points[len(tokens) - 1]):  # warm-up (weights paged in, caches built)
        run_forward(shape(kind, n))
    for bq in uniform:  # every batch shape once, not timed (its kernels' first launch)
        run_forward(shape("u", bq))
    first_s = 0.0
    rounds = repeats
    for r in range(max_repeats):
        if r >= rounds:
            break
        shift = r % len(points)
        t0 = time.perf_counter()
        for kind, n in points[shift:] + points[:shift]:
            store(kind, n).append(run_forward(shape(kind, n)))
        if r == 0:
            first_s = time.perf_counter() - t0
            rounds = min(max_repeats, max(repeats, int(target_s / max(first_s, 1e-6))))
    return fit(tok, seq, {"repeats": rounds, "round_s": round(first_s, 3)}, batch)


def measure_model(model: Any, *, max_tokens: int, max_seqs: int, context: int = 256, repeats: int = 3,
                  target_s: float = 3.0) -> StepCostModel:
    """Measure a `LoadedModel` (the target or a draft model) through its runner, on its device.

    Uses up to `max_seqs` free KV slots (fewer if fewer are free; they are freed afterwards), each
    holding `context` tokens of a fixed pattern; every timed forward asks logits for all its rows, as
    a verify step does.

    Raises:
        RuntimeError: no KV slot is free.
    """
    import torch

    from specserve.engine.model_runner import SeqInput

    kv, runner, dev = model.kv, model.runner, model.device
    context = max(1, min(context, model.max_model_len - max_tokens - 1))
    max_tokens = max(1, min(max_tokens, model.max_model_len - context - 1))
    slots = []
    try:
        while len(slots) < max_seqs and kv.num_free_slots > 0:
            slots.append(kv.allocate())
        if not slots:
            raise RuntimeError("cannot measure the step cost: every KV slot is in use")
        vocab = model.config.vocab_size
        ctx_ids = [(1000 + 7 * i) % vocab for i in range(context)]
        for s in slots:
            runner.forward([SeqInput(s, 0, ctx_ids, 1)])
        # On a CPU the process's CPU time, not the wall clock: on a shared machine the wall clock also
        # counts the turns of other processes, which drown the differences between token counts. The
        # wall / CPU-time ratio of every forward converts the table to wall ms afterwards.
        cuda = dev.type == "cuda"
        clock = time.perf_counter if cuda else time.process_time
        wall_per_cpu: list[float] = []

        def run_forward(per_seq: list[int]) -> float:
            seqs_in = []
            for s, n in zip(slots, per_seq):
                kv.truncate(s, context)
                seqs_in.append(SeqInput(s, context, [(11 + j) % vocab for j in range(n)], n))
            if cuda:
                torch.cuda.synchronize(dev)
            t0, w0 = clock(), time.perf_counter()
            runner.forward(seqs_in)
            if cuda:
                torch.cuda.synchronize(dev)
            ms = 1000 * (clock() - t0)
            if not cuda and ms > 0:
                wall_per_cpu.append(1000 * (time.perf_counter() - w0) / ms)
            return ms

        t0 = time.perf_counter()
        # on CUDA, decode and verify steps replay graphs bucketed by (sequences, tokens per sequence); the
        # qlen grid covers the decode buckets' sequences (up to short_qlen), not the prefill buckets' longer
        # ones (the token grid's one-sequence points above short_qlen do replay prefill buckets)
        max_qlen = getattr(runner, "short_qlen", 16)
        cm = measure(run_forward, token_grid(max_tokens), seq_grid(len(slots)), repeats, target_s,
                     qlens=qlen_grid(min(max_qlen, max_tokens)) if cuda else ())
    finally:
        for s in slots:
            kv.free(s)
    clock_name = "wall"
    if not cuda and wall_per_cpu:
        ratios = sorted(wall_per_cpu)
        factor = ratios[len(ratios) // 4]
        meta = cm.meta
        cm = cm.scaled(factor)
        cm.meta = {**meta, "cpu_time_to_wall": round(factor, 4)}
        clock_name = "process cpu time x cpu_time_to_wall"
    cm.meta.update(measurement_meta(model), context=context, clock=clock_name,
                   measure_s=round(time.perf_counter() - t0, 2), measured_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    return cm


def cpu_model_name() -> str:
    """The processor's model name from /proc/cpuinfo, else `platform.processor()` or the machine type."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _device_name(device: Any) -> str:
    if getattr(device, "type", "cpu") == "cuda":
        import torch

        return torch.cuda.get_device_name(device)
    return cpu_model_name()


def _code_fingerprint() -> str:
    """sha256 of the sources that decide how fast a forward is, the C++ kernels included (a new build is
    re-measured)."""
    import specserve

    root = Path(specserve.__file__).parent
    h = hashlib.sha256()
    for p in sorted(list((root / "model").glob("*.py")) + list((root / "model").glob("*.cpp"))
                    + list((root / "engine").glob("*.py")) + [root / "native.py"]):  # native.py: the compiler flags
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def measurement_meta(model: Any) -> dict[str, Any]:
    """What the cache key is made of: model, checksum, dtype, device (type, name), torch, threads, code, and
    the CPU kernels the loaded model uses (`linear_backend`, `layer_backend`: a fallback after a failed
    build, or an environment choice, is another measurement)."""
    import torch

    net = getattr(model, "model", None)
    return {"model": model.files.name, "checksum": model.files.checksum, "dtype": str(model.dtype).removeprefix("torch."),
            "device": str(model.device), "device_name": _device_name(model.device), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "code": _code_fingerprint(),
            "linear_backend": getattr(net, "linear_backend", None), "layer_backend": getattr(net, "layer_backend", None)}


def cache_path(model: Any, max_tokens: int, max_seqs: int, context: int) -> Path:
    """Where the measurement of `model` with this grid lives: $SPECSERVE_HOME/step_cost/<model>-<key>.json."""
    from specserve.hub import home

    meta = measurement_meta(model)
    name = meta.pop("model")  # the checksum identifies the weights; a folder's name may change
    key = json.dumps({**meta, "max_tokens": max_tokens, "max_seqs": max_seqs, "context": context}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in name)[:60] if model.files.source == "catalog" else "model"
    return home() / "step_cost" / f"{safe}-{digest}.json"


PROBE_SIZE = 512  # parallel_probe's square fp32 matmul (spreads over the threads of any BLAS)
PROBE_MS = 60.0  # parallel_probe's duration, ms
PROBE_PARALLEL = 0.65  # the probe ran its threads side by side when it reads at most this (0.5 on 2 idle cores)


def parallel_probe(duration_ms: float = PROBE_MS) -> float:
    """Wall ms per process CPU-ms of PROBE_SIZE x PROBE_SIZE fp32 matmuls repeated for ~`duration_ms` on
    torch's current threads: ~1 / threads where the threads run side by side, ~1.0 (or more) where
    other work holds the cores."""
    import torch

    a = torch.full((PROBE_SIZE, PROBE_SIZE), 0.5)  # not randn: the probe must not advance the global RNG
    torch.mm(a, a)  # warm-up: thread pool and kernel selection
    c0, w0 = time.process_time(), time.perf_counter()
    while time.perf_counter() - w0 < duration_ms / 1000:
        torch.mm(a, a)
    return (time.perf_counter() - w0) / max(time.process_time() - c0, 1e-9)


def machine_busy(measured: "StepCostModel | None" = None) -> str | None:
    """Why timings taken now would not be the device's own, or None.

    - The 1-minute load average is above BUSY_LOAD_PER_CPU x the machine's CPUs (other work competes
      for them). Both are host-wide (in a container limited to a few CPUs of a big host, the host's
      load against that cpuset would read "busy" forever). The average lags by about a minute and
      counts this process's own threads (up to one per CPU while it measures), hence 1.5 per CPU.
    - Or, for a CPU measurement (`measured`) with two or more threads: its forwards did not run their
      threads side by side (`cpu_time_to_wall` above UNPARALLEL_WALL_PER_CPU), and a matmul that spreads
      over them, timed right after, did not clearly either (`parallel_probe` above PROBE_PARALLEL; it is
      recorded as `meta["probe_cpu_time_to_wall"]`).
      On 2 idle cores the 0.5b's forwards take 0.50 wall ms per CPU-ms; beside other work, threads that
      spin while waiting for a core inflate the CPU time too (0.96 and a decode read 631 ms against 72
      ms idle, at a load average of 2.1-2.95 on 2 CPUs, under the first rule's threshold). A model too
      small to spread its forwards (a tiny test model) reads ~1.0 on idle cores too; the probe tells
      the two apart, so its table is cached.
    None where neither applies (or the load average is unavailable)."""
    if measured is not None:
        ratio, threads = measured.meta.get("cpu_time_to_wall"), measured.meta.get("threads") or 1
        if ratio is not None and threads >= 2 and ratio > UNPARALLEL_WALL_PER_CPU:
            # a model too small to spread its forwards over the threads reads ~1.0 on idle cores too:
            # only when a matmul that does spread reads the same are the cores taken by other work
            probe = measured.meta["probe_cpu_time_to_wall"] = round(parallel_probe(), 4)
            if probe > PROBE_PARALLEL:
                return (f"{threads} threads but {ratio:.2f} wall ms per CPU-ms, and {probe:.2f} for a "
                        f"{PROBE_SIZE}x{PROBE_SIZE} matmul: they did not run side by side")
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
    cpus = os.cpu_count() or 1
    if load > BUSY_LOAD_PER_CPU * cpus:
        return f"load average {load:.1f} on {cpus} CPU{'s' if cpus > 1 else ''}"
    return None


def load_or_measure(model: Any, *, max_tokens: int, max_seqs: int, context: int = 256, repeats: int = 3,
                    refresh: bool = False, role: str = "target") -> StepCostModel:
    """The cached measurement of `model` on this device, or a new one (written to the cache unless the
    machine was busy while it was taken, see `machine_busy`; then `meta["busy"]` says why). `role`
    ("target" or "draft") only names the model in the log: a model that drafts for itself is measured
    once in each role (different grids).

    A cache file that cannot be read is measured again; one that cannot be written only logs a warning.
    """
    path = cache_path(model, max_tokens, max_seqs, context)
    if not refresh and path.is_file():
        try:
            cm = StepCostModel.from_dict(json.loads(path.read_text()))
            cm.meta["cache"] = str(path)
            return cm
        except (OSError, ValueError, KeyError, TypeError) as e:
            logger.warning("step cost cache %s is unreadable (%s); measuring again", path, e)
    logger.info("measuring the step cost of %s (%s) on %s (once per model, dtype and device)", model.files.name, role,
                model.device)
    busy = machine_busy()
    cm = measure_model(model, max_tokens=max_tokens, max_seqs=max_seqs, context=context, repeats=repeats)
    busy = busy or machine_busy(cm)
    if busy:
        cm.meta["busy"] = busy
        logger.warning("the step cost of %s was measured while the machine was busy (%s): used for this run, "
                       "not cached; it is measured again at the next start (%s)", model.files.name, busy, cm.summary())
        return cm
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(cm.to_dict(), indent=1) + "\n")
        tmp.replace(path)
        cm.meta["cache"] = str(path)
    except OSError as e:
        logger.warning("could not cache the step cost in %s: %s", path, e)
    logger.info("step cost of %s (%s): %s", model.files.name, role, cm.summary())
    return cm
