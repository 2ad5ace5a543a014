"""The options of ``masktrl rollout`` (commands/rollout.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from masktrl.commands.values import file_path, not_empty

ModelOpt = Annotated[
    str,
    typer.Option(
        "--model",
        metavar="RUN|MODEL",
        help="A run (folder, or name under --out; its latest checkpoint, or --step), a model "
        "folder or a cached hub id.",
    ),
]
DataOpt = Annotated[
    str,
    typer.Option(
        "--data",
        metavar="NAME|FILE",
        parser=not_empty("give a benchmark name or a data file"),
        help="synthetic | aime24 | aime25 | aime | math500 | gsm8k | dapo-math | a "
        ".jsonl/.json/.parquet "
        "math file | dataset (with --set "
        "task.source=...), or any file, folder "
        "or cached hub id with --set task.* "
        "keys.",
    ),
]
OutputOpt = Annotated[
    Path,
    typer.Option(
        "--output",
        "-o",
        metavar="FILE",
        parser=file_path("give the rollout parquet file to write"),
        help="The rollout parquet file to write (never inside a run folder: a run's batches are its own).",
    ),
]
NOpt = Annotated[int, typer.Option("--n", metavar="N", help="Samples per prompt: the group size G (rollout.n).")]
LogprobsKOpt = Annotated[
    int, typer.Option("--logprobs-k", metavar="K", help="K of the recorded behaviour top-K lists (rollout.logprobs_k).")
]
TopkOpt = Annotated[int | None, typer.Option("--topk", metavar="K", hidden=True, help="Deprecated: --logprobs-k.")]
PromptsOpt = Annotated[
    int | None,
    typer.Option(
        "--prompts", metavar="N", help="Number of prompts (default: 32 synthetic, or all problems).", show_default=False
    ),
]
StepOpt = Annotated[
    int | None,
    typer.Option("--step", metavar="N", help="Checkpoint step of a run (0: its starting policy).", show_default=False),
]
TemperatureOpt = Annotated[float, typer.Option("--temperature", metavar="T", help="Sampling temperature.")]
TopPOpt = Annotated[float, typer.Option("--top-p", metavar="P", help="Nucleus sampling threshold.")]
MaxNewTokensOpt = Annotated[
    int | None,
    typer.Option(
        "--max-new-tokens",
        metavar="N",
        help="Default: the run's, else 1024; at most what the model's context leaves after the longest prompt.",
        show_default=False,
    ),
]
SeedOpt = Annotated[int, typer.Option("--seed", metavar="N", help="Sampling seed.")]
EngineOpt = Annotated[
    str | None,
    typer.Option("--engine", metavar="hf|vllm", help="hf | vllm (default: the run's, else hf).", show_default=False),
]
TemplateOpt = Annotated[
    str | None,
    typer.Option(
        "--template",
        metavar="NAME",
        help="Prompt template: base | chat | instruct | raw | dapo | a format string with {prompt} (task.template).",
        show_default=False,
    ),
]
ForceOpt = Annotated[bool, typer.Option("--force", help="Replace an existing --output file.")]
