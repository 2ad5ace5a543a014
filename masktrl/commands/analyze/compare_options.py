"""The options of ``masktrl analyze compare`` (commands/analyze/compare.py)."""

from __future__ import annotations

from typing import Annotated

import typer

from masktrl.commands.values import not_empty

BaselineOpt = Annotated[
    str,
    typer.Option(
        "--baseline",
        metavar="LABEL",
        help="The group the others are tested against: a method name "
        "with one group, a label, a handle (#2) or a "
        "run folder of the group.",
    ),
]
MetricOpt = Annotated[
    str,
    typer.Option(
        "--metric",
        metavar="KEY",
        parser=not_empty("give a logged metric (eval/heldout/accuracy, eval/<bench>/avg_at_k), or leave --metric out"),
        help="Metric: eval/heldout/accuracy or eval/<bench>/avg_at_k.",
    ),
]
EvalBenchOpt = Annotated[
    str | None,
    typer.Option(
        "--eval",
        metavar="BENCH",
        parser=not_empty("give a benchmark (task, gsm8k, ...), or leave --eval out"),
        show_default=False,
        help="Score each run by the avg@k of its "
        "`masktrl eval BENCH` report on its final checkpoint (e.g. "
        "task: the run's own held-out split, k samples per prompt) "
        "instead of --metric.",
    ),
]
TestOpt = Annotated[
    str,
    typer.Option(
        "--test",
        metavar="welch|permutation|paired",
        help="welch | permutation | paired (a paired t-test over the seeds shared with the "
        "baseline: a seed's runs share its warm start). All three are in the JSON.",
    ),
]
NBootOpt = Annotated[int, typer.Option("--n-boot", metavar="N", help="Bootstrap resamples for the 95% CI.")]
MarginOpt = Annotated[
    float | None,
    typer.Option(
        "--margin",
        metavar="X",
        show_default=False,
        help="Equivalence margin: every "
        "difference not found significant gets a TOST of |difference| < X "
        "(paired with --test paired, else Welch); "
        "without it no row is called equivalent.",
    ),
]
InteractionOpt = Annotated[
    str | None,
    typer.Option(
        "--interaction",
        metavar="A-B,C-D",
        parser=not_empty("give two effects as A-B,C-D, or leave --interaction out"),
        show_default=False,
        help="Test whether the "
        "effect A-B differs from C-D (group handles or labels; paired "
        "by seed when both have the same seeds), "
        "with its TOST at --margin: e.g. #2-#1,#4-#3 for a method's "
        "effect under two sources.",
    ),
]
