"""``--resume NAME --force`` with a change the checkpoint or the machine cannot take (docs/RELIABILITY.md):
the model's shape (LoRA on, off or of another rank, another architecture, another hidden size),
a task with another vocabulary, an engine that is not installed. Each is refused with one line
and exit code 2 before anything is written, so the run stays byte for byte as it was; ``--dry-run``
makes the same checks. Issue #37 cases 2 and 3."""

import hashlib
import importlib.util
import json

import pytest

from tests.conftest import cli, copy_run, write_tiny_config

LORA = {"model": {"lora": {"rank": 4, "alpha": 8}}}


def _finished(base, overlay=None):
    config = write_tiny_config(base / "tiny.yaml", overlay)
    cli("train", "--config", config, "--out", base / "out", "--run", "r")
    return config, base / "out", base / "out" / "r"


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """A complete 2-step run of the tiny model (copy it before changing it)."""
    return _finished(tmp_path_factory.mktemp("plain"))


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    """A complete 2-step LoRA run (rank 4) of the tiny model."""
    return _finished(tmp_path_factory.mktemp("lora"), LORA)


def hashes(root):
    """sha256 of every file under the run folder (and the folder's entries): what 'byte for byte' compares."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(root.rglob("*"))
    }


def words_file(tmp_path):
    """A dataset task whose alphabet (so the tiny model's vocabulary) is not arithmetic's."""
    path = tmp_path / "words.jsonl"
    words = ["abc", "cab", "bca", "aab", "abb", "bab", "cca", "acb", "bbc", "cac", "aca", "bcc"]
    path.write_text("".join(json.dumps({"word": w, "target": w[::-1]}) + "\n" for w in words))
    return path


PLAIN_CHANGES = [
    (["model.lora.rank=4"], "model.lora.rank"),
    (["model.architecture=llama"], "does not fit"),
    (["model.hidden_size=64"], "does not fit"),
]
LORA_CHANGES = [(["model.lora.rank=8"], "does not fit"), (["model.lora.rank=null"], "model.lora.rank")]


def _refused(cli_error, out, sets, needle, *, dry_run):
    args = ["train", "--resume", "r", "--out", out, "--force", "--set", "train.steps=3"]
    for item in sets:
        args += ["--set", item]
    line = cli_error(*args, *(["--dry-run"] if dry_run else []))
    assert needle in line, line
    return line


@pytest.mark.parametrize("dry_run", [False, True], ids=["run", "dry-run"])
@pytest.mark.parametrize("sets,needle", PLAIN_CHANGES, ids=[c[0][0] for c in PLAIN_CHANGES])
def test_a_model_shape_change_is_refused_before_anything_is_written(plain, tmp_path, cli_error, sets, needle, dry_run):
    _, out, root = copy_run(plain, tmp_path)
    before = hashes(root)
    line = _refused(cli_error, out, sets, needle, dry_run=dry_run)
    assert "nothing was changed" in line
    assert hashes(root) == before
    assert "complete" in cli("runs", out).output


@pytest.mark.parametrize("dry_run", [False, True], ids=["run", "dry-run"])
@pytest.mark.parametrize("sets,needle", LORA_CHANGES, ids=[c[0][0] for c in LORA_CHANGES])
def test_a_lora_change_is_refused_before_anything_is_written(lora, tmp_path, cli_error, sets, needle, dry_run):
    _, out, root = copy_run(lora, tmp_path)
    before = hashes(root)
    _refused(cli_error, out, sets, needle, dry_run=dry_run)
    assert hashes(root) == before


@pytest.mark.parametrize("dry_run", [False, True], ids=["run", "dry-run"])
def test_a_task_with_another_vocabulary_is_refused_before_anything_is_written(plain, tmp_path, cli_error, dry_run):
    _, out, root = copy_run(plain, tmp_path)
    before = hashes(root)
    sets = [
        "task.name=dataset",
        f"task.source={words_file(tmp_path)}",
        "task.prompt_key=word",
        "task.answer_key=target",
        "task.template={prompt}>",
        "task.reward=exact-match",
        "task.n_test=4",
    ]
    _refused(cli_error, out, sets, "does not fit", dry_run=dry_run)
    assert hashes(root) == before


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
@pytest.mark.parametrize("dry_run", [False, True], ids=["run", "dry-run"])
def test_an_engine_that_is_not_installed_is_refused_before_anything_is_written(plain, tmp_path, cli_error, dry_run):
    _, out, root = copy_run(plain, tmp_path)
    before = hashes(root)
    _refused(cli_error, out, ["rollout.engine=vllm"], "vLLM is not installed", dry_run=dry_run)
    assert hashes(root) == before


def test_a_change_the_checkpoint_takes_still_resumes(plain, tmp_path):
    """The checks refuse what cannot load, nothing else: more steps and another learning rate resume."""
    _, out, root = copy_run(plain, tmp_path)
    cli("train", "--resume", "r", "--out", out, "--force", "--set", "train.steps=3", "--set", "train.lr=2e-3")
    assert json.loads((root / "summary.json").read_text())["steps"] == 3
