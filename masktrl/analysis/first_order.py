"""The replayed update under control, and the first-order prediction of each token's ΔD split by
where the step came from (docs/ANALYSIS.md, "What moves D").

**The replayed optimizer** (``ReplayOptimizer``): ``run`` = the run's AdamW with its stored moments
and learning-rate schedule (what training did); ``adamw`` = AdamW with the run's betas and weight
decay but fresh moments at checkpoint P, constant learning rate; ``sgd`` = plain SGD (no momentum,
no weight decay), constant learning rate. ``lr`` (default: the run's learning rate at checkpoint
P) sets the constant rate of ``sgd``/``adamw`` and, for ``run``, replaces its schedule by that
constant. ``reset_moments``: the Adam state is cleared before every minibatch (fresh m = v = 0
and step count 0 at each update, so each update is Adam's first: about lr·sign(g)).

**The decomposition.** One minibatch update moves the weights by Δθ. For token t,
ΔD_t ≈ ⟨∇θ D_t, Δθ⟩ (D = the top-K KL of docs/METHODS.md §3, as the study measures it). AdamW's
step is linear in its parts once its denominator is fixed at the value the step used
(denom = sqrt(v_new / bc2) + eps, bc_i = 1 - beta_i^t):

    Δθ = -lr wd θ  +  (-lr / bc1) beta1 m_old / denom  +  (-lr / bc1)(1 - beta1) g / denom
         decay        momentum                             gradient

and for SGD Δθ = -lr g. g is the minibatch's (clipped) gradient, g = c Σ_s a_s ∇θ log π_s with
a_s = ∂L/∂log π_s (the aggregated loss) and c the gradient clip's factor. The gradient part
splits into the token's **own** term (its own a_t ∇θ log π_t) and the **rest** of the minibatch.
So per token

    fo_total = fo_decay + fo_momentum + fo_own + fo_rest          (fo_gradient = fo_own + fo_rest)

``fo_total`` is computed separately, along the measured Δθ = θ_after − θ_before, so the sum is a
check, not an identity. Directional derivatives for all tokens at once use the double-backward
identity J u = ∂/∂w ⟨∇θ (Σ_t w_t D_t), u⟩ at w = 1; the own term needs two gradients per token
and is computed on at most ``own_tokens`` tokens per minibatch (those with D > δ and A ≠ 0
first, a seeded random choice among them); ``fo_own`` and ``fo_rest`` are NaN elsewhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from masktrl.config import check_lr
from masktrl.errors import MasktrlError

OPTIMIZERS = ("run", "sgd", "adamw")
PARTS = ("decay", "momentum", "own", "rest")  # fo_total = their sum
OWN_TOKENS = 32


@dataclass(frozen=True)
class ReplayOptimizer:
    """The optimizer a replay runs (module docstring)."""

    name: str = "run"
    lr: float | None = None
    reset_moments: bool = False

    def describe(self, lr_used: float | None = None) -> dict:
        return {"name": self.name, "lr": self.lr, "lr_used": lr_used, "reset_moments": self.reset_moments}


def check_replay_optimizer(name: str = "run", lr: float | None = None, reset_moments: bool = False) -> ReplayOptimizer:
    """The choice, or ``MasktrlError`` (one line) for an unknown name, an lr that is not a positive
    finite number, or ``reset_moments`` with sgd (it has none)."""
    if name not in OPTIMIZERS:
        raise MasktrlError(f"--replay-optimizer must be one of {', '.join(OPTIMIZERS)}, got {name!r}")
    if lr is not None and not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
        raise MasktrlError(f"--replay-lr must be a positive number, got {lr}")
    if lr is not None:
        check_lr("--replay-lr", lr)  # 1e300 raised inside the optimizer
    if reset_moments and name == "sgd":
        raise MasktrlError("--reset-moments needs an optimizer with moments (run or adamw); sgd has none")
    return ReplayOptimizer(name, None if lr is None else float(lr), bool(reset_moments))


def build_optimizer(model, train_cfg, choice: ReplayOptimizer, run_optimizer, run_scheduler):
    """(optimizer, scheduler, lr used) for ``choice``; ``run_optimizer``/``run_scheduler`` are the
    run's, already at checkpoint P. The constant schedules are ``LambdaLR`` at factor 1."""
    current = float(run_optimizer.param_groups[0]["lr"])
    lr = choice.lr if choice.lr is not None else current
    if choice.name == "run":
        if choice.lr is None:
            return run_optimizer, run_scheduler, current
        for g in run_optimizer.param_groups:
            g["lr"] = lr
            g["initial_lr"] = lr
        return run_optimizer, torch.optim.lr_scheduler.LambdaLR(run_optimizer, lambda _: 1.0), lr
    params = [p for g in run_optimizer.param_groups for p in g["params"]]
    if choice.name == "adamw":
        betas = run_optimizer.param_groups[0].get("betas", (0.9, 0.999))
        opt = torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=train_cfg.weight_decay)
    else:
        opt = torch.optim.SGD(params, lr=lr, momentum=0.0, weight_decay=0.0)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0), lr


