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


def _pair_grid(result: dict, scopes) -> tuple[Figure, list[tuple]]:
    """A figure with one panel per (scope, pair): rows are scopes, columns pairs; and the list of
    (axes, scope, pair name, the pair's JSON block)."""
    names = list(result["pairs"])
    rows, cols = len(scopes), max(1, len(names))
    fig = Figure(figsize=(4.2 * cols, 3.4 * rows), layout="constrained")
    panels = [
        (fig.add_subplot(rows, cols, r * cols + c + 1), scope, name, result["pairs"][name])
        for r, scope in enumerate(scopes)
        for c, name in enumerate(names)
    ]
    return fig, panels


def _study_title(result: dict, what: str) -> str:
    steps = result["steps"]
    span = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}..{steps[-1]} ({len(steps)})"
    return (
        f"{what}: {', '.join(result['runs'][:3])}{' ...' if len(result['runs']) > 3 else ''}, "
        f"{span}, δ={result['delta']:g}, "
        f"{result['n_replicates']} replicates ({result['replicate_unit']}), update "
        f"{result['update']['name']}"
    )


def pair_bars(result: dict, scopes) -> Figure:
    """Fig. 3a: unsafe-keep rate of each rule of each pair, mean ± SE over replicates."""
    fig, panels = _pair_grid(result, scopes)
    for ax, scope, name, block in panels:
        crit = block["criteria"]
        means = [_nan(block[scope][k]["unsafe_keep_mean"]) for k in crit]
        ses = [0.0 if x != x else x for x in (_nan(block[scope][k]["unsafe_keep_se"]) for k in crit)]
        ax.bar(range(2), means, 0.6, yerr=ses, capsize=4, color=COLORS[:2])
        ax.set_xticks(range(2), [f"{k}\n(kept {block[scope][k]['n_kept_total']})" for k in crit], fontsize=8)
        ax.set_ylim(0, 1.05)
        ax.axhline(0.5, color="0.7", lw=0.8, ls=":")
        p = block[scope]["paired"]["p"]
        ax.set_title(
            f"{name} ({scope})\n{block['n_disagree_total']} disagreement tokens, paired p = "
            f"{'—' if p is None or p != p else f'{p:.3g}'}",
            fontsize=8,
        )
        ax.set_ylabel("unsafe keep (ΔD > 0)", fontsize=8)
    fig.suptitle(_study_title(result, "unsafe-keep rate on disagreement tokens"), fontsize=9)
    return fig


def pair_ecdf(result: dict, ecdf: dict, scopes) -> Figure:
    """Fig. 4a: empirical CDF of ΔD of each rule's kept disagreement tokens (all replicates)."""
    fig, panels = _pair_grid(result, scopes)
    for ax, scope, name, _ in panels:
        every = []
        for i, (crit, vals) in enumerate(ecdf[name][scope].items()):
            v = np.sort(np.asarray(vals, dtype=float))
            v = v[np.isfinite(v)]
            if v.size:
                every.append(v)
                ax.step(
                    v,
                    np.arange(1, v.size + 1) / v.size,
                    where="post",
                    color=COLORS[i],
                    ls=STYLES[i % len(STYLES)],
                    label=f"{crit} (n={v.size})",
                )
        if every:  # the view spans the 1st-99th percentile of both rules' values (and 0): heavy tails stay readable
            lo, hi = np.quantile(np.concatenate(every), [0.01, 0.99])
            lo, hi = min(float(lo), 0.0), max(float(hi), 0.0)
            pad = 0.05 * (hi - lo or 1.0)
            ax.set_xlim(lo - pad, hi + pad)
            ax.axvspan(lo - pad, 0.0, color="0.92", lw=0)
        ax.axvline(0.0, color="0.5", lw=0.8, ls="--")
        ax.set_xlabel("ΔD = D_after − D_before", fontsize=8)
        ax.set_ylabel("fraction of kept tokens", fontsize=8)
        ax.set_title(f"{name} ({scope})", fontsize=8)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "no kept disagreement tokens", ha="center", transform=ax.transAxes, fontsize=8)
    fig.suptitle(
        _study_title(result, "ΔD of kept disagreement tokens (shaded: contracted; x: 1st-99th percentile)"), fontsize=9
    )
    return fig


