"""The README's "Layout" block names every module below specserve/ and benchmarks/, and nothing else
(package `__init__.py` files aside), so the map a new reader starts from stays true."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _layout_modules() -> dict[str, set[str]]:
    """{folder: module file names} as the README's Layout code block lists them."""
    text = (ROOT / "README.md").read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    groups: dict[str, set[str]] = {}
    top = folder = ""
    for line in block.splitlines():
        if m := re.match(r"^(\w+)/(.*)$", line):  # specserve/, benchmarks/, docs/, ...
            top = folder = m.group(1)
            rest = m.group(2)
        elif top in ("specserve", "benchmarks") and (m := re.match(r"^  (\w+)/(.*)$", line)):  # a subfolder
            folder, rest = f"{top}/{m.group(1)}", m.group(2)
        elif top == "specserve" and re.match(r"^  \w+\.py", line):  # modules of the package root
            folder, rest = "specserve", line
        else:  # a continuation line of the same folder
            rest = line
        groups.setdefault(folder, set()).update(re.findall(r"(?<![/\w])\w+\.py\b", rest))  # not a/path.py
    return groups


def _tree_modules() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for base in ("specserve", "benchmarks"):
        for f in (ROOT / base).rglob("*.py"):
            out.setdefault(str(f.parent.relative_to(ROOT)), set()).add(f.name)
    return out


def test_readme_layout_matches_the_tree():
    layout, tree = _layout_modules(), _tree_modules()
    for folder in sorted(set(tree) | {f for f in layout if f.split("/")[0] in ("specserve", "benchmarks")}):
        want = tree.get(folder, set()) - {"__init__.py"}
        got = layout.get(folder, set()) - {"__init__.py"}
        assert got == want, f"README Layout, {folder}/: missing {sorted(want - got)}, not in the tree {sorted(got - want)}"
