"""The import direction of docs/DESIGN.md, enforced: `lint-imports` checks the contracts of
pyproject.toml ([tool.importlinter]) and fails on any import against the layers."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_imports_point_one_way():
    lint = Path(sys.executable).with_name("lint-imports")
    assert lint.is_file(), "lint-imports is missing: pip install -e '.[dev]' (import-linter)"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([str(lint), "--no-cache", "--no-logo"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout and "Contracts: 4 kept" in r.stdout, r.stdout[-2000:]
