"""``masktrl train --dry-run``: every check a run makes before it writes anything
(``rl/checks.py``), what would happen to the run folder (``runs/plan.py``) and the projected
disk use; nothing is written."""

from __future__ import annotations

from masktrl.config import Config
from masktrl.rl.checks import Checked, projected_disk
from masktrl.runs.plan import Start
from masktrl.runs.store import RunStore

WHAT = {"new": "a new run", "resume": "resume it from its last checkpoint", "restart": "start it again in place"}


def run(cfg: Config, start: Start, checked: Checked) -> list[tuple[str, str]]:
    """The rows ``--dry-run`` prints: the run folder's fate, what ``checked`` found, the disk a
    run of ``cfg`` will use at most. A resume also checks every artifact the resumed run reads."""
    if start.mode == "resume":
        RunStore(start.root).resume_step(checked.vocab_size)
    rows = [("run folder", f"{start.root}: {WHAT[start.mode]}" + (f" ({start.note})" if start.note else ""))]
    rows += checked.report
    rows.append(("projected disk use", projected_disk(cfg, checked)))
    return rows
