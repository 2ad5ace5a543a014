"""Figures of the analyses. Built on ``matplotlib.figure.Figure`` (the Agg renderer, no pyplot
state), so plotting never depends on or changes a display backend; ``io.save_figure`` writes them.
"""

from __future__ import annotations

import math

import numpy as np
from matplotlib.figure import Figure

STYLES = ["-", "--", ":"]
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]


def _nan(x) -> float:
    return float("nan") if x is None else float(x)


def _grid(n: int, width: float = 4.2, height: float = 3.2, cols: int = 3):
    cols = min(cols, n)
    rows = math.ceil(n / cols)
    fig = Figure(figsize=(width * cols, height * rows), layout="constrained")
    axes = [fig.add_subplot(rows, cols, i + 1) for i in range(n)]
    return fig, axes


# --------------------------------------------------------------------------- disagreement


def disagreement_bars(result: dict, criteria, scopes) -> Figure:
    """Unsafe-keep rate and contracted fraction per criterion, mean ± SE over seeds."""
    fig, axes = _grid(len(scopes), 5.0, 3.6, cols=len(scopes))
    x = np.arange(len(criteria))
    for ax, scope in zip(axes, scopes):
        for j, (key, label) in enumerate((("unsafe_keep", "unsafe keep (ΔD>0)"), ("contract_frac", "contracted (ΔD<0)"))):
            means = [_nan(result[scope][c][f"{key}_mean"]) for c in criteria]
            ses = [_nan(result[scope][c][f"{key}_se"]) for c in criteria]
            ses = [0.0 if s != s else s for s in ses]
            ax.bar(x + (j - 0.5) * 0.38, means, 0.38, yerr=ses, capsize=3, label=label, color=COLORS[j])
        ax.set_xticks(x, [f"{c}\n(n={result[scope][c]['n_kept_mean']:.1f})" for c in criteria], fontsize=8)
        ax.set_ylim(0, 1.05)
        ax.set_title(f"{scope}: kept disagreement tokens", fontsize=9)
        ax.axhline(0.5, color="0.7", lw=0.8, ls=":")
        ax.legend(fontsize=7)
    fig.suptitle(
        f"{result['run']} step {result['step']} (policy {result['policy_step']}), δ={result['delta']:g}, "
        f"{result['seeds']} seeds, {result['n_disagree_mean']:.1f} disagreement tokens/seed",
        fontsize=9,
    )
    return fig


def ecdf_panels(data: dict, criteria, scopes, title: str) -> Figure:
    """Empirical CDF of ΔD for each criterion's kept disagreement tokens, one panel per scope."""
    fig, axes = _grid(len(scopes), 5.0, 3.6, cols=len(scopes))
    for ax, scope in zip(axes, scopes):
        for i, c in enumerate(criteria):
            v = np.sort(np.asarray(data[scope][c], dtype=float))
            if v.size:
                ax.step(v, np.arange(1, v.size + 1) / v.size, where="post", color=COLORS[i], ls=STYLES[i % len(STYLES)],
                        label=f"{c} (n={v.size})")
        ax.axvline(0.0, color="0.5", lw=0.8, ls="--")
        ax.set_xlabel("ΔD = D_after − D_before")
        ax.set_ylabel("fraction of kept tokens")
        ax.set_title(scope, fontsize=9)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "no kept disagreement tokens", ha="center", transform=ax.transAxes, fontsize=8)
    fig.suptitle(title, fontsize=9)
    return fig


# --------------------------------------------------------------------------- dynamics


