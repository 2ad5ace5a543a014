"""``masktrl rollout``."""

from __future__ import annotations

from masktrl.commands import rollout_options
from masktrl.commands.options import DEFAULT_OUT, OutOpt, TaskConfigOpt, TaskSetOpt
from masktrl.commands.ui import console, err_console, kv_table, plain


def rollout(
    model: rollout_options.ModelOpt,
    data: rollout_options.DataOpt,
    output: rollout_options.OutputOpt,
    n: rollout_options.NOpt = 8,
    logprobs_k: rollout_options.LogprobsKOpt = 20,
    topk: rollout_options.TopkOpt = None,
    prompts: rollout_options.PromptsOpt = None,
    step: rollout_options.StepOpt = None,
    temperature: rollout_options.TemperatureOpt = 1.0,
    top_p: rollout_options.TopPOpt = 1.0,
    max_new_tokens: rollout_options.MaxNewTokensOpt = None,
    seed: rollout_options.SeedOpt = 0,
    engine: rollout_options.EngineOpt = None,
    template: rollout_options.TemplateOpt = None,
    out: OutOpt = DEFAULT_OUT,
    force: rollout_options.ForceOpt = False,
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
        err_console.print(
            f"[yellow]deprecated:[/] --topk; use --logprobs-k {topk} (named as the config key rollout.logprobs_k)",
            highlight=False,
        )
        logprobs_k = topk
    opts = recipe.RolloutOptions(
        n,
        logprobs_k,
        prompts,
        temperature,
        top_p,
        max_new_tokens,
        seed,
        engine,
        template,
        tuple(map(str, config)) if config else None,
        tuple(set_ or ()),
    )
    info = recipe.run(model, data, output, opts, step=step, force=force, out=out)
    console.print(
        kv_table("masktrl rollout", [(k, f"{v:.3f}" if isinstance(v, float) else plain(v)) for k, v in info.items()])
    )