def pair_contracted(result: dict, scopes) -> Figure:
    """Fig. 4b: pooled fraction of each rule's kept disagreement tokens with ΔD < 0."""
    fig, panels = _pair_grid(result, scopes)
    for ax, scope, name, block in panels:
        crit = block["criteria"]
        vals = [_nan(block[scope][k]["contract_frac_pooled"]) for k in crit]
        bars = ax.bar(range(2), vals, 0.6, color=COLORS[:2])
        for bar, k in zip(bars, crit):
            ax.annotate(
                f"n={block[scope][k]['n_kept_total']}",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=7,
            )
        ax.set_xticks(range(2), crit, fontsize=8)
        ax.set_ylim(0, 1.05)
        ax.set_title(f"{name} ({scope})", fontsize=8)
        ax.set_ylabel("kept with ΔD < 0 (pooled)", fontsize=8)
    fig.suptitle(_study_title(result, "fraction of kept disagreement updates that contracted D"), fontsize=9)
    return fig


def first_order_bars(result: dict) -> Figure:
    """Per direction rule: its measured unsafe-keep rate (one step, every D > δ token it keeps)
    beside the rate each first-order part of the step would give (paired bars), and the sign
    agreement of each part with the measured ΔD."""
    fo = result["first_order"]
    rules = list(fo["unsafe_keep"])
    parts = ["measured", "total", "gradient", "momentum", "decay", "own", "rest"]
    fig, axes = _grid(2, 6.5, 3.4, cols=2)
    width = 0.8 / len(parts)
    for j, part in enumerate(parts):
        vals = [_nan(fo["unsafe_keep"][r].get(part)) for r in rules]
        axes[0].bar(
            np.arange(len(rules)) + (j - len(parts) / 2 + 0.5) * width,
            vals,
            width,
            color=COLORS[j % len(COLORS)],
            label=part,
        )
    axes[0].set_xticks(range(len(rules)), rules, fontsize=7, rotation=20)
    axes[0].set_ylim(0, 1.05)
    axes[0].set_ylabel("kept D > δ updates with ΔD > 0", fontsize=8)
    axes[0].set_title("unsafe keep: measured, and as each part predicts", fontsize=8)
    axes[0].legend(fontsize=6, ncol=2)
    names = [p for p in parts[1:] if p in fo["sign_agree"]]
    axes[1].bar(
        range(len(names)),
        [_nan(fo["sign_agree"][p]) for p in names],
        0.6,
        color=[COLORS[(parts.index(p)) % len(COLORS)] for p in names],
    )
    axes[1].set_xticks(range(len(names)), names, fontsize=7)
    axes[1].set_ylim(0, 1.05)
    axes[1].set_title(
        f"sign(part) = sign(measured ΔD), n = {fo['n_tokens']} (own, rest: n = {fo['n_own']})", fontsize=8
    )
    opt = result.get("replay_optimizer") or {}
    fig.suptitle(
        _study_title(
            result,
            f"first-order parts of ΔD, optimizer {opt.get('name')} lr {opt.get('lr_used')}"
            f"{' reset moments' if opt.get('reset_moments') else ''}",
        ),
        fontsize=9,
    )
    return fig


