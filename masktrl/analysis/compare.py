"""Methods side by side over seeds: final eval accuracy with mean, std, bootstrap 95% CI and,
against a baseline group, the difference with its 95% CI, a two-sample test, Holm and
Benjamini-Hochberg adjustments across the table and the smallest difference the seeds could
detect at 80% power; the best-of-evaluations value, labelled as biased.

Per run: *final* = ``eval_after`` of summary.json (held-out accuracy; for another metric, its
last logged value); *best* = the maximum over the run's eval rows in metrics.jsonl and the
final value, a maximum over several noisy evaluations and therefore biased upward: reported
(``best.biased``), never tested. Runs are grouped by their config without the seed
(``io.group_runs``); the run (one seed) is the unit of replication; every group has a handle
(``#1``, ``#2``, ... in table order) that ``baseline`` accepts, as does any member run's folder.
Runs of different tasks are refused.

With ``eval_bench`` (``--eval BENCH``) *final* is instead the avg@k of each run's ``masktrl eval
BENCH`` report on its final checkpoint (``<run>/eval/<BENCH>-step<S>.json``, checked against the
manifest's hash) and *best* the maximum over its reports of that benchmark at every step; a run
without the final report is an error naming the runs and the command that makes them.

Every group also has a **collapse rate** (``analysis/collapse.py``): how many of its runs' training
reward fell below half its starting value and stayed there.

The paired design (``test="paired"``, the seeds shared with the baseline) adds what a referee asks of
it: the exact sign-flip p beside the paired t p, the rule that **the larger of the two decides**
(``p``, then Holm across the table); the detectable difference from the paired SD at Holm's
first-step alpha / m (``mdd_paired``, post hoc: the SD is the observed one); and for every row
whose difference is not significant, the TOST of equivalence within ``margin`` (``tost_p``; no
margin, no equivalence claim). ``interaction`` tests whether one effect (group a - group b) differs
from another (c - d): "the effect does not depend on the source" needs the interaction's TOST.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from masktrl.analysis.collapse import DEFINITION as COLLAPSE_DEFINITION
from masktrl.analysis.collapse import collapse_rate, run_collapse
from masktrl.analysis.io import RunInfo, check_one_run_per_seed, group_runs, task_difference
from masktrl.errors import ArtifactError, MasktrlError
from masktrl.readers import read_json
from masktrl.runs.store import eval_key, eval_steps
from masktrl.stats import (
    bootstrap_ci,
    interaction_test,
    paired_mdd,
    paired_tests,
    permutation_test,
    sign_flip_p,
    tost_paired,
    tost_welch,
    welch_t_test,
)

POWER = 0.8
ALPHA = 0.05
P_UNIT = "run (one seed)"

HELDOUT = "eval/heldout/accuracy"
MIN_SEEDS = 3
TESTS = ("welch", "permutation", "paired")
MAX_BOOT = 1_000_000  # --n-boot: resamples of the bootstrap CI (each keeps its mean: 8 MB at most)
DECISION_RULE = (
    "paired: a difference is declared when max(paired t p, exact sign-flip p), Holm-adjusted across "
    "the table, "
    "is below alpha (the sign-flip floor is 2^(1-n): 0.0625 at 5 seeds)"
)


def run_scores(run: RunInfo, metric: str = HELDOUT) -> tuple[float, float]:
    """(final, best) of one complete run."""
    logged = [float(r[metric]) for r in run.metrics if isinstance(r.get(metric), (int, float))]
    if metric == HELDOUT:
        final = run.summary.get("eval_after")
        if final is None:
            raise MasktrlError(f"{run.root}/summary.json has no eval_after")
        final = float(final)
    elif logged:
        final = logged[-1]
    else:
        raise MasktrlError(f"{run.root}: metric {metric} was never logged")
    return final, max(logged + [final])


def final_step(run: RunInfo) -> int:
    """The step of the run's final checkpoint (what ``masktrl eval --model RUN`` evaluates by default)."""
    steps = run.store.checkpoints()
    if not steps:
        raise ArtifactError(f"{run.root}: no complete checkpoint to evaluate")
    return steps[-1]


