"""Shadow check: replay a sample of baseline's greedy requests on the candidate, off the response path,
and count every output difference (the `shadow` gate fails on any).

Speculative decoding is lossless: a greedy request (temperature 0, one choice) must produce the same
text with or without speculation. While a rollout with a `shadow` plan runs, `ShadowReplayer.wants()`
picks `sample` of the greedy requests (decided when the request arrives); when such a request was
served by the baseline, `submit()` replays the same body, non-streamed, on the candidate in a
background task (at most `max_in_flight` at once; a sample over that is dropped, never queued), and
compares each choice's text and finish_reason. The client's response never waits for the replay.
Where the replay runs: the gateway sends it to a healthy candidate backend; the server sends it to
itself in-process (`ShadowCapture` middleware + `SHADOW_PROFILE`, a context variable the policy honours,
so no client can force a profile this way). Replays are real requests: the server logs them with
`profile_reason` "shadow" and counts them in /metrics, and the gates leave them out.
Caveat: engines whose numerics depend on the batch (vLLM on GPU) can differ on greedy ties without any
bug in speculation; the check then fails honestly, so use it where outputs are batch-invariant.
What it does not do: compare sampled requests (their outputs are random) or token ids (text only).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from typing import Any, Awaitable, Callable

from specserve.rollout.policy import SHADOW_PROFILE

logger = logging.getLogger("specserve.rollout")

GENERATION_PATHS = {"/v1/completions": False, "/v1/chat/completions": True}  # path -> chat

Output = list[tuple[str, Any]]  # per choice index: (text, finish_reason)


def is_greedy(body: dict) -> bool:
    """temperature 0 and one choice (OpenAI's default temperature is 1, so it must be given)."""
    t = body.get("temperature")
    return (isinstance(t, (int, float)) and not isinstance(t, bool) and t == 0
            and body.get("n") in (None, 1) and not body.get("best_of"))


def outputs_from_body(body: dict, chat: bool) -> Output:
    """(text, finish_reason) per choice of a non-streamed completion or chat completion."""
    out = []
    for c in sorted(body.get("choices") or [], key=lambda c: c.get("index", 0)):
        text = ((c.get("message") or {}).get("content") if chat else c.get("text")) or ""
        out.append((text, c.get("finish_reason")))
    return out


def outputs_from_events(events: list[dict], chat: bool) -> Output:
    """The same from the parsed `data:` events of a stream (deltas joined per choice)."""
    texts: dict[int, list[str]] = {}
    finish: dict[int, Any] = {}
    for ev in events:
        for c in ev.get("choices") or []:
            i = c.get("index", 0)
            piece = ((c.get("delta") or {}).get("content") if chat else c.get("text")) or ""
            texts.setdefault(i, []).append(piece)
            if c.get("finish_reason") is not None:
                finish[i] = c["finish_reason"]
    return [("".join(texts[i]), finish.get(i)) for i in sorted(texts)]


def parse_sse(raw: bytes) -> list[dict]:
    """The JSON objects of an SSE body's `data:` lines ([DONE] and junk skipped)."""
    events = []
    for line in raw.split(b"\n"):
        if line.startswith(b"data:"):
            data = line[5:].strip()
            if data and data != b"[DONE]":
                try:
                    events.append(json.loads(data))
                except ValueError:
                    continue
    return events


def difference(baseline: Output, candidate: Output) -> str | None:
    """None when equal, else where they first differ (for the gate's reason)."""
    if len(baseline) != len(candidate):
        return f"{len(baseline)} choices on baseline, {len(candidate)} on the candidate"
    for i, ((bt, bf), (ct, cf)) in enumerate(zip(baseline, candidate)):
        if bt != ct:
            at = next((j for j, (x, y) in enumerate(zip(bt, ct)) if x != y), min(len(bt), len(ct)))
            return (f"choice {i} differs at character {at}: baseline {bt[max(0, at - 20):at + 20]!r}, "
                    f"candidate {ct[max(0, at - 20):at + 20]!r}")
        if bf != cf:
            return f"choice {i}: finish_reason {bf!r} on baseline, {cf!r} on the candidate"
    return None


class ShadowReplayer:
    """Samples and replays (see the module docstring). `controller` gives the running plan and the
    window; `replay(path, body, candidate)` returns the candidate's non-streamed response JSON."""

    def __init__(self, controller: Any, replay: Callable[[str, dict, str], Awaitable[dict]],
                 rng: random.Random | None = None):
        self.controller = controller
        self.replay = replay
        self.rng = rng or random.Random()
        self.in_flight = 0
        self.tasks: set[asyncio.Task] = set()

    def _shadow(self):
        c = self.controller
        return c.plan.shadow if c.state == "running" and c.plan is not None else None

    def wants(self, body: dict) -> bool:
        """Decide, when a request arrives, whether to capture it for a replay."""
        s = self._shadow()
        return bool(s) and self.in_flight < s.max_in_flight and is_greedy(body) and self.rng.random() < s.sample

    def submit(self, path: str, body: dict, served_by: str, baseline_output: Output, rid: str = "") -> bool:
        """Replay in the background if the request was served by the plan's baseline. Returns whether it did."""
        s = self._shadow()
        plan = self.controller.plan
        if not s or served_by != plan.baseline or self.in_flight >= s.max_in_flight or not baseline_output:
            return False
        replay_body = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "profile")}
        self.in_flight += 1
        task = asyncio.get_running_loop().create_task(
            self._run(path, replay_body, plan.candidate, GENERATION_PATHS.get(path, False), baseline_output, rid))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return True

    async def _run(self, path: str, body: dict, candidate: str, chat: bool, baseline_output: Output,
                   rid: str) -> None:
        try:
            resp = await self.replay(path, body, candidate)
            diff = difference(baseline_output, outputs_from_body(resp, chat))
            self.controller.window.add_shadow(diff is None, f"{rid or path}: {diff}" if diff else "")
            if diff:
                logger.warning("shadow: %s differs on %s: %s", rid or path, candidate, diff)
        except Exception as e:  # noqa: BLE001 - a failed replay is no evidence either way
            logger.warning("shadow: replay of %s on %s failed: %s", rid or path, candidate, e)
        finally:
            self.in_flight -= 1

    async def aclose(self) -> None:
        for t in list(self.tasks):
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


