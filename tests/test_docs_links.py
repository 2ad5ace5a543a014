"""Every page a file of the repository names as ``docs/NAME.md`` exists, and every numbered
section it cites as ``docs/NAME.md §N`` (or ``§N.M``) is a numbered heading of that page, so a
page merged, renamed or renumbered cannot leave a reference behind."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [
    "README.md",
    "docs/*.md",
    "masktrl/**/*.py",
    "tests/*.py",
    "benchmarks/*.py",
    "scripts/*.py",
    "configs/**/*.yaml",
]
PAGE = re.compile(r"docs/([\w.-]+\.md)")
SECTION = re.compile(r"docs/(\w+)\.md,? §(\d+(?:\.\d+)?)")
HEADING = re.compile(r"^#{2,3} (\d+(?:\.\d+)?)\.? ", re.M)


def _texts() -> dict[str, str]:
    files = [p for g in SOURCES for p in sorted(ROOT.glob(g)) if p != Path(__file__).resolve()]  # not its own examples
    return {p.relative_to(ROOT).as_posix(): p.read_text() for p in files}


def numbered(page: Path) -> set[str]:
    return set(HEADING.findall(page.read_text())) if page.is_file() else set()


def broken(texts: dict[str, str], docs: Path) -> list[str]:
    """'FILE: REFERENCE' for every page named that does not exist and every section cited that does not."""
    out = [f"{f}: docs/{m[1]}" for f, t in texts.items() for m in PAGE.finditer(t) if not (docs / m[1]).is_file()]
    heads = {p.stem: numbered(p) for p in docs.glob("*.md")}
    out += [f"{f}: {m[0]}" for f, t in texts.items() for m in SECTION.finditer(t) if m[2] not in heads.get(m[1], set())]
    return out


def test_every_page_and_section_cited_exists():
    texts = _texts()
    assert len(texts) > 100 and sum(len(SECTION.findall(t)) for t in texts.values()) > 50
    assert broken(texts, ROOT / "docs") == []


def test_a_removed_page_or_a_missing_section_is_caught(tmp_path):
    (tmp_path / "A.md").write_text("# A\n\n## 1. One\n\n### 1.1 Sub\n")
    ok = {"x.py": "see docs/A.md §1 and docs/A.md §1.1"}
    assert broken(ok, tmp_path) == []
    bad = {"x.py": "see docs/A.md §2, docs/A_perf.md and docs/B.md §1"}
    assert broken(bad, tmp_path) == [
        "x.py: docs/A_perf.md",
        "x.py: docs/B.md",
        "x.py: docs/A.md §2",
        "x.py: docs/B.md §1",
    ]
