"""specserve's C++ extensions: each is compiled once per machine on first use and loaded from a cache.

Two hot paths of the engine are C++ (`specserve/model/panel_linear.cpp`, the CPU linear layers, and
`specserve/spec_decode/suffix_tree.cpp`, the suffix proposer's tree). Each is one source file built with
torch.utils.cpp_extension (gcc and ninja; the `ninja` wheel is a dependency) with -O3 -march=native, so
the build directory is named after a hash of the source, the flags, this CPU's instruction-set flags, the
torch version and install folder, and the Python ABI (EXT_SUFFIX) and include folder: another CPU
type, torch, Python or virtual environment compiles anew, an unchanged one loads in well under a
second. (The install and include folders are in the hash because torch writes them into the folder's
build.ninja: two checkouts with their own venvs sharing one folder would rewrite it, and rebuild, on
every alternate load.) The cache lives under ~/.cache/specserve/kernels
(SPECSERVE_KERNEL_DIR overrides).

A build that fails is remembered with its reason (the first line that reports an error); every later
`load` raises it at once, so a caller can fall back (with a logged warning) or fail with that message.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import sysconfig
import threading
from pathlib import Path
from types import ModuleType

import torch

from specserve.config import ConfigError


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _ninja_on_path() -> None:
    """torch.utils.cpp_extension runs `ninja`: use the `ninja` package's binary when none is on PATH."""
    if shutil.which("ninja"):
        return
    try:
        import ninja  # the PyPI package ships the binary
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


class NativeUnavailableError(ConfigError, RuntimeError):
    """A native kernel that was asked for by name (`--cpu-linear panel`, `SPECSERVE_CPU_LAYER_KERNELS=native`)
    cannot be used here: it cannot be built, or it does not support the model. A ConfigError, so the CLI
    prints one line; a RuntimeError, as the build failures it wraps."""


class NativeExtension:
    """One C++ source file compiled on first use (thread-safe) and cached per CPU type and torch install.

    Args:
        name: the extension's base name (a Python identifier); the module is named
            `{name}_{16 hex digits of the build hash}`.
        source: path of the .cpp file (it defines the pybind11 module TORCH_EXTENSION_NAME).
        cflags: compiler flags; also part of the build hash.
        what: how error messages name it, e.g. "the panel linear kernel".
    """

    def __init__(self, name: str, source: Path, cflags: list[str], what: str) -> None:
        self.name, self.source, self.cflags, self.what = name, source, cflags, what
        self._lock = threading.Lock()
        self._module: ModuleType | None = None
        self._error: str | None = None

    def build_name(self) -> str:
        digest = hashlib.sha256()
        for part in (self.source.read_bytes(), " ".join(self.cflags).encode(), _cpu_flags().encode(),
                     torch.__version__.encode(), str(Path(torch.__file__).resolve().parent).encode(),
                     str(sysconfig.get_paths().get("include")).encode(),
                     str(sysconfig.get_config_var("EXT_SUFFIX")).encode()):
            digest.update(part)
        return f"{self.name}_{digest.hexdigest()[:16]}"

    def load(self) -> ModuleType:
        """The compiled module (built on first use, ~10-20 s; then loaded from the cache).

        Raises:
            RuntimeError: it cannot be built here (no C++ compiler, no ninja, a compile error); the message
                says why. The failure is remembered: later calls raise at once.
        """
        module = self._module
        if module is not None:  # the hot path (a linear layer's every call): no lock
            return module
        with self._lock:
            if self._module is not None:
                return self._module
            if self._error is not None:
                raise RuntimeError(self._error)
            try:
                from torch.utils.cpp_extension import load

                _ninja_on_path()
                name = self.build_name()
                root = Path(os.environ.get("SPECSERVE_KERNEL_DIR") or Path.home() / ".cache" / "specserve" / "kernels")
                build_dir = root / name
                build_dir.mkdir(parents=True, exist_ok=True)
                self._module = load(name=name, sources=[str(self.source)], extra_cflags=self.cflags,
                                    extra_ldflags=["-fopenmp"] if "-fopenmp" in self.cflags else [],
                                    build_directory=str(build_dir), verbose=False)
            except Exception as e:  # noqa: BLE001 - any build failure means "not available here"
                lines = str(e).strip().splitlines()
                errors = [ln.strip() for ln in lines if "error" in ln.lower() and not ln.lstrip().startswith("[")]
                first = (errors or lines or [type(e).__name__])[0]  # the compiler's error, not the command line
                self._error = f"{self.what} could not be built: {type(e).__name__}: {first}"
                raise RuntimeError(self._error) from e
            return self._module

    def available(self) -> bool:
        """Whether the extension can be built (or is built) on this machine; builds it if needed."""
        try:
            self.load()
        except RuntimeError:
            return False
        return True


def native_cflags(openmp: bool) -> list[str]:
    """-O3 -march=native (and -fopenmp), with 512-bit vectors preferred on x86-64 (gcc's default for some
    Intel -march targets is 256 bits)."""
    flags = ["-O3", "-march=native"] + (["-fopenmp"] if openmp else [])
    if platform.machine() in ("x86_64", "AMD64"):
        flags.append("-mprefer-vector-width=512")
    return flags