def estimator_panels(result: dict) -> Figure:
    """Sign agreement, relative error and bracket certification of the tail estimators vs K."""
    fig, axes = _grid(4, 4.2, 3.4, cols=4)
    ks = result["ks"]
    for si, name in enumerate(("moved", "over_delta")):
        block = result["subsets"][name]
        rows = [block["k"][str(k)] for k in ks]
        ls = STYLES[si]
        label = f"{name} (n={block['n_tokens']})"
        for ei, est in enumerate(("agg", "uniform")):
            axes[0].errorbar(
                ks,
                [_nan(r[est]["sign_agree_mean"]) for r in rows],
                yerr=[
                    0
                    if _nan(r[est]["sign_agree_se"]) != _nan(r[est]["sign_agree_se"])
                    else _nan(r[est]["sign_agree_se"])
                    for r in rows
                ],
                color=COLORS[ei],
                ls=ls,
                marker="o",
                ms=3,
                capsize=3,
                label=f"{est}, {label}",
            )
            axes[1].plot(
                ks,
                [max(_nan(r[est]["rel_err_p50"]), 1e-16) for r in rows],
                color=COLORS[ei],
                ls=ls,
                marker="o",
                ms=3,
                label=f"{est} p50, {name}",
            )
            axes[1].plot(
                ks,
                [max(_nan(r[est]["rel_err_p90"]), 1e-16) for r in rows],
                color=COLORS[ei],
                ls=ls,
                marker="x",
                ms=4,
                alpha=0.6,
                label=f"{est} p90, {name}",
            )
        axes[2].plot(
            ks,
            [_nan(r["bracket"]["certified_frac"]) for r in rows],
            color=COLORS[2],
            ls=ls,
            marker="o",
            ms=3,
            label=f"certified, {label}",
        )
        axes[2].plot(
            ks,
            [_nan(r["bracket"]["contains_frac"]) for r in rows],
            color=COLORS[3],
            ls=ls,
            marker="x",
            ms=4,
            label=f"contains exact, {name}",
        )
        axes[3].plot(
            ks, [_nan(r["pi_tail_mean"]) for r in rows], color=COLORS[4], ls=ls, marker="o", ms=3, label=f"mean, {name}"
        )
        axes[3].plot(
            ks, [_nan(r["pi_tail_p90"]) for r in rows], color=COLORS[5], ls=ls, marker="x", ms=4, label=f"p90, {name}"
        )
    titles = (
        "sign agreement with exact Ḋ_KL (mean ± SE over replicates)",
        "relative error |est − exact| / |exact| (floor 1e-16)",
        "bracket: sign certified / contains exact",
        "training mass outside the list 1 − π(list)",
    )
    for ax, title in zip(axes, titles):
        ax.set_xscale("log")
        ax.minorticks_off()
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.set_xlabel(f"list size K (stored K = {int(result['stored_k'])})", fontsize=8)
        ax.set_title(title, fontsize=8)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
    axes[1].set_yscale("log")
    for ax in (axes[0], axes[2]):
        ax.set_ylim(0, 1.05)
    steps = result["steps"]
    span = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}..{steps[-1]} ({len(steps)})"
    fig.suptitle(
        f"top-K estimators of Ḋ_KL vs the exact value: {', '.join(result['runs'][:3])}, {span}, |V| "
        f"= {result['vocab_size']}, "
        f"update {result['update']['name']}",
        fontsize=9,
    )
    return fig


# --------------------------------------------------------------------------- dynamics


