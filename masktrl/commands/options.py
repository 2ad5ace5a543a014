"""Option types shared by every subcommand, so --config, --run, --out, --seed and --set read
the same everywhere (the command classes that render their help: commands/help_format.py).

Conventions: ``--out DIR`` is always the folder that holds runs (default ``outputs``; a run
given by name is looked up there); a command that writes a file or a result folder of its
own names it ``--output``. A flag that sets a config key is spelled like the key
(``rollout.logprobs_k`` -> ``--logprobs-k``). Every value option shows a metavar (FILE, DIR,
N, ...), flags show none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from masktrl.commands.values import config_file, out_folder

DEFAULT_OUT = Path("outputs")


ConfigOpt = Annotated[
    list[Path] | None,
    typer.Option(
        "--config",
        "-c",
        metavar="FILE",
        parser=config_file,
        show_default=False,
        help="YAML file, or a shipped preset by name from any folder (lab, qwen3-4b, "
        "methods/pdm-agg; default: tiny). "
        "Repeatable: a later file overrides an earlier one key by key, "
        "e.g. --config qwen3-4b --config methods/pdm-agg.",
    ),
]
RunOpt = Annotated[
    str | None,
    typer.Option("--run", metavar="NAME", help="Run name (default: <method>-<timestamp>).", show_default=False),
]
OutOpt = Annotated[
    Path,
    typer.Option(
        "--out", metavar="DIR", parser=out_folder, help="Folder holding runs; a run given by name is looked up here."
    ),
]
SeedOpt = Annotated[
    int | None, typer.Option("--seed", metavar="N", help="Run seed (overrides the config).", show_default=False)
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        metavar="KEY=VALUE",
        show_default=False,
        help="Dotted config override, repeatable: --set train.lr=1e-4 --set "
        "method.divergence=topk-tv "
        "(every key: masktrl config keys).",
    ),
]

TaskConfigOpt = Annotated[
    list[Path] | None,
    typer.Option(
        "--config",
        "-c",
        metavar="FILE",
        parser=config_file,
        help="YAML file whose task section (and model.chat_template) sets the dataset, reward and "
        "template, as for train (docs/TASKS.md); repeatable, a later file overrides "
        "an earlier one.",
        show_default=False,
    ),
]
TaskSetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        metavar="KEY=VALUE",
        help="task.KEY=VALUE or model.chat_template=..., repeatable: the dataset, reward and template "
        "keys "
        "of train, e.g. --set task.source=data/x.jsonl --set "
        "task.reward=my_rewards.py:score.",
    ),
]


def method_help() -> str:
    """Every registered method with its one-line help, read from the method registry."""
    from masktrl.methods import get_method, method_names

    listed = "; ".join(f"{name}: {get_method(name).help}" for name in method_names())
    return (
        f"Method (default: the config's). {listed}. Or a rule of your own: path/to/rules.py:NAME "
        "(docs/METHODS.md, "
        '"Writing your own rule"). Parameters via --set method.X=...'
    )


MethodOpt = Annotated[
    str | None, typer.Option("--method", "-m", metavar="NAME|FILE.py:NAME", help=method_help(), show_default=False)
]