# --------------------------------------------------------------------------- the step's parts


@dataclass
class Snapshot:
    """What a step's decomposition needs from just before it."""

    theta: list[Tensor]
    exp_avg: list[Tensor | None]
    lr: float


def snapshot(optimizer) -> Snapshot:
    params = [p for g in optimizer.param_groups for p in g["params"]]
    m = [
        optimizer.state[p]["exp_avg"].detach().clone() if "exp_avg" in optimizer.state.get(p, {}) else None
        for p in params
    ]
    return Snapshot([p.detach().clone() for p in params], m, float(optimizer.param_groups[0]["lr"]))


def step_parts(optimizer, before: Snapshot) -> dict[str, list[Tensor]]:
    """The step just taken, Δθ, split into decay, momentum and gradient directions (lists of
    per-parameter tensors), plus ``total`` = θ_now − θ_before and ``precond``: the elementwise
    factor P with gradient = P ⊙ g (g = the gradient the step used, ``p.grad``)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    group = optimizer.param_groups[0]
    lr, wd = before.lr, float(group.get("weight_decay", 0.0))
    out = {"decay": [], "momentum": [], "gradient": [], "total": [], "precond": []}
    for p, theta, m_old in zip(params, before.theta, before.exp_avg):
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        out["total"].append(p.detach() - theta)
        if isinstance(optimizer, torch.optim.SGD):
            if float(group.get("momentum", 0.0)) != 0.0:
                raise MasktrlError("the decomposition supports plain SGD (no momentum) and AdamW")
            out["decay"].append(-lr * wd * theta)
            out["momentum"].append(torch.zeros_like(theta))
            out["precond"].append(torch.full_like(theta, -lr))
        elif isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            _adam_parts(optimizer, p, theta, m_old, lr, wd, out)
            continue
        else:
            raise MasktrlError(f"the decomposition supports SGD and AdamW, not {type(optimizer).__name__}")
        out["gradient"].append(out["precond"][-1] * g)
    return out


def _adam_parts(optimizer, p, theta, m_old, lr, wd, out) -> None:
    group = optimizer.param_groups[0]
    b1, b2 = group["betas"]
    eps = group["eps"]
    if group.get("amsgrad"):
        raise MasktrlError("the decomposition does not support amsgrad")
    state = optimizer.state[p]
    t = float(state["step"])
    bc1, bc2 = 1 - b1**t, 1 - b2**t
    denom = state["exp_avg_sq"].sqrt() / math.sqrt(bc2) + eps
    g = p.grad if p.grad is not None else torch.zeros_like(p)
    decoupled = isinstance(optimizer, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay", False))
    if not decoupled and wd:
        raise MasktrlError("the decomposition supports AdamW's decoupled weight decay, not Adam's L2 term")
    scale = -lr / bc1
    out["decay"].append(-lr * wd * theta)
    out["momentum"].append(scale * b1 * m_old / denom if m_old is not None else torch.zeros_like(theta))
    out["precond"].append(scale * (1 - b1) / denom)
    out["gradient"].append(out["precond"][-1] * g)


def directional(values: Tensor, params: list[Tensor], directions: dict[str, list[Tensor]]) -> dict[str, Tensor]:
    """{name: [n] ⟨∇θ values_t, u⟩} for every direction u, by double backward; ``values`` [n] carries
    the graph to ``params``."""
    w = torch.ones_like(values, requires_grad=True)
    grads = torch.autograd.grad(values, params, grad_outputs=w, create_graph=True, allow_unused=True)
    out = {}
    names = list(directions)
    for i, name in enumerate(names):
        h = sum((gp * u).sum() for gp, u in zip(grads, directions[name]) if gp is not None)
        (jv,) = torch.autograd.grad(h, w, retain_graph=i < len(names) - 1)
        out[name] = jv.detach()
    return out


def own_terms(
    d: Tensor, logp: Tensor, coef: Tensor, params: list[Tensor], precond: list[Tensor], tokens: list[int]
) -> dict[int, float]:
    """{t: ⟨∇θ D_t, P ⊙ coef_t ∇θ log π_t⟩} for the tokens ``tokens`` (two gradients each)."""
    out = {}
    for t in tokens:
        a = torch.autograd.grad(d[t], params, retain_graph=True, allow_unused=True)
        b = torch.autograd.grad(logp[t], params, retain_graph=True, allow_unused=True)
        s = sum(float((x * pc * y).sum()) for x, y, pc in zip(a, b, precond) if x is not None and y is not None)
        out[t] = float(coef[t]) * s
    return out


def choose_own(over: np.ndarray, n_max: int, seed: int) -> list[int]:
    """Up to ``n_max`` token indices: those flagged in ``over`` first (seeded random order), then others."""
    rng = np.random.default_rng(seed)
    first = rng.permutation(np.flatnonzero(over))
    rest = rng.permutation(np.flatnonzero(~over))
    return [int(i) for i in np.concatenate([first, rest])[:n_max]]


# --------------------------------------------------------------------------- one replayed minibatch


def differentiable_topk_kl(batch, lp_full: Tensor) -> tuple[Tensor, Tensor]:
    """(D [n], log π_k [n]) with the graph to the weights: the top-K KL of §3 (union support, the
    1e-12 floor of the training tail) from the batch's behaviour lists and the full training
    log-probabilities ``lp_full`` [n, V] (which carry the gradient)."""
    from masktrl.methods import support

    s = support(batch, "union")  # masks and mu (detached)
    ids = batch.topk_ids.clamp_min(0)
    logp = lp_full.gather(1, batch.sampled_ids[:, None])[:, 0]  # [n]
    pi_all = torch.cat([lp_full.gather(1, ids), logp[:, None]], dim=1)  # [n, K+1]
    pi_all = torch.where(s.member, pi_all, torch.full_like(pi_all, float("-inf")))
    mu_lp = s.mu_lp.to(lp_full.dtype)
    pos = s.member & (mu_lp > float("-inf"))
    atoms = torch.where(
        pos, mu_lp.exp() * (mu_lp - torch.where(pos, pi_all, torch.zeros_like(pi_all))), torch.zeros_like(pi_all)
    ).sum(1)
    pi_t = (-torch.expm1(torch.logsumexp(pi_all, dim=1))).clamp_min(0.0)  # [n]
    mu_t = s.mu_tail.to(lp_full.dtype)
    has = mu_t > 0
    if s.m is not None:
        has = has & (s.m > 0)
    tail = mu_t * (torch.where(has, mu_t, torch.ones_like(mu_t)).log() - pi_t.clamp_min(1e-12).log())
    return atoms + torch.where(has, tail, torch.zeros_like(tail)), logp


def decompose_minibatch(replay, idx: list[int], snap: Snapshot, coef: Tensor, own: list[int]) -> dict[str, np.ndarray]:
    """The first-order parts (module docstring) of the update just taken on samples ``idx``.

    ``snap``: the optimizer snapshot from before the update; ``coef`` [n]: ∂L/∂log π_t of the
    minibatch's aggregated loss; ``own``: the tokens (indices into the minibatch) whose own term
    is computed. The weights are put back to θ_before for the forward and restored after."""
    from masktrl.rl.policy import lm_head_weight, policy_token_batch, response_hidden

    model, optimizer = replay.model, replay.optimizer
    params = [p for g in optimizer.param_groups for p in g["params"]]
    parts = step_parts(optimizer, snap)
    after = [p.detach().clone() for p in params]
    samples = [replay.samples[i] for i in idx]
    temperature = replay.cfg.rollout.temperature
    try:
        with torch.no_grad():
            for p, th in zip(params, snap.theta):
                p.copy_(th)
        batch = policy_token_batch(model, samples, temperature, replay.cfg.train.logprob_chunk).batch
        batch = type(batch)(
            batch.logp.detach(),
            batch.behavior_logp,
            batch.sampled_ids,
            batch.topk_ids,
            batch.topk_behavior_logp,
            batch.topk_logp.detach(),
            batch.seq_ids,
            batch.vocab_size,
        )
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with torch.enable_grad(), sdpa_kernel([SDPBackend.MATH]):  # the math kernel has a double backward
            h = response_hidden.__wrapped__(model, samples)  # [n, H] with the graph to the weights
            lp_full = torch.log_softmax(h.float() @ lm_head_weight(model).float().t() / temperature, dim=-1)  # [n, V]
            d, logp = differentiable_topk_kl(batch, lp_full)
            g_raw = torch.autograd.grad(
                (coef.to(logp.dtype) * logp).sum(), params, retain_graph=True, allow_unused=True
            )
            raw = math.sqrt(sum(float((x * x).sum()) for x in g_raw if x is not None))
            used = math.sqrt(sum(float((p.grad * p.grad).sum()) for p in params if p.grad is not None))
            clip = used / raw if raw > 0 else 1.0
            match = sum(
                float(((x * clip - p.grad) ** 2).sum())
                for x, p in zip(g_raw, params)
                if x is not None and p.grad is not None
            )
            dirs = {k: parts[k] for k in ("total", "decay", "momentum", "gradient")}
            jv = directional(d, params, dirs)
            precond = [pc * clip for pc in parts["precond"]]
            own_vals = own_terms(d, logp, coef, params, precond, own)
    finally:
        with torch.no_grad():
            for p, th in zip(params, after):
                p.copy_(th)
    n = len(coef)
    own_col = np.full(n, np.nan)
    for t, v in own_vals.items():
        own_col[t] = v
    grad = jv["gradient"].double().cpu().numpy()
    return {
        "fo_total": jv["total"].double().cpu().numpy(),
        "fo_decay": jv["decay"].double().cpu().numpy(),
        "fo_momentum": jv["momentum"].double().cpu().numpy(),
        "fo_gradient": grad,
        "fo_own": own_col,
        "fo_rest": grad - own_col,
        "fo_d_recomputed": d.detach().double().cpu().numpy(),
        "fo_clip_factor": np.full(n, clip),
        "fo_grad_rel_mismatch": np.full(n, math.sqrt(match) / used if used > 0 else 0.0),
    }


# --------------------------------------------------------------------------- summary


def summarize_parts(t: dict, delta: float, criteria: tuple[str, ...]) -> dict:
    """Sign agreement of every part with the measured ΔD (one step), the share of tokens where
    momentum outweighs the gradient, |own| / |rest|, and each rule's unsafe-keep rate as measured
    and as each part would predict it; over tokens with D > δ, A ≠ 0 and a valid behaviour
    probability (own and rest: where computed)."""
    d = t["d"]
    over = t["valid"].astype(bool) & np.isfinite(d) & (d > delta) & (t["adv"] != 0)
    dd = t["d_one"] - d
    cols = {"total": t["fo_total"], "gradient": t["fo_gradient"], **{p: t[f"fo_{p}"] for p in PARTS}}
    out = {
        "n_tokens": int(over.sum()),
        "n_own": int((over & np.isfinite(t["fo_own"])).sum()),
        "sign_agree": {},
        "unsafe_keep": {},
    }
    present = {name: bool(np.any(np.nan_to_num(v) != 0)) for name, v in cols.items()}  # decay / momentum may be absent
    out["parts_present"] = present
    for name, v in cols.items():
        sel = over & np.isfinite(v)
        ok = sel.any() and present[name]
        out["sign_agree"][name] = float((np.sign(v[sel]) == np.sign(dd[sel])).mean()) if ok else float("nan")
    out["momentum_outweighs_gradient_frac"] = (
        float((np.abs(t["fo_momentum"][over]) > np.abs(t["fo_gradient"][over])).mean()) if over.any() else float("nan")
    )
    own_sel = over & np.isfinite(t["fo_own"]) & (t["fo_rest"] != 0)
    out["own_over_rest_median"] = (
        float(np.median(np.abs(t["fo_own"][own_sel]) / np.abs(t["fo_rest"][own_sel])))
        if own_sel.any()
        else float("nan")
    )
    resid = t["fo_total"] - (t["fo_decay"] + t["fo_momentum"] + t["fo_gradient"])
    valid = np.isfinite(resid)
    out["parts_sum_max_abs_residual"] = float(np.max(np.abs(resid[valid]))) if valid.any() else float("nan")
    out["fo_total_max_abs"] = float(np.max(np.abs(t["fo_total"][valid]))) if valid.any() else float("nan")
    for c in criteria:
        kept = over & t[f"keep_{c}"].astype(bool)
        row = {"n_kept": int(kept.sum()), "measured": float((dd[kept] > 0).mean()) if kept.any() else float("nan")}
        for name, v in cols.items():
            sel = kept & np.isfinite(v)
            row[name] = float((v[sel] > 0).mean()) if sel.any() and present[name] else float("nan")
        out["unsafe_keep"][c] = row
    return out