def curves(groups: list[dict], metrics: list[tuple[str, str]]) -> Figure:
    """One panel per metric; a line per group (mean over seeds) with its 95% band; one legend
    for the figure, below the panels."""
    fig, axes = _grid(len(metrics))
    legend: dict[str, object] = {}
    for ax, (key, label) in zip(axes, metrics):
        for i, g in enumerate(groups):
            c = g["curves"].get(key)
            if not c or not c["step"]:
                continue
            steps = np.array(c["step"], dtype=float)
            mean = np.array([_nan(v) for v in c["mean"]])
            color = COLORS[i % len(COLORS)]
            name = f"{g['label']} (n={len(g['runs'])})"
            (line,) = ax.plot(
                steps, mean, color=color, lw=1.2, marker="o" if len(steps) < 12 else None, ms=3, label=name
            )
            legend.setdefault(name, line)
            lo, hi = np.array([_nan(v) for v in c["lo"]]), np.array([_nan(v) for v in c["hi"]])
            if np.isfinite(lo).any():
                ax.fill_between(steps, lo, hi, color=color, alpha=0.15, lw=0)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("step")
        if not ax.get_legend_handles_labels()[0]:
            ax.text(0.5, 0.5, "not logged", ha="center", transform=ax.transAxes, fontsize=8, color="0.5")
    if legend:
        widest = max(len(name) for name in legend)  # long labels get fewer columns, so the legend fits the figure
        fig.legend(
            list(legend.values()),
            list(legend),
            loc="outside lower center",
            ncols=max(1, min(4, len(legend), 180 // widest)),
            fontsize=8,
        )
    return fig


def age_histogram(groups: list[dict], tokens: bool = False) -> Figure:
    """The distribution of batch ages (``rollout_age``): per group, the fraction of its steps
    that trained on a batch of each age, bars side by side. ``tokens``: the distribution of token
    ages instead (``token_ages``: per-token policy versions, rollout.partial), the fraction of
    the tokens trained on."""
    key = "token_ages" if tokens else "ages"
    fig, (ax,) = _grid(1, 5.0, 3.4)
    shown = [g for g in groups if g.get(key)]
    width = 0.8 / max(1, len(shown))
    for i, g in enumerate(shown):
        ages = {int(a): n for a, n in g[key].items()}
        total = sum(ages.values())
        xs = np.array(sorted(ages), dtype=float)
        ax.bar(
            xs + (i - (len(shown) - 1) / 2) * width,
            [ages[int(a)] / total for a in xs],
            width=width,
            color=COLORS[i % len(COLORS)],
            label=f"{g['label']} (n={len(g['runs'])})",
        )
    what = "token" if tokens else "batch"
    ax.set_xlabel(f"{what} age (steps behind the trained policy)")
    ax.set_ylabel("fraction of tokens" if tokens else "fraction of steps")
    ax.set_title("rollout.partial: token ages" if tokens else "rollout.staleness: batch ages", fontsize=9)
    if shown:
        ax.legend(fontsize=8)
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
                ax.errorbar(
                    [i],
                    [mean],
                    yerr=[[mean - lo], [hi - mean]],
                    fmt="o",
                    color=COLORS[i % len(COLORS)],
                    capsize=4,
                    zorder=3,
                )
        ax.set_xticks(range(len(rows)), [r["label"] for r in rows], rotation=20, fontsize=8)
        ax.set_title(f"{key} {table['metric']}", fontsize=9)
    return fig


# --------------------------------------------------------------------------- SIS


def sis_panels(rep: dict) -> Figure:
    fig, axes = _grid(7, cols=4)
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

    ax = axes[6]
    if tr["log_r_dev"]:
        ax.plot(tr["step"], [_nan(v) for v in tr["log_r_dev"]], color=COLORS[0], label="D = Σ|log r| (without SIS)")
    if tr["log_w_dev"]:
        ax.plot(tr["step"], [_nan(v) for v in tr["log_w_dev"]], color=COLORS[1], label="D_SIS = Σ|log w| (with SIS)")
    ax.scatter(
        [rep["step"]] * 2,
        [r["log_r_dev"], r["log_w_dev"]],
        color=[COLORS[0], COLORS[1]],
        marker="x",
        zorder=3,
        label=f"recomputed (step {rep['step']})",
    )
    ax.set_title("log-importance deviation per sequence (mean)", fontsize=9)
    ax.set_xlabel("step")
    ax.legend(fontsize=7)

    for ax, key, color in ((axes[4], "accepted", COLORS[2]), (axes[5], "rejected", COLORS[1])):
        top = rep["tokens"][key]
        ax.barh(range(len(top))[::-1], [t["count"] for t in top], color=color)
        ax.set_yticks(range(len(top))[::-1], [repr(t["token"]) for t in top], fontsize=7)
        ax.set_title(f"most frequent {key} tokens (step {rep['step']})", fontsize=9)
    return fig


def sis_bias_panels(result: dict) -> Figure:
    """Cosine and relative norm of the top-K SIS gradient against the exact-envelope SIS gradient
    and the on-policy gradient, against the residual mass ξ_K."""
    fig, axes = _grid(2, 4.6, 3.4, cols=2)
    xi = [r["xi_mean"] for r in result["ks"]]
    for j, (ref, label) in enumerate(
        (("vs_exact", "top-K vs exact-envelope SIS"), ("vs_on_policy", "top-K SIS vs on-policy"))
    ):
        axes[0].plot(xi, [r[ref]["cos"] for r in result["ks"]], marker="o", color=COLORS[j], label=label)
        axes[1].plot(xi, [r[ref]["rel_norm"] for r in result["ks"]], marker="o", color=COLORS[j], label=label)
    e = result["exact"]["vs_on_policy"]
    axes[0].scatter(
        [0.0], [e["cos"]], marker="*", s=60, color=COLORS[2], label="exact-envelope SIS vs on-policy", zorder=3
    )
    axes[1].scatter(
        [0.0], [e["rel_norm"]], marker="*", s=60, color=COLORS[2], label="exact-envelope SIS vs on-policy", zorder=3
    )
    for r in result["ks"]:
        axes[0].annotate(f"K={r['k']}", (r["xi_mean"], r["vs_exact"]["cos"]), fontsize=7)
    for ax, title in zip(axes, ("cosine of the gradients", "‖g − g_ref‖ / ‖g_ref‖")):
        ax.set_xlabel("residual mass ξ_K = 1 − π(top-K), mean over tokens", fontsize=8)
        ax.set_title(title, fontsize=8)
        ax.legend(fontsize=6)
    fig.suptitle(
        f"SIS gradient bias on one batch: {result['run']}, step {result['step']}, |V| = "
        f"{result['vocab_size']}"
        f"{' (hypothetical: not a SIS run)' if result['hypothetical'] else ''}",
        fontsize=9,
    )
    return fig
