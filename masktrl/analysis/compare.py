"""Methods side by side over seeds: final and best eval accuracy with mean, std, bootstrap 95%
CI and a two-sample test against a baseline method.

Per run: *final* = ``eval_after`` of summary.json (held-out accuracy; for another metric, its
last logged value); *best* = the maximum over the run's eval rows in metrics.jsonl and the
final value. Runs are grouped by their config without the seed (``io.group_runs``); the
seeds are the unit of replication.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from masktrl.analysis.io import RunInfo, group_runs
from masktrl.stats import bootstrap_ci, paired_tests, permutation_test, welch_t_test
from masktrl.errors import MasktrlError

HELDOUT = "eval/heldout/accuracy"
MIN_SEEDS = 3
TESTS = ("welch", "permutation", "paired")


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


def test_against(values: list[float], base: list[float], n_perm: int, seed: int = 0,
                 seeds: list[int] | None = None, base_seeds: list[int] | None = None) -> dict:
    """Welch's t-test and the permutation test of mean(values) == mean(base), and the paired
    t-test over the seeds both have (runs of one seed share the warm start; nan with < 2)."""
    t, p = welch_t_test(values, base)
    shared = sorted(set(seeds or []) & set(base_seeds or []))
    pick = lambda vals, ss: [vals[ss.index(s)] for s in shared]  # noqa: E731
    paired = paired_tests(pick(values, seeds), pick(base, base_seeds))
    return {
        "diff_vs_baseline": float(np.mean(values) - np.mean(base)),
        "t_welch": t,
        "p_welch": p,
        "p_permutation": permutation_test(values, base, n_perm=n_perm, seed=seed),
        "n_paired": len(shared),
        "t_paired": paired["t"],
        "p_paired": paired["p_ttest"],
    }


def find_baseline(labels: list[tuple[str, str]], baseline: str) -> str:
    """The group label matching ``baseline`` (a label, or a method name with one group)."""
    names = [label for label, _ in labels]
    if baseline in names:
        return baseline
    by_method = [label for label, method in labels if method == baseline]
    if len(by_method) == 1:
        return by_method[0]
    if by_method:
        raise MasktrlError(f"baseline {baseline!r} is ambiguous ({', '.join(by_method)}): pass one of these labels")
    raise MasktrlError(f"baseline method {baseline!r} is not among the runs (methods: {', '.join(names)})")


def compare(runs: list[RunInfo], baseline: str = "grpo", metric: str = HELDOUT, test: str = "welch",
            n_boot: int = 10000, n_perm: int = 10000) -> dict:
    """The method table (JSON-ready, see docs/ANALYSIS.md). Incomplete runs are listed in ``skipped``."""
    if test not in TESTS:
        raise MasktrlError(f"--test must be one of {', '.join(TESTS)}; got {test!r}")
    complete = [r for r in runs if r.complete]
    skipped = [str(r.root) for r in runs if not r.complete]
    if not complete:
        raise MasktrlError("no complete run to compare (a run is complete once summary.json is written)")
    groups = group_runs(complete)
    base_label = find_baseline([(label, m[0].cfg.method_name) for label, m in groups], baseline)
    scores = {label: [run_scores(r, metric) for r in members] for label, members in groups}
    base_seeds = [r.cfg.seed for r in dict(groups)[base_label]]
    rows, warnings = [], []
    for label, members in groups:
        row = {"label": label, "method": members[0].cfg.method_name, "runs": [str(r.root) for r in members],
               "seeds": [r.cfg.seed for r in members], "is_baseline": label == base_label}
        for i, key in enumerate(("final", "best")):
            vals = [s[i] for s in scores[label]]
            base = [s[i] for s in scores[base_label]]
            row[key] = describe(vals, n_boot)
            tests = (test_against(vals, base, n_perm, seeds=row["seeds"], base_seeds=base_seeds) if label != base_label else
                     {"diff_vs_baseline": 0.0, "t_welch": float("nan"), "p_welch": float("nan"), "p_permutation": float("nan"),
                      "n_paired": 0, "t_paired": float("nan"), "p_paired": float("nan")})
            row[key].update(tests, p=tests[f"p_{test}"])
        if len(members) < MIN_SEEDS:
            warnings.append(f"{label}: only {len(members)} seed{'s' if len(members) != 1 else ''} (< {MIN_SEEDS}); its CI and p-value mean little")
        rows.append(row)
    return {"metric": metric, "baseline": base_label, "test": test, "n_boot": n_boot, "n_perm": n_perm,
            "methods": rows, "warnings": warnings, "skipped": skipped}


def save(table: dict, out_dir: Path) -> list[Path]:
    from masktrl.analysis import plots
    from masktrl.analysis.io import save_figure, write_json

    return [
        write_json(Path(out_dir) / "compare.json", table),
        save_figure(plots.method_points(table), Path(out_dir) / "compare.png"),
    ]

