"""``masktrl analyze disagreement``: the token study."""

from __future__ import annotations

from masktrl.commands.analyze import (
    DEFAULT_OUT,
    Command,
    OutOpt,
    app,
    disagreement_options,
    options,
    replay_optimizer,
    study_options,
    written,
)
from masktrl.commands.analyze.disagreement_table import print_disagreement
from masktrl.commands.ui import progress_bar


@app.command(cls=Command)
def disagreement(
    run: study_options.StudyRunsOpt,
    out: OutOpt = DEFAULT_OUT,
    output: study_options.StudyOutputOpt = None,
    steps: study_options.StepsOpt = None,
    delta: options.DeltaOpt = 0.15,
    update_method: study_options.UpdateOpt = "unmasked",
    partitions: study_options.PartitionsOpt = 1,
    replicate: disagreement_options.ReplicateOpt = "batch",
    policy_step: study_options.PolicyStepOpt = None,
    minibatches: study_options.MinibatchesOpt = None,
    exact: disagreement_options.ExactOpt = True,
    pairs: disagreement_options.PairsOpt = None,
    test: disagreement_options.TestOpt = "wilcoxon",
    optimizer: study_options.ReplayOptimizerOpt = "run",
    replay_lr: study_options.ReplayLrOpt = None,
    reset_moments: study_options.ResetMomentsOpt = False,
    decompose: disagreement_options.DecomposeOpt = False,
    own_tokens: disagreement_options.OwnTokensOpt = 32,
    k: options.RecutKsOpt = None,
) -> None:
    """Token study (the predictive-mask paper's Figs. 3-4): where two direction rules
    disagree outside the trust region, which kept tokens whose D grew?"""
    from masktrl.analysis import disagreement as study
    from masktrl.analysis.replicates import parse_steps, run_roots

    choice = replay_optimizer(optimizer, replay_lr, reset_moments)
    ks = study.parse_ks(k)
    roots = run_roots(run, out)
    chosen = study.parse_pairs(pairs, exact)
    with progress_bar() as progress:
        result, table = study.run_study(
            roots,
            parse_steps(steps),
            delta,
            update=update_method,
            partitions=partitions,
            unit=replicate,
            policy_step=policy_step,
            minibatches=minibatches,
            exact=exact,
            pairs=chosen,
            test=test,
            progress=progress,
            optimizer=choice,
            decompose=decompose,
            own_tokens=own_tokens,
            ks=ks,
        )
    paths = study.save(result, table, output or study.output_dir(roots, result))
    print_disagreement(result)
    written(paths)
