"""The README's two set-up commands are the ones CI and users run."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _readme_commands():
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```bash\n(python3 -m venv[^\n]*)\n```", text)


def test_readme_opens_with_the_train_and_test_commands():
    train_cmd, test_cmd = _readme_commands()[:2]
    assert train_cmd.endswith("masktrl train") and "torch==2.13.0" in train_cmd
    assert (
        "python -m pytest" in test_cmd
        and test_cmd.endswith("bash scripts/test_vllm.sh")
        and "torch==2.13.0" in test_cmd
    )


def test_ci_runs_exactly_the_readme_test_command():
    test_cmd = _readme_commands()[1]
    assert test_cmd in (ROOT / ".ci" / "run").read_text().splitlines()
