"""``masktrl runs``: what is in an outputs folder, read from each run's manifest and metrics."""

from __future__ import annotations

from pathlib import Path

from masktrl.errors import MasktrlError
from masktrl.runs.store import RunStore


def list_runs(folder: Path) -> list[dict]:
    """One row per run folder under ``folder``; a damaged run is listed as ``damaged`` with the
    reason, and the listing goes on."""
    folder = Path(folder)
    if not folder.is_dir():
        raise MasktrlError(f"no such folder: {folder}")
    rows = []
    for root in sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")):
        if (root / "manifest.json").exists() or (root / "run.yaml").exists():
            rows.append(describe(root))
    return rows


def describe(root: Path) -> dict:
    row = {"name": root.name, "method": None, "seed": None, "steps_done": 0, "steps_planned": None,
           "last_reward": None, "last_eval": None, "status": "unknown", "problem": None}
    try:
        _describe(RunStore(root, writable=False), row)
    except (MasktrlError, OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        problem = str(exc) if isinstance(exc, MasktrlError) else f"{type(exc).__name__}: {exc}"
        row.update(status="damaged", problem=problem.replace(f"{root}/", "").replace(str(root), "the run folder"))
    return row


def _describe(store: RunStore, row: dict) -> None:
    m = store.manifest
    row.update(method=m.get("method"), seed=m.get("seed"), steps_planned=m.get("steps_planned"), status=store.status())
    metrics = store.read_metrics()
    if metrics:
        row["steps_done"] = metrics[-1]["step"]
        row["last_reward"] = metrics[-1].get("reward_mean")
        evals = [r[k] for r in metrics for k in r if k.startswith("eval/") and isinstance(r[k], (int, float))]
        row["last_eval"] = evals[-1] if evals else None
    row["last_eval"] = (store.summary() or {}).get("eval_after", row["last_eval"])
