"""JSON-lines request log: one line per completion request, whatever its outcome.

Fields: id, time (unix seconds at arrival), endpoint, profile, profile_reason, rollout_step (the staged
rollout's step when the profile was chosen, e.g. "ngram_4@5%"; null without one), method, k, model,
model_checksum, n, stream, prompt_tokens, completion_tokens, ttft_s, e2e_s, num_drafts,
num_draft_tokens, num_accepted_tokens, num_accepted_tokens_per_pos, acceptance_rate,
mean_acceptance_length, finish_reason (one per choice, joined by ","), status ("ok" | "error" |
"cancelled"), http_status, error (message, for errors). With `log_prompts`, also `prompt` and `output`
(text, or token ids for a token-id prompt); without it no prompt or output text is written.
`subscribe(fn)` also hands every record to `fn` (the rollout window), with or without a log file.
Every string field is cut to `MAX_FIELD_CHARS` characters (a client's header or body cannot grow a
line); a missing value is written as null.
What it does not do: rotation or shipping (point a log collector at the file); metrics (see
`specserve.metrics.prometheus`).
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import IO, Any, Callable

logger = logging.getLogger("specserve.server")

FIELDS = (
    "id", "time", "endpoint", "profile", "profile_reason", "rollout_step", "method", "k", "model", "model_checksum",
    "n", "stream",
    "prompt_tokens", "completion_tokens", "ttft_s", "e2e_s", "num_drafts", "num_draft_tokens",
    "num_accepted_tokens", "num_accepted_tokens_per_pos", "acceptance_rate", "mean_acceptance_length",
    "finish_reason", "status", "http_status", "error",
)
TEXT_FIELDS = ("prompt", "output")
MAX_FIELD_CHARS = 512


def _cut(value: Any) -> Any:
    if isinstance(value, str) and len(value) > MAX_FIELD_CHARS:
        return value[: MAX_FIELD_CHARS - 3] + "..."
    return value


class RequestLog:
    """Append-only JSON-lines writer (thread-safe, flushed per line). `path` None = disabled; `fields` are
    the keys written, in order (the gateway writes its own set)."""

    def __init__(self, path: str | Path | None, *, log_prompts: bool = False, fields: tuple[str, ...] = FIELDS):
        self.path = Path(path) if path else None
        self.fields = fields
        self.log_prompts = log_prompts
        self._lock = threading.Lock()
        self._fh: IO[str] | None = None
        self._subscribers: list[Callable[[dict[str, Any]], None]] = []
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = self.path.open("a", encoding="utf-8", buffering=1)

    @property
    def enabled(self) -> bool:
        return self._fh is not None

    def subscribe(self, fn: Callable[[dict[str, Any]], None]) -> None:
        """Call `fn(record)` for every record written from now on (errors in `fn` are logged, not raised)."""
        self._subscribers.append(fn)

    def write(self, record: dict[str, Any]) -> None:
        """Write one record: known fields in a fixed order, text fields only with log_prompts."""
        for fn in self._subscribers:
            try:
                fn(record)
            except Exception:  # noqa: BLE001 - a subscriber must never fail a request
                logger.exception("request log subscriber failed")
        if self._fh is None:
            return
        line = {k: _cut(record.get(k)) for k in self.fields}
        if self.log_prompts:
            for k in TEXT_FIELDS:
                line[k] = record.get(k)
        text = json.dumps(line, ensure_ascii=False, default=str)
        with self._lock:
            if self._fh is not None:
                self._fh.write(text + "\n")

    def close(self) -> None:
        with self._lock:
            if self._fh is not None:
                self._fh.close()
                self._fh = None
