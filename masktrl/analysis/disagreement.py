"""The token study of the predictive divergence mask: where the ratio rule and Ḋ disagree,
which one kept the tokens whose divergence then grew?

For a token outside the trust region (D > δ, D = top-K KL, docs/METHODS.md §3) three criteria
decide whether its update may go ahead ("keep"):

    ratio          keep iff sign(A (r - 1)) <= 0       (DPPO's direction rule)
    ddot_agg       keep iff sign(A Ḋ_KL,agg) <= 0      (PDM, aggregated tail, docs/METHODS.md §4.2)
    ddot_uniform   keep iff sign(A Ḋ_KL,uniform) <= 0  (PDM, uniform tail)

The *disagreement tokens* are those with D > δ, A != 0 and finite D on which the three keep
decisions are not unanimous. A criterion's **unsafe-keep rate** is the fraction of the
disagreement tokens it keeps whose realised ΔD = D_after - D_before is > 0; the
**contracted fraction** is the fraction with ΔD < 0.

The update is real (``replay.replay_step``): checkpoint P with its optimizer state, the
rollout batch of step S, the run's method, parameters and optimizer, split into M
minibatches. Each token's criteria and D_before are taken from the forward pass its own
minibatch trains on (exactly what the method sees); ΔD is measured twice:

    one_step         just after that minibatch's optimizer step (one update)
    all_minibatches  after all M updates of the step

A seed j (0-based) replays the step with the seed value ``run seed + j``, which sets only the
minibatch partition/order (``stream_seed(seed, "order", S)``) and the SIS uniforms
(``stream_seed(seed, "sis", S, mb)``). Seed 0 with P = S-1 and the run's M reproduces the
run's own update exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from masktrl.stats import mean_se
from masktrl.methods import divergence, divergence_rate
from masktrl.methods.batch import log_ratio

CRITERIA = ("ratio", "ddot_agg", "ddot_uniform")
SCOPES = ("one_step", "all_minibatches")
STUDY_MINIBATCHES = 4  # used when the run trained on whole batches (M = 1, see study_minibatches)


# --------------------------------------------------------------------------- pure token math


def keep_decisions(adv: Tensor, log_r: Tensor, ddot_agg: Tensor, ddot_uniform: Tensor) -> dict[str, Tensor]:
    """[N] bool per criterion: the token's update is kept (not masked by the direction rule)."""
    return {
        "ratio": ~(torch.sign(adv * log_r) > 0),  # sign(r - 1) = sign(log r)
        "ddot_agg": ~(torch.sign(adv * ddot_agg) > 0),
        "ddot_uniform": ~(torch.sign(adv * ddot_uniform) > 0),
    }


def disagreement_mask(d: Tensor, delta: float, adv: Tensor, keeps: dict[str, Tensor]) -> Tensor:
    """[N] bool: D > δ, A != 0, D finite, and the criteria's keep decisions are not unanimous."""
    stacked = torch.stack([keeps[c] for c in CRITERIA])  # [3, N]
    split = stacked.any(dim=0) & ~stacked.all(dim=0)
    return (d > delta) & torch.isfinite(d) & (adv != 0) & split


def keep_rates(delta_d: Tensor, keeps: dict[str, Tensor], select: Tensor) -> dict[str, dict]:
    """Per criterion, over the ``select``-ed tokens it keeps: n_kept, unsafe_keep, contract_frac.

    unsafe_keep = #(ΔD > 0) / n_kept and contract_frac = #(ΔD < 0) / n_kept (nan when n_kept = 0).
    """
    out = {}
    for c in CRITERIA:
        kept = keeps[c] & select
        n = int(kept.sum())
        dd = delta_d[kept]
        out[c] = {
            "n_kept": n,
            "n_select": int(select.sum()),
            "unsafe_keep": float((dd > 0).sum()) / n if n else float("nan"),
            "contract_frac": float((dd < 0).sum()) / n if n else float("nan"),
        }
    return out


# --------------------------------------------------------------------------- one seed


@dataclass
class TokenRecord:
    """All trained tokens of one seed (every minibatch), in minibatch order."""

    adv: Tensor  # [N]
    d_before: Tensor  # [N] D at the forward its minibatch trained on
    keeps: dict[str, Tensor]  # criterion -> [N] bool
    d_one: Tensor  # [N] D just after its own minibatch's update
    d_all: Tensor  # [N] D after all minibatch updates


