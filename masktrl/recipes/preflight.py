"""``masktrl train --dry-run``: every check a run makes before it writes anything
(``rl/checks.py``), what would happen to the run folder (``runs/plan.py``) and the projected
disk use; nothing is written."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from masktrl.config import Config
from masktrl.rl import checks
from masktrl.runs.plan import RunRequest, check_steps_cover, plan_run
from masktrl.runs.store import RunStore

WHAT = {"new": "a new run", "resume": "resume it from its last checkpoint", "restart": "start it again in place"}


@dataclass(frozen=True)
class DryRun:
    cfg: Config  # the resolved config the run would train with
    rows: list[tuple[str, str]]  # what was checked and found, in order


def run(request: RunRequest) -> DryRun:
    """Resolve ``request`` as ``masktrl train`` would, run every check (a resume also checks every
    artifact the resumed run reads) and project the disk use."""
    plan = plan_run(request)
    checked = checks.check(plan.cfg, rollouts_from=plan.rollouts_from, out=Path(request.out))
    step = 0
    try:
        if plan.start.mode == "resume":
            step = RunStore(plan.root).resume_step(checked.vocab_size)
            check_steps_cover(plan.cfg, plan.root, step)
            if (
                step and plan.forced_changes
            ):  # --resume --force: the checkpoint loads into the model the new config builds
                checks.check_checkpoint(plan.cfg, checked.tokenizer, RunStore(plan.root).checkpoint_dir(step))
        start = plan.start
        rows = [("run folder", f"{start.root}: {WHAT[start.mode]}" + (f" ({start.note})" if start.note else ""))]
        if step and plan.forced_changes:
            rows.append(
                (
                    "--force",
                    f"{', '.join(plan.forced_changes)}: checkpoint {step} loads into the model this config builds",
                )
            )
        rows += checked.report
        rows.append(("projected disk use", checks.projected_disk(plan.cfg, checked)))
    finally:
        checked.task.close()
    return DryRun(plan.cfg, rows)
