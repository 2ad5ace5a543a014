"""caches.tidy: a command that is refused, fails or is a dry run leaves no folder that the libraries'
imports made under --out (torch's dynamo cache under .cache/torchinductor, vLLM's); only empty
folders are removed, a file is never, and an --out that existed before is left as it is."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from masktrl import caches

ROOT = Path(__file__).resolve().parents[1]


def contained(monkeypatch, out: Path) -> None:
    for key in ("MPLCONFIGDIR", "TORCHINDUCTOR_CACHE_DIR"):
        monkeypatch.delenv(key, raising=False)  # contain() sets them; monkeypatch restores them
    monkeypatch.setattr(caches, "_made", [])
    monkeypatch.setattr(caches, "_scratch_root", None)
    monkeypatch.setattr(caches, "_mode", None)
    caches.contain(["train", "--out", str(out)])


def test_empty_folders_made_under_a_new_out_are_removed(tmp_path, monkeypatch):
    out = tmp_path / "out"
    contained(monkeypatch, out)
    (out / ".cache" / "torchinductor" / "dynamo").mkdir(parents=True)
    caches.tidy()
    assert not out.exists()


def test_a_file_is_kept_with_the_folders_above_it(tmp_path, monkeypatch):
    out = tmp_path / "out"
    contained(monkeypatch, out)
    (out / ".cache" / "torchinductor").mkdir(parents=True)
    (out / ".cache" / "empty").mkdir()
    (out / ".cache" / "torchinductor" / "f").write_text("x")
    caches.tidy()
    assert (out / ".cache" / "torchinductor" / "f").read_text() == "x"
    assert not (out / ".cache" / "empty").exists()


def test_an_out_that_existed_is_left_as_it_was(tmp_path, monkeypatch):
    out = tmp_path / "out"
    (out / ".cache" / "torchinductor").mkdir(parents=True)  # an earlier run's
    contained(monkeypatch, out)
    (out / ".cache" / "torchinductor" / "dynamo").mkdir()
    caches.tidy()
    assert (out / ".cache" / "torchinductor" / "dynamo").is_dir()


def test_without_out_nothing_is_tidied(tmp_path, monkeypatch):
    monkeypatch.setattr(caches, "_made", [])
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)  # contain() sets it; restored after
    caches.contain(["analyze", "compare", str(tmp_path)])
    (tmp_path / "x").mkdir()
    caches.tidy()
    assert (tmp_path / "x").is_dir()


def test_a_dry_run_of_the_lab_leaves_no_out(tmp_path):
    """The lab's checks import torch's dynamo, whose import makes its cache folder under --out."""
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "masktrl.cli", "train", "--config", "configs/lab.yaml", "--out", str(out), "--dry-run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "nothing was written" in done.stdout
    assert not out.exists()


def test_without_out_torchs_inductor_folder_is_removed_at_exit(tmp_path):
    """Importing torch's dynamo (transformers' generate does) made ``torchinductor_<user>`` in the
    system's temporary folder, where a command without --out (``masktrl eval`` of a run given by
    path) left it; it now lives in a temporary folder of its own, removed when the process exits."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    code = (
        "import os; from masktrl import caches; caches.contain(['eval', 'gsm8k']); import torch._dynamo; "
        "print(os.environ['TORCHINDUCTOR_CACHE_DIR'])"
    )
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env={**env, "TMPDIR": str(tmp)}
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert Path(done.stdout.strip()).parent == tmp  # it was there while the process ran
    assert list(tmp.iterdir()) == []