class ShadowCapture:
    """ASGI middleware of the server: captures sampled greedy requests and their responses, and hands
    those served by baseline to the replayer. Passes everything straight through otherwise."""

    def __init__(self, app: Any, replayer_getter: Callable[[], ShadowReplayer | None]):
        self.app = app
        self.replayer_getter = replayer_getter

    async def __call__(self, scope, receive, send):
        replayer = self.replayer_getter()
        if (replayer is None or scope["type"] != "http" or scope["path"] not in GENERATION_PATHS
                or SHADOW_PROFILE.get() is not None or replayer._shadow() is None):
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:  # buffer the request body, then hand the app a receive that replays it
            msg = await receive()
            if msg["type"] != "http.request":
                return await self.app(scope, _replay_receive([msg], receive), send)
            chunks.append(msg)
            more = msg.get("more_body", False)
        try:
            body = json.loads(b"".join(m.get("body", b"") for m in chunks))
        except ValueError:
            body = None
        if not isinstance(body, dict) or not replayer.wants(body):
            return await self.app(scope, _replay_receive(chunks, receive), send)
        status, profile, rid, out = 0, None, "", []

        async def capture(msg):
            nonlocal status, profile, rid
            if msg["type"] == "http.response.start":
                status = msg["status"]
                headers = {k.decode().lower(): v.decode() for k, v in msg.get("headers", [])}
                profile, rid = headers.get("x-specserve-profile"), headers.get("x-request-id", "")
            elif msg["type"] == "http.response.body":
                out.append(msg.get("body", b""))
            await send(msg)

        await self.app(scope, _replay_receive(chunks, receive), capture)
        if status != 200 or profile is None:
            return
        raw, chat = b"".join(out), GENERATION_PATHS[scope["path"]]
        try:
            output = outputs_from_events(parse_sse(raw), chat) if body.get("stream") else outputs_from_body(
                json.loads(raw), chat)
        except ValueError:
            return
        replayer.submit(scope["path"], body, profile, output, rid)


def _replay_receive(messages: list[dict], receive):
    pending = list(messages)

    async def inner():
        return pending.pop(0) if pending else await receive()

    return inner


async def replay_in_process(app: Any, path: str, body: dict, candidate: str) -> dict:
    """Send `body` to this server's own app with the candidate forced (the server's replay function)."""
    import httpx

    token = SHADOW_PROFILE.set(candidate)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://shadow",
                                     timeout=None) as client:
            r = await client.post(path, json=body)
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
        return r.json()
    finally:
        SHADOW_PROFILE.reset(token)
