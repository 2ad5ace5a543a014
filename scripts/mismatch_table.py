"""The behaviour-source table of docs/NOTEBOOK.md §7: methods x sweep folders, in one markdown table.

    python scripts/mismatch_table.py outputs/mismatch/float32 outputs/mismatch/bfloat16 outputs/mismatch/fp8 \\
        --eval task --json outputs/mismatch/table.json --figure docs/results/mismatch/lab-differences.png

For each folder it computes `masktrl analyze compare FOLDER --eval task --test paired` in-process
(the same function, so the same numbers; baseline grpo: the paired t p and the exact sign-flip p,
the larger deciding, Holm across the folder, and the paired MDD at alpha/m, post hoc) and adds, per group, what the
metrics of
its runs say about the behaviour and the trust region. ``Δ vs grpo`` is the mean paired
difference over the seeds the group shares with grpo, the centre of its paired interval (with
other seed sets it is not the difference of the means, docs/ANALYSIS.md); then:

* ``|Δlogp| 1 → end``: the mismatch ``mismatch/logp_abs_mean`` (mean |log mu - log pi_old| of the
  sampled tokens at the sampling weights, docs/ROLLOUTS.md) at step 1 and over the last 50 steps,
  averaged over the group's runs;
* ``KL k3 end``: ``mismatch/kl_k3`` over the last 50 steps;
* ``blocked``: ``mask_frac`` averaged over all steps, the fraction of response tokens whose update
  the method's clip or mask (and the correction's mask) blocks (docs/METHODS.md);
* ``entropy end``: ``entropy`` (the mean next-token entropy, in nats, of the policy being trained
  over the response tokens it updates) over the last 50 steps.

``--pooled`` adds a second table: each method's difference from grpo averaged over the folders,
seed by seed (d_s = mean over the folders of score(method, s) - score(grpo, s)), for the seeds
every folder has for both. The runs of one seed share its warm start and prompts across the
folders, so the seed is the unit: the interval is the one-sample t interval of the d_s, the t p
its t-test against 0 beside the exact sign-flip p, the larger deciding, Holm over the methods. Only methods present in
every folder are pooled.

Without ``--eval`` the score is each run's one-sample ``eval_after`` (as in `analyze compare`).
Incomplete runs are left out and counted under the table. ``--figure`` draws the differences
against grpo with their paired 95% intervals, one panel per folder that has more than its
baseline (filled: Holm p < 0.05).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

from masktrl.analysis import compare as cmp
from masktrl.analysis.io import expand_runs, load_run, save_figure
from masktrl.caches import temporary_matplotlib_cache
from masktrl.errors import MasktrlError
from masktrl.io import atomic_write_json
from masktrl.methods.corrections import kind_defaults
from masktrl.stats import paired_tests, sign_flip_p

TAIL = 50  # steps averaged for the "end" of a run


def run_means(metrics: list[dict], key: str, tail: int | None = None) -> float:
    """Mean of ``key`` over the run's logged steps (the last ``tail`` of them if given); nan if absent."""
    vals = [m[key] for m in metrics if isinstance(m.get(key), (int, float)) and math.isfinite(m[key])]
    if tail is not None:
        vals = vals[-tail:]
    return float(np.mean(vals)) if vals else float("nan")


def first_value(metrics: list[dict], key: str) -> float:
    return next((float(m[key]) for m in metrics if isinstance(m.get(key), (int, float))), float("nan"))


def group_behaviour(runs) -> dict:
    """The behaviour and trust-region columns of one group: means over its runs."""

    def over(fn):
        vals = [fn(r.metrics) for r in runs]
        vals = [v for v in vals if math.isfinite(v)]
        return float(np.mean(vals)) if vals else float("nan")

    return {
        "mismatch_start": over(lambda m: first_value(m, "mismatch/logp_abs_mean")),
        "mismatch_end": over(lambda m: run_means(m, "mismatch/logp_abs_mean", TAIL)),
        "kl_k3_end": over(lambda m: run_means(m, "mismatch/kl_k3", TAIL)),
        "mask_frac": over(lambda m: run_means(m, "mask_frac")),
        "entropy_end": over(lambda m: run_means(m, "entropy", TAIL)),
    }


def folder_table(folder: Path, eval_bench: str | None, n_boot: int) -> dict:
    runs = [load_run(p) for p in expand_runs([folder])]
    table = cmp.compare(runs, "grpo", test="paired", n_boot=n_boot, eval_bench=eval_bench)
    by_root = {str(r.root): r for r in runs}
    for row in table["methods"]:
        row["behaviour"] = group_behaviour([by_root[p] for p in row["runs"]])
        row["display"] = short_label(row["label"], by_root[row["runs"][0]].cfg.resolved_method())
    return {"folder": str(folder), "source": folder.name, "table": table}


