"""``masktrl analyze compare``: methods over seeds."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape

from masktrl.commands.analyze import DEFAULT_OUT, Command, OutOpt, ResultOpt, RunsArg, app, fmt, pm, written
from masktrl.commands.ui import console


@app.command(cls=Command)
def compare(
    runs: RunsArg,
    out: OutOpt = DEFAULT_OUT,
    output: ResultOpt = None,
    baseline: Annotated[str, typer.Option("--baseline", metavar="LABEL", help="Method (or group label) the others are tested against.")] = "grpo",
    metric: Annotated[str, typer.Option("--metric", metavar="KEY", help="Metric: eval/heldout/accuracy or eval/<bench>/avg_at_k.")] = "eval/heldout/accuracy",
    test: Annotated[str, typer.Option("--test", metavar="welch|permutation|paired", help="welch | permutation | paired (a paired t-test over the seeds shared with the baseline: a seed's runs share its warm start). All three are in the JSON.")] = "welch",
    n_boot: Annotated[int, typer.Option("--n-boot", metavar="N", help="Bootstrap resamples for the 95% CI.")] = 10000,
) -> None:
    """Methods by final and best eval accuracy over seeds: mean, std, bootstrap 95% CI, p-value vs baseline."""
    from masktrl.analysis import compare as cmp
    from masktrl.analysis.io import expand_runs, load_run, multi_run_dir

    roots = expand_runs(runs, out)
    table = cmp.compare([load_run(r) for r in roots], baseline, metric, test, n_boot)
    paths = cmp.save(table, multi_run_dir(roots, output))
    print_compare(table)
    written(paths)


def print_compare(table: dict) -> None:
    from rich.table import Table

    t = Table(title=f"{table['metric']}: mean ± std over seeds, bootstrap 95% CI, {table['test']} p vs {escape(table['baseline'])}")
    t.add_column("method")
    t.add_column("n", justify="right")
    for key in ("final", "best"):
        t.add_column(f"{key}", justify="right")
        t.add_column("95% CI", justify="right")
        t.add_column("p", justify="right")
    for row in table["methods"]:
        cells = []
        for key in ("final", "best"):
            s = row[key]
            cells += [pm(s["mean"], s["std"]), f"[{fmt(s['ci_low'])}, {fmt(s['ci_high'])}]", "base" if row["is_baseline"] else fmt(s["p"])]
        t.add_row(escape(row["label"]), str(row["final"]["n"]), *cells)
    console.print(t)
    for w in table["warnings"]:
        console.print(f"[yellow]warning:[/] {w}", highlight=False)
    for s in table["skipped"]:
        console.print(f"[yellow]skipped incomplete run[/] {s}", highlight=False)
