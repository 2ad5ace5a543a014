"""``masktrl rollout``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from masktrl.commands.options import DEFAULT_OUT, OutOpt, TaskConfigOpt, TaskSetOpt
from masktrl.commands.ui import console, err_console, kv_table


def rollout(
    model: Annotated[str, typer.Option("--model", metavar="RUN|MODEL", help="A run (folder, or name under --out; its latest checkpoint, or --step), a model " "folder or a cached hub id.")],
    data: Annotated[str, typer.Option("--data", metavar="NAME|FILE", help="synthetic | aime24 | aime25 | aime | math500 | gsm8k | dapo-math | a " ".jsonl/.json/.parquet "
                                                     "math file | dataset (with --set " "task.source=...), or any file, folder " "or cached hub id with --set task.* " "keys.")],
    output: Annotated[Path, typer.Option("--output", "-o", metavar="FILE", help="The rollout parquet file to write (never inside a run folder: a run's batches are " "its own).")],
    n: Annotated[int, typer.Option("--n", metavar="N", help="Samples per prompt: the group size G (rollout.n).")] = 8,
    logprobs_k: Annotated[int, typer.Option("--logprobs-k", metavar="K", help="K of the recorded behaviour top-K lists (rollout.logprobs_k).")] = 20,
    topk: Annotated[Optional[int], typer.Option("--topk", metavar="K", hidden=True, help="Deprecated: --logprobs-k.")] = None,
    prompts: Annotated[Optional[int], typer.Option("--prompts", metavar="N", help="Number of prompts (default: 32 synthetic, or all problems).", show_default=False)] = None,
    step: Annotated[Optional[int], typer.Option("--step", metavar="N", help="Checkpoint step of a run (0: its starting policy).", show_default=False)] = None,
    temperature: Annotated[float, typer.Option("--temperature", metavar="T", help="Sampling temperature.")] = 1.0,
    top_p: Annotated[float, typer.Option("--top-p", metavar="P", help="Nucleus sampling threshold.")] = 1.0,
    max_new_tokens: Annotated[Optional[int], typer.Option("--max-new-tokens", metavar="N", help="Default: the run's, else 1024.", show_default=False)] = None,
    seed: Annotated[int, typer.Option("--seed", metavar="N", help="Sampling seed.")] = 0,
    engine: Annotated[Optional[str], typer.Option("--engine", metavar="hf|vllm", help="hf | vllm (default: the run's, else hf).", show_default=False)] = None,
    template: Annotated[Optional[str], typer.Option("--template", metavar="NAME", help="Prompt template: base | chat | instruct | raw | dapo | a format string with " "{prompt} (task.template).", show_default=False)] = None,
    out: OutOpt = DEFAULT_OUT,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing --output file.")] = False,
    config: TaskConfigOpt = None,
    set_: TaskSetOpt = None,
) -> None:
    """Generate rollouts with behaviour log-probabilities and top-K lists into a parquet file
    (schema: docs/ROLLOUTS.md), usable by `masktrl train --rollouts-from FILE`.

    Datasets, rewards and templates take the keys of `masktrl train` (docs/TASKS.md): --config
    FILE (its task section) and --set task.KEY=VALUE, e.g. --data dataset --set task.source=x.jsonl
    --set task.reward=my_rewards.py:score; every example of task.test_split (else task.split).
    """
    from masktrl.recipes import rollout as recipe

    if topk is not None:
        err_console.print(f"[yellow]deprecated:[/] --topk; use --logprobs-k {topk} (named as the config key " "rollout.logprobs_k)", highlight=False)
        logprobs_k = topk
    opts = recipe.RolloutOptions(n, logprobs_k, prompts, temperature, top_p, max_new_tokens, seed, engine, template,
                          tuple(map(str, config)) if config else None, tuple(set_ or ()))
    info = recipe.run(model, data, output, opts, step=step, force=force, out=out)
    console.print(kv_table("masktrl rollout", [(k, f"{v:.3f}" if isinstance(v, float) else str(v)) for k, v in info.items()]))
