"""The token study of the predictive divergence mask (the predictive-mask paper's Figs. 3-4):
outside the trust region, where two direction rules disagree, which one kept the tokens whose
divergence then grew?

For a token outside the trust region (D > δ, D = top-K KL, docs/METHODS.md §3) a direction rule
decides whether its update may go ahead ("keep", ``token_replay.keep_decisions``):

    ratio          keep iff sign(A (r - 1)) <= 0       (DPPO's direction rule)
    ddot_agg       keep iff sign(A Ḋ_KL,agg) <= 0      (PDM, aggregated tail, §4.2)
    ddot_uniform   keep iff sign(A Ḋ_KL,uniform) <= 0  (PDM, uniform tail)

For a **pair** of rules (a, b) the disagreement set is the tokens with D > δ (finite), A != 0
and a valid behaviour probability on which a and b decide differently: a keeps exactly the
tokens b masks. For each rule of the pair, over the tokens of the set it keeps: the
**unsafe-keep rate** = fraction with ΔD = D_after - D_before > 0, the **contracted fraction**
= fraction with ΔD < 0 (ΔD = 0 exactly counts as neither), for two moments of the update:

    one_step         just after the token's own minibatch update
    all_minibatches  after all the step's minibatch updates

A replicate is one independent rollout batch (run x step; ``replicates.py``); partition seeds
of a batch are pooled into it (or are the replicates, ``unit="partition"``). Rates are per
replicate, then mean ± standard error over replicates with a kept token; pooled rates are over
all kept tokens of all replicates (the paper's Fig. 4b). The two rules of a pair are compared
across the replicates where both kept a token with a paired Wilcoxon signed-rank and a paired
t-test (``masktrl.stats.paired_tests``).

Everything here is computed from the token table (``token_replay.record_tokens``), which is
written as a parquet beside the JSON, so any set can be rebuilt from it (``replicate_counts``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from masktrl.analysis.token_replay import BRACKET_CRITERIA, CRITERIA, EXACT_CRITERIA
from masktrl.errors import MasktrlError
from masktrl.stats import mean_se, paired_tests, run_blocked_test

PAIRS = (("ratio", "ddot_agg"), ("ratio", "ddot_uniform"), ("ddot_agg", "ddot_uniform"))
SCOPES = ("one_step", "all_minibatches")
AFTER = {"one_step": "d_one", "all_minibatches": "d_all"}
TESTS = ("wilcoxon", "ttest")
QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)


def pair_name(a: str, b: str) -> str:
    return f"{a}_vs_{b}"


def parse_pairs(spec: str | None, exact: bool) -> tuple[tuple[str, str], ...]:
    """``ratio:ddot_agg,ratio:ddot_exact`` -> pairs; None -> the paper's three (``PAIRS``)."""
    if spec is None:
        return PAIRS
    known = CRITERIA + BRACKET_CRITERIA + (EXACT_CRITERIA if exact else ())
    pairs = []
    for part in spec.split(","):
        names = [x.strip() for x in part.split(":")]
        if len(names) != 2 or names[0] == names[1] or any(n not in known for n in names):
            raise MasktrlError(f"--pairs: {part!r} is not a pair a:b of two different criteria ({', '.join(known)})")
        pairs.append((names[0], names[1]))
    return tuple(pairs)


# --------------------------------------------------------------------------- sets from the token table


def over_delta(t: dict, delta: float) -> np.ndarray:
    """[N] bool: valid behaviour probability, finite D > δ and A != 0 (where a direction rule acts)."""
    d = t["d"]
    return t["valid"].astype(bool) & np.isfinite(d) & (d > delta) & (t["adv"] != 0)


def pair_set(t: dict, a: str, b: str, delta: float) -> np.ndarray:
    """[N] bool: the disagreement set of the pair (a, b)."""
    return over_delta(t, delta) & (t[f"keep_{a}"] != t[f"keep_{b}"])


def delta_d(t: dict, scope: str) -> np.ndarray:
    return t[AFTER[scope]] - t["d"]


def _rates(dd: np.ndarray) -> dict:
    n = int(dd.size)
    grew, contracted = int((dd > 0).sum()), int((dd < 0).sum())
    return {
        "n_kept": n,
        "n_grew": grew,
        "n_contracted": contracted,
        "unsafe_keep": grew / n if n else float("nan"),
        "contract_frac": contracted / n if n else float("nan"),
    }


