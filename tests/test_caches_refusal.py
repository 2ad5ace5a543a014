"""caches.undone_on_refusal: a refused check leaves no folder it made under --out (vLLM's import
makes torch's inductor folder there); a check that passes keeps what was made; a file is never
removed."""

from __future__ import annotations

import pytest

from masktrl import caches


@pytest.fixture
def out(tmp_path, monkeypatch):
    root = tmp_path / "out"
    monkeypatch.setattr(caches, "_scratch_root", root / ".cache")
    return root


def test_a_refused_check_leaves_no_out(out):
    with pytest.raises(ValueError), caches.undone_on_refusal():
        (out / ".cache" / "torchinductor" / "sub").mkdir(parents=True)
        raise ValueError("refused")
    assert not out.exists()


def test_a_passing_check_keeps_the_folders(out):
    with caches.undone_on_refusal():
        (out / ".cache" / "torchinductor").mkdir(parents=True)
    assert (out / ".cache" / "torchinductor").is_dir()


def test_files_and_folders_that_were_there_stay(out):
    (out / ".cache").mkdir(parents=True)
    with pytest.raises(ValueError), caches.undone_on_refusal():
        (out / ".cache" / "torchinductor").mkdir()
        (out / ".cache" / "keep.txt").write_text("x")
        raise ValueError("refused")
    assert (out / ".cache" / "keep.txt").exists() and (out / ".cache" / "torchinductor").is_dir()


def test_a_file_written_during_a_refused_check_is_kept(out):
    with pytest.raises(ValueError), caches.undone_on_refusal():
        (out / ".cache" / "torchinductor").mkdir(parents=True)
        (out / ".cache" / "torchinductor" / "f").write_text("x")
        raise ValueError("refused")
    assert (out / ".cache" / "torchinductor" / "f").exists()
