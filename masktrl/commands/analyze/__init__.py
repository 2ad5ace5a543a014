"""``masktrl analyze <analysis>``: studies of finished runs, written as JSON + PNG.

Runs are given as folders or as names under ``--out`` (the folder of runs, as on every
command). Single-run analyses write under ``<run>/analysis/``; multi-run analyses under
``--output``, else the first run's parent ``analysis/`` folder. See docs/ANALYSIS.md.
"""

from __future__ import annotations

import math
from pathlib import Path

import typer

from masktrl.commands.help_format import Command, Group  # noqa: F401  (Command: for the analyses)
from masktrl.commands.options import DEFAULT_OUT, OutOpt  # noqa: F401  (for the analyses)
from masktrl.commands.ui import console, plain

app = typer.Typer(
    cls=Group,
    help="Analyses of runs: disagreement (token study), estimators (top-K Ḋ vs exact), dynamics "
    "(curves), compare (seed statistics), sis.",
    no_args_is_help=True,
)


def fmt(x, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    return f"{x:.{digits}f}"


def pm(mean, se, digits: int = 3) -> str:
    return fmt(mean, digits) if se is None or se != se else f"{fmt(mean, digits)} ± {fmt(se, digits)}"


def written(paths: list[Path]) -> None:
    console.print("wrote " + ", ".join(plain(p) for p in paths), highlight=False)


def replay_optimizer(name: str, lr: float | None, reset: bool):
    """The checked ``first_order.ReplayOptimizer`` (one-line error for a bad choice)."""
    from masktrl.analysis.first_order import check_replay_optimizer

    return check_replay_optimizer(name, lr, reset)


def optimizer_text(result: dict) -> str:
    opt = result.get("replay_optimizer") or {}
    lr = opt.get("lr_used")
    lr_text = f" lr {lr:g}" if lr is not None else ""
    reset = " (moments reset per minibatch)" if opt.get("reset_moments") else ""
    return f"optimizer {opt.get('name', 'run')}{lr_text}{reset}"


def steps_text(steps: list[int]) -> str:
    return str(steps[0]) if len(steps) == 1 else f"{steps[0]}..{steps[-1]} ({len(steps)})"


# the analyses, one module each, registered on ``app`` in this order
from masktrl.commands.analyze import disagreement, estimators, dynamics, compare, sis  # noqa: E402, F401, I001
from masktrl.commands.analyze.compare_table import print_compare  # noqa: E402, F401
