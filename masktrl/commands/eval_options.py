"""The options of ``masktrl eval`` (commands/eval.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from masktrl.commands.values import file_path
from masktrl.config import EVAL_BENCHMARKS

BenchArg = Annotated[
    str,
    typer.Argument(
        metavar="BENCH",
        help=f"Benchmark: {' | '.join(EVAL_BENCHMARKS)} | dataset (with --set task.source=...). "
        "task (alias synthetic): the run's own held-out split (arithmetic, residues, longtail).",
        show_default=False,
    ),
]
ModelOpt = Annotated[
    str,
    typer.Option(
        "--model",
        metavar="RUN|MODEL|FOLDER",
        help="A run (folder, or name under --out), a folder of runs (a sweep's: each complete run, skipping reports "
        "that exist), a model folder, or a hub id (local cache only).",
        show_default=False,
    ),
]
StepOpt = Annotated[
    int | None,
    typer.Option(
        "--step",
        metavar="N",
        help="Run only: the checkpoint step (default: the latest complete one; 0: the starting policy).",
        show_default=False,
    ),
]
KOpt = Annotated[int, typer.Option("--k", metavar="K", help="Samples per problem.")]
TemperatureOpt = Annotated[
    float, typer.Option("--temperature", metavar="T", help="Sampling temperature (0: greedy, needs --k 1).")
]
TopPOpt = Annotated[float, typer.Option("--top-p", metavar="P", help="Nucleus sampling threshold.")]
MaxNewTokensOpt = Annotated[
    int | None,
    typer.Option(
        "--max-new-tokens",
        metavar="N",
        help="Response length (default: the run's rollout.max_new_tokens, else 4096 on math; cut to fit the context).",
        show_default=False,
    ),
]
DataOpt = Annotated[
    Path | None,
    typer.Option(
        "--data",
        metavar="FILE",
        parser=file_path("give a .jsonl/.json/.parquet file of problems, or leave --data out"),
        help="Math benchmarks: a .jsonl/.json/.parquet file of problems (default: the "
        "local datasets cache); dataset: task.source.",
        show_default=False,
    ),
]
TemplateOpt = Annotated[
    str | None,
    typer.Option(
        "--template",
        metavar="NAME",
        help="Prompt template: base | chat | instruct | raw | dapo | a format string with "
        "{prompt} (default: the run's, else base for math, raw for dataset; chat for a "
        "run with model.chat_template).",
        show_default=False,
    ),
]
EngineOpt = Annotated[
    str | None,
    typer.Option(
        "--engine",
        metavar="hf|vllm",
        help="hf | vllm (default: the run's rollout.engine, else hf).",
        show_default=False,
    ),
]
SeedOpt = Annotated[int, typer.Option("--seed", metavar="N", help="Sampling seed.")]
NProblemsOpt = Annotated[
    int | None,
    typer.Option("--n-problems", metavar="N", help="Evaluate only the first N problems.", show_default=False),
]
BatchSizeOpt = Annotated[
    int | None,
    typer.Option(
        "--batch-size",
        metavar="N",
        help="Sequences generated together (default: the run's rollout.batch_size, 512).",
        show_default=False,
    ),
]
DtypeOpt = Annotated[
    str | None,
    typer.Option(
        "--dtype",
        metavar="DTYPE",
        help="float32 | bfloat16 | float16 (default: the run's model.dtype; bfloat16 on GPU, else float32).",
        show_default=False,
    ),
]
OutputOpt = Annotated[
    Path | None,
    typer.Option(
        "--output",
        "-o",
        metavar="FILE",
        parser=file_path("give the JSON report to write, or leave --output out"),
        show_default=False,
        help="Not a run: the JSON report to write (default: eval/ beside the model folder, OUT/eval/ for a hub id).",
    ),
]
ForceOpt = Annotated[bool, typer.Option("--force", help="Replace an existing report of this benchmark and step.")]
