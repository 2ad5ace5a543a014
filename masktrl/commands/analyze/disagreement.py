"""``masktrl analyze disagreement``: the token study."""

from __future__ import annotations

from masktrl.commands.analyze import (
    DEFAULT_OUT,
    Command,
    OutOpt,
    app,
    disagreement_options,
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
        result, table = study.run_study(roots, parse_steps(steps), delta, update=update_method, partitions=partitions, unit=replicate,
                                        policy_step=policy_step, minibatches=minibatches, exact=exact, pairs=chosen, test=test,
                                        progress=progress, optimizer=choice, decompose=decompose, own_tokens=own_tokens, ks=ks)
    paths = study.save(result, table, output or study.output_dir(roots, result))
    print_disagreement(result)
    written(paths)


def print_disagreement(result: dict) -> None:
    from rich.table import Table

    from masktrl.analysis.disagreement import SCOPES
    from masktrl.commands.analyze.tables import p_text

    b = result["batches"]
    stale = sorted({x["staleness"] for x in b})
    console.print(
        f"{len(result['runs'])} run(s) ({', '.join(sorted(set(result['methods'].values())))}), " "steps "
        f"{steps_text(result['steps'])}: {result['n_batches']} batches x {result['partitions']} " "partition(s) = "
        f"{result['n_replicates']} replicates ({result['replicate_unit']}); update " f"{result['update']['name']} "
        f"({result['update']['method']}), {optimizer_text(result)}, M = " f"{'/'.join(map(str, result['minibatches']))}, staleness {'/'.join(map(str, stale))}, "
        f"δ = {result['delta']:g}; {result['n_over_delta_mean']:.1f} tokens with D > δ per " "replicate",
        highlight=False,
    )
    table = Table(title="unsafe keep = P(ΔD > 0 | kept disagreement token): mean ± SE over replicates; contracted = " "pooled "
                        f"P(ΔD < 0); p on unsafe keep: {p_text(result)}")
    table.add_column("pair")
    table.add_column("criterion")
    table.add_column("disagree\ntotal (/rep)", justify="right")
    for scope in SCOPES:
        table.add_column(f"{scope}\nunsafe keep", justify="right")
        table.add_column("contracted", justify="right")
        table.add_column("kept", justify="right")
        table.add_column("p", justify="right")
    for name, block in result["pairs"].items():
        for i, c in enumerate(block["criteria"]):
            cells = [name if i == 0 else "", c, f"{block['n_disagree_total']} ({block['n_disagree_mean']:.1f})" if i == 0 else ""]
            for scope in SCOPES:
                x = block[scope][c]
                p = block[scope]["paired"]["p"]
                cells += [pm(x["unsafe_keep_mean"], x["unsafe_keep_se"]), fmt(x["contract_frac_pooled"]), str(x["n_kept_total"]),
                          (fmt(p) if i == 0 else "")]
            table.add_row(*cells, end_section=i == len(block["criteria"]) - 1)
    console.print(table)
    over = Table(title=f"every token with D > δ a rule keeps ({result['n_over_delta_total']} tokens with D > δ): " "unsafe keep, mean ± SE over replicates")
    over.add_column("criterion")
    for scope in SCOPES:
        over.add_column(f"{scope}\nunsafe keep", justify="right")
        over.add_column("kept", justify="right")
    for c in result["over_delta"][SCOPES[0]]:
        cells = []
        for scope in SCOPES:
            x = result["over_delta"][scope][c]
            cells += [pm(x["unsafe_keep_mean"], x["unsafe_keep_se"]), str(x["n_kept_total"])]
        over.add_row(c, *cells)
    console.print(over)
    from masktrl.commands.analyze.tables import print_first_order, print_k_sweep

    if "first_order" in result:
        print_first_order(result)
    if "k_sweep" in result:
        print_k_sweep(result)
    if all(block["n_disagree_total"] == 0 for block in result["pairs"].values()):
        console.print(
            "[yellow]no disagreement token: try a smaller --delta, more --minibatches, or stale " "rollouts "
            "(rollout.staleness, or --policy-step later than S-1) so that π moves away from μ[/]"
        )
