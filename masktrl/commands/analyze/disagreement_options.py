"""The options of ``masktrl analyze disagreement`` (commands/analyze/disagreement.py)."""

from __future__ import annotations

from typing import Annotated

import typer

ReplicateOpt = Annotated[
    str,
    typer.Option(
        "--replicate", metavar="batch|partition", help="The unit of replication: batch (run x step) or partition."
    ),
]
ExactOpt = Annotated[
    bool,
    typer.Option(
        "--exact/--no-exact", help="Exact full-vocabulary D and Ḋ per token (needs the behaviour checkpoint)."
    ),
]
PairsOpt = Annotated[
    str | None,
    typer.Option(
        "--pairs",
        metavar="A:B,...",
        help="Pairs a:b of criteria (default: ratio:ddot_agg,ratio:ddot_uniform,ddot_agg:ddot_uniform).",
        show_default=False,
    ),
]
TestOpt = Annotated[
    str,
    typer.Option(
        "--test",
        metavar="wilcoxon|ttest",
        help="Paired test over the batches of one run: wilcoxon | ttest "
        "(both in the JSON); with several runs the run is "
        "the unit (run-blocked sign flip).",
    ),
]
DecomposeOpt = Annotated[
    bool,
    typer.Option(
        "--decompose",
        help="First-order parts of every token's ΔD: own gradient term, rest of the "
        "minibatch, Adam momentum, weight decay "
        "(slower: double backward per part).",
    ),
]
OwnTokensOpt = Annotated[
    int,
    typer.Option(
        "--own-tokens",
        metavar="N",
        help="With --decompose: tokens per minibatch whose own term is "
        "computed (two gradients each; D > δ and A "
        "!= 0 first).",
    ),
]
