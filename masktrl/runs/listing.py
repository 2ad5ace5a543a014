"""``masktrl runs``: what is in an outputs folder, read from each run's manifest and metrics.

Each row says what to do with a run that is not complete: ``interrupted`` (killed, or stopped
before it recorded its summary) and ``failed`` runs are *incomplete* — the same command, or
``masktrl train --resume NAME``, continues them; a ``damaged`` run has a recorded file that fails
its check and must be restored from a copy. A run killed between writing its summary and
recording it is incomplete, not damaged: its summary is read only once the run is complete.
"""

from __future__ import annotations

from pathlib import Path

from masktrl.errors import MasktrlError
from masktrl.runs.store import RunStore


def list_runs(folder: Path) -> list[dict]:
    """One row per run folder under ``folder``; a damaged run is listed as ``damaged`` with the
    reason, and the listing goes on."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise MasktrlError(f"{folder} is a file, not a folder of runs")
    if not folder.is_dir():
        raise MasktrlError(f"no such folder: {folder}")
    rows = []
    for root in sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")):
        if (root / "manifest.json").exists() or (root / "run.yaml").exists():
            rows.append(describe(root))
    return rows


def describe(root: Path) -> dict:
    row = {
        "name": root.name,
        "method": None,
        "seed": None,
        "steps_done": 0,
        "steps_planned": None,
        "last_reward": None,
        "last_eval": None,
        "status": "unknown",
        "problem": None,
        "reason": None,
    }
    try:
        _describe(RunStore(root, writable=False), row)
    except (MasktrlError, OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        problem = str(exc) if isinstance(exc, MasktrlError) else f"{type(exc).__name__}: {exc}"
        row.update(status="damaged", problem=problem.replace(f"{root}/", "").replace(str(root), "the run folder"))
    return row


def _describe(store: RunStore, row: dict) -> None:
    m = store.manifest
    store.verify_config()
    row.update(
        method=m.get("method"),
        seed=m.get("seed"),
        steps_planned=m.get("steps_planned"),
        status=store.status(),
        reason=m.get("reason") if m.get("status") == "failed" else None,
    )
    metrics = store.read_metrics()
    if metrics:
        row["steps_done"] = metrics[-1]["step"]
        row["last_reward"] = metrics[-1].get("reward_mean")
        evals = [r[k] for r in metrics for k in r if k.startswith("eval/") and isinstance(r[k], (int, float))]
        row["last_eval"] = evals[-1] if evals else None
    if row["status"] == "complete":  # an incomplete run's summary.json may be one written and not yet recorded
        row["last_eval"] = (store.summary() or {}).get("eval_after", row["last_eval"])


def advice(row: dict, out: Path) -> str | None:
    """What to do with a run that is not complete, one line: incomplete (the same command
    continues it) or damaged (restore the file)."""
    resume = f"masktrl train --resume {row['name']} --out {out}"
    if row["status"] == "damaged":
        return (
            f"damaged {row['name']}: {row['problem']}; restore it from a copy (nothing reads or resumes "
            "the run until then)"
        )
    if row["status"] == "interrupted":
        return f"incomplete {row['name']}: interrupted; run the same command again ({resume} continues it)"
    if row["status"] == "failed":
        why = f": {row['reason']}" if row.get("reason") else ""
        return f"incomplete {row['name']}: failed{why}; once fixed, run the same command again ({resume} continues it)"
    return None