def eval_report(run: RunInfo, bench: str, step: int) -> dict:
    """The ``masktrl eval`` report of ``bench`` at ``step``, verified against the manifest's hash."""
    store = run.store
    store.verify(eval_key(bench, step))
    report = read_json(store.eval_path(bench, step), error=ArtifactError, finite=False)
    if not isinstance(report, dict) or not isinstance(report.get("avg_at_k"), (int, float)):
        raise ArtifactError(f"{store.eval_path(bench, step)}: not an eval report (no avg_at_k)")
    return report


def eval_scores(runs: list[RunInfo], bench: str) -> tuple[dict[str, tuple[float, float, int]], dict]:
    """Per run root: (final avg@k, best avg@k over the run's reports of ``bench``, number of
    reports), and the generation settings the final reports share. ``MasktrlError`` naming the
    runs without a final report (and the command to make them), or reports that differ in k,
    problems or sampling."""
    missing = [r for r in runs if not (r.store.stage(eval_key(bench, final_step(r))) or {}).get("status") == "done"]
    if missing:
        folders = sorted({str(r.root.parent) for r in missing})
        names = ", ".join(r.name for r in missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise MasktrlError(
            f"--eval {bench}: {len(missing)} of {len(runs)} runs have no eval report at their final "
            "checkpoint "
            f"({names}); make them with: " + "; ".join(f"masktrl eval {bench} --model {f}" for f in folders)
        )
    out, settings = {}, {}
    for r in runs:
        final = eval_report(r, bench, final_step(r))
        g = final.get("generation") or {}
        sig = {
            "k": final.get("k"),
            "n_problems": final.get("n_problems"),
            "temperature": g.get("temperature"),
            "top_p": g.get("top_p"),
            "max_new_tokens": g.get("max_new_tokens"),
        }
        for key, value in sig.items():
            if settings.setdefault(key, value) != value:
                raise MasktrlError(
                    f"--eval {bench}: the reports differ in {key} ({settings[key]} vs {value} in "
                    f"{r.name}); "
                    f"evaluate every run alike (masktrl eval {bench} --force ...)"
                )
        steps = eval_steps(r.store.manifest["stages"], bench)
        values = [float(eval_report(r, bench, s)["avg_at_k"]) for s in steps]
        out[str(r.root)] = (float(final["avg_at_k"]), max(values), len(values))
    return out, settings


def describe(values: list[float], n_boot: int, seed: int = 0) -> dict:
    """n, mean, std (ddof=1; nan for one value) and the percentile-bootstrap 95% CI of the mean."""
    v = np.asarray(values, dtype=float)
    lo, hi = bootstrap_ci(v, n_boot=n_boot, seed=seed)
    return {
        "values": [float(x) for x in v],
        "n": int(v.size),
        "mean": float(v.mean()),
        "std": float(v.std(ddof=1)) if v.size > 1 else float("nan"),
        "ci_low": lo,
        "ci_high": hi,
    }


def test_against(
    values: list[float],
    base: list[float],
    n_perm: int,
    seed: int = 0,
    seeds: list[int] | None = None,
    base_seeds: list[int] | None = None,
) -> dict:
    """Welch's t-test and the permutation test of mean(values) == mean(base), and the paired
    t-test over the seeds both have (runs of one seed share the warm start; nan with < 2).
    ``diff_vs_baseline`` is the difference of the groups' means, the centre of Welch's interval;
    ``diff_paired`` is the mean difference over the shared seeds, the centre of the paired
    interval. They are equal when both groups have the same seeds."""
    t, p = welch_t_test(values, base)
    shared = sorted(set(seeds or []) & set(base_seeds or []))
    pick = lambda vals, ss: [vals[ss.index(s)] for s in shared]  # noqa: E731
    a, b = pick(values, seeds), pick(base, base_seeds)
    paired = paired_tests(a, b)
    lo, hi = welch_diff_ci(values, base)
    plo, phi = paired_diff_ci(a, b)
    return {
        "diff_vs_baseline": float(np.mean(values) - np.mean(base)),
        "diff_ci_low": lo,
        "diff_ci_high": hi,
        # the paired interval's own centre: with other seed sets it is not the difference of means
        "diff_paired": float(np.mean(np.subtract(a, b))) if shared else float("nan"),
        "diff_ci_paired_low": plo,
        "diff_ci_paired_high": phi,
        "mdd_80": min_detectable_difference(values, base),
        "t_welch": t,
        "p_welch": p,
        "p_permutation": permutation_test(values, base, n_perm=n_perm, seed=seed),
        "n_paired": len(shared),
        "t_paired": paired["t"],
        "p_paired_t": paired["p_ttest"],
        "p_sign_flip": sign_flip_p(np.subtract(a, b)) if shared else float("nan"),
        # the paired rule: the larger of the t and the exact sign-flip p decides
        "p_paired": max(paired["p_ttest"], sign_flip_p(np.subtract(a, b))) if len(shared) >= 2 else float("nan"),
        "diffs_paired": [float(x) for x in np.subtract(a, b)],
    }


def welch_diff_ci(a, b, level: float = 0.95) -> tuple[float, float]:
    """The Welch (unequal-variance) t interval of mean(a) - mean(b), df by Welch-Satterthwaite;
    nan with fewer than 2 values in a group or no spread at all."""
    from scipy import stats as sps

    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if min(x.size, y.size) < 2:
        return float("nan"), float("nan")
    va, vb = x.var(ddof=1) / x.size, y.var(ddof=1) / y.size
    se = float(np.sqrt(va + vb))
    d = float(x.mean() - y.mean())
    if se == 0:
        return d, d
    df = (va + vb) ** 2 / (va**2 / (x.size - 1) + vb**2 / (y.size - 1))
    h = float(sps.t.ppf(0.5 + level / 2, df)) * se
    return d - h, d + h


def paired_diff_ci(a, b, level: float = 0.95) -> tuple[float, float]:
    """The paired t interval of mean(a - b) over matched seeds; nan with fewer than 2 pairs."""
    from scipy import stats as sps

    d = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)
    if d.size < 2:
        return float("nan"), float("nan")
    se = float(d.std(ddof=1) / np.sqrt(d.size))
    h = float(sps.t.ppf(0.5 + level / 2, d.size - 1)) * se
    return float(d.mean()) - h, float(d.mean()) + h


