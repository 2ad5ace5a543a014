"""Helpers for tests of the dataset task: a private `datasets` cache and a stand-in of a hub
dataset in it (what `load_dataset("org/name")` leaves behind once it has run with network)."""

import glob
import json
import os
import shutil
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.fixture
def datasets_cache(tmp_path, monkeypatch):
    """A fresh HF_DATASETS_CACHE under tmp_path, for this test only (nothing is written to ~)."""
    datasets = pytest.importorskip("datasets")
    cache = tmp_path / "hf-datasets-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    return cache


def write_jsonl(path, rows):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def write_parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def cache_hub_dataset(cache: Path, repo: str, splits: dict[str, list[dict]], tmp: Path) -> None:
    """Put ``repo`` (``org/name``, config ``default``) with these splits into the datasets cache
    ``cache``, laid out as a real download leaves it: ``org___name/default/0.0.0/<commit>/``."""
    from datasets.packaged_modules.json.json import Json

    org, name = repo.split("/")
    src = tmp / f"hub-src-{name}"
    files = {split: str(write_jsonl(src / f"{split}.jsonl", rows)) for split, rows in splits.items()}
    build = tmp / f"hub-build-{name}"
    Json(data_files=files, dataset_name=name, cache_dir=str(build)).download_and_prepare()
    version = glob.glob(str(build / name / "*" / "0.0.0"))[0]
    dest = cache / f"{org}___{name}" / "default" / "0.0.0" / ("c0ffee" * 6 + "abcd")
    dest.parent.mkdir(parents=True)
    shutil.copytree(version, dest)
    for lock in glob.glob(str(dest / "*.lock")):
        os.remove(lock)