def replicate_counts(t: dict, delta: float, pairs=PAIRS, criteria: tuple[str, ...] | None = None) -> list[dict]:
    """Per replicate: token counts, and per pair and scope each rule's n_kept, n_grew,
    n_contracted, unsafe_keep, contract_frac over the pair's disagreement set; per rule (every
    ``keep_*`` column of the table) the same over every token with D > δ it keeps (``over_delta``)."""
    criteria = criteria or tuple(k[len("keep_") :] for k in t if k.startswith("keep_"))
    out = []
    for r in np.unique(t["replicate"]):
        sel = t["replicate"] == r
        sub = {k: v[sel] for k, v in t.items()}
        over = over_delta(sub, delta)
        row = {
            "replicate": int(r),
            "runs": sorted(set(sub["run"].tolist())),
            "steps": sorted({int(s) for s in sub["step"]}),
            "partitions": sorted({int(p) for p in sub["partition"]}),
            "n_tokens": int(sel.sum()),
            "n_nonzero_adv": int((sub["valid"].astype(bool) & (sub["adv"] != 0)).sum()),
            "n_over_delta": int(over.sum()),
            "pairs": {},
            "over_delta": {
                scope: {c: _rates(delta_d(sub, scope)[over & sub[f"keep_{c}"]]) for c in criteria} for scope in SCOPES
            },
        }
        for a, b in pairs:
            s = pair_set(sub, a, b, delta)
            block = {"n_disagree": int(s.sum())}
            for scope in SCOPES:
                dd = delta_d(sub, scope)
                block[scope] = {c: _rates(dd[s & sub[f"keep_{c}"]]) for c in (a, b)}
            row["pairs"][pair_name(a, b)] = block
        out.append(row)
    return out


# --------------------------------------------------------------------------- replicates -> summary


def _mse(values: list[float]) -> tuple[float, float]:
    v = [x for x in values if x == x]
    return mean_se(v) if v else (float("nan"), float("nan"))


def _quantiles(vals: np.ndarray) -> dict:
    if vals.size == 0:
        return {}
    return {f"p{int(q * 100):02d}": float(x) for q, x in zip(QUANTILES, np.quantile(vals, QUANTILES))}


def criterion_stats(rows: list[dict], kept_dd: np.ndarray) -> dict:
    """Mean ± SE over replicates with a kept token, totals and pooled rates of one rule."""
    um, us = _mse([r["unsafe_keep"] for r in rows])
    cm, cs = _mse([r["contract_frac"] for r in rows])
    kept = sum(r["n_kept"] for r in rows)
    return {
        "unsafe_keep_mean": um,
        "unsafe_keep_se": us,
        "contract_frac_mean": cm,
        "contract_frac_se": cs,
        "n_kept_mean": float(np.mean([r["n_kept"] for r in rows])) if rows else float("nan"),
        "n_kept_total": kept,
        "n_replicates_with_kept": sum(r["n_kept"] > 0 for r in rows),
        "unsafe_keep_pooled": sum(r["n_grew"] for r in rows) / kept if kept else float("nan"),
        "contract_frac_pooled": sum(r["n_contracted"] for r in rows) / kept if kept else float("nan"),
        "delta_d_quantiles": _quantiles(kept_dd),
    }


def paired(rows_a: list[dict], rows_b: list[dict], runs: list[str] | None = None, unit: str = "batch") -> dict:
    """Paired tests a vs b over the replicates where both kept a token.

    One run: Wilcoxon and paired t over its replicates (``unit`` "batch" or "partition": they
    share the run's trajectory, so the p-values speak for that run only). Several runs
    (``runs``: the run of each replicate): the run is the unit, a run-blocked sign-flip test
    (``masktrl.stats.run_blocked_test``); no per-replicate test is reported."""
    keep = [i for i, (x, y) in enumerate(zip(rows_a, rows_b)) if x["n_kept"] and y["n_kept"]]
    several = runs is not None and len({runs[i] for i in range(len(runs))}) > 1
    if several:
        out = {"unit": "run"}
        for key in ("unsafe_keep", "contract_frac"):
            out[key] = run_blocked_test([rows_a[i][key] - rows_b[i][key] for i in keep], [runs[i] for i in keep])
        return out
    out = {"unit": unit}
    for key in ("unsafe_keep", "contract_frac"):
        out[key] = paired_tests([rows_a[i][key] for i in keep], [rows_b[i][key] for i in keep])
    return out


