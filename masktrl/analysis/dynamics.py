"""Training curves of several runs on shared axes; runs that differ only in seed become one
line (the mean over seeds) with a 95% band (Student-t interval of the mean at each step).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from masktrl.analysis.io import RunInfo, check_one_run_per_seed, group_runs
from masktrl.runs.store import EVAL_AFTER_KEY, EVAL_BEFORE_KEY
from masktrl.stats import t_critical

HELDOUT = "eval/heldout/accuracy"
METRICS = [
    ("reward_mean", "reward (mean)"),
    ("response_len_mean", "response length (tokens)"),
    ("ppo_kl", "ppo_kl (k1 estimate of KL(μ||π))"),
    ("mask_frac", "mask / clip fraction"),
    ("D_p95", "D_p95 (95th percentile of the method's D, else top-K KL)"),
    ("sis_accept_rate", "SIS accept rate"),
    (HELDOUT, "held-out accuracy"),
]
MISMATCH = [  # the engine-trainer gap of each batch (rollout/mismatch.py), plotted when a run logged it
    ("mismatch/logp_abs_mean", "mean |log μ − log π_old| of the sampled tokens"),
    ("mismatch/kl_k3", "KL(μ||π_old), k3 estimate"),
    ("mismatch/frac_gt_0.5", "tokens with |log μ − log π_old| > 0.5"),
    ("mismatch/routing_flip_rate", "MoE routing flips (engine copy vs trainer)"),
]
AGENTIC = [  # multi-turn batches (task.env, rl/collect.py episode_stats), plotted when a run logged them
    ("turns_per_episode", "policy turns per episode"),
    ("calls_per_episode", "tool calls per episode"),
    ("tool_call_rate", "episodes that called the tool"),
]
AGE = ("rollout_age", "batch age (steps behind; rollout.staleness)")  # logged when rollout.staleness is a distribution
# logged when the batches record per-token policy versions (rollout.partial): the mean token age and,
# per age a, rollout_token_age/a tokens of that age
TOKEN_AGE = ("rollout_token_age_mean", "mean token age (steps behind; rollout.partial)")
TOKEN_AGE_PREFIX = "rollout_token_age/"


def run_series(run: RunInfo, key: str) -> dict[int, float]:
    """step -> value of metric ``key`` for one run.

    The held-out accuracy adds eval_before at step 0
    and eval_after at the last step (summary.json, else the manifest's eval stages).
    """
    out: dict[int, float] = {}
    for row in run.metrics:
        v = row.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out[int(row["step"])] = float(v)
    if key == HELDOUT:
        before, after = _evals(run)
        if before is not None:
            out[0] = before
        if after is not None and run.metrics:
            out[int(run.metrics[-1]["step"])] = after
    return out


def _evals(run: RunInfo) -> tuple[float | None, float | None]:
    if run.summary is not None:
        return run.summary.get("eval_before"), run.summary.get("eval_after")
    store = run.store
    get = lambda stage: (store.stage(stage) or {}).get("accuracy") if store.exists() else None  # noqa: E731
    return get(EVAL_BEFORE_KEY), get(EVAL_AFTER_KEY)


def smooth(series: dict[int, float], window: int) -> dict[int, float]:
    """Trailing moving average over ``window`` logged points (1 = unchanged)."""
    if window <= 1:
        return series
    steps = sorted(series)
    vals = np.array([series[s] for s in steps])
    csum = np.concatenate([[0.0], np.cumsum(vals)])
    return {
        s: float((csum[i + 1] - csum[max(0, i + 1 - window)]) / (i + 1 - max(0, i + 1 - window)))
        for i, s in enumerate(steps)
    }


def band(values: list[float]) -> tuple[float, float, float]:
    """(mean, low, high): the 95% t-interval of the mean; low = high = nan for one value."""
    v = np.asarray(values, dtype=float)
    mean = float(v.mean())
    if v.size < 2:
        return mean, float("nan"), float("nan")
    half = t_critical(v.size - 1) * float(v.std(ddof=1)) / math.sqrt(v.size)
    return mean, mean - half, mean + half


def group_curve(runs: list[RunInfo], key: str, window: int = 1) -> dict:
    series = [smooth(run_series(r, key), window if key != HELDOUT else 1) for r in runs]
    steps = sorted({s for ser in series for s in ser})
    curve = {"step": [], "mean": [], "lo": [], "hi": [], "n": []}
    for s in steps:
        vals = [ser[s] for ser in series if s in ser]
        mean, lo, hi = band(vals)
        for k, v in zip(("step", "mean", "lo", "hi", "n"), (s, mean, lo, hi, len(vals))):
            curve[k].append(v)
    return curve


def metric_list(runs: list[RunInfo]) -> list[tuple[str, str]]:
    """The standard metrics, the ``mismatch/*`` ones any run logged, plus any other ``eval/...``
    key a run logged (benchmarks)."""
    logged = {k for r in runs for row in r.metrics for k in row}
    extra = sorted(k for k in logged if k.startswith("eval/") and k != HELDOUT)
    ages = [AGE] if AGE[0] in logged else []
    ages += [TOKEN_AGE] if TOKEN_AGE[0] in logged else []
    measured = [(k, label) for k, label in MISMATCH + AGENTIC if k in logged]
    return METRICS + measured + ages + [(k, k) for k in extra]


def age_counts(runs: list[RunInfo]) -> dict[str, int]:
    """How many steps of ``runs`` trained on a batch of each age (``rollout_age``), by age."""
    counts: dict[int, int] = {}
    for r in runs:
        for row in r.metrics:
            age = row.get(AGE[0])
            if isinstance(age, int) and not isinstance(age, bool):
                counts[age] = counts.get(age, 0) + 1
    return {str(a): counts[a] for a in sorted(counts)}


def token_age_counts(runs: list[RunInfo]) -> dict[str, int]:
    """How many tokens ``runs`` trained on at each age (the ``rollout_token_age/a`` counts of
    runs with per-token policy versions, rollout.partial), by age."""
    counts: dict[int, int] = {}
    for r in runs:
        for row in r.metrics:
            for key, n in row.items():
                if key.startswith(TOKEN_AGE_PREFIX) and isinstance(n, int) and not isinstance(n, bool):
                    age = int(key[len(TOKEN_AGE_PREFIX) :])
                    counts[age] = counts.get(age, 0) + n
    return {str(a): counts[a] for a in sorted(counts)}


def dynamics(runs: list[RunInfo], window: int = 1) -> dict:
    """Grouped curves of every metric; JSON-ready (see docs/ANALYSIS.md)."""
    metrics = metric_list(runs)
    groups = []
    grouped = group_runs(runs)
    check_one_run_per_seed(grouped, runs="runs")  # a copy or a rerun averaged in as another seed narrowed the band
    for label, members in grouped:
        curves = {key: group_curve(members, key, window) for key, _ in metrics}
        groups.append(
            {
                "label": label,
                "method": members[0].cfg.method_name,
                "runs": [str(r.root) for r in members],
                "seeds": [r.cfg.seed for r in members],
                "curves": curves,
                "final": {k: (c["mean"][-1] if c["mean"] else None) for k, c in curves.items()},
                "final_step": {k: (c["step"][-1] if c["step"] else None) for k, c in curves.items()},
                **({"ages": age_counts(members)} if any(k == AGE[0] for k, _ in metrics) else {}),
                **({"token_ages": token_age_counts(members)} if any(k == TOKEN_AGE[0] for k, _ in metrics) else {}),
            }
        )
    return {"runs": [str(r.root) for r in runs], "smooth": window, "metrics": [k for k, _ in metrics], "groups": groups}


def save(result: dict, out_dir: Path) -> list[Path]:
    from masktrl.analysis.io import figures, save_figure, write_json

    plots = figures(out_dir)  # matplotlib once the JSON is written (its cache: caches.settle_matplotlib)

    labels = dict(METRICS + MISMATCH + AGENTIC + [AGE, TOKEN_AGE])
    metrics = [(k, labels.get(k, k)) for k in result["metrics"]]
    paths = [
        write_json(Path(out_dir) / "dynamics.json", result),
        save_figure(plots.curves(result["groups"], metrics), Path(out_dir) / "dynamics.png"),
    ]
    if any("ages" in g for g in result["groups"]):
        paths.append(save_figure(plots.age_histogram(result["groups"]), Path(out_dir) / "ages.png"))
    if any("token_ages" in g for g in result["groups"]):
        paths.append(save_figure(plots.age_histogram(result["groups"], tokens=True), Path(out_dir) / "token_ages.png"))
    return paths