def curves(groups: list[dict], metrics: list[tuple[str, str]]) -> Figure:
    """One panel per metric; a line per group (mean over seeds) with its 95% band."""
    fig, axes = _grid(len(metrics))
    for ax, (key, label) in zip(axes, metrics):
        for i, g in enumerate(groups):
            c = g["curves"].get(key)
            if not c or not c["step"]:
                continue
            steps = np.array(c["step"], dtype=float)
            mean = np.array([_nan(v) for v in c["mean"]])
            color = COLORS[i % len(COLORS)]
            ax.plot(steps, mean, color=color, lw=1.2, marker="o" if len(steps) < 12 else None, ms=3,
                    label=f"{g['label']} (n={len(g['runs'])})")
            lo, hi = np.array([_nan(v) for v in c["lo"]]), np.array([_nan(v) for v in c["hi"]])
            if np.isfinite(lo).any():
                ax.fill_between(steps, lo, hi, color=color, alpha=0.2, lw=0)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("step")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", transform=ax.transAxes, fontsize=8, color="0.5")
    return fig


# --------------------------------------------------------------------------- compare


def method_points(table: dict) -> Figure:
    """Final and best accuracy per method: seeds as dots, mean with bootstrap 95% CI."""
    fig, axes = _grid(2, 5.0, 3.6, cols=2)
    rows = table["methods"]
    for ax, key in zip(axes, ("final", "best")):
        for i, row in enumerate(rows):
            s = row[key]
            vals = [v for v in s["values"] if v is not None]
            ax.scatter([i + 0.12] * len(vals), vals, s=12, color="0.5", zorder=2)
            lo, hi, mean = _nan(s["ci_low"]), _nan(s["ci_high"]), _nan(s["mean"])
            if mean == mean:
                ax.errorbar([i], [mean], yerr=[[mean - lo], [hi - mean]], fmt="o", color=COLORS[i % len(COLORS)], capsize=4, zorder=3)
        ax.set_xticks(range(len(rows)), [r["label"] for r in rows], rotation=20, fontsize=8)
        ax.set_title(f"{key} {table['metric']}", fontsize=9)
    return fig


# --------------------------------------------------------------------------- SIS


def sis_panels(rep: dict) -> Figure:
    fig, axes = _grid(6, cols=3)
    ax = axes[0]
    tr = rep["training"]
    if tr["accept_rate"]:
        ax.plot(tr["step"], [_nan(v) for v in tr["accept_rate"]], lw=1.2, label="logged")
    r = rep["replay"]
    ax.scatter([rep["step"]], [r["accept_rate"]], color=COLORS[1], zorder=3, label=f"recomputed (step {rep['step']})")
    ax.set_title("SIS accept rate (accepted / valid tokens)", fontsize=9)
    ax.set_xlabel("step")
    ax.legend(fontsize=7)

    ax = axes[1]
    ro = rep["rollouts"]
    for q, style in (("mean", "-"), ("p50", "--"), ("p90", ":")):
        ax.plot(ro["step"], ro[f"behaviour_residual_{q}"], style, color=COLORS[0], label=f"1−μ(top-K) {q}")
    if tr["residual_mean"]:
        ax.plot(tr["step"], [_nan(v) for v in tr["residual_mean"]], color=COLORS[1], label="1−π(top-K) mean (logged)")
    ax.set_title("residual top-K mass over training", fontsize=9)
    ax.set_xlabel("step")
    ax.legend(fontsize=7)

    ax = axes[2]
    ax.hist(r["pi_residual"], bins=40, color=COLORS[0])
    ax.set_yscale("log")
    ax.set_title(f"1 − π(top-K) per token, step {rep['step']} (policy {rep['step'] - 1})", fontsize=9)

    ax = axes[3]
    ax.plot(ro["step"], ro["outside_topk_frac"], color=COLORS[2])
    ax.set_title("sampled tokens outside the behaviour top-K", fontsize=9)
    ax.set_xlabel("step")

    for ax, key, color in ((axes[4], "accepted", COLORS[2]), (axes[5], "rejected", COLORS[1])):
        top = rep["tokens"][key]
        ax.barh(range(len(top))[::-1], [t["count"] for t in top], color=color)
        ax.set_yticks(range(len(top))[::-1], [repr(t["token"]) for t in top], fontsize=7)
        ax.set_title(f"most frequent {key} tokens (step {rep['step']})", fontsize=9)
    return fig
