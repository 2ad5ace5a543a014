"""Option types shared by every subcommand, so --config, --run, --out, --seed and --set read
the same everywhere."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

ConfigOpt = Annotated[
    Optional[Path], typer.Option("--config", "-c", help="YAML preset (default: configs/tiny.yaml).", show_default=False)
]
RunOpt = Annotated[
    Optional[str], typer.Option("--run", help="Run name (default: <method>-<timestamp>).", show_default=False)
]
OutOpt = Annotated[Path, typer.Option("--out", help="Folder holding runs.")]
SeedOpt = Annotated[Optional[int], typer.Option("--seed", help="Run seed (overrides the config).", show_default=False)]
SetOpt = Annotated[
    Optional[list[str]],
    typer.Option("--set", help="Dotted override, repeatable: --set train.lr=1e-4 --set method.divergence=topk-tv."),
]

TaskConfigOpt = Annotated[
    Optional[Path],
    typer.Option("--config", "-c", help="YAML file whose task section (and model.chat_template) sets the dataset, reward and "
                 "template, as for train (docs/TASKS.md).", show_default=False),
]
TaskSetOpt = Annotated[
    Optional[list[str]],
    typer.Option("--set", help="task.KEY=VALUE or model.chat_template=..., repeatable: the dataset, reward and template keys "
                 "of train, e.g. --set task.source=data/x.jsonl --set task.reward=my_rewards.py:score."),
]


def method_help() -> str:
    """Every registered method with its one-line help, read from the method registry."""
    from masktrl.methods import get_method, method_names

    listed = "; ".join(f"{name}: {get_method(name).help}" for name in method_names())
    return f"Method (default: the config's). {listed}. Parameters via --set method.X=..."


MethodOpt = Annotated[Optional[str], typer.Option("--method", "-m", help=method_help(), show_default=False)]
DEFAULT_OUT = Path("outputs")
