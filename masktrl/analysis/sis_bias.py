"""How far the top-K SIS gradient is from the exact-envelope SIS gradient and from the on-policy
gradient, on one batch, as a function of the residual mass ξ_K (docs/ANALYSIS.md, "analyze sis
--bias"; the SIS paper's referee comments 1-2).

At step S, from checkpoint P = S-1 (the policy the batch's first update sees), with the run's
SIS uniforms for that step and the SIS parameters of the run (SIS defaults for another method):

    top-K SIS (K)   the acceptance test with the top-K envelope of the lists re-cut to K (§6.2)
    exact SIS       the same test with the exact envelope M* = max_{i: mu_i > 0} pi_i / mu_i over
                    the whole vocabulary (mu from the behaviour checkpoint, pi from P): accepted
                    tokens are exact samples of pi
    on-policy       importance-weighted policy gradient l = -A sg(r) log pi_k on every valid token
                    (no clip, no mask): unbiased for the on-policy token-level gradient E_pi[A ∇ log pi]
    base            the SIS base objective without SIS (its clip on r): separates the clip's share
                    of the distance to the on-policy gradient from the envelope's

Each is the gradient of its batch loss (the SIS base's aggregation) with respect to every
weight. Reported per K: the mean residual mass ξ_K = 1 - pi(T_K) over valid tokens, the accept
rates, and for each pair the cosine and the relative norm of the difference ‖g_a - g_b‖ / ‖g_b‖.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from masktrl.errors import MasktrlError

KS = (5, 10, 20)


def _flat(grads) -> torch.Tensor:
    return torch.cat([g.reshape(-1).double() for g in grads if g is not None])


def _pair(a: torch.Tensor, b: torch.Tensor) -> dict:
    nb = float(b.norm())
    return {
        "cos": float(torch.dot(a, b) / (a.norm() * b.norm()).clamp_min(1e-300)),
        "rel_norm": float((a - b).norm() / nb) if nb > 0 else float("nan"),
    }


def sis_bias(root: Path, step: int, ks: tuple[int, ...] | None = None) -> dict:
    """The measurement of the module docstring on run ``root`` at step ``step``, at the list sizes
    ``ks`` (each at most the stored K: one line otherwise); None: ``default_ks`` of the stored K."""
    from masktrl.analysis.replicates import plan
    from masktrl.analysis.step_replay import load_behaviour, load_replay, sis_uniforms
    from masktrl.methods import get_method, make_params, sis_accept, token_losses, truncate_topk
    from masktrl.methods.batch import log_ratio, log_ratio_live, residual_mass, unit_ratio_log
    from masktrl.methods.masks import ppo_clip_loss
    from masktrl.rl.policy import full_logprobs, lm_head_weight, policy_token_batch, response_hidden

    plan([Path(root)], [step], None, exact=True, no_exact=False)  # checkpoints S-1 and the behaviour's, full sampling
    replay = load_replay(Path(root), step, update_name="run")
    stored_k = max((len(r) for s in replay.samples for r in s.gen.topk_ids), default=0)
    ks, ks_note = (ks, None) if ks is not None else default_ks(stored_k)
    bad = [k for k in ks if k > stored_k]
    if bad:
        raise MasktrlError(
            f"--k {bad[0]} is above the stored list size K = {stored_k} (rollout.logprobs_k): lists can only be re-cut"
        )
    behaviour = load_behaviour(replay)
    cfg = replay.cfg
    sis = cfg.method.params if cfg.method.rule == "sis" else make_params("sis")
    base = sis.base_params
    method = get_method("sis")
    model = replay.model
    params = [p for p in model.parameters() if p.requires_grad]
    out = policy_token_batch(model, replay.samples, cfg.rollout.temperature, cfg.train.logprob_chunk)
    b, adv = out.batch, out.advantages
    u = sis_uniforms(cfg.seed, step, 0, b.n, b.logp.dtype)
    valid = b.valid

    with torch.no_grad():  # the exact envelope, chunked over tokens
        h = response_hidden(model, replay.samples)
        w = lm_head_weight(model)
        log_m = torch.empty(b.n, dtype=torch.float64)
        rows = max(1, (1 << 22) // w.shape[0])
        for s in range(0, b.n, rows):
            e = min(s + rows, b.n)
            pi = full_logprobs(h[s:e], w, cfg.rollout.temperature)
            mu = full_logprobs(behaviour.hidden[s:e], behaviour.weight, cfg.rollout.temperature)
            diff = torch.where(mu > float("-inf"), pi - mu, torch.full_like(pi, float("-inf")))
            log_m[s:e] = diff.amax(dim=1)
        lr = log_ratio(b).double()
        gap = torch.where(valid & (lr > float("-inf")), lr - log_m, torch.full_like(lr, float("-inf")))
        a_exact = gap.clamp_max(0.0).exp()
        acc_exact = valid & (u.double() < a_exact)

    def grad_of(loss_vec) -> torch.Tensor:
        total = method.aggregate(sis, loss_vec, b, horizon=cfg.rollout.max_new_tokens)
        return _flat(torch.autograd.grad(total, params, retain_graph=True, allow_unused=True))

    live = torch.where(acc_exact, unit_ratio_log(b), log_ratio_live(b))
    exact_loss, _ = ppo_clip_loss(live, adv, base.eps_low, base.eps_high, getattr(base, "dual_clip", None))
    g_exact = grad_of(torch.where(valid, exact_loss, torch.zeros_like(exact_loss)))
    onp = token_losses("dppo", b, adv, delta_pos=math.inf, delta_neg=math.inf).loss
    g_on = grad_of(onp)
    g_base = grad_of(token_losses(sis.base, b, adv, **_base_kwargs(base)).loss)  # the base objective without SIS
    rows_out = []
    for k in sorted(set(ks)):
        bk = truncate_topk(b, k)
        dec = sis_accept(bk, u)
        g_k = grad_of(token_losses("sis", b, adv, u=u, **{**_sis_kwargs(sis), "k": k}).loss)
        with torch.no_grad():
            xi = residual_mass(bk.topk_logp.detach(), bk.topk_ids, b.vocab_size)[valid]
        rows_out.append(
            {
                "k": k,
                "xi_mean": float(xi.mean()),
                "xi_p90": float(torch.quantile(xi.double(), 0.9)),
                "accept_rate": float(dec.accepted[valid].double().mean()),
                "vs_exact": _pair(g_k, g_exact),
                "vs_on_policy": _pair(g_k, g_on),
                "vs_base": _pair(g_k, g_base),
            }
        )
    return {
        "analysis": "sis-bias",
        "run": Path(root).name,
        "method": cfg.method_name,
        "step": step,
        "policy_step": replay.policy_step,
        "behaviour_step": behaviour.step,
        "hypothetical": cfg.method_name != "sis",
        "sis_params": _sis_kwargs(sis),
        "stored_k": stored_k,
        "vocab_size": b.vocab_size,
        "n_valid": int(valid.sum()),
        "exact": {
            "accept_rate": float(acc_exact[valid].double().mean()),
            "vs_on_policy": _pair(g_exact, g_on),
            "vs_base": _pair(g_exact, g_base),
        },
        "base_vs_on_policy": _pair(g_base, g_on),
        "ks": rows_out,
        "ks_note": ks_note,
    }


def _base_kwargs(p) -> dict:
    from dataclasses import asdict

    return {k: v for k, v in asdict(p).items() if k in ("eps_low", "eps_high", "dual_clip", "loss_agg")}


def _sis_kwargs(p) -> dict:
    from dataclasses import asdict

    return {k: v for k, v in asdict(p).items() if v is not None and k != "k"}


def save(result: dict, out: Path) -> list[Path]:
    from masktrl.analysis.io import figures, save_figure, write_json

    plots = figures(out)  # matplotlib once the JSON is written (its cache: caches.settle_matplotlib)

    name = f"sis-bias-step{result['step']}"
    return [
        write_json(Path(out) / f"{name}.json", result),
        save_figure(plots.sis_bias_panels(result), Path(out) / f"{name}.png"),
    ]


def default_ks(stored_k: int) -> tuple[tuple[int, ...], str | None]:
    """(the list sizes measured when ``--k`` is not given, a note or None): ``KS`` up to the stored
    K, and K itself in place of those above it (the tiny default's 17-token vocabulary stores
    K = 17: 5, 10, 17)."""
    fit = tuple(k for k in KS if k <= stored_k)
    if len(fit) == len(KS):
        return KS, None
    above = [k for k in KS if k > stored_k]
    ks = tuple(sorted({*fit, stored_k}))
    return ks, (
        f"--k {','.join(map(str, KS))} (the default): {', '.join(map(str, above))} above the stored "
        "list size "
        f"K = {stored_k}; measured at {', '.join(map(str, ks))}"
    )


def parse_ks(spec: str | None) -> tuple[int, ...] | None:
    """``--k``: the sorted list sizes; None (not given) lets ``sis_bias`` take ``default_ks``."""
    if spec is None:
        return None
    try:
        ks = tuple(sorted({int(x) for x in spec.split(",") if x.strip()}))
    except ValueError:
        raise MasktrlError(f"--k must be a comma-separated list of list sizes, got {spec!r}") from None
    if not ks or ks[0] < 1:
        raise MasktrlError(f"--k needs list sizes >= 1, got {spec!r}")
    return ks


def summary_rows(result: dict) -> list[tuple]:
    """(K, ξ_K, accept rate, cos/rel vs exact, cos/rel vs on-policy) rows for a table."""
    rows = [
        (
            str(r["k"]),
            r["xi_mean"],
            r["accept_rate"],
            r["vs_exact"]["cos"],
            r["vs_exact"]["rel_norm"],
            r["vs_on_policy"]["cos"],
            r["vs_on_policy"]["rel_norm"],
        )
        for r in result["ks"]
    ]
    e = result["exact"]
    rows.append(("exact", 0.0, e["accept_rate"], 1.0, 0.0, e["vs_on_policy"]["cos"], e["vs_on_policy"]["rel_norm"]))
    return [tuple(x if isinstance(x, str) else float(np.round(x, 6)) for x in r) for r in rows]
