"""The ``masktrl`` command line: thin commands that load a config, call a pipeline stage and
print a rich summary. One error boundary turns user errors into one red line and exit code 2
(``MASKTRL_DEBUG=1`` shows the traceback)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from masktrl.errors import MasktrlError
from masktrl.options import DEFAULT_OUT, ConfigOpt, MethodOpt, OutOpt, RunOpt, SeedOpt, SetOpt

app = typer.Typer(
    help="Trust-region masking experiments for LLM RL: rollout -> train -> evaluate -> analyze.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()


@app.callback()
def _root() -> None:
    """Trust-region masking experiments for LLM RL: rollout -> train -> evaluate -> analyze."""

err_console = Console(stderr=True)


def progress_bar() -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    )


@app.command()
def train(
    config: ConfigOpt = None,
    method: MethodOpt = None,
    run: RunOpt = None,
    out: OutOpt = DEFAULT_OUT,
    seed: SeedOpt = None,
    set_: SetOpt = None,
) -> None:
    """Run RL training (default: the embedded tiny model on synthetic arithmetic, GRPO).

    Artifacts go to OUT/RUN: run.yaml, manifest.json, metrics.jsonl, steps/*/rollouts.parquet,
    checkpoints/*, summary.json.
    """
    from masktrl.config import load_config
    from masktrl.pipeline import train as train_stage
    from masktrl.pipeline.store import RunStore

    cfg = load_config(config, set_ or [], method=method, seed=seed)
    name = run or f"{cfg.method_name}-{time.strftime('%Y%m%d-%H%M%S')}"
    store = RunStore(Path(out) / name)
    if store.root.exists() and any(store.root.iterdir()):
        raise MasktrlError(f"run folder {store.root} already exists: choose another --run (nothing was changed)")
    console.print(f"[bold]masktrl train[/] run [cyan]{name}[/] method [cyan]{cfg.method_name}[/] seed {cfg.seed}")
    with progress_bar() as progress:
        result = train_stage.run(cfg, store, progress)
    _print_summary(result.summary, store.root)


def _print_summary(summary: dict, root: Path) -> None:
    table = Table(title=f"run {summary['run']}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key in ("method", "seed", "steps", "eval_decoding"):
        table.add_row(key, str(summary[key]))
    table.add_row("held-out accuracy before RL", f"{summary['eval_before']:.3f}")
    table.add_row("held-out accuracy after RL", f"{summary['eval_after']:.3f}")
    table.add_row("change", f"{summary['eval_after'] - summary['eval_before']:+.3f}")
    table.add_row("wall time", f"{summary['wall_time_s']:.0f} s")
    console.print(table)
    console.print(f"artifacts: {root}")


def main() -> None:
    try:
        app()
    except MasktrlError as exc:
        if os.environ.get("MASKTRL_DEBUG"):
            raise
        err_console.print(f"[red]error:[/] {exc}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except KeyboardInterrupt:
        err_console.print("[yellow]interrupted[/]")
        sys.exit(130)


if __name__ == "__main__":
    main()