def replicate_runs(reps: list[dict]) -> list[str]:
    """The run of each replicate (a replicate is one batch or partition of one run)."""
    return ["+".join(r["runs"]) for r in reps]


def summarize(
    t: dict, reps: list[dict], delta: float, pairs=PAIRS, test: str = "wilcoxon", unit: str = "batch"
) -> dict:
    """The per-pair summary (see docs/ANALYSIS.md for every field). With several runs the paired
    p-value is the run-blocked test's (``paired``), whatever ``test`` says; ``p_unit`` names the unit."""
    runs = replicate_runs(reps)
    out = {}
    for a, b in pairs:
        name = pair_name(a, b)
        nd = [r["pairs"][name]["n_disagree"] for r in reps]
        m, se = mean_se(nd)
        block = {
            "criteria": [a, b],
            "n_disagree_mean": m,
            "n_disagree_se": se,
            "n_disagree_total": int(sum(nd)),
            "n_replicates_with_disagreement": sum(x > 0 for x in nd),
        }
        s = pair_set(t, a, b, delta)
        for scope in SCOPES:
            dd = delta_d(t, scope)
            rows = {c: [r["pairs"][name][scope][c] for r in reps] for c in (a, b)}
            sb = {c: criterion_stats(rows[c], dd[s & t[f"keep_{c}"]]) for c in (a, b)}
            sb["paired"] = paired(rows[a], rows[b], runs, unit)
            if sb["paired"]["unit"] == "run":
                sb["paired"]["p"], sb["paired"]["test"] = sb["paired"]["unsafe_keep"]["p"], "run-blocked sign flip"
            else:
                sb["paired"]["p"] = sb["paired"]["unsafe_keep"]["p_wilcoxon" if test == "wilcoxon" else "p_ttest"]
                sb["paired"]["test"] = test
            sb["paired"]["p_unit"] = sb["paired"]["unit"]
            block[scope] = sb
        out[name] = block
    return out


def summarize_over_delta(t: dict, reps: list[dict], delta: float) -> dict:
    """Per rule, over every token with D > δ it keeps (not only a pair's disagreement set)."""
    over = over_delta(t, delta)
    out = {}
    for scope in SCOPES:
        dd = delta_d(t, scope)
        crits = reps[0]["over_delta"][scope] if reps else {}
        out[scope] = {
            c: criterion_stats([r["over_delta"][scope][c] for r in reps], dd[over & t[f"keep_{c}"]]) for c in crits
        }
    return out


# --------------------------------------------------------------------------- the study


def run_study(
    runs: list[Path],
    steps: list[int] | None = None,
    delta: float = 0.15,
    *,
    update: str = "unmasked",
    partitions: int = 1,
    unit: str = "batch",
    policy_step: int | None = None,
    minibatches: int | None = None,
    exact: bool = True,
    pairs=PAIRS,
    test: str = "wilcoxon",
    progress=None,
    optimizer=None,
    decompose: bool = False,
    own_tokens: int = 32,
    ks: tuple[int, ...] = (),
) -> tuple[dict, dict]:
    """The whole study on the run folders ``runs``: (JSON-ready result, token table).

    ``optimizer``: a ``first_order.ReplayOptimizer`` (default: the run's own); ``decompose``: the
    first-order parts of every token's ΔD (``first_order``), summarised under ``first_order``."""
    from masktrl.analysis import first_order as fo
    from masktrl.analysis.replicates import prepare, replay_all
    from masktrl.runs.store import RunStore

    if test not in TESTS:
        raise MasktrlError(f"--test must be one of {', '.join(TESTS)}, got {test!r}")
    if any(c in EXACT_CRITERIA for p in pairs for c in p) and not exact:
        raise MasktrlError("a pair with ddot_exact needs the exact values (drop --no-exact)")
    optimizer = optimizer or fo.ReplayOptimizer()
    refs = prepare(
        runs,
        steps,
        delta=delta,
        update=update,
        partitions=partitions,
        policy_step=policy_step,
        minibatches=minibatches,
        exact=exact,
        optimizer=optimizer,
        own_tokens=own_tokens,
    )
    if ks:
        _check_recut(refs, ks)
    table, info = replay_all(
        refs,
        update=update,
        partitions=partitions,
        minibatches=minibatches,
        exact=exact,
        unit=unit,
        progress=progress,
        optimizer=optimizer,
        decompose_delta=delta if decompose else None,
        own_tokens=own_tokens,
        recut_ks=ks,
    )

    reps = replicate_counts(table, delta, pairs)
    n_over = [r["n_over_delta"] for r in reps]
    result = {
        "analysis": "disagreement",
        "runs": sorted({ref.run for ref in refs}, key=[ref.run for ref in refs].index),
        "methods": {row["run"]: row["method"] for row in info},
        "task": RunStore(refs[0].root).config().to_dict().get("task"),
        "steps": sorted({ref.step for ref in refs}),
        "delta": delta,
        "divergence": "topk-kl",
        "update": info[0]["update"],
        "replay_optimizer": info[0]["replay_optimizer"],
        "minibatches": sorted({row["minibatches"] for row in info}),
        "partitions": partitions,
        "replicate_unit": unit,
        "n_batches": len(refs),
        "n_replicates": len(reps),
        "exact": exact,
        "pairs_tested": [list(p) for p in pairs],
        "test": test,
        "n_tokens_total": int(len(table["d"])),
        "n_over_delta_mean": float(np.mean(n_over)),
        "n_over_delta_total": int(sum(n_over)),
        "pairs": summarize(table, reps, delta, pairs, test, unit),
        "p_unit": "run" if len({ref.run for ref in refs}) > 1 else unit,
        "over_delta": summarize_over_delta(table, reps, delta),
        "batches": info,
        "replicates": reps,
    }
    if ks:
        result["k_sweep"] = k_sweep(table, reps, delta, ks)
    if decompose:
        crit = tuple(k[len("keep_") :] for k in table if k.startswith("keep_") and "_k" not in k[len("keep_") :])
        result["first_order"] = {"own_tokens": own_tokens, **fo.summarize_parts(table, delta, crit)}
    return result, table


