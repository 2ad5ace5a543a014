"""docs/METHODS.md is the reference the method code cites: every `§N` (or `§N.M`, `§N-M`) cited in
masktrl/methods exists as a numbered section, §0-§10 keep their meaning, and no citation points
outside the repository."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "METHODS.md"
CODE = sorted((ROOT / "masktrl" / "methods").glob("*.py"))


def sections() -> dict[str, str]:
    heads = re.findall(r"^#{2,3} (\d+(?:\.\d+)?)\.? (.+)$", DOC.read_text(), flags=re.M)
    return dict(heads)


def test_numbered_sections_keep_their_meaning():
    s = sections()
    want = {
        "0": "Notation",
        "1": "Support and tail",
        "2": "PPO",
        "3": "DPPO",
        "4": "Predictive divergence mask",
        "4.1": "Full vocabulary",
        "4.2": "Top-K estimators",
        "4.4": "Certified bracket",
        "5": "GSPO",
        "6": "Selective importance sampling",
        "7": "Validity",
        "8": "Aggregation",
        "9": "Provenance",
        "10": "Public API",
        "11": "Group advantages",
        "12": "Per-step diagnostics",
        "14": "Off-policy corrections",
        "14.1": "Kinds and keys",
        "14.3": "Bypass and decoupled",
        "15": "CISPO",
    }
    for num, title in want.items():
        assert num in s and s[num].startswith(title), (num, s.get(num))


def test_every_citation_in_the_method_code_exists():
    s = sections()
    cited = set()
    for path in CODE:
        text = path.read_text()
        assert "SPEC" not in text and "shared/" not in text, path.name
        for a, b in re.findall(r"§(\d+(?:\.\d+)?)(?:-(\d+))?", text):
            cited.add(a)
            if b:
                cited.update(str(i) for i in range(int(a.split(".")[0]), int(b) + 1))
    assert {"4.5", "4.6", "6.1", "8.1", "11", "12"} <= cited | set(s)
    missing = sorted(c for c in cited if c not in s)
    assert not missing, f"cited but not in docs/METHODS.md: {missing}"


def test_every_method_and_correction_kind_is_documented():
    from masktrl.methods import method_names
    from masktrl.methods.corrections import CORRECTION_KINDS, RS_STATS

    text = DOC.read_text()
    for name in method_names():  # a row of the §10 parameter table
        assert re.search(rf"^\| `{name}` \|", text, flags=re.M), name
    section = text.split("## 14. Off-policy corrections")[1].split("## 15.")[0]
    for kind in CORRECTION_KINDS:  # a row of the §14.1 table
        assert re.search(rf"^\| `{kind}`", section, flags=re.M), kind
    for stat in {s.split("_k")[0] + "_k*" for s in RS_STATS}:  # verl's four families of rs statistics
        assert stat in section, stat
