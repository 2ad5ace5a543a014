"""``masktrl analyze compare``: methods over seeds."""

from __future__ import annotations

from masktrl.commands.analyze import DEFAULT_OUT, Command, OutOpt, app, compare_options, options, written
from masktrl.commands.analyze.compare_table import print_compare


@app.command(cls=Command)
def compare(
    runs: options.RunsArg,
    out: OutOpt = DEFAULT_OUT,
    output: options.ResultOpt = None,
    baseline: compare_options.BaselineOpt = "grpo",
    metric: compare_options.MetricOpt = "eval/heldout/accuracy",
    eval_bench: compare_options.EvalBenchOpt = None,
    test: compare_options.TestOpt = "welch",
    n_boot: compare_options.NBootOpt = 10000,
    margin: compare_options.MarginOpt = None,
    interaction: compare_options.InteractionOpt = None,
) -> None:
    """Methods over seeds (the run is the unit): final accuracy (or, with --eval, the avg@k of each run's eval report)
    with mean, std, bootstrap 95% CI; vs the baseline the difference with its CI, p (Holm and BH across the table) and
    the 80%-power detectable difference; best of the evaluations, biased upward, untested; the collapse rate (training
    reward below half its start, for good). With --test paired: the exact sign-flip p beside the paired t p (the larger
    decides), the paired MDD at alpha/m (post hoc) and, with --margin, a TOST for every difference not found;
    --interaction tests whether one effect differs from another."""
    from masktrl.analysis import compare as cmp
    from masktrl.analysis.io import expand_runs, load_run, multi_run_dir

    roots = expand_runs(runs, out)
    table = cmp.compare(
        [load_run(r) for r in roots],
        baseline,
        metric,
        test,
        n_boot,
        eval_bench=eval_bench,
        margin=margin,
        interaction=interaction,
    )
    paths = cmp.save(table, multi_run_dir(roots, output))
    print_compare(table)
    written(paths)
