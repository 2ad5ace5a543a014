"""``masktrl analyze estimators``: top-K estimators of Ḋ against the exact value."""

from __future__ import annotations

from masktrl.commands.analyze import (
    DEFAULT_OUT,
    Command,
    OutOpt,
    app,
    estimators_options,
    fmt,
    optimizer_text,
    options,
    pm,
    replay_optimizer,
    steps_text,
    study_options,
    written,
)
from masktrl.commands.ui import console, progress_bar


@app.command(cls=Command)
def estimators(
    run: study_options.StudyRunsOpt,
    out: OutOpt = DEFAULT_OUT,
    output: study_options.StudyOutputOpt = None,
    steps: study_options.StepsOpt = None,
    k: estimators_options.KOpt = "5,10,20,50",
    delta: options.DeltaOpt = 0.15,
    update_method: study_options.UpdateOpt = "unmasked",
    partitions: study_options.PartitionsOpt = 1,
    policy_step: study_options.PolicyStepOpt = None,
    minibatches: study_options.MinibatchesOpt = None,
    optimizer: study_options.ReplayOptimizerOpt = "run",
    replay_lr: study_options.ReplayLrOpt = None,
    reset_moments: study_options.ResetMomentsOpt = False,
) -> None:
    """Top-K estimators of Ḋ_KL against the exact Ḋ of the full KL and of the top-K KL: sign
    agreement, relative error, bracket certification and containment."""
    from masktrl.analysis import estimators as est
    from masktrl.analysis.disagreement import output_dir
    from masktrl.analysis.replicates import parse_steps, run_roots

    choice = replay_optimizer(optimizer, replay_lr, reset_moments)
    roots = run_roots(run, out)
    ks = est.parse_ks(k)
    with progress_bar() as progress:
        result, table = est.run_estimators(
            roots,
            parse_steps(steps),
            ks,
            delta,
            update=update_method,
            partitions=partitions,
            policy_step=policy_step,
            minibatches=minibatches,
            progress=progress,
            optimizer=choice,
        )
    paths = est.save(result, table, output or output_dir(roots, result))
    print_estimators(result)
    written(paths)


def print_estimators(result: dict) -> None:
    from rich.table import Table

    console.print(
        f"{len(result['runs'])} run(s), steps {steps_text(result['steps'])}, "
        f"{result['n_batches']} batches, |V| = {result['vocab_size']}, "
        f"stored K = {result['stored_k']}, update {result['update']['name']}, "
        f"{optimizer_text(result)}; behaviour μ recomputed from its "
        "checkpoint (max |Δ log μ_k| vs the stored value "
        f"{result['mu_recompute_max_abs_logp_diff']:.2g}, max Σ_S |Δμ| on a list "
        f"{result.get('mu_recompute_max_list_mass_diff', float('nan')):.2g}: the containment "
        "tolerance is 2 Σ_S |Δμ| per token)",
        highlight=False,
    )
    for name, block in result["subsets"].items():
        what = "exact KL > 1e-6" if name == "moved" else f"exact KL > δ = {result['delta']:g}"
        table = Table(
            title=f"{name}: {block['n_tokens']} tokens ({what}); sign agreement with the exact Ḋ of the "
            "full KL (mean ± SE over "
            "replicates), relative error p50 / p90; with the exact Ḋ of the "
            "top-K KL (pooled); the bracket"
        )
        for col in (
            "K",
            "list",
            "agg sign",
            "agg rel err",
            "uniform sign",
            "uniform rel err",
            "agg / uniform vs top-K Ḋ",
            "bracket certifies",
            "certified right",
            "contains exact (τ)",
            "1 − π(list)",
        ):
            table.add_column(col, justify="right")
        for kk, row in block["k"].items():
            a, u, br = row["agg"], row["uniform"], row["bracket"]
            vt = row.get("vs_topk_kl")
            topk = f"{fmt(vt['agg']['sign_agree'])} / {fmt(vt['uniform']['sign_agree'])}" if vt else "—"
            table.add_row(
                kk,
                row["source"],
                pm(a["sign_agree_mean"], a["sign_agree_se"]),
                f"{fmt(a['rel_err_p50'])} / {fmt(a['rel_err_p90'])}",
                pm(u["sign_agree_mean"], u["sign_agree_se"]),
                f"{fmt(u['rel_err_p50'])} / {fmt(u['rel_err_p90'])}",
                topk,
                fmt(br["certified_frac"]),
                fmt(br["certified_correct"]),
                fmt(br["contains_frac"]),
                fmt(row["pi_tail_mean"]),
            )
        console.print(table)
