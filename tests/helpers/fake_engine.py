"""A model-free stand-in with the `LLMEngine` API, for fast server tests (and client tests elsewhere).

What it does: byte-level "tokenizer" (ids 0..255 are bytes, 256 is EOS); greedy output is a fixed
function of the prompt and position (lowercase letters and spaces), identical with and without
speculation; seeded sampling is reproducible. A speculative request commits 1 + a tokens per step
(a = accepted drafts, cycling 0..k) and counts drafts like the real engine (drafts cut by a stop or
max_tokens are not counted as accepted). Stop strings, stop token ids, max_tokens, the context limit,
logprobs, abort (frees "KV" now), continuous batching up to max_num_seqs and `stats()` behave like the
engine's. `step_delay_s` makes steps slow, for disconnect and queueing tests.
What it does not do: anything a real model does. Never use it to serve.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from specserve.outputs import RequestOutput, SpecStats, TokenLogprob

EOS = 256
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


class FakeRequestError(ValueError):
    pass


class FakeTokenizer:
    eos_token_id = EOS
    vocab_size = 260

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True, **_: Any) -> str:
        out = bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        if not skip_special_tokens:
            out += "<eos>" * sum(1 for i in ids if i == EOS)
        return out


@dataclass
class _Req:
    rid: str
    prompt: list[int]
    params: Any
    spec_config: Any
    rng: random.Random
    arrival: float
    out: list[int] = field(default_factory=list)
    lps: list[TokenLogprob] = field(default_factory=list)
    text: str = ""
    emitted_tokens: int = 0
    emitted_text: int = 0
    finish_reason: str | None = None
    stop_reason: Any = None
    stats: SpecStats = field(default_factory=SpecStats)
    first_token: float | None = None
    step_no: int = 0


class FakeEngine:
    def __init__(self, *, max_model_len: int = 256, max_num_seqs: int = 8, step_delay_s: float = 0.0,
                 eos_at: int | None = None, model_name: str = "fake-model"):
        self.tokenizer = FakeTokenizer()
        self.model_name = model_name
        self.model_checksum = "fake-checksum"
        self.max_model_len = max_model_len
        self.config = SimpleNamespace(max_num_seqs=max_num_seqs, speculative_config=None)
        self.step_delay_s = step_delay_s
        self.eos_at = eos_at  # greedy requests emit EOS at this output position
        self.prepared: list[Any] = []
        self.running: list[_Req] = []
        self.waiting: list[_Req] = []
        self._aborted: list[_Req] = []
        self.ids: set[str] = set()

    def encode_prompt(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        text = "".join(f"<{m['role']}>{m.get('content') or ''}\n" for m in messages) + "<assistant>"
        return self.tokenizer.encode(text)

    def prepare_speculative_config(self, cfg: Any) -> None:
        self.prepared.append(cfg)

    def add_request(self, request_id: str, prompt: Any, params: Any, *, speculative_config: Any = None,
                    arrival_time: float | None = None) -> None:
        ids = self.encode_prompt(prompt) if isinstance(prompt, str) else list(prompt)
        if request_id in self.ids:
            raise FakeRequestError(f"request id {request_id!r} is already in use")
        if not ids:
            raise FakeRequestError("the prompt is empty")
        if any(not 0 <= t < self.tokenizer.vocab_size for t in ids):
            raise FakeRequestError("prompt token ids out of vocabulary")
        if len(ids) + 1 > self.max_model_len:
            raise FakeRequestError(f"the prompt has {len(ids)} tokens; this model's context is "
                                   f"{self.max_model_len} tokens")
        seed = params.seed if params.seed is not None else random.getrandbits(32)
        self.ids.add(request_id)
        self.waiting.append(_Req(request_id, ids, params, speculative_config, random.Random(seed),
                                 arrival_time or time.monotonic()))

    def abort_request(self, request_id: str) -> None:
        for lst in (self.running, self.waiting):
            for r in lst:
                if r.rid == request_id:
                    lst.remove(r)
                    r.finish_reason = "abort"
                    self.ids.discard(request_id)
                    self._aborted.append(r)
                    return

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting or self._aborted)

    def stats(self) -> dict:
        used = sum(len(r.prompt) + len(r.out) for r in self.running)
        cap = self.config.max_num_seqs * self.max_model_len
        return {"num_running": len(self.running), "num_waiting": len(self.waiting),
                "kv_cache_usage": used / cap, "num_kv_tokens": used}

    # ---- generation ---------------------------------------------------------------------------

    def _next_token(self, r: _Req) -> int:
        pos = len(r.out)
        if r.params.greedy:
            if self.eos_at is not None and pos == self.eos_at:
                return EOS
            h = sum(r.prompt) % 26
            return 32 if (h + pos) % 7 == 6 else ord(_LETTERS[(h + pos) % 26])
        return ord(_LETTERS[r.rng.randrange(26)])

    def _commit(self, r: _Req, tok: int) -> bool:
        """Append one token with every stop check. True when the request finished."""
        p = r.params
        r.out.append(tok)
        if p.logprobs is not None:
            lp = -0.25 - (tok % 7) / 10
            top = [(tok, lp)] + [((tok + j) % 256, lp - j) for j in range(1, p.logprobs)]
            r.lps.append(TokenLogprob(tok, lp, top[: p.logprobs]))
        if (tok == EOS and not p.ignore_eos) or tok in p.stop_token_ids:
            r.finish_reason, r.stop_reason = "stop", (None if tok == EOS and tok not in p.stop_token_ids else tok)
            return True
        if tok < 256:
            r.text = self.tokenizer.decode(r.out)
            for s in p.stop:
                i = r.text.find(s)
                if i != -1:
                    r.text, r.finish_reason, r.stop_reason = r.text[:i], "stop", s
                    return True
        at_cap = p.max_tokens is not None and len(r.out) >= p.max_tokens
        if at_cap or len(r.prompt) + len(r.out) >= self.max_model_len:
            r.finish_reason = "length"
            return True
        return False

    def step(self) -> list[RequestOutput]:
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        outs = [self._output(r) for r in self._aborted]
        self._aborted.clear()
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            self.running.append(self.waiting.pop(0))
        for r in list(self.running):
            k = r.spec_config.num_speculative_tokens if (r.spec_config is not None and r.out) else 0
            accepted = r.step_no % (k + 1) if k else 0
            r.step_no += 1
            committed = 0
            for _ in range(1 + accepted):
                committed += 1
                if self._commit(r, self._next_token(r)):
                    break
            if k:
                acc = min(accepted, committed - 1)
                r.stats.add(SpecStats(1, k, acc, [1] * acc + [0] * (k - acc), committed))
            if r.first_token is None:
                r.first_token = time.monotonic()
            if r.finish_reason is not None:
                self.running.remove(r)
                self.ids.discard(r.rid)
            outs.append(self._output(r))
        return outs

    def _output(self, r: _Req) -> RequestOutput:
        held = 0
        if r.finish_reason is None:  # hold back a possible stop-string prefix, like the engine
            for s in r.params.stop:
                for n in range(min(len(s) - 1, len(r.text)), 0, -1):
                    if r.text.endswith(s[:n]):
                        held = max(held, n)
                        break
        vis = len(r.text) - held
        new_text = r.text[r.emitted_text:vis] if vis > r.emitted_text else ""
        new_ids, new_lps = r.out[r.emitted_tokens:], (r.lps[r.emitted_tokens:] if r.params.logprobs is not None
                                                       else None)
        r.emitted_tokens, r.emitted_text = len(r.out), max(vis, r.emitted_text)
        return RequestOutput(
            request_id=r.rid, prompt_token_ids=r.prompt, new_token_ids=new_ids, new_text=new_text,
            new_logprobs=new_lps, token_ids=list(r.out), text=r.text,
            logprobs=list(r.lps) if r.params.logprobs is not None else None,
            finished=r.finish_reason is not None, finish_reason=r.finish_reason, stop_reason=r.stop_reason,
            spec_stats=r.stats, metrics={"arrival": r.arrival, "first_token": r.first_token},
        )