def parse_ks(spec: str | None) -> tuple[int, ...]:
    """``--k 5,10,20`` -> (5, 10, 20); None -> () (no re-cut study)."""
    return () if spec is None else parse_list_sizes(spec)


def parse_list_sizes(spec: str) -> tuple[int, ...]:
    """``5,10,20`` -> (5, 10, 20), sorted and distinct; MasktrlError for anything else."""
    try:
        ks = sorted({int(x) for x in spec.split(",") if x.strip()})
    except ValueError:
        raise MasktrlError(f"--k must be a comma-separated list of list sizes, got {spec!r}") from None
    if not ks or ks[0] < 1:
        raise MasktrlError(f"--k needs list sizes >= 1, got {spec!r}")
    return tuple(ks)


def _check_recut(refs, ks: tuple[int, ...]) -> None:
    from masktrl.runs.store import RunStore

    if min(ks) < 1:
        raise MasktrlError(f"--k needs list sizes >= 1, got {min(ks)}")
    for ref in refs:
        samples, _ = RunStore(ref.root).read_rollouts(ref.step)
        stored = max((len(row) for s in samples for row in s.gen.topk_ids), default=0)
        if max(ks) > stored:
            raise MasktrlError(
                f"--k {max(ks)} is above the stored list size K = {stored} of run {ref.run}, step "
                f"{ref.step}: "
                "the study re-cuts the stored lists (record longer ones with "
                "rollout.logprobs_k)"
            )


def k_sweep(t: dict, reps: list[dict], delta: float, ks: tuple[int, ...]) -> dict:
    """Per re-cut list size K: over the tokens with D_K > δ (A != 0, valid), each rule's one-step
    unsafe keep (ΔD_K > 0), mean ± SE over replicates, and the ratio-vs-Ḋ pairs' disagreement
    rates with the paired test of ``paired`` (the run is the unit when runs are pooled)."""
    runs = replicate_runs(reps)
    out = {}
    for k in ks:
        sub = {
            **t,
            "d": t[f"d_k{k}"],
            "d_one": t[f"d_one_k{k}"],
            "d_all": t[f"d_one_k{k}"],
            "keep_ddot_agg": t[f"keep_ddot_agg_k{k}"],
            "keep_ddot_uniform": t[f"keep_ddot_uniform_k{k}"],
        }
        sub = {
            c: v
            for c, v in sub.items()
            if not (c.startswith("keep_") and c not in ("keep_ratio", "keep_ddot_agg", "keep_ddot_uniform"))
        }
        rk = replicate_counts(sub, delta, PAIRS, ("ratio", "ddot_agg", "ddot_uniform"))
        over = {
            c: criterion_stats([r["over_delta"]["one_step"][c] for r in rk], np.array([]))
            for c in ("ratio", "ddot_agg", "ddot_uniform")
        }
        block = {
            "n_over_delta_mean": float(np.mean([r["n_over_delta"] for r in rk])),
            "over_delta": {
                c: {"unsafe_keep_mean": v["unsafe_keep_mean"], "unsafe_keep_se": v["unsafe_keep_se"]}
                for c, v in over.items()
            },
            "pairs": {},
        }
        for a, b in PAIRS:
            name = pair_name(a, b)
            rows = {c: [r["pairs"][name]["one_step"][c] for r in rk] for c in (a, b)}
            test = paired(rows[a], rows[b], runs, "batch")
            p = test["unsafe_keep"]["p"] if test["unit"] == "run" else test["unsafe_keep"]["p_wilcoxon"]
            block["pairs"][name] = {c: _mse([r["unsafe_keep"] for r in rows[c]])[0] for c in (a, b)}
            block["pairs"][name].update(p=p, p_unit=test["unit"])
        out[str(k)] = block
    return out


