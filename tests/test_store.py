"""Run store: atomic writes, manifest hashes, torn metrics lines."""

import pytest

from masktrl.errors import ArtifactError
from masktrl.io import atomic_write_text
from masktrl.rollout.base import Generation, Sample
from masktrl.rollout.storage import read_rollouts, write_rollouts
from masktrl.runs.store import RunStore


def test_atomic_write_leaves_no_temporary_files(tmp_path):
    atomic_write_text(tmp_path / "a.txt", "one")
    atomic_write_text(tmp_path / "a.txt", "two")
    assert (tmp_path / "a.txt").read_text() == "two"
    assert [p.name for p in tmp_path.iterdir()] == ["a.txt"]


def test_manifest_records_hashes_and_detects_corruption(tmp_path):
    store = RunStore(tmp_path / "run")
    f = store.root / "steps" / "000001" / "x.bin"
    f.parent.mkdir(parents=True)
    f.write_bytes(b"abc")
    store.mark_done("step/000001/rollout", [f])
    assert RunStore(store.root).is_done("step/000001/rollout")  # persisted
    store.verify("step/000001/rollout")
    f.write_bytes(b"abd")
    with pytest.raises(ArtifactError, match="x.bin"):
        store.verify("step/000001/rollout")
    f.unlink()
    with pytest.raises(ArtifactError, match="missing"):
        store.verify("step/000001/rollout")
    (store.root / "manifest.json").write_text("{not json")
    with pytest.raises(ArtifactError, match="manifest"):
        _ = RunStore(store.root).manifest


def test_metrics_ignore_a_torn_last_line(tmp_path):
    store = RunStore(tmp_path)
    store.append_metrics({"step": 1, "x": 0.5})
    store.append_metrics({"step": 2, "x": 0.25})
    with open(store.metrics_path, "a") as fh:
        fh.write('{"step": 3, "x')
    assert [r["step"] for r in store.read_metrics()] == [1, 2]


def test_rollouts_round_trip(tmp_path):
    gen = Generation(
        [5, 6, 1],
        [-0.5, -1.25, float("-inf")],
        [[5, 7], [6, 2], [2, -1]],
        [[-0.5, -1.0], [-1.25, -2.0], [-0.125, float("-inf")]],
        True,
    )  # float32-exact values, as engines record; token 3 has zero mass (invalid), outside its list
    s = Sample("ex1", "1+2=", "3", [3, 4], 0, gen, text="3", reward=1.0, advantage=0.7)
    p = tmp_path / "r.parquet"
    write_rollouts(p, [s, s], {"step": 1})
    back, meta = read_rollouts(p)
    assert meta == {"step": 1}
    assert back[0].gen == gen and back[1].advantage == 0.7 and back[0].prompt_ids == [3, 4]
    p.write_bytes(p.read_bytes()[:50])
    with pytest.raises(ArtifactError, match="r.parquet"):
        read_rollouts(p)