def short_label(label: str, method: dict) -> str:
    """A group by its correction, from its resolved method block: ``grpo + token-tis (decoupled)``,
    ``grpo + token-tis cap=1,floor=1 (decoupled)`` (keys away from the kind's defaults shown),
    ``grpo (decoupled)`` for kind none; a dual clip is added (``..., dual_clip=3``). A label that ``analyze compare``
    built from other keys
    (``dppo[divergence=topk-tv]``) is kept."""
    if "[" in label:
        shown = [part.split("=", 1)[0] for part in label[:-1].split("[", 1)[1].split(",")]
        if not all(k.startswith("correction.") for k in shown):
            return label
    dual = f", dual_clip={method['dual_clip']:g}" if method.get("dual_clip") is not None else ""
    corr = method.get("correction")
    if not corr:
        return method["name"] + dual
    kind = corr.get("kind") or "none"
    changed = {k: corr[k] for k, default in kind_defaults(kind).items() if k in corr and corr[k] != default}
    if corr.get("ref") == "current":  # masktrl's own bypass variant (docs/METHODS.md §14.1)
        changed["ref"] = "current"
    extra = ",".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in changed.items())
    out = method["name"] if kind == "none" else f"{method['name']} + {kind}" + (f" {extra}" if extra else "")
    return out + (" (decoupled)" if corr.get("mode") == "decoupled" else "") + dual


def f3(x) -> str:
    return "—" if x is None or not math.isfinite(x) else f"{x:.3f}"


def signed(x) -> str:
    return "—" if x is None or not math.isfinite(x) else f"{x:+.3f}"


def small(x) -> str:
    return "—" if x is None or not math.isfinite(x) else (f"{x:.1e}" if 0 < abs(x) < 1e-2 else f"{x:.3f}")


def ordered(rows: list[dict]) -> list[dict]:
    """The baseline first, then its own variants (grpo + a correction), then the other methods, by name."""
    base = next((r for r in rows if r["is_baseline"]), None)
    stem = base.get("display", base["label"]) if base else ""

    def key(r):
        name = r.get("display", r["label"])
        return (not r["is_baseline"], not name.startswith(stem + " "), name)

    return sorted(rows, key=key)


def markdown(folders: list[dict]) -> str:
    score = "avg@k" if folders and folders[0]["table"].get("eval") else "held-out accuracy (one sample)"
    head = [
        "method",
        "source",
        "n",
        f"{score} mean ± sd",
        "Δ vs grpo [paired 95% CI]",
        "t p",
        "sign-flip p",
        "Holm p",
        "paired MDD",
        "collapsed",
        "\\|Δlogp\\| 1 → end",
        "KL k3 end",
        "blocked",
        "entropy end",
    ]  # the bars escaped: a markdown cell
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for f in folders:
        for row in ordered(f["table"]["methods"]):
            s, b, c = row["final"], row["behaviour"], row["collapse"]
            sd = "" if not math.isfinite(s["std"]) else f" ± {s['std']:.3f}"
            if row["is_baseline"]:
                diff, tp, sp, holm, mdd = "base", "", "", "", ""
            else:
                diff = (
                    f"{signed(s.get('diff_paired'))} [{signed(s.get('diff_ci_paired_low'))}, "
                    f"{signed(s.get('diff_ci_paired_high'))}]"
                )
                tp, sp, holm, mdd = (
                    f3(s.get("p_paired_t")),
                    f3(s.get("p_sign_flip")),
                    f3(s.get("p_holm")),
                    f3(s.get("mdd_paired")),
                )
            lines.append(
                "| "
                + " | ".join(
                    [
                        row.get("display", row["label"]),
                        f["source"],
                        str(s["n"]),
                        f"{f3(s['mean'])}{sd}",
                        diff,
                        tp,
                        sp,
                        holm,
                        mdd,
                        f"{c['count']}/{c['total']}",
                        f"{f3(b['mismatch_start'])} → {f3(b['mismatch_end'])}",
                        small(b["kl_k3_end"]),
                        f3(b["mask_frac"]),
                        f3(b["entropy_end"]),
                    ]
                )
                + " |"
            )
    skipped = sum(len(f["table"]["skipped"]) for f in folders)
    if skipped:
        lines.append(f"\n{skipped} incomplete run(s) left out.")
    return "\n".join(lines)


