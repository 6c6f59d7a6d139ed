"""Every design note the code cites is in the repository (issue 8, "References inside the repository"):
each `docs/<file>.md` named in a source, test, benchmark, script or doc file exists, each case number
cited (`B10`) is a case of docs/speculation-cases.md, and nothing cites DESIGN.md, a file outside the
repository. Model-free and fast: it reads the tracked files as text."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CITED_DOC = re.compile(r"\bdocs/[A-Za-z0-9_./-]+\.md\b")
CASE = re.compile(r"\bB[0-9]{2}\b")
CASE_HEADING = re.compile(r"^#+ *(B[0-9]{2})\b", re.M)
OUTSIDE = re.compile(r"\bDESIGN\.md\b")


def _tracked_text_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "*.py", "*.md", "*.sh", "*.toml"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / p for p in out.splitlines() if (ROOT / p).is_file()]


def test_every_cited_doc_exists_and_nothing_cites_outside_the_repo():
    missing, outside = [], []
    for f in _tracked_text_files():
        if f == Path(__file__).resolve():
            continue
        text = f.read_text(encoding="utf-8", errors="replace")
        rel = f.relative_to(ROOT)
        missing += [f"{rel}: {d}" for d in sorted(set(CITED_DOC.findall(text))) if not (ROOT / d).is_file()]
        outside += [f"{rel}:{text[:m.start()].count(chr(10)) + 1}" for m in OUTSIDE.finditer(text)]
    assert not missing, f"cited docs that do not exist: {missing}"
    assert not outside, f"citations of DESIGN.md (not in the repository; cite docs/design.md): {outside}"


def test_every_cited_case_number_is_a_case_of_the_doc():
    cases = set(CASE_HEADING.findall((ROOT / "docs/speculation-cases.md").read_text(encoding="utf-8")))
    assert len(cases) >= 10
    cited = {}
    for f in _tracked_text_files():
        if f.suffix == ".py":
            for c in CASE.findall(f.read_text(encoding="utf-8", errors="replace")):
                cited.setdefault(c, str(f.relative_to(ROOT)))
    assert not {c: f for c, f in cited.items() if c not in cases}, "case numbers cited that docs/speculation-cases.md lacks"