def study_minibatches(run_minibatches: int, requested: int | None) -> int:
    """The study's M: as requested, else the run's, else STUDY_MINIBATCHES for a one-minibatch run.

    With M = 1 every token is trained on-policy (π = μ, D ≈ 0), so no token is outside the
    trust region and every seed gives the same update.
    """
    if requested is not None:
        return requested
    return run_minibatches if run_minibatches > 1 else STUDY_MINIBATCHES


def run_seed(replay, seed_value: int, minibatches: int) -> TokenRecord:
    """Replay the step once from checkpoint P and record every token's criteria and ΔD."""
    from masktrl.analysis.step_replay import policy_outputs, replay_step, token_index

    replay.restore()
    parts: list[list[int]] = []
    before_rows: list[dict] = []
    d_one: list[Tensor] = []

    def before(mb, idx, out, losses, u):
        b = out.batch
        parts.append(idx)
        before_rows.append(
            {
                "adv": out.advantages.detach(),
                "d": divergence(b, "topk-kl"),
                "keeps": keep_decisions(out.advantages.detach(), log_ratio(b), divergence_rate(b, "kl", "agg"), divergence_rate(b, "kl", "uniform")),
            }
        )

    def after(mb, idx):
        d_one.append(divergence(policy_outputs(replay, idx).batch, "topk-kl"))

    replay_step(replay, seed_value, minibatches, before, after)
    d_all = [divergence(policy_outputs(replay, idx).batch, "topk-kl") for idx in parts]
    order = torch.cat([token_index(replay, idx) for idx in parts])
    if sorted(order.tolist()) != list(range(replay.n_tokens)):
        raise AssertionError("minibatches do not cover every token exactly once")
    cat = lambda key: torch.cat([r[key] for r in before_rows])  # noqa: E731
    return TokenRecord(
        adv=cat("adv"),
        d_before=cat("d"),
        keeps={c: torch.cat([r["keeps"][c] for r in before_rows]) for c in CRITERIA},
        d_one=torch.cat(d_one),
        d_all=torch.cat(d_all),
    )


def seed_result(rec: TokenRecord, delta: float) -> dict:
    """One seed's counts and rates for both scopes; also the delta-D values of kept tokens."""
    select = disagreement_mask(rec.d_before, delta, rec.adv, rec.keeps)
    over = (rec.d_before > delta) & torch.isfinite(rec.d_before) & (rec.adv != 0)
    res = {
        "n_tokens": int(rec.adv.numel()),
        "n_nonzero_adv": int((rec.adv != 0).sum()),
        "n_over_delta": int(over.sum()),
        "n_disagree": int(select.sum()),
    }
    for scope, d_after in (("one_step", rec.d_one), ("all_minibatches", rec.d_all)):
        delta_d = d_after - rec.d_before  # [N]
        res[scope] = keep_rates(delta_d, rec.keeps, select)
        res[scope + "_over_delta"] = keep_rates(delta_d, rec.keeps, over)
        res[scope + "_kept_delta_d"] = {c: delta_d[rec.keeps[c] & select].tolist() for c in CRITERIA}
    return res


# --------------------------------------------------------------------------- seeds -> summary


def summarize(per_seed: list[dict]) -> dict:
    """Mean ± standard error over seeds (seeds where a criterion kept nothing are left out)."""
    out = {}
    for scope in SCOPES:
        block = {}
        for c in CRITERIA:
            rows = [s[scope][c] for s in per_seed]
            over = [s[scope + "_over_delta"][c] for s in per_seed]
            block[c] = {
                **_mse("unsafe_keep", [r["unsafe_keep"] for r in rows]),
                **_mse("contract_frac", [r["contract_frac"] for r in rows]),
                "n_disagree_mean": float(np.mean([s["n_disagree"] for s in per_seed])),
                "n_kept_mean": float(np.mean([r["n_kept"] for r in rows])),
                "n_seeds_with_kept": sum(r["n_kept"] > 0 for r in rows),
                "unsafe_keep_pooled": _pooled(per_seed, scope, c),
                "unsafe_keep_over_delta_mean": _mse("x", [r["unsafe_keep"] for r in over])["x_mean"],
                "delta_d_quantiles": _quantiles([x for s in per_seed for x in s[scope + "_kept_delta_d"][c]]),
            }
        out[scope] = block
    return out


