"""What selective importance sampling sees in a run (docs/METHODS.md §6).

* over training, from metrics.jsonl: the logged accept rate (SIS runs only), the mean
  residual top-K mass 1 − π(top-K) the trainer logged, and the log-importance deviation
  (§6.1): D = mean over sequences of sum_t |log r_t| (``log_r_dev``, every method) and D_SIS =
  the same with the SIS weights (``log_w_dev``, SIS runs), with their ratio D_SIS / D;
* over training, from the stored rollouts (no model needed): the behaviour's residual mass
  1 − μ(top-K) per token (mean, median, p90, p99 per step) and the share of sampled tokens
  outside the behaviour top-K (no acceptance test exists for those);
* at one step S, recomputed by replaying the step from checkpoint S-1 exactly as training did
  (same minibatch split, same weights at each minibatch): π's residual mass per token, and the
  SIS decision ``sis_accept`` with the training uniforms ``stream_seed(seed, "sis", S, mb)``,
  so for a SIS run the recomputed accept rate (and D, D_SIS) equals the logged one. For another method the
  decisions are what SIS would have made on that run's batch (marked ``hypothetical``).
  The most frequent accepted and rejected sampled tokens are decoded with the run's tokenizer.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import torch

from masktrl.analysis.io import RunInfo, default_replay_step
from masktrl.errors import MasktrlError
from masktrl.methods import sis_accept
from masktrl.methods.batch import log_ratio, outside_list, residual_mass
from masktrl.methods.diagnostics import log_importance_deviation
from masktrl.rollout.base import behaviour_lists
from masktrl.runs.store import RunStore

MAX_ROLLOUT_STEPS = 200  # rollout files read for the curves (evenly spaced when there are more)


def rollout_curves(root: Path, vocab_size: int | None = None) -> dict:
    """Per stored step: behaviour residual-mass statistics and the outside-top-K share."""
    store = RunStore(root)
    steps = store.rollout_steps()
    if len(steps) > MAX_ROLLOUT_STEPS:
        steps = [steps[int(i)] for i in np.linspace(0, len(steps) - 1, MAX_ROLLOUT_STEPS)]
    out = {
        k: []
        for k in (
            "step",
            "outside_topk_frac",
            "behaviour_residual_mean",
            "behaviour_residual_p50",
            "behaviour_residual_p90",
            "behaviour_residual_p99",
            "n_tokens",
        )
    }
    for step in steps:
        samples, _ = store.read_rollouts(step, vocab_size=vocab_size)
        sampled, ids, lps = behaviour_lists(samples)  # [N], [N, K], [N, K]
        if not len(sampled):
            continue
        resid = residual_mass(lps, ids, vocab_size).numpy()
        out["step"].append(step)
        out["outside_topk_frac"].append(float(outside_list(sampled, ids).double().mean()))
        out["behaviour_residual_mean"].append(float(resid.mean()))
        for q in (50, 90, 99):
            out[f"behaviour_residual_p{q}"].append(float(np.quantile(resid, q / 100)))
        out["n_tokens"].append(len(sampled))
    return out


def replay_decisions(root: Path, step: int) -> dict:
    """Replay step ``step`` from checkpoint step-1 and record SIS decisions per token."""
    from masktrl.analysis.step_replay import load_replay, replay_step, sis_uniforms

    replay = load_replay(root, step)
    seed, m = replay.cfg.seed, replay.cfg.train.minibatches
    rows: dict[str, list] = {
        "sampled": [],
        "accepted": [],
        "tested": [],
        "valid": [],
        "resid": [],
        "mb_rate": [],
        "mb_dev": [],
    }
    vocab: list[int | None] = []

    def before(mb, idx, out, losses, u):
        b = out.batch
        vocab.append(b.vocab_size)
        u = sis_uniforms(seed, step, mb, b.n, b.logp.dtype) if u is None else u
        dec = sis_accept(b, u)
        rows["sampled"].append(b.sampled_ids)
        rows["accepted"].append(dec.accepted)
        rows["tested"].append(~torch.isnan(dec.accept_prob))
        rows["valid"].append(b.valid)
        rows["resid"].append(residual_mass(b.topk_logp.detach().to(torch.float64), b.topk_ids, b.vocab_size))
        rows["mb_rate"].append(float(dec.accepted[b.valid].double().mean()) if bool(b.valid.any()) else float("nan"))
        rows["mb_dev"].append((log_importance_deviation(b, log_ratio(b)), log_importance_deviation(b, dec.log_w)))

    replay_step(replay, seed, m, before)
    cat = {k: torch.cat(v) for k, v in rows.items() if k not in ("mb_rate", "mb_dev")}
    return {
        "tokenizer": replay.tokenizer,
        "method": replay.cfg.method_name,
        "vocab_size": vocab[0],
        "mb_rates": rows["mb_rate"],
        "mb_dev": rows["mb_dev"],
        **cat,
    }


def token_table(tokenizer, ids: torch.Tensor, total: Counter, top: int) -> list[dict]:
    counts = Counter(ids.tolist())
    return [
        {"id": i, "token": decode(tokenizer, i), "count": c, "share_of_this_token": c / total[i]}
        for i, c in counts.most_common(top)
    ]


def decode(tokenizer, token_id: int) -> str:
    text = tokenizer.decode([token_id])
    return text if text else str(tokenizer.convert_ids_to_tokens(token_id))


TRAINING_KEYS = {
    "accept_rate": "sis_accept_rate",
    "residual_mean": "topk_residual_mass_mean",
    "log_r_dev": "log_r_dev",
    "log_w_dev": "log_w_dev",
}


def training_curves(metrics: list[dict]) -> dict:
    """Per logged step: accept rate, residual mass, D (log_r_dev), D_SIS (log_w_dev) and
    D_SIS / D; a curve never logged is an empty list."""
    out = {"step": [r["step"] for r in metrics]}
    for key, logged in TRAINING_KEYS.items():
        vals = [r.get(logged) for r in metrics]
        out[key] = vals if any(v is not None for v in vals) else []
    if out["log_r_dev"] and out["log_w_dev"]:
        out["log_dev_ratio"] = [
            w / r if r and w is not None else None for r, w in zip(out["log_r_dev"], out["log_w_dev"])
        ]
    else:
        out["log_dev_ratio"] = []
    return out


def check_flags(step: int | None, top: int, k: str | None, bias: bool) -> None:
    """``masktrl analyze sis``'s flags, before the run is read: MasktrlError for a rollout step
    below 1 (it said "policy step must be >= 0, got -1"), a negative ``--top`` (it listed no
    token) or ``--k`` without ``--bias`` (it was ignored)."""
    if step is not None and step < 1:
        raise MasktrlError(f"--step must be >= 1 (rollout step S, sampled by checkpoint S-1), got {step}")
    if top < 0:
        raise MasktrlError(f"--top must be >= 0, got {top}")
    if k is not None and not bias:
        raise MasktrlError("--k goes with --bias (the envelope list sizes of the gradient bias)")


def sis_report(run: RunInfo, step: int | None = None, top: int = 10) -> dict:
    """The whole report, JSON-ready (see docs/ANALYSIS.md)."""
    step = default_replay_step(run.root) if step is None else step
    rep = replay_decisions(run.root, step)
    training = training_curves(run.metrics)
    logged_row = next((r for r in run.metrics if r["step"] == step), {})
    logged = logged_row.get("sis_accept_rate")
    dev_r = float(np.nanmean([d[0] for d in rep["mb_dev"]]))  # mean over minibatches, as logged
    dev_w = float(np.nanmean([d[1] for d in rep["mb_dev"]]))

    valid, tested, acc = rep["valid"], rep["tested"], rep["accepted"]
    rejected = tested & ~acc
    sampled = rep["sampled"]
    total = Counter(sampled[valid].tolist())
    resid = rep["resid"][valid].numpy()
    return {
        "run": run.name,
        "method": rep["method"],
        "step": step,
        "policy_step": step - 1,
        "hypothetical": rep["method"] != "sis",
        "training": training,
        "rollouts": rollout_curves(run.root, rep["vocab_size"]),
        "replay": {
            "n_valid": int(valid.sum()),
            "accept_rate": float(np.nanmean(rep["mb_rates"])),  # mean over minibatches, as logged
            "accept_rate_logged": logged,
            "tested_frac": float(tested[valid].double().mean()),
            "accepted_frac_of_tested": float(acc[tested].double().mean()) if bool(tested.any()) else float("nan"),
            "outside_topk_frac": float((~tested[valid]).double().mean()),
            "pi_residual_mean": float(resid.mean()),
            "pi_residual_quantiles": {f"p{q}": float(np.quantile(resid, q / 100)) for q in (50, 90, 99)},
            "pi_residual": [float(x) for x in resid],
            "log_r_dev": dev_r,
            "log_w_dev": dev_w,
            "log_dev_ratio": dev_w / dev_r if dev_r else float("nan"),
            "log_r_dev_logged": logged_row.get("log_r_dev"),
            "log_w_dev_logged": logged_row.get("log_w_dev"),
        },
        "tokens": {
            "accepted": token_table(rep["tokenizer"], sampled[acc], total, top),
            "rejected": token_table(rep["tokenizer"], sampled[rejected], total, top),
            "untested": token_table(rep["tokenizer"], sampled[valid & ~tested], total, top),
        },
    }


def save(rep: dict, root: Path) -> list[Path]:
    from masktrl.analysis.io import analysis_dir, figures, save_figure, write_json

    out = analysis_dir(root)
    plots = figures(out)  # matplotlib once the JSON is written (its cache: caches.settle_matplotlib)
    return [
        write_json(out / f"sis-step{rep['step']}.json", rep),
        save_figure(plots.sis_panels(rep), out / f"sis-step{rep['step']}.png"),
    ]