def min_detectable_difference(a, b, power: float = POWER, alpha: float = ALPHA) -> float:
    """The smallest |mean(a) - mean(b)| a two-sided two-sample t-test at ``alpha`` detects with
    probability ``power`` given these seed counts and spreads: (t_{1-alpha/2} + t_{power}) · s ·
    sqrt(1/n_a + 1/n_b), s the pooled standard deviation, df = n_a + n_b - 2 (the usual
    normal-shift approximation with t quantiles). nan when df < 1."""
    from scipy import stats as sps

    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    df = x.size + y.size - 2
    if df < 1:
        return float("nan")
    ss = (x.var(ddof=1) * (x.size - 1) if x.size > 1 else 0.0) + (y.var(ddof=1) * (y.size - 1) if y.size > 1 else 0.0)
    s = float(np.sqrt(ss / df))
    return float((sps.t.ppf(1 - alpha / 2, df) + sps.t.ppf(power, df)) * s * np.sqrt(1 / x.size + 1 / y.size))


def holm(pvalues: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values (nan stays nan and is not counted)."""
    p = np.asarray(pvalues, dtype=float)
    ok = np.flatnonzero(np.isfinite(p))
    out = np.full(p.size, np.nan)
    order = ok[np.argsort(p[ok], kind="stable")]
    m, running = len(order), 0.0
    for i, j in enumerate(order):
        running = max(running, min(1.0, (m - i) * p[j]))
        out[j] = running
    return [float(x) for x in out]


def benjamini_hochberg(pvalues: list[float]) -> list[float]:
    """Benjamini-Hochberg adjusted p-values (q-values; nan stays nan and is not counted)."""
    p = np.asarray(pvalues, dtype=float)
    ok = np.flatnonzero(np.isfinite(p))
    out = np.full(p.size, np.nan)
    order = ok[np.argsort(p[ok], kind="stable")]
    m, running = len(order), 1.0
    for i in range(m - 1, -1, -1):
        j = order[i]
        running = min(running, p[j] * m / (i + 1))
        out[j] = min(1.0, running)
    return [float(x) for x in out]


def find_baseline(labels: list[tuple[str, str]], baseline: str, members: list[list[RunInfo]] | None = None) -> str:
    """The group label matching ``baseline``: a label, a handle (``#2`` or ``2``: the group's
    1-based position in the table), a member run's folder (name or path), or a method name with
    one group."""
    names = [label for label, _ in labels]
    if baseline in names:
        return baseline
    handle = baseline[1:] if baseline.startswith("#") else baseline
    if handle.isdigit() and 1 <= int(handle) <= len(names):
        return names[int(handle) - 1]
    for label, runs in zip(names, members or []):
        if any(baseline in (r.name, str(r.root)) or Path(baseline).resolve() == Path(r.root).resolve() for r in runs):
            return label
    by_method = [i for i, (_, method) in enumerate(labels) if method == baseline]
    if len(by_method) == 1:
        return names[by_method[0]]
    if by_method:
        options = ", ".join(f"#{i + 1} {names[i]}" for i in by_method)
        raise MasktrlError(f"baseline {baseline!r} is ambiguous: pass a handle or a run folder ({options})")
    raise MasktrlError(
        f"baseline {baseline!r} is not among the runs (groups: "
        f"{', '.join(f'#{i + 1} {n}' for i, n in enumerate(names))})"
    )


def check_one_task(runs: list[RunInfo]) -> None:
    """``MasktrlError`` naming two runs and the first task key they differ in, when the runs do not
    share one task (their accuracies are not comparable)."""
    for r in runs[1:]:
        diff = task_difference(runs[0].cfg, r.cfg)
        if diff is not None:
            raise MasktrlError(
                f"runs of different tasks cannot be compared: {runs[0].name} has {diff[0]}, {r.name} has {diff[1]}"
            )


def compare(
    runs: list[RunInfo],
    baseline: str = "grpo",
    metric: str = HELDOUT,
    test: str = "welch",
    n_boot: int = 10000,
    n_perm: int = 10000,
    eval_bench: str | None = None,
    margin: float | None = None,
    interaction: str | None = None,
) -> dict:
    """The method table (JSON-ready, see docs/ANALYSIS.md). Incomplete runs are listed in
    ``skipped``. ``eval_bench``: score each run by its ``masktrl eval`` report instead of ``metric``.
    ``margin``: the equivalence margin of the TOSTs; ``interaction``: "A-B,C-D" (handles or labels)."""
    if test not in TESTS:
        raise MasktrlError(f"--test must be one of {', '.join(TESTS)}; got {test!r}")
    if not 1 <= n_boot <= MAX_BOOT:
        raise MasktrlError(
            f"--n-boot must be in [1, {MAX_BOOT}], got {n_boot} (the bootstrap keeps one mean per resample)"
        )
    if margin is not None and not (isinstance(margin, (int, float)) and 0 < margin < float("inf")):
        raise MasktrlError(f"--margin must be a positive number, got {margin!r}")
    if eval_bench is not None and metric != HELDOUT:
        raise MasktrlError(
            f"--eval and --metric choose the score two ways; pass one (got --eval {eval_bench} --metric {metric})"
        )
    complete = [r for r in runs if r.complete]
    skipped = [str(r.root) for r in runs if not r.complete]
    if not complete:
        raise MasktrlError("no complete run to compare (a run is complete once summary.json is written)")
    check_one_task(complete)
    groups = group_runs(complete)
    check_one_run_per_seed(groups)
    base_label = find_baseline([(label, m[0].cfg.method_name) for label, m in groups], baseline, [m for _, m in groups])
    if eval_bench is not None:
        per_run, settings = eval_scores(complete, eval_bench)
        scores = {label: [per_run[str(r.root)][:2] for r in members] for label, members in groups}
        n_evals = {root: v[2] for root, v in per_run.items()}
        metric = f"eval/{eval_bench}/avg_at_k (final checkpoint)"
    else:
        scores = {label: [run_scores(r, metric) for r in members] for label, members in groups}
        n_evals, settings = {str(r.root): len(_evals(r, metric)) + 1 for r in complete}, None
    base_seeds = [r.cfg.seed for r in dict(groups)[base_label]]
    rows, warnings = [], []
    for gi, (label, members) in enumerate(groups):
        row = {
            "handle": f"#{gi + 1}",
            "label": label,
            "method": members[0].cfg.method_name,
            "runs": [str(r.root) for r in members],
            "seeds": [r.cfg.seed for r in members],
            "is_baseline": label == base_label,
        }
        vals = [s[0] for s in scores[label]]
        base = [s[0] for s in scores[base_label]]
        row["final"] = describe(vals, n_boot)
        tests = (
            test_against(vals, base, n_perm, seeds=row["seeds"], base_seeds=base_seeds)
            if label != base_label
            else _no_test()
        )
        row["final"].update(tests, p=tests[f"p_{test}"], p_unit=P_UNIT)
        row["best"] = describe([s[1] for s in scores[label]], n_boot)
        row["best"].update(
            biased=True,
            n_evals=[n_evals[str(r.root)] for r in members],
            p=float("nan"),
            note="max over the run's evaluations and its final value: biased upward, not tested",
        )
        per_run = [{"run": str(r.root), **run_collapse(r.metrics)} for r in members]
        row["collapse"] = {**collapse_rate(per_run), "runs": per_run}
        if len(members) < MIN_SEEDS:
            warnings.append(
                f"{label}: only {len(members)} seed{'s' if len(members) != 1 else ''} (< "
                f"{MIN_SEEDS}); its CI and p-value mean little"
            )
        rows.append(row)
    others = [r for r in rows if not r["is_baseline"]]
    for adj, fn in (("p_holm", holm), ("q_bh", benjamini_hochberg)):
        for r, v in zip(others, fn([r["final"]["p"] for r in others])):
            r["final"][adj] = v
    for r in rows:
        if r["is_baseline"]:
            r["final"]["p_holm"] = r["final"]["q_bh"] = float("nan")
    verdicts(others, next(r for r in rows if r["is_baseline"]), test, margin)
    inter = interaction_row(rows, interaction, margin) if interaction else None
    kind = eval_kind(eval_bench, settings) if eval_bench is not None else metric_kind(metric, complete)
    return {
        "metric": metric,
        "metric_kind": kind,
        "eval": eval_bench,
        "eval_settings": settings,
        "collapse_definition": COLLAPSE_DEFINITION,
        "baseline": base_label,
        "baseline_handle": next(r["handle"] for r in rows if r["is_baseline"]),
        "test": test,
        "p_unit": P_UNIT,
        "adjustment": "Holm (p_holm) and Benjamini-Hochberg (q_bh) over the non-baseline rows' final p",
        "power": POWER,
        "alpha": ALPHA,
        "n_boot": n_boot,
        "n_perm": n_perm,
        "margin": margin,
        "decision_rule": DECISION_RULE if test == "paired" else f"{test}: Holm-adjusted p below alpha",
        "mdd_note": f"mdd_paired: post hoc, from the observed paired SD, two-sided paired t at alpha / m "
        f"(m = {len(others)} rows, Holm's first step), {POWER:.0%} power",
        "interaction": inter,
        "methods": rows,
        "warnings": warnings,
        "skipped": skipped,
    }


def verdicts(others: list[dict], base: dict, test: str, margin: float | None) -> None:
    """Per non-baseline row: ``mdd_paired`` (the paired detectable difference at alpha / m, post hoc),
    ``verdict`` (differs | equivalent | not detected) and, where the difference is not significant,
    ``tost_p`` at ``margin`` (the paired TOST under the paired test, Welch's otherwise; nan without
    a margin)."""
    m = max(1, sum(1 for r in others if np.isfinite(r["final"]["p"])))
    for r in others:
        f = r["final"]
        d = f.get("diffs_paired", [])
        f["alpha_adjusted"] = ALPHA / m
        f["mdd_paired"] = paired_mdd(d, alpha=ALPHA / m, power=POWER)
        f["tost_p"] = float("nan")
        if np.isfinite(f["p_holm"]) and f["p_holm"] < ALPHA:
            f["verdict"] = "differs"
            continue
        if margin is not None:
            f["tost_p"] = (
                tost_paired(d, margin) if test == "paired" else tost_welch(f["values"], base["final"]["values"], margin)
            )["p"]
        f["verdict"] = "equivalent" if f["tost_p"] < ALPHA else "not detected"


def interaction_row(rows: list[dict], spec: str, margin: float | None) -> dict:
    """The interaction test of ``spec`` = "A-B,C-D": the effect A - B (per shared seed) against C - D;
    paired when the two effects have the same seeds."""
    by = {}
    for r in rows:
        by[r["handle"]] = by[r["handle"][1:]] = by[r["label"]] = r
    try:
        effects = [[by[h.strip()] for h in part.split("-", 1)] for part in spec.split(",")]
        assert len(effects) == 2 and all(len(e) == 2 for e in effects)
    except (KeyError, AssertionError):
        raise MasktrlError(
            f"--interaction takes two effects as 'A-B,C-D' with group handles or labels "
            f"({', '.join(r['handle'] for r in rows)}), got {spec!r}"
        ) from None

    def effect(a: dict, b: dict) -> tuple[list[int], list[float]]:
        shared = sorted(set(a["seeds"]) & set(b["seeds"]))
        va = dict(zip(a["seeds"], a["final"]["values"]))
        vb = dict(zip(b["seeds"], b["final"]["values"]))
        return shared, [va[s] - vb[s] for s in shared]

    (s1, d1), (s2, d2) = effect(*effects[0]), effect(*effects[1])
    paired = s1 == s2
    out = interaction_test(d1, d2, paired=paired, margin=margin)
    out.update(
        spec=" vs ".join(f"{a['handle']}-{b['handle']}" for a, b in effects),
        seeds=[s1, s2],
        effects=[float(np.mean(d1)) if d1 else float("nan"), float(np.mean(d2)) if d2 else float("nan")],
    )
    return out


def _no_test() -> dict:
    nan = float("nan")
    return {
        "diff_vs_baseline": 0.0,
        "diff_ci_low": nan,
        "diff_ci_high": nan,
        "diff_paired": 0.0,
        "diff_ci_paired_low": nan,
        "diff_ci_paired_high": nan,
        "mdd_80": nan,
        "t_welch": nan,
        "p_welch": nan,
        "p_permutation": nan,
        "n_paired": 0,
        "t_paired": nan,
        "p_paired": nan,
        "p_paired_t": nan,
        "p_sign_flip": nan,
        "diffs_paired": [],
    }


def _evals(run: RunInfo, metric: str) -> list[float]:
    return [float(r[metric]) for r in run.metrics if isinstance(r.get(metric), (int, float))]


def metric_kind(metric: str, runs: list[RunInfo]) -> str:
    """What one value of ``metric`` is: avg@k over k samples per prompt, or one sample per prompt."""
    if metric.endswith("/avg_at_k"):
        k_metric = metric.removesuffix("avg_at_k") + "k"  # eval/<bench>/avg_at_k -> eval/<bench>/k
        ks = sorted(
            {int(r[k_metric]) for run in runs for r in run.metrics if isinstance(r.get(k_metric), (int, float))}
        )
        return f"avg@k: mean accuracy over k samples per prompt (k = {', '.join(map(str, ks)) or 'as logged'})"
    if metric == HELDOUT:
        greedy = {bool(run.cfg.to_dict().get("eval", {}).get("greedy", True)) for run in runs}
        return (
            "one "
            + ("greedy answer" if greedy == {True} else "sampled answer" if greedy == {False} else "answer")
            + " per held-out prompt (pass --metric eval/<bench>/avg_at_k for avg@k over several "
            "samples)"
        )
    return "the metric's last logged value"


def eval_kind(bench: str, settings: dict) -> str:
    return (
        f"avg@k of masktrl eval {bench} on each run's final checkpoint: mean accuracy over k = "
        f"{settings['k']} samples "
        f"per prompt, {settings['n_problems']} prompts"
    )


def save(table: dict, out_dir: Path) -> list[Path]:
    from masktrl.analysis.io import figures, save_figure, write_json

    plots = figures(out_dir)  # matplotlib once the JSON is written (its cache: caches.settle_matplotlib)

    return [
        write_json(Path(out_dir) / "compare.json", table),
        save_figure(plots.method_points(table), Path(out_dir) / "compare.png"),
    ]
