"""``masktrl analyze <analysis>``: studies of finished runs, written as JSON + PNG.

Runs are given as folders or as names under ``--out`` (the folder of runs, as on every
command). Single-run analyses write under ``<run>/analysis/``; multi-run analyses under
``--output``, else the first run's parent ``analysis/`` folder. See docs/ANALYSIS.md.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from masktrl.commands.ui import console, kv_table, progress_bar
from masktrl.commands.options import DEFAULT_OUT, Command, Group, OutOpt

app = typer.Typer(
    cls=Group,
    help="Analyses of runs: disagreement (token study), estimators (top-K Ḋ vs exact), dynamics (curves), compare (seed statistics), sis.",
    no_args_is_help=True,
)

RunArg = Annotated[str, typer.Option("--run", metavar="RUN", help="Run folder, or a run name under --out.", show_default=False)]
RunsArg = Annotated[list[str], typer.Argument(metavar="RUN", help="Run folders or names under --out, or folders of runs.", show_default=False)]
ResultOpt = Annotated[
    Optional[Path],
    typer.Option("--output", "-o", metavar="DIR", help="Where to write JSON + PNG (default: the first run's parent analysis/).", show_default=False),
]
StepOpt = Annotated[
    Optional[int], typer.Option("--step", metavar="S", help="Rollout step S (default: the latest S whose checkpoint S-1 exists).", show_default=False)
]


def fmt(x, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    return f"{x:.{digits}f}"


def pm(mean, se, digits: int = 3) -> str:
    return fmt(mean, digits) if se is None or se != se else f"{fmt(mean, digits)} ± {fmt(se, digits)}"


def _written(paths: list[Path]) -> None:
    console.print("wrote " + ", ".join(str(p) for p in paths), highlight=False)


StudyRunsOpt = Annotated[
    list[str],
    typer.Option("--run", metavar="RUN", help="Run folder, run name under --out, or a folder of runs (a sweep); repeat to pool runs.",
                 show_default=False),
]
StepsOpt = Annotated[
    Optional[str],
    typer.Option("--steps", "--step", metavar="STEPS", help="Rollout steps S: 600 | 600,650,700 | 600:700:50 (inclusive) "
                 "(default: each run's latest S whose checkpoint S-1 exists).", show_default=False),
]
UpdateOpt = Annotated[
    str,
    typer.Option("--update-method", metavar="NAME", help="The replayed update: unmasked (importance-weighted PG, no trust-region mask: "
                 "favours no criterion), run (the run's own method) or a method name (its defaults)."),
]
PartitionsOpt = Annotated[int, typer.Option("--partitions", metavar="N", help="Replays of each batch with other minibatch partitions (seed values run seed + 0..N-1).")]
PolicyStepOpt = Annotated[
    Optional[int],
    typer.Option("--policy-step", metavar="P", help="Checkpoint the update starts from (one run, one step; default S-1; later = staler rollouts).", show_default=False),
]
MinibatchesOpt = Annotated[
    Optional[int],
    typer.Option("--minibatches", metavar="M", help="Minibatch updates in the step (default: the run's; 4 if it used 1 without staleness).", show_default=False),
]
StudyOutputOpt = Annotated[
    Optional[Path],
    typer.Option("--output", "-o", metavar="DIR", help="Where to write JSON, parquet and PNG (default: <run>/analysis/, "
                 "or the first run's parent analysis/ when runs are pooled).", show_default=False),
]
DeltaOpt = Annotated[float, typer.Option("--delta", metavar="D", help="Trust-region threshold δ on the top-K KL D (the paper's main value).")]


@app.command(cls=Command)
def disagreement(
    run: StudyRunsOpt,
    out: OutOpt = DEFAULT_OUT,
    output: StudyOutputOpt = None,
    steps: StepsOpt = None,
    delta: DeltaOpt = 0.15,
    update_method: UpdateOpt = "unmasked",
    partitions: PartitionsOpt = 1,
    replicate: Annotated[str, typer.Option("--replicate", metavar="batch|partition", help="The unit of replication: batch (run x step) or partition.")] = "batch",
    policy_step: PolicyStepOpt = None,
    minibatches: MinibatchesOpt = None,
    exact: Annotated[bool, typer.Option("--exact/--no-exact", help="Exact full-vocabulary D and Ḋ per token (needs the behaviour checkpoint).")] = True,
    pairs: Annotated[
        Optional[str], typer.Option("--pairs", metavar="A:B,...", help="Pairs a:b of criteria (default: ratio:ddot_agg,ratio:ddot_uniform,ddot_agg:ddot_uniform).", show_default=False)
    ] = None,
    test: Annotated[str, typer.Option("--test", metavar="wilcoxon|ttest", help="Paired test shown in the table: wilcoxon | ttest (both are in the JSON).")] = "wilcoxon",
) -> None:
    """Token study (the predictive-mask paper's Figs. 3-4): where two direction rules disagree outside the trust region, which kept tokens whose D grew?"""
    from masktrl.analysis import disagreement as study
    from masktrl.analysis.replicates import parse_steps, run_roots

    roots = run_roots(run, out)
    chosen = study.parse_pairs(pairs, exact)
    with progress_bar() as progress:
        result, table = study.run_study(roots, parse_steps(steps), delta, update=update_method, partitions=partitions, unit=replicate,
                                        policy_step=policy_step, minibatches=minibatches, exact=exact, pairs=chosen, test=test,
                                        progress=progress)
    paths = study.save(result, table, output or study.output_dir(roots, result))
    print_disagreement(result)
    _written(paths)


def print_disagreement(result: dict) -> None:
    from rich.table import Table

    from masktrl.analysis.disagreement import SCOPES

    b = result["batches"]
    stale = sorted({x["staleness"] for x in b})
    console.print(
        f"{len(result['runs'])} run(s) ({', '.join(sorted(set(result['methods'].values())))}), steps "
        f"{_steps_text(result['steps'])}: {result['n_batches']} batches x {result['partitions']} partition(s) = "
        f"{result['n_replicates']} replicates ({result['replicate_unit']}); update {result['update']['name']} "
        f"({result['update']['method']}), M = {'/'.join(map(str, result['minibatches']))}, staleness {'/'.join(map(str, stale))}, "
        f"δ = {result['delta']:g}; {result['n_over_delta_mean']:.1f} tokens with D > δ per replicate",
        highlight=False,
    )
    table = Table(title=f"unsafe keep = P(ΔD > 0 | kept disagreement token): mean ± SE over replicates; contracted = pooled "
                        f"P(ΔD < 0); p = paired {result['test']} on unsafe keep")
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
    over = Table(title=f"every token with D > δ a rule keeps ({result['n_over_delta_total']} tokens with D > δ): unsafe keep, mean ± SE over replicates")
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
    if all(block["n_disagree_total"] == 0 for block in result["pairs"].values()):
        console.print(
            "[yellow]no disagreement token: try a smaller --delta, more --minibatches, or stale rollouts "
            "(rollout.staleness, or --policy-step later than S-1) so that π moves away from μ[/]"
        )


def _steps_text(steps: list[int]) -> str:
    return str(steps[0]) if len(steps) == 1 else f"{steps[0]}..{steps[-1]} ({len(steps)})"


@app.command(cls=Command)
def estimators(
    run: StudyRunsOpt,
    out: OutOpt = DEFAULT_OUT,
    output: StudyOutputOpt = None,
    steps: StepsOpt = None,
    k: Annotated[str, typer.Option("--k", metavar="K,...", help="List sizes K (re-cut from the stored list up to its size, else from the recomputed μ).")] = "5,10,20,50",
    delta: DeltaOpt = 0.15,
    update_method: UpdateOpt = "unmasked",
    partitions: PartitionsOpt = 1,
    policy_step: PolicyStepOpt = None,
    minibatches: MinibatchesOpt = None,
) -> None:
    """Top-K estimators of Ḋ_KL against the exact full-vocabulary value: sign agreement, relative error, bracket certification."""
    from masktrl.analysis import estimators as est
    from masktrl.analysis.disagreement import output_dir
    from masktrl.analysis.replicates import parse_steps, run_roots

    roots = run_roots(run, out)
    ks = est.parse_ks(k)
    with progress_bar() as progress:
        result, table = est.run_estimators(roots, parse_steps(steps), ks, delta, update=update_method, partitions=partitions,
                                           policy_step=policy_step, minibatches=minibatches, progress=progress)
    paths = est.save(result, table, output or output_dir(roots, result))
    print_estimators(result)
    _written(paths)


def print_estimators(result: dict) -> None:
    from rich.table import Table

    console.print(
        f"{len(result['runs'])} run(s), steps {_steps_text(result['steps'])}, {result['n_batches']} batches, |V| = {result['vocab_size']}, "
        f"stored K = {result['stored_k']}, update {result['update']['name']}; behaviour μ recomputed from its checkpoint "
        f"(max |Δ log μ_k| vs the stored value: {result['mu_recompute_max_abs_logp_diff']:.2g})",
        highlight=False,
    )
    for name, block in result["subsets"].items():
        what = "exact KL > 1e-6" if name == "moved" else f"exact KL > δ = {result['delta']:g}"
        table = Table(title=f"{name}: {block['n_tokens']} tokens ({what}); sign agreement with the exact Ḋ_KL (mean ± SE over replicates), "
                            "relative error p50 / p90")
        for col in ("K", "list", "agg sign", "agg rel err", "uniform sign", "uniform rel err", "bracket certifies", "certified right",
                    "contains exact", "1 − π(list)"):
            table.add_column(col, justify="right")
        for kk, row in block["k"].items():
            a, u, br = row["agg"], row["uniform"], row["bracket"]
            table.add_row(kk, row["source"], pm(a["sign_agree_mean"], a["sign_agree_se"]), f"{fmt(a['rel_err_p50'])} / {fmt(a['rel_err_p90'])}",
                          pm(u["sign_agree_mean"], u["sign_agree_se"]), f"{fmt(u['rel_err_p50'])} / {fmt(u['rel_err_p90'])}",
                          fmt(br["certified_frac"]), fmt(br["certified_correct"]), fmt(br["contains_frac"]), fmt(row["pi_tail_mean"]))
        console.print(table)


@app.command(cls=Command)
def dynamics(
    runs: RunsArg,
    out: OutOpt = DEFAULT_OUT,
    output: ResultOpt = None,
    smooth: Annotated[int, typer.Option("--smooth", metavar="W", help="Moving-average window over logged steps (1 = raw).")] = 1,
) -> None:
    """Curves of reward, length, ppo_kl, mask fraction, SIS accept rate and eval accuracy; seeds averaged with a 95% band."""
    from masktrl.analysis import dynamics as dyn
    from masktrl.analysis.io import expand_runs, load_run, multi_run_dir
    from masktrl.errors import MasktrlError

    if smooth < 1:
        raise MasktrlError(f"--smooth must be >= 1, got {smooth}")
    roots = expand_runs(runs, out)
    result = dyn.dynamics([load_run(r) for r in roots], smooth)
    paths = dyn.save(result, multi_run_dir(roots, output))
    from rich.table import Table

    table = Table(title="last logged value (mean over seeds)")
    table.add_column("runs")
    table.add_column("seeds", justify="right")
    short = {"reward_mean": "reward", "response_len_mean": "length", "ppo_kl": "ppo_kl", "mask_frac": "mask frac",
             "sis_accept_rate": "accept", dyn.HELDOUT: "eval acc"}
    for key in short.values():
        table.add_column(key, justify="right")
    for g in result["groups"]:
        table.add_row(escape(g["label"]), ",".join(str(s) for s in g["seeds"]), *[fmt(g["final"].get(k)) for k in short])
    console.print(table)
    _written(paths)


@app.command(cls=Command)
def compare(
    runs: RunsArg,
    out: OutOpt = DEFAULT_OUT,
    output: ResultOpt = None,
    baseline: Annotated[str, typer.Option("--baseline", metavar="LABEL", help="Method (or group label) the others are tested against.")] = "grpo",
    metric: Annotated[str, typer.Option("--metric", metavar="KEY", help="Metric: eval/heldout/accuracy or eval/<bench>/avg_at_k.")] = "eval/heldout/accuracy",
    test: Annotated[str, typer.Option("--test", metavar="welch|permutation|paired", help="welch | permutation | paired (a paired t-test over the seeds shared with the baseline: a seed's runs share its warm start). All three are in the JSON.")] = "welch",
    n_boot: Annotated[int, typer.Option("--n-boot", metavar="N", help="Bootstrap resamples for the 95% CI.")] = 10000,
) -> None:
    """Methods by final and best eval accuracy over seeds: mean, std, bootstrap 95% CI, p-value vs baseline."""
    from masktrl.analysis import compare as cmp
    from masktrl.analysis.io import expand_runs, load_run, multi_run_dir

    roots = expand_runs(runs, out)
    table = cmp.compare([load_run(r) for r in roots], baseline, metric, test, n_boot)
    paths = cmp.save(table, multi_run_dir(roots, output))
    print_compare(table)
    _written(paths)


def print_compare(table: dict) -> None:
    from rich.table import Table

    t = Table(title=f"{table['metric']}: mean ± std over seeds, bootstrap 95% CI, {table['test']} p vs {escape(table['baseline'])}")
    t.add_column("method")
    t.add_column("n", justify="right")
    for key in ("final", "best"):
        t.add_column(f"{key}", justify="right")
        t.add_column("95% CI", justify="right")
        t.add_column("p", justify="right")
    for row in table["methods"]:
        cells = []
        for key in ("final", "best"):
            s = row[key]
            cells += [pm(s["mean"], s["std"]), f"[{fmt(s['ci_low'])}, {fmt(s['ci_high'])}]", "base" if row["is_baseline"] else fmt(s["p"])]
        t.add_row(escape(row["label"]), str(row["final"]["n"]), *cells)
    console.print(t)
    for w in table["warnings"]:
        console.print(f"[yellow]warning:[/] {w}", highlight=False)
    for s in table["skipped"]:
        console.print(f"[yellow]skipped incomplete run[/] {s}", highlight=False)


def _dev_over_training(tr: dict) -> list[tuple[str, str]]:
    """Mean over the logged steps of D, D_SIS and D_SIS / D (rows of the SIS table)."""
    rows = []
    for key, label in (("log_r_dev", "D"), ("log_w_dev", "D_SIS"), ("log_dev_ratio", "D_SIS / D")):
        vals = [v for v in tr.get(key) or [] if v is not None and v == v]
        if vals:
            rows.append((f"{label}, mean over {len(vals)} logged steps", fmt(sum(vals) / len(vals), 4)))
    return rows


@app.command(cls=Command)
def sis(
    run: RunArg,
    out: OutOpt = DEFAULT_OUT,
    step: StepOpt = None,
    top: Annotated[int, typer.Option("--top", metavar="N", help="How many accepted / rejected tokens to list.")] = 10,
) -> None:
    """SIS: accept rate over training, residual top-K mass, tokens outside the top-K, accepted vs rejected tokens."""
    from masktrl.analysis import sis_report
    from masktrl.analysis.io import load_run

    info = load_run(run, out)
    rep = sis_report.sis_report(info, step, top)
    paths = sis_report.save(rep, info.root)
    r = rep["replay"]
    hyp = " (hypothetical: the run's method is " + rep["method"] + ")" if rep["hypothetical"] else ""
    rows = [
        ("accept rate, recomputed" + hyp, fmt(r["accept_rate"], 4)),
        ("accept rate, logged", fmt(r["accept_rate_logged"], 4)),
        ("tested (k in behaviour top-K)", fmt(r["tested_frac"])),
        ("accepted / tested", fmt(r["accepted_frac_of_tested"])),
        ("sampled outside behaviour top-K", fmt(r["outside_topk_frac"])),
        ("D = Σ|log r| per sequence, recomputed", fmt(r["log_r_dev"], 4)),
        ("D = Σ|log r| per sequence, logged", fmt(r["log_r_dev_logged"], 4)),
        ("D_SIS = Σ|log w| per sequence, recomputed" + hyp, fmt(r["log_w_dev"], 4)),
        ("D_SIS = Σ|log w| per sequence, logged", fmt(r["log_w_dev_logged"], 4)),
        ("D_SIS / D", fmt(r["log_dev_ratio"])),
        *_dev_over_training(rep["training"]),
        ("1 − π(top-K): mean", fmt(r["pi_residual_mean"], 4)),
        *[(f"1 − π(top-K): {q}", fmt(v, 4)) for q, v in r["pi_residual_quantiles"].items()],
        ("valid tokens", str(r["n_valid"])),
    ]
    console.print(kv_table(f"SIS at step {rep['step']} (policy {rep['policy_step']}), run {rep['run']}", rows))
    from rich.table import Table

    t = Table(title="most frequent sampled tokens")
    for col in ("accepted", "count", "acc. share", "rejected", "count", "rej. share"):
        t.add_column(col, justify="right")
    acc, rej = rep["tokens"]["accepted"], rep["tokens"]["rejected"]
    for i in range(max(len(acc), len(rej))):
        a = acc[i] if i < len(acc) else None
        b = rej[i] if i < len(rej) else None
        t.add_row(
            *(repr(a["token"]), str(a["count"]), fmt(a["share_of_this_token"], 2)) if a else ("", "", ""),
            *(repr(b["token"]), str(b["count"]), fmt(b["share_of_this_token"], 2)) if b else ("", "", ""),
        )
    console.print(t)
    _written(paths)