def _mse(name: str, values: list[float]) -> dict:
    v = [x for x in values if x == x]
    if not v:
        return {f"{name}_mean": float("nan"), f"{name}_se": float("nan")}
    m, se = mean_se(v)
    return {f"{name}_mean": m, f"{name}_se": se}


def _pooled(per_seed: list[dict], scope: str, c: str) -> float:
    vals = [x for s in per_seed for x in s[scope + "_kept_delta_d"][c]]
    return float(np.mean(np.array(vals) > 0)) if vals else float("nan")


def _quantiles(vals: list[float]) -> dict:
    if not vals:
        return {}
    q = np.quantile(np.array(vals), [0.05, 0.25, 0.5, 0.75, 0.95])
    return {f"p{int(p * 100):02d}": float(x) for p, x in zip([0.05, 0.25, 0.5, 0.75, 0.95], q)}


# --------------------------------------------------------------------------- the study


def run_study(
    root: Path,
    step: int | None = None,
    seeds: int = 61,
    delta: float = 0.15,
    policy_step: int | None = None,
    minibatches: int | None = None,
    progress=None,
) -> dict:
    """The whole study on run ``root``; returns the JSON-ready result (see docs/ANALYSIS.md)."""
    from masktrl.analysis.io import default_replay_step
    from masktrl.analysis.step_replay import load_replay
    from masktrl.errors import MasktrlError

    if seeds < 1:
        raise MasktrlError(f"--seeds must be >= 1, got {seeds}")
    if not delta >= 0:
        raise MasktrlError(f"--delta must be >= 0, got {delta}")
    if minibatches is not None and minibatches < 1:
        raise MasktrlError(f"--minibatches must be >= 1, got {minibatches}")
    step = default_replay_step(root) if step is None else step
    replay = load_replay(root, step, policy_step)
    m = study_minibatches(replay.cfg.train.minibatches, minibatches)
    bar = progress.add_task("seeds", total=seeds, info="") if progress else None
    per_seed = []
    for j in range(seeds):
        rec = run_seed(replay, replay.cfg.seed + j, m)
        per_seed.append({"seed": j, "seed_value": replay.cfg.seed + j, **seed_result(rec, delta)})
        if progress:
            progress.update(bar, advance=1, info=f"{per_seed[-1]['n_disagree']} disagreement tokens")
    return {
        "run": replay.root.name,
        "method": replay.cfg.method_name,
        "step": step,
        "policy_step": replay.policy_step,
        "behaviour_step": step - 1,
        "staleness": replay.policy_step - (step - 1),
        "delta": delta,
        "divergence": "topk-kl",
        "seeds": seeds,
        "minibatches": m,
        "minibatches_run": replay.cfg.train.minibatches,
        "n_tokens": replay.n_tokens,
        "seed_varies": "minibatch partition/order (stream 'order') and SIS uniforms (stream 'sis'); seed value = run seed + j",
        "n_over_delta_mean": float(np.mean([s["n_over_delta"] for s in per_seed])),
        "n_disagree_mean": float(np.mean([s["n_disagree"] for s in per_seed])),
        **summarize(per_seed),
        "per_seed": [{k: v for k, v in s.items() if not k.endswith("_kept_delta_d")} for s in per_seed],
        "kept_delta_d": {scope: {c: [x for s in per_seed for x in s[scope + "_kept_delta_d"][c]] for c in CRITERIA} for scope in SCOPES},
    }


def save(result: dict, root: Path) -> list[Path]:
    """JSON + two PNGs under ``<run>/analysis/``; the name carries step, policy step, M and δ."""
    from masktrl.analysis import plots
    from masktrl.analysis.io import analysis_dir, save_figure, write_json

    stem = f"disagreement-step{result['step']}-policy{result['policy_step']}-mb{result['minibatches']}-delta{result['delta']:g}"
    out = analysis_dir(root)
    title = f"ΔD of kept disagreement tokens, {result['run']} step {result['step']}, δ={result['delta']:g}"
    return [
        write_json(out / f"{stem}.json", result),
        save_figure(plots.disagreement_bars(result, CRITERIA, SCOPES), out / f"{stem}-bars.png"),
        save_figure(plots.ecdf_panels(result["kept_delta_d"], CRITERIA, SCOPES, title), out / f"{stem}-ecdf.png"),
    ]