def stem(result: dict) -> str:
    """File name stem: steps, policy step (if not S-1), M, δ, update, and the runs when pooled."""
    steps = result["steps"]
    part = f"step{steps[0]}" if len(steps) == 1 else f"steps{steps[0]}-{steps[-1]}n{len(steps)}"
    batches = result["batches"]
    if len(batches) == 1 and batches[0]["policy_step"] != batches[0]["step"] - 1:
        part += f"-policy{batches[0]['policy_step']}"
    runs = "" if len(result["runs"]) == 1 else f"-runs{len(result['runs'])}"
    mb = "-".join(map(str, result["minibatches"]))
    update = result["update"]["name"]
    return f"disagreement-{part}{runs}-mb{mb}-delta{result['delta']:g}-{update}{optimizer_suffix(result)}"


def optimizer_suffix(result: dict) -> str:
    """'' for the run's own optimizer as training ran it; else -opt-{name}[-lr{lr}][-reset]."""
    opt = result.get("replay_optimizer") or {}
    if opt.get("name", "run") == "run" and opt.get("lr") is None and not opt.get("reset_moments"):
        return ""
    lr = f"-lr{opt['lr']:g}" if opt.get("lr") is not None else ""
    return f"-opt-{opt['name']}{lr}{'-reset' if opt.get('reset_moments') else ''}"


def output_dir(runs: list[Path], result: dict) -> Path:
    """``<run>/analysis`` for one run; the first run's parent ``analysis/`` for several."""
    from masktrl.analysis.io import analysis_dir, multi_run_dir

    return analysis_dir(runs[0]) if len(result["runs"]) == 1 else multi_run_dir(runs, None)


def save(result: dict, table: dict, out: Path) -> list[Path]:
    """JSON, the token parquet and three PNGs (Fig. 3a bars, Fig. 4a ECDF, Fig. 4b contracted)."""
    from masktrl.analysis.io import figures, save_figure, write_json, write_table

    plots = figures(out)  # matplotlib once the JSON is written (its cache: caches.settle_matplotlib)

    name = stem(result)
    result = {**result, "tokens_file": f"{name}-tokens.parquet"}
    ecdf = ecdf_data(table, result)
    return [
        write_json(out / f"{name}.json", result),
        write_table(out / f"{name}-tokens.parquet", table),
        save_figure(plots.pair_bars(result, SCOPES), out / f"{name}-bars.png"),
        save_figure(plots.pair_ecdf(result, ecdf, SCOPES), out / f"{name}-ecdf.png"),
        save_figure(plots.pair_contracted(result, SCOPES), out / f"{name}-contracted.png"),
        *(
            [save_figure(plots.first_order_bars(result), out / f"{name}-first-order.png")]
            if "first_order" in result
            else []
        ),
    ]


def ecdf_data(table: dict, result: dict) -> dict:
    """{pair: {scope: {criterion: ΔD of its kept disagreement tokens}}} (Fig. 4a)."""
    out = {}
    for a, b in (tuple(p) for p in result["pairs_tested"]):
        s = pair_set(table, a, b, result["delta"])
        out[pair_name(a, b)] = {
            scope: {c: delta_d(table, scope)[s & table[f"keep_{c}"]] for c in (a, b)} for scope in SCOPES
        }
    return out
