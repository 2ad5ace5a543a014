"""``masktrl runs``: what is in an outputs folder, read from each run's manifest and metrics."""

from __future__ import annotations

from pathlib import Path

from masktrl.errors import ArtifactError, MasktrlError
from masktrl.pipeline.runstore import RunStore


def list_runs(folder: Path) -> list[dict]:
    folder = Path(folder)
    if not folder.is_dir():
        raise MasktrlError(f"no such folder: {folder}")
    rows = []
    for root in sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")):
        if (root / "manifest.json").exists() or (root / "run.yaml").exists():
            rows.append(describe(root))
    return rows


def describe(root: Path) -> dict:
    store = RunStore(root)
    row = {"name": root.name, "method": None, "seed": None, "steps_done": 0, "steps_planned": None,
           "last_reward": None, "last_eval": None, "status": "unknown"}
    try:
        m = store.manifest
    except ArtifactError:
        row["status"] = "corrupted manifest"
        return row
    row.update(method=m.get("method"), seed=m.get("seed"), steps_planned=m.get("steps_planned"), status=store.status())
    metrics = store.read_metrics()
    if metrics:
        row["steps_done"] = metrics[-1]["step"]
        row["last_reward"] = metrics[-1].get("reward_mean")
        evals = [r[k] for r in metrics for k in r if k.startswith("eval/") and isinstance(r[k], (int, float))]
        row["last_eval"] = evals[-1] if evals else None
    try:
        row["last_eval"] = (store.summary() or {}).get("eval_after", row["last_eval"])
    except ArtifactError:
        pass
    return row
