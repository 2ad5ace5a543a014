"""``masktrl analyze dynamics``: training curves."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape

from masktrl.commands.analyze import DEFAULT_OUT, Command, OutOpt, app, fmt, options, written
from masktrl.commands.ui import console


@app.command(cls=Command)
def dynamics(
    runs: options.RunsArg,
    out: OutOpt = DEFAULT_OUT,
    output: options.ResultOpt = None,
    smooth: Annotated[
        int, typer.Option("--smooth", metavar="W", help="Moving-average window over logged steps (1 = raw).")
    ] = 1,
) -> None:
    """Curves of reward, length, ppo_kl, mask fraction, SIS accept rate and
    eval accuracy; seeds averaged with a 95% band."""
    from masktrl.analysis import dynamics as dyn
    from masktrl.analysis.io import expand_runs, load_run, multi_run_dir
    from masktrl.errors import MasktrlError

    if smooth < 1:
        raise MasktrlError(f"--smooth must be >= 1, got {smooth}")
    roots = expand_runs(runs, out)
    result = dyn.dynamics([load_run(r) for r in roots], smooth)
    paths = dyn.save(result, multi_run_dir(roots, output))
    from rich.table import Table

    table = Table(title="last logged value (mean over seeds)")
    table.add_column("runs")
    table.add_column("seeds", justify="right")
    short = {
        "reward_mean": "reward",
        "response_len_mean": "length",
        "ppo_kl": "ppo_kl",
        "mask_frac": "mask frac",
        "sis_accept_rate": "accept",
        dyn.HELDOUT: "eval acc",
    }
    if any(k == "tool_call_rate" for k in result["metrics"]):  # multi-turn runs (task.env)
        short.update(turns_per_episode="turns", tool_call_rate="tool rate")
    for key in short.values():
        table.add_column(key, justify="right")
    for g in result["groups"]:
        table.add_row(
            escape(g["label"]), ",".join(str(s) for s in g["seeds"]), *[fmt(g["final"].get(k)) for k in short]
        )
    console.print(table)
    written(paths)
