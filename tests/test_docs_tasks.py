"""The Python examples of docs/TASKS.md run as written (on CPU, with the tiny model)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("datasets")


def python_blocks():
    return re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "TASKS.md").read_text(), flags=re.S)


def run_script(tmp_path, code, *args):
    script = tmp_path / "example.py"
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_DATASETS_CACHE": str(tmp_path / "hf-cache")}
    proc = subprocess.run(
        [sys.executable, str(script), *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_train_example_runs_two_steps_with_its_registered_reward(tmp_path):
    train_example = next(b for b in python_blocks() if "register_reward" in b and "train(plan_config(cfg" in b)
    out = tmp_path / "work"
    out.mkdir()
    before, after = map(float, run_script(tmp_path, train_example, str(out)).split()[-2:])
    assert 0.0 <= before <= 1.0 and 0.0 <= after <= 1.0
    rows = [json.loads(line) for line in (out / "reverse-run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["reward_errors"] == 0 for r in rows)


def test_register_task_example(tmp_path):
    example = next(b for b in python_blocks() if "register_task" in b)
    lines = run_script(tmp_path, example).splitlines()
    assert lines == ["['Is abba (4) a palindrome? ', 'Is abc (3) a palindrome? ']", "[1.0, 0.0]"]
