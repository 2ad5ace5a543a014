"""How good are the top-K estimators of Ḋ_KL? Their error against the exact value, measured in a
replayed update (docs/METHODS.md §4.3-§4.5).

In a replay the full distributions are at hand: pi from the policy being updated, mu from the
checkpoint of the behaviour policy that sampled the batch (``step_replay.load_behaviour``).
For every token, at the forward pass its minibatch trains on, the exact Ḋ_KL (§4.5) is
compared with, for each list size K:

    ddot_agg, ddot_uniform   the aggregated- and uniform-tail estimators (§4.2)
    bracket                  the certified bracket [lo, hi] (§4.4)

A K up to the stored list size re-cuts the stored list (``truncate_topk``, §1.1: what an engine
asked for top-K would have returned); a larger K takes the top-K of the recomputed behaviour
distribution. All in float64 (pi at the list ids from the full log-probabilities), so the
errors are those of the tail models, not of rounding.

Reported per K, over two token sets:

    moved       valid tokens with exact KL(mu || pi) > 1e-6 (below it pi ~ mu and Ḋ is rounding)
    over_delta  valid tokens with exact KL > δ (where a trust-region mask acts)

sign agreement (sign(estimate) == sign(exact)), quantiles of the relative error
|estimate - exact| / |exact| and of the absolute error, against two references named plainly:
the full-KL Ḋ (``agg``, ``uniform``: what the tail models and the bracket of §4.3-§4.4 target)
and the exact Ḋ of the top-K KL the mask itself uses (``vs_topk_kl``, §4.7). For the bracket:
the fraction of tokens whose sign it certifies (lo > 0 or hi < 0), whether those signs are right,
and the fraction of tokens it contains, within a per-token tolerance derived from the measured
difference between the stored and the recomputed mu on the list (``contain_tol``), and, from
the recomputed mu at the same ids, within 1e-12 (``contains_frac_same_mu``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from masktrl.analysis.disagreement import optimizer_suffix, parse_list_sizes
from masktrl.stats import mean_se

KS = (5, 10, 20, 50)
ESTIMATORS = ("agg", "uniform")
MOVED_FLOOR = 1e-6
CONTAIN_TOL = 1e-6  # the fixed tolerance of earlier reports (kept as contains_frac_tol_1e-6)
SAME_MU_TOL = 1e-12  # float64 rounding: the bracket and the exact value from one mu
QUANTILES = (0.5, 0.9, 0.99)
SUBSETS = ("moved", "over_delta")


def parse_ks(spec: str | None) -> tuple[int, ...]:
    """``--k 5,10,20`` -> (5, 10, 20); None -> ``KS``."""
    return KS if spec is None else parse_list_sizes(spec)


def subset(t: dict, name: str, delta: float) -> np.ndarray:
    exact = t["ddot_exact"]
    base = t["valid"].astype(bool) & np.isfinite(exact) & np.isfinite(t["d_full"])
    floor = MOVED_FLOOR if name == "moved" else max(delta, MOVED_FLOOR)
    return base & (t["d_full"] > floor)


def _q(vals: np.ndarray, prefix: str) -> dict:
    vals = vals[np.isfinite(vals)]
    if vals.size == 0:
        return {f"{prefix}_p{int(q * 100)}": float("nan") for q in QUANTILES}
    return {f"{prefix}_p{int(q * 100)}": float(x) for q, x in zip(QUANTILES, np.quantile(vals, QUANTILES))}


def estimator_stats(est: np.ndarray, exact: np.ndarray, replicate: np.ndarray) -> dict:
    """Sign agreement (pooled and mean ± SE over replicates) and error quantiles of one estimator."""
    agree = np.sign(est) == np.sign(exact)
    nz = exact != 0
    rel = np.abs(est[nz] - exact[nz]) / np.abs(exact[nz])
    per_rep = [float(agree[replicate == r].mean()) for r in np.unique(replicate)]
    m, se = mean_se(per_rep) if per_rep else (float("nan"), float("nan"))
    return {
        "sign_agree": float(agree.mean()) if agree.size else float("nan"),
        "sign_agree_mean": m,
        "sign_agree_se": se,
        **_q(rel, "rel_err"),
        **_q(np.abs(est - exact), "abs_err"),
    }


def _frac(x: np.ndarray) -> float:
    return float(x.mean()) if x.size else float("nan")


def _contains(lo: np.ndarray, hi: np.ndarray, x: np.ndarray, tol) -> np.ndarray:
    return (lo - tol <= x) & (x <= hi + tol)


def bracket_stats(
    lo: np.ndarray, hi: np.ndarray, exact: np.ndarray, *, tol=CONTAIN_TOL, lo_same=None, hi_same=None, topk=None
) -> dict:
    """Certification and containment of the bracket [lo, hi] against the exact full-KL Ḋ.

    ``tol`` (scalar or per token): the containment tolerance for a bracket from the stored list
    against the exact value from the recomputed mu (``token_replay.estimates_at_k``).
    ``lo_same``/``hi_same``: the bracket from the recomputed mu at the same list ids (contained
    within 1e-12 when the bracket is right). ``topk``: the exact Ḋ of the top-K KL, which the
    bracket does not bound (reported, not certified).
    """
    certified = (lo > 0) | (hi < 0)
    right = np.where(lo > 0, exact > 0, exact < 0)
    out = {
        "certified_frac": _frac(certified),
        "certified_correct": float(right[certified].mean()) if certified.any() else float("nan"),
        "contains_frac": _frac(_contains(lo, hi, exact, tol)),
        **_q(hi - lo, "width"),
    }
    if np.ndim(tol):
        out.update(_q(np.asarray(tol), "contain_tol"))
        clear = certified & (np.abs(exact) > tol)  # the sign is beyond what the list's numerics can move
        out["certified_correct_beyond_tol"] = float(right[clear].mean()) if clear.any() else float("nan")
        out["contains_frac_tol_1e-6"] = _frac(_contains(lo, hi, exact, CONTAIN_TOL))
    if lo_same is not None:
        out["contains_frac_same_mu"] = _frac(_contains(lo_same, hi_same, exact, SAME_MU_TOL))
    if topk is not None:
        right_topk = np.where(lo > 0, topk > 0, topk < 0)
        out["certified_correct_topk"] = float(right_topk[certified].mean()) if certified.any() else float("nan")
        out["contains_topk_frac"] = _frac(_contains(lo, hi, topk, SAME_MU_TOL))
    return out


def summarize(t: dict, ks: tuple[int, ...], delta: float, stored_k: int) -> dict:
    out = {}
    for name in SUBSETS:
        sel = subset(t, name, delta)
        exact, rep = t["ddot_exact"][sel], t["replicate"][sel]
        block = {"n_tokens": int(sel.sum()), "k": {}}
        for k in ks:
            row = {"source": "stored" if k <= stored_k else "recomputed"}
            topk = t[f"ddot_topk_exact_k{k}"][sel] if f"ddot_topk_exact_k{k}" in t else None
            for e in ESTIMATORS:
                row[e] = estimator_stats(t[f"ddot_{e}_k{k}"][sel], exact, rep)
            if topk is not None:
                row["vs_topk_kl"] = {e: estimator_stats(t[f"ddot_{e}_k{k}"][sel], topk, rep) for e in ESTIMATORS}
                row["topk_exact_vs_full_kl"] = estimator_stats(topk, exact, rep)
            extra = {}
            if f"contain_tol_k{k}" in t:
                extra = {
                    "tol": t[f"contain_tol_k{k}"][sel],
                    "lo_same": t[f"bracket_lo_same_mu_k{k}"][sel],
                    "hi_same": t[f"bracket_hi_same_mu_k{k}"][sel],
                    "topk": topk,
                }
            row["bracket"] = bracket_stats(t[f"bracket_lo_k{k}"][sel], t[f"bracket_hi_k{k}"][sel], exact, **extra)
            tail = t[f"pi_tail_k{k}"][sel]
            row["pi_tail_mean"] = float(tail.mean()) if tail.size else float("nan")
            row.update(_q(tail, "pi_tail"))
            block["k"][str(k)] = row
        out[name] = block
    return out


def run_estimators(
    runs: list[Path],
    steps: list[int] | None = None,
    ks: tuple[int, ...] = KS,
    delta: float = 0.15,
    *,
    update: str = "unmasked",
    partitions: int = 1,
    policy_step: int | None = None,
    minibatches: int | None = None,
    progress=None,
    optimizer=None,
) -> tuple[dict, dict]:
    """(JSON-ready result, token table) of the estimator study on the run folders ``runs``;
    ``optimizer``: a ``first_order.ReplayOptimizer`` (default: the run's own)."""
    from masktrl.analysis.first_order import ReplayOptimizer
    from masktrl.analysis.replicates import prepare, replay_all

    optimizer = optimizer or ReplayOptimizer()
    refs = prepare(
        runs,
        steps,
        delta=delta,
        update=update,
        partitions=partitions,
        policy_step=policy_step,
        minibatches=minibatches,
        exact=True,
        optimizer=optimizer,
        no_exact=False,
    )
    table, info = replay_all(
        refs,
        update=update,
        partitions=partitions,
        minibatches=minibatches,
        exact=True,
        ks=ks,
        progress=progress,
        optimizer=optimizer,
    )
    stored_k = min(row["stored_k"] for row in info)
    result = {
        "analysis": "estimators",
        "runs": list(dict.fromkeys(ref.run for ref in refs)),
        "methods": {row["run"]: row["method"] for row in info},
        "steps": sorted({ref.step for ref in refs}),
        "ks": list(ks),
        "stored_k": stored_k,
        "vocab_size": info[0]["vocab_size"],
        "delta": delta,
        "update": info[0]["update"],
        "replay_optimizer": info[0]["replay_optimizer"],
        "minibatches": sorted({row["minibatches"] for row in info}),
        "partitions": partitions,
        "n_batches": len(refs),
        "moved_floor": MOVED_FLOOR,
        "contain_tol": CONTAIN_TOL,
        "mu_recompute_max_abs_logp_diff": max(row.get("mu_recompute_max_abs_logp_diff", 0.0) for row in info),
        "mu_recompute_max_list_mass_diff": max(row.get("mu_recompute_max_list_mass_diff", 0.0) for row in info),
        "same_mu_tol": SAME_MU_TOL,
        "subsets": summarize(table, ks, delta, stored_k),
        "batches": info,
    }
    return result, table


def stem(result: dict) -> str:
    steps = result["steps"]
    part = f"step{steps[0]}" if len(steps) == 1 else f"steps{steps[0]}-{steps[-1]}n{len(steps)}"
    runs = "" if len(result["runs"]) == 1 else f"-runs{len(result['runs'])}"
    return f"estimators-{part}{runs}-{result['update']['name']}{optimizer_suffix(result)}"


def save(result: dict, table: dict, out: Path) -> list[Path]:
    from masktrl.analysis.io import figures, save_figure, write_json, write_table

    plots = figures(out)  # matplotlib once the JSON is written (its cache: caches.settle_matplotlib)

    name = stem(result)
    result = {**result, "tokens_file": f"{name}-tokens.parquet"}
    return [
        write_json(out / f"{name}.json", result),
        write_table(out / f"{name}-tokens.parquet", table),
        save_figure(plots.estimator_panels(result), out / f"{name}.png"),
    ]
