"""``masktrl analyze <analysis>``: studies of finished runs, written as JSON + PNG.

Single-run analyses write under ``<run>/analysis/``; multi-run analyses under ``--out``, else
the first run's parent ``analysis/`` folder. See docs/ANALYSIS.md.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Optional

import typer

from masktrl.commands.ui import console, kv_table, progress_bar
from masktrl.commands.options import DEFAULT_OUT

app = typer.Typer(
    help="Analyses of runs: disagreement (token study), dynamics (curves), compare (seed statistics), sis.",
    no_args_is_help=True,
)

RunArg = Annotated[str, typer.Option("--run", help="Run folder, or a run name under --out.", show_default=False)]
RunsDirOpt = Annotated[Path, typer.Option("--out", help="Folder holding runs (for a run given by name).")]
RunsArg = Annotated[list[str], typer.Argument(help="Run folders (or names under ./outputs), or folders of runs.", show_default=False)]
ResultOpt = Annotated[
    Optional[Path], typer.Option("--out", help="Where to write JSON + PNG (default: the first run's parent analysis/).", show_default=False)
]
StepOpt = Annotated[
    Optional[int], typer.Option("--step", help="Rollout step S (default: the latest S whose checkpoint S-1 exists).", show_default=False)
]


def fmt(x, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    return f"{x:.{digits}f}"


def pm(mean, se, digits: int = 3) -> str:
    return fmt(mean, digits) if se is None or se != se else f"{fmt(mean, digits)} ± {fmt(se, digits)}"


def _written(paths: list[Path]) -> None:
    console.print("wrote " + ", ".join(str(p) for p in paths), highlight=False)


@app.command()
def disagreement(
    run: RunArg,
    out: RunsDirOpt = DEFAULT_OUT,
    step: StepOpt = None,
    seeds: Annotated[int, typer.Option("--seeds", help="Number of replays (seed values run seed + 0..N-1).")] = 61,
    delta: Annotated[float, typer.Option("--delta", help="Trust-region threshold on the top-K KL D.")] = 0.15,
    policy_step: Annotated[
        Optional[int], typer.Option("--policy-step", help="Checkpoint the update starts from (default S-1; later = stale rollouts).", show_default=False)
    ] = None,
    minibatches: Annotated[
        Optional[int], typer.Option("--minibatches", help="Minibatch updates in the step (default: the run's, or 4 if it used 1).", show_default=False)
    ] = None,
) -> None:
    """Token study: where ratio and Ḋ disagree outside the trust region, which kept tokens whose D grew?"""
    from masktrl.analysis import disagreement as study
    from masktrl.pipeline.runstore import resolve_run

    root = resolve_run(run, out)
    with progress_bar() as progress:
        result = study.run_study(root, step, seeds, delta, policy_step, minibatches, progress)
    paths = study.save(result, root)
    console.print(
        f"run [cyan]{result['run']}[/] ({result['method']}): rollouts of step {result['step']}, update from checkpoint "
        f"{result['policy_step']} (staleness {result['staleness']}), {result['minibatches']} minibatches, δ = {result['delta']:g}, "
        f"{result['seeds']} seeds; {result['n_tokens']} tokens, {result['n_over_delta_mean']:.1f} with D > δ and "
        f"{result['n_disagree_mean']:.1f} disagreement tokens per seed",
        highlight=False,
    )
    from rich.table import Table

    table = Table(title="unsafe keep = P(ΔD > 0 | kept disagreement token), mean ± SE over seeds")
    table.add_column("criterion")
    for scope in study.SCOPES:
        table.add_column(f"{scope}\nunsafe keep", justify="right")
        table.add_column("contracted", justify="right")
        table.add_column("kept/seed", justify="right")
    table.add_column("unsafe keep\nall D>δ (1 step)", justify="right")
    for c in study.CRITERIA:
        cells = []
        for scope in study.SCOPES:
            b = result[scope][c]
            cells += [pm(b["unsafe_keep_mean"], b["unsafe_keep_se"]), pm(b["contract_frac_mean"], b["contract_frac_se"]), fmt(b["n_kept_mean"], 1)]
        table.add_row(c, *cells, fmt(result["one_step"][c]["unsafe_keep_over_delta_mean"]))
    console.print(table)
    if result["n_disagree_mean"] == 0:
        console.print(
            "[yellow]no disagreement token: try a smaller --delta, more --minibatches, or --policy-step later than S-1 "
            "(stale rollouts) so that π moves away from μ[/]"
        )
    _written(paths)


@app.command()
def dynamics(
    runs: RunsArg,
    out: ResultOpt = None,
    smooth: Annotated[int, typer.Option("--smooth", help="Moving-average window over logged steps (1 = raw).")] = 1,
) -> None:
    """Curves of reward, length, ppo_kl, mask fraction, SIS accept rate and eval accuracy; seeds averaged with a 95% band."""
    from masktrl.analysis import dynamics as dyn
    from masktrl.analysis.io import expand_runs, load_run, multi_run_dir
    from masktrl.errors import MasktrlError

    if smooth < 1:
        raise MasktrlError(f"--smooth must be >= 1, got {smooth}")
    roots = expand_runs(runs, DEFAULT_OUT)
    result = dyn.dynamics([load_run(r) for r in roots], smooth)
    paths = dyn.save(result, multi_run_dir(roots, out))
    from rich.table import Table

    table = Table(title="last logged value (mean over seeds)")
    table.add_column("runs")
    table.add_column("seeds", justify="right")
    short = {"reward_mean": "reward", "response_len_mean": "length", "ppo_kl": "ppo_kl", "mask_frac": "mask frac",
             "sis_accept_rate": "accept", dyn.HELDOUT: "eval acc"}
    for key in short.values():
        table.add_column(key, justify="right")
    for g in result["groups"]:
        table.add_row(g["label"], ",".join(str(s) for s in g["seeds"]), *[fmt(g["final"].get(k)) for k in short])
    console.print(table)
    _written(paths)


@app.command()
def compare(
    runs: RunsArg,
    out: ResultOpt = None,
    baseline: Annotated[str, typer.Option("--baseline", help="Method (or group label) the others are tested against.")] = "grpo",
    metric: Annotated[str, typer.Option("--metric", help="Metric: eval/heldout/accuracy or eval/<bench>/avg_at_k.")] = "eval/heldout/accuracy",
    test: Annotated[str, typer.Option("--test", help="welch | permutation (both are in the JSON).")] = "welch",
    n_boot: Annotated[int, typer.Option("--n-boot", help="Bootstrap resamples for the 95% CI.")] = 10000,
) -> None:
    """Methods by final and best eval accuracy over seeds: mean, std, bootstrap 95% CI, p-value vs baseline."""
    from masktrl.analysis import compare as cmp
    from masktrl.analysis.io import expand_runs, load_run, multi_run_dir

    roots = expand_runs(runs, DEFAULT_OUT)
    table = cmp.compare([load_run(r) for r in roots], baseline, metric, test, n_boot)
    paths = cmp.save(table, multi_run_dir(roots, out))
    print_compare(table)
    _written(paths)


def print_compare(table: dict) -> None:
    from rich.table import Table

    t = Table(title=f"{table['metric']}: mean ± std over seeds, bootstrap 95% CI, {table['test']} p vs {table['baseline']}")
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
        t.add_row(row["label"], str(row["final"]["n"]), *cells)
    console.print(t)
    for w in table["warnings"]:
        console.print(f"[yellow]warning:[/] {w}", highlight=False)
    for s in table["skipped"]:
        console.print(f"[yellow]skipped incomplete run[/] {s}", highlight=False)


@app.command()
def sis(
    run: RunArg,
    out: RunsDirOpt = DEFAULT_OUT,
    step: StepOpt = None,
    top: Annotated[int, typer.Option("--top", help="How many accepted / rejected tokens to list.")] = 10,
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