def pooled(folders: list[dict]) -> list[dict]:
    """Each method's difference from grpo, averaged over the folders seed by seed (the module
    docstring): rows ``{display, seeds, diffs, mean, ci_low, ci_high, p, p_holm}``, in the order of
    ``ordered`` on the first folder. A method missing from a folder, or with fewer than 2 shared
    seeds, is left out."""

    def scores(row):
        return dict(zip(row["seeds"], row["final"]["values"]))

    bases = [scores(next(r for r in f["table"]["methods"] if r["is_baseline"])) for f in folders]
    out = []
    for row in ordered(folders[0]["table"]["methods"]) if folders else []:
        if row["is_baseline"]:
            continue
        name = row.get("display", row["label"])
        mine = [
            next(
                (
                    scores(r)
                    for r in f["table"]["methods"]
                    if r.get("display", r["label"]) == name and not r["is_baseline"]
                ),
                None,
            )
            for f in folders
        ]
        if any(m is None for m in mine):
            continue
        seeds = sorted(set.intersection(*(set(m) & set(b) for m, b in zip(mine, bases))))
        if len(seeds) < 2:
            continue
        diffs = [float(np.mean([m[s] - b[s] for m, b in zip(mine, bases)])) for s in seeds]
        lo, hi = cmp.paired_diff_ci(diffs, [0.0] * len(diffs))
        p_t, p_flip = paired_tests(diffs, [0.0] * len(diffs))["p_ttest"], sign_flip_p(diffs)
        out.append(
            {
                "display": name,
                "seeds": seeds,
                "diffs": diffs,
                "mean": float(np.mean(diffs)),
                "ci_low": lo,
                "ci_high": hi,
                "p_t": p_t,
                "p_sign_flip": p_flip,
                "p": max(p_t, p_flip),
            }
        )  # the paired rule: the larger decides
    for r, v in zip(out, cmp.holm([r["p"] for r in out])):
        r["p_holm"] = v
    return out


def pooled_markdown(rows: list[dict], sources: list[str]) -> str:
    head = [
        "method",
        "seeds",
        f"Δ vs grpo, mean over {', '.join(sources)} [95% CI over seeds]",
        "t p",
        "sign-flip p",
        "Holm p",
        "per seed",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append(
            "| "
            + " | ".join(
                [
                    r["display"],
                    str(len(r["seeds"])),
                    f"{signed(r['mean'])} [{signed(r['ci_low'])}, {signed(r['ci_high'])}]",
                    f3(r["p_t"]),
                    f3(r["p_sign_flip"]),
                    f3(r["p_holm"]),
                    ", ".join(signed(d) for d in r["diffs"]),
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def figure(folders: list[dict]):
    """One panel per folder: each method's Δ vs grpo with its paired 95% CI (filled marker: Holm p < 0.05)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    rows = [[r for r in ordered(f["table"]["methods"]) if not r["is_baseline"]] for f in folders]
    kept = [i for i, group in enumerate(rows) if group] or [0]  # a folder of its baseline alone has no panel
    folders, rows = [folders[i] for i in kept], [rows[i] for i in kept]
    n = max((len(r) for r in rows), default=1)
    # one x scale for every panel, so the sources' differences compare by eye
    fig, axes = plt.subplots(
        1, len(folders), figsize=(3.2 * len(folders) + 2.4, 0.42 * n + 1.4), sharex=True, sharey=True, squeeze=False
    )
    names = [r.get("display", r["label"]) for r in rows[0]] if rows else []
    for ax, f, group in zip(axes[0], folders, rows):
        for row in group:
            name = row.get("display", row["label"])
            if name not in names:
                names.append(name)
            y, s = names.index(name), row["final"]
            lo, hi, d = s.get("diff_ci_paired_low"), s.get("diff_ci_paired_high"), s.get("diff_paired")
            if d is None or not math.isfinite(d):
                continue
            sig = s.get("p_holm") is not None and math.isfinite(s["p_holm"]) and s["p_holm"] < 0.05
            if lo is not None and hi is not None and math.isfinite(lo) and math.isfinite(hi):
                ax.plot([lo, hi], [y, y], color="tab:blue", lw=1.6)
            ax.plot([d], [y], "o", color="tab:blue", mfc="tab:blue" if sig else "white", ms=6)
        ax.axvline(0.0, color="0.5", lw=0.8, ls="--")
        ax.set_title(f"{f['source']} (n = {max((r['final']['n'] for r in group), default=0)})", fontsize=10)
        ax.set_xlabel("Δ vs grpo")
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(5))
    axes[0][0].set_yticks(range(len(names)), names, fontsize=8)
    axes[0][0].invert_yaxis()
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+", type=Path, help="sweep folders, one per behaviour source")
    ap.add_argument("--eval", dest="eval_bench", default=None, help="score by this eval report's avg@k (e.g. task)")
    ap.add_argument("--json", type=Path, default=None, help="also write the tables as JSON here")
    ap.add_argument("--figure", type=Path, default=None, help="also draw the differences (PNG) here")
    ap.add_argument(
        "--pooled", action="store_true", help="also the differences averaged over the folders, seed by seed"
    )
    ap.add_argument("--n-boot", type=int, default=10000)
    args = ap.parse_args(argv)
    try:
        folders = [folder_table(f, args.eval_bench, args.n_boot) for f in args.folders]
        out = args.json
        pool = pooled(folders) if args.pooled else None
        if args.json:
            atomic_write_json(args.json, {"folders": folders, "pooled": pool})
        out = args.figure
        if args.figure:
            with temporary_matplotlib_cache():  # matplotlib's config and font cache: never in $HOME
                save_figure(figure(folders), args.figure)
    except MasktrlError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: cannot write {out}: {e.strerror or e}", file=sys.stderr)
        return 2
    print(markdown(folders))
    if pool is not None:
        print("\n" + pooled_markdown(pool, [f["source"] for f in folders]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
