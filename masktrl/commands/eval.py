"""``masktrl eval`` (alias ``evaluate``)."""

from __future__ import annotations

from pathlib import Path

from masktrl.commands import eval_options
from masktrl.commands.eval_table import tool_rows
from masktrl.commands.options import DEFAULT_OUT, OutOpt, TaskConfigOpt, TaskSetOpt
from masktrl.commands.ui import console, kv_table, plain, progress_bar


def eval_command(
    bench: eval_options.BenchArg,
    model: eval_options.ModelOpt,
    step: eval_options.StepOpt = None,
    k: eval_options.KOpt = 16,
    temperature: eval_options.TemperatureOpt = 1.0,
    top_p: eval_options.TopPOpt = 1.0,
    max_new_tokens: eval_options.MaxNewTokensOpt = None,
    data: eval_options.DataOpt = None,
    template: eval_options.TemplateOpt = None,
    engine: eval_options.EngineOpt = None,
    seed: eval_options.SeedOpt = 0,
    n_problems: eval_options.NProblemsOpt = None,
    batch_size: eval_options.BatchSizeOpt = None,
    dtype: eval_options.DtypeOpt = None,
    out: OutOpt = DEFAULT_OUT,
    output: eval_options.OutputOpt = None,
    force: eval_options.ForceOpt = False,
    config: TaskConfigOpt = None,
    set_: TaskSetOpt = None,
) -> None:
    """Evaluate a checkpoint on a benchmark: k samples per problem, avg@k, pass@k, maj@k, 95% CI.

    Results: a table, and <run>/eval/<bench>-step<S>.json (recorded in the run's manifest) or,
    for a model that is not a run, eval/<bench>-<model>.json. `masktrl eval task --model
    outputs/sweep` evaluates every complete run of a sweep's folder (one line each; a rerun does
    what is left); `analyze compare --eval task` then compares their avg@k.

    Datasets, rewards and templates take the keys of `masktrl train` (docs/TASKS.md): --config
    FILE (its task section) and --set task.KEY=VALUE, e.g. `masktrl eval dataset --model M --set
    task.source=data/x.jsonl --set task.reward=my_rewards.py:score`; every example of
    task.test_split (else task.split) is evaluated.
    """
    from masktrl.recipes import eval as recipe

    opts = recipe.EvalOptions(
        k=k,
        temperature=temperature,
        top_p=top_p,
        max_new_tokens=max_new_tokens,
        data=str(data) if data else None,
        template=template,
        engine=engine,
        seed=seed,
        n_problems=n_problems,
        batch_size=batch_size,
        dtype=dtype,
        config=tuple(map(str, config)) if config else None,
        overrides=tuple(set_ or ()),
    )
    opts.validate(bench)  # before any model is loaded
    step_text = f" step {step}" if step is not None else ""
    console.print(f"[bold]masktrl eval[/] [cyan]{plain(bench)}[/] model [cyan]{plain(model)}[/]{step_text}")
    runs = recipe.folder_runs(model)
    if runs is not None:  # a folder of runs
        with progress_bar() as progress:
            for root, result in recipe.run_folder(
                bench, runs, step, opts, out=out, output=output, force=force, progress=progress
            ):
                print_line(root, result)
        return
    with progress_bar() as progress:
        result = recipe.run(bench, model, step, opts, out=out, output=output, force=force, progress=progress)
    print_report(result.report, result.path)


def print_line(root: Path, result) -> None:
    r = None if isinstance(result, str) else result.report
    se = f" ± {r['avg_at_k_se']:.4f} (se)" if r and r.get("avg_at_k_se") is not None else ""
    console.print(
        f"{plain(root.name)}: "
        + (
            f"[yellow]{plain(result)}[/]"
            if r is None
            else f"avg@{r['k']} {r['avg_at_k']:.4f}{se}, pass@{r['k']} {r['pass_at_k']:.4f} -> {plain(result.path)}"
        ),
        highlight=False,
    )


def print_report(r: dict, path: Path) -> None:
    k = r["k"]
    low, high = r["ci95"]
    g = r["generation"]
    decoding = "greedy" if g["greedy"] else f"T={g['temperature']:g}, top_p={g['top_p']:g}"
    rows = [
        ("model", r["model"] + (f" (step {r['step']})" if r["step"] is not None else "")),
        ("problems", str(r["n_problems"])),
        ("samples per problem", f"{k} ({decoding}, {g['max_new_tokens']} new tokens, {g['engine']})"),
        (
            f"avg@{k}",
            f"{r['avg_at_k']:.4f}  [95% CI {low:.4f}, {high:.4f}]"
            + (f"  se {r['avg_at_k_se']:.4f}" if r.get("avg_at_k_se") is not None else ""),
        ),
        *[(f"pass@{j}", f"{v:.4f}") for j, v in r["pass_at"].items() if j != "1"],
        (f"maj@{k}", f"{r['maj_at_k']:.4f}"),
        ("truncated samples", f"{r['truncated_frac']:.1%}"),
        *tool_rows(r.get("tools")),
        *(
            [("skipped: prompt longer than the context", str(r["prompts_too_long"]))]
            if r.get("prompts_too_long")
            else []
        ),
        ("wall time", f"{r['time_s']:.0f} s"),
    ]
    console.print(kv_table(f"eval {r['benchmark']}", rows))
    console.print(f"results: {plain(path)}", highlight=False)
