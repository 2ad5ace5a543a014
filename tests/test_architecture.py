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


def _functions(folder: str):
    import ast

    for path in sorted((REPO / "masktrl" / folder).glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield f"{path.relative_to(REPO)}:{node.lineno} {node.name}", node.end_lineno - node.lineno + 1


def test_recipes_and_rl_functions_fit_on_a_screen():
    """No function in recipes/ or rl/ is longer than 60 lines (docs/DESIGN.md)."""
    long = [f"{name} ({n} lines)" for folder in ("recipes", "rl") for name, n in _functions(folder) if n > 60]
    assert not long, long


def test_commands_are_thin():
    """No command module is longer than 120 lines: a command parses, calls one stage, prints."""
    long = [f"{p.relative_to(REPO)} ({n} lines)" for p in sorted((REPO / "masktrl" / "commands").rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > 120]
    assert not long, long


def test_stage_keys_are_parsed_only_by_the_run_store():
    """``split("/")`` on a stage key appears in runs/store.py only."""
    hits = [f"{p.relative_to(REPO)}:{i}" for p in sorted((REPO / "masktrl").rglob("*.py")) if p.name != "store.py"
            for i, line in enumerate(p.read_text().splitlines(), 1) if 'split("/")' in line]
    assert not hits, hits
