"""Reference KL and entropy bonus, composable with every method (docs/METHODS.md §13).

Every method's params carry the same five fields (``RegularizerParams``, a base of every params
class); with ``kl_coef = 0`` and ``entropy_coef = 0`` (the defaults) nothing here runs and a
method's loss is exactly its own. Otherwise the per-token loss becomes

    l_t  +  kl_coef * kl_t  -  entropy_coef * H_t          (kl_in = "loss")

before the method's own aggregation (§8), as verl's actor adds ``kl_loss_coef * kl_loss`` and
subtracts ``entropy_coeff * entropy`` aggregated with the same ``loss_agg_mode``. With
``kl_in = "reward"`` the KL is a reward penalty instead: R <- R - kl_coef * sum_t kl_t over the
response, with log pi replaced by the behaviour's log mu (no gradient), as verl's
``apply_kl_penalty``; the advantages are then computed from the penalised rewards.

The KL estimators of KL(pi || pi_ref) from the sampled token (x = log pi_k - log pi_ref_k):

    k1          x
    k2          x^2 / 2
    k3          exp(-x) - 1 + x                                   (Schulman's k3; TRL's GRPO KL)
    low_var_kl  clamp(k3(clamp(x, -20, 20)), -10, 10)             (verl's low_var_kl)

``kl_is_correction`` multiplies the estimate by the live ratio r = pi_k / mu_k (gradient
included), which makes the estimate, and for k1 and k3 its gradient, unbiased under samples
from mu rather than pi (TRL's ``use_bias_correction_kl``; DeepSeek-V3.2). low_var_kl clamps
after the weight.

Pure torch, no model: the reference log-probabilities come from the caller (a frozen copy of the
starting policy, or the same model with its adapters disabled).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from masktrl.methods.batch import TokenBatch, check_choice, log_ratio_live

KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")
KL_PLACES = ("loss", "reward")
LOW_VAR_LOG_CLAMP = 20.0  # low_var_kl clamps log(pi/pi_ref) to [-20, 20] ...
LOW_VAR_CLAMP = 10.0  # ... and the estimate to [-10, 10] (verl)


# --------------------------------------------------------------------------- params


def _coef(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"method.{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"method.{name} must be finite, got {value!r}")
    if value < 0:
        raise ValueError(f"method.{name} must be >= 0, got {value!r}")


def check_regularizers(p) -> None:
    """ValueError naming the field (``method.kl_coef must be >= 0, got -1``) for a bad value."""
    _coef("kl_coef", p.kl_coef)
    _coef("entropy_coef", p.entropy_coef)
    if p.kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"method.kl_estimator must be one of {', '.join(KL_ESTIMATORS)}; got {p.kl_estimator!r}")
    if p.kl_in not in KL_PLACES:
        raise ValueError(f"method.kl_in must be one of {', '.join(KL_PLACES)}; got {p.kl_in!r}")
    if not isinstance(p.kl_is_correction, bool):
        raise ValueError(f"method.kl_is_correction must be true or false, got {p.kl_is_correction!r}")
    if p.kl_is_correction and p.kl_in == "reward":
        raise ValueError("method.kl_is_correction applies only with method.kl_in=loss (the reward penalty uses log mu)")


@dataclass(frozen=True, kw_only=True)
class RegularizerParams:
    """The regulariser fields every method's params share (a base class of each; docs/METHODS.md §13)."""

    kl_coef: float = 0.0
    """Reference-KL coefficient (verl kl_loss_coef / kl_ctrl.kl_coef, TRL beta, OpenRLHF init_kl_coef); 0 = off."""
    kl_estimator: str = "low_var_kl"
    """KL(pi || pi_ref) estimator: k1 | k2 | k3 | low_var_kl (k3 clamped to [-10, 10], verl's)."""
    kl_in: str = "loss"
    """Where the KL goes: loss (verl use_kl_loss, TRL) | reward (verl use_kl_in_reward: R - kl_coef * sum_t kl_t)."""
    kl_is_correction: bool = False
    """Multiply the in-loss KL by pi/mu, unbiased under off-policy samples (TRL use_bias_correction_kl)."""
    entropy_coef: float = 0.0
    """Entropy bonus: subtract entropy_coef * H(pi) per token (verl entropy_coeff); 0 = off."""

    def __post_init__(self) -> None:
        check_regularizers(self)

    @property
    def kl_in_loss(self) -> bool:
        """Whether the loss has a KL term (needs reference log-probabilities with the batch)."""
        return self.kl_coef > 0 and self.kl_in == "loss"

    @property
    def kl_in_reward(self) -> bool:
        """Whether the rewards are penalised by the KL before the advantages."""
        return self.kl_coef > 0 and self.kl_in == "reward"

    @property
    def uses_reference(self) -> bool:
        """Whether anything needs the reference policy's log-probabilities (kl_coef > 0)."""
        return self.kl_coef > 0

    @property
    def uses_entropy_grad(self) -> bool:
        """Whether the loss has an entropy term (the policy forward must keep its gradient)."""
        return self.entropy_coef > 0


def regularizer_params(p) -> RegularizerParams:
    """The five regulariser fields of any params object (or ``RegularizerParams`` itself)."""
    if type(p) is RegularizerParams:
        return p
    return RegularizerParams(
        kl_coef=p.kl_coef,
        kl_estimator=p.kl_estimator,
        kl_in=p.kl_in,
        kl_is_correction=p.kl_is_correction,
        entropy_coef=p.entropy_coef,
    )


# --------------------------------------------------------------------------- estimators


def kl_estimate(logp: Tensor, ref_logp: Tensor, estimator: str) -> Tensor:
    """[N] per-token estimate of KL(pi || pi_ref) from log pi_k and log pi_ref_k (§13.1).

    Differentiable in both arguments (the caller detaches ``ref_logp``); computed in the promoted
    dtype. ``ref_logp = -inf`` gives +inf (k1, k2, k3) or 10 (low_var_kl).
    """
    check_choice("estimator", estimator, KL_ESTIMATORS)
    dt = torch.promote_types(logp.dtype, ref_logp.dtype)
    x = logp.to(dt) - ref_logp.to(dt)  # [N] log(pi / pi_ref)
    if estimator == "k1":
        return x
    if estimator == "k2":
        return 0.5 * x * x
    if estimator == "k3":
        return _k3(x)
    return _k3(x.clamp(-LOW_VAR_LOG_CLAMP, LOW_VAR_LOG_CLAMP)).clamp(-LOW_VAR_CLAMP, LOW_VAR_CLAMP)


def _k3(x: Tensor) -> Tensor:
    return torch.expm1(-x) + x  # exp(-x) - 1 + x, accurate near x = 0


def _check_ref(batch: TokenBatch, ref_logp: Tensor, name: str = "ref_logp") -> None:
    if not isinstance(ref_logp, Tensor) or ref_logp.shape != (batch.n,):
        raise ValueError(f"{name} must have shape [N] = [{batch.n}], got {list(getattr(ref_logp, 'shape', []))}")
    if not ref_logp.is_floating_point():
        raise ValueError(f"{name} must be a floating tensor, got {ref_logp.dtype}")
    bad = torch.isnan(ref_logp) | (ref_logp == float("inf"))
    if bool((bad & batch.valid).any()):
        raise ValueError(f"{name} contains NaN or +inf log-probabilities")


def reference_kl(batch: TokenBatch, ref_logp: Tensor, estimator: str, *, is_correction: bool = False) -> Tensor:
    """[N] per-token KL term with its gradient through ``batch.logp`` (§13.1); 0 on invalid tokens.

    ``ref_logp`` [N]: log pi_ref at the sampled tokens (detached here). ``is_correction``: the
    estimate times r = exp(log pi_k - log mu_k), differentiated as well, so that
    E_mu[grad(r k)] = E_pi[grad k] + E_pi[k grad log pi]; for k1 and k3 that is grad KL(pi||pi_ref).
    low_var_kl clamps after the weight.
    """
    _check_ref(batch, ref_logp)
    dt = batch.dtype
    valid = batch.valid
    ref = torch.where(valid, ref_logp.detach().to(dt), torch.zeros((), dtype=dt, device=ref_logp.device))
    lp = batch.logp.to(dt)
    if estimator == "low_var_kl":  # the log clamp now, the value clamp after the weight
        kl = _k3((lp - ref).clamp(-LOW_VAR_LOG_CLAMP, LOW_VAR_LOG_CLAMP))  # [N]
    else:
        kl = kl_estimate(lp, ref, estimator)  # [N]
    if is_correction:
        kl = kl * log_ratio_live(batch).exp()  # value r, gradient r * d log pi (r = 1, no gradient, on invalid tokens)
    if estimator == "low_var_kl":
        kl = kl.clamp(-LOW_VAR_CLAMP, LOW_VAR_CLAMP)
    return torch.where(valid, kl, torch.zeros_like(kl))


def kl_reward_penalty(behavior_logp: Tensor, ref_logp: Tensor, seq_ids: Tensor, estimator: str, coef: float) -> Tensor:
    """[G] float64 reward penalties coef * sum_t kl_t per sequence (sorted ``seq_ids``), with kl_t
    the estimator at log mu_k instead of log pi_k (no gradient): verl's ``apply_kl_penalty``
    for an outcome reward, R <- R - penalty (§13.2). Tokens with log mu = -inf are left out.
    """
    check_choice("estimator", estimator, KL_ESTIMATORS)
    _coef("kl_coef", coef)
    for name, t in (("behavior_logp", behavior_logp), ("ref_logp", ref_logp), ("seq_ids", seq_ids)):
        if not isinstance(t, Tensor) or t.dim() != 1 or t.shape != behavior_logp.shape:
            raise ValueError(
                f"{name} must have shape [N] = [{behavior_logp.shape[0]}], got {list(getattr(t, 'shape', []))}"
            )
    mu = behavior_logp.detach().to(torch.float64)
    ref = ref_logp.detach().to(torch.float64)
    valid = mu > float("-inf")
    if bool((valid & (torch.isnan(ref) | (ref == float("inf")))).any()):
        raise ValueError("ref_logp contains NaN or +inf log-probabilities")
    kl = kl_estimate(
        torch.where(valid, mu, torch.zeros_like(mu)), torch.where(valid, ref, torch.zeros_like(ref)), estimator
    )
    kl = torch.where(valid, kl, torch.zeros_like(kl))  # [N]
    uniq, inv = torch.unique(seq_ids, return_inverse=True)
    per_seq = torch.zeros(uniq.shape[0], dtype=torch.float64, device=kl.device).index_add_(0, inv, kl)  # [G]
    return coef * per_seq


# --------------------------------------------------------------------------- the loss terms


class Regularized(NamedTuple):
    loss: Tensor  # [N] the method's per-token loss plus the regulariser terms; 0 on invalid tokens
    kl: Tensor | None  # [N] the in-loss KL term before its coefficient (None when off)
    entropy: Tensor | None  # [N] the entropy the bonus used (None when off)


def regularize(
    loss: Tensor, batch: TokenBatch, params, *, ref_logp: Tensor | None = None, entropy: Tensor | None = None
) -> Regularized:
    """The per-token loss with the in-loss KL and the entropy bonus of ``params`` (§13):

        loss_t + kl_coef * kl_t - entropy_coef * H_t      on valid tokens, 0 elsewhere

    With both coefficients 0 (or the KL in the reward) the KL part is skipped and ``loss`` is
    returned itself, so the update is bit-identical to the method alone. ``ref_logp`` [N] is
    needed when the KL is in the loss, ``entropy`` [N] (with its gradient) when
    ``entropy_coef > 0``. Aggregate the result with the method's mode.
    """
    if not isinstance(loss, Tensor) or loss.shape != (batch.n,):
        raise ValueError(f"loss must have shape [N] = [{batch.n}], got {list(getattr(loss, 'shape', []))}")
    kl = ent = None
    total = loss
    valid = batch.valid
    if params.kl_in_loss:
        if ref_logp is None:
            raise ValueError("ref_logp is required when method.kl_coef > 0 and method.kl_in=loss")
        kl = reference_kl(batch, ref_logp, params.kl_estimator, is_correction=params.kl_is_correction)
        total = total + params.kl_coef * kl.to(total.dtype)
    if params.uses_entropy_grad:
        if not isinstance(entropy, Tensor) or entropy.shape != (batch.n,):
            raise ValueError(
                f"entropy must have shape [N] = [{batch.n}] when method.entropy_coef > 0, "
                "got "
                f"{list(getattr(entropy, 'shape', [])) if entropy is not None else None}"
            )
        ent = torch.where(valid, entropy.to(total.dtype), torch.zeros((), dtype=total.dtype, device=entropy.device))
        total = total - params.entropy_coef * ent
    if total is not loss:
        total = torch.where(valid, total, torch.zeros_like(total))
    return Regularized(total, kl, ent)


def mean_over_valid(values: Tensor, batch: TokenBatch) -> float:
    """The mean of ``values`` [N] over the valid tokens, as a python float (nan for none)."""
    valid = batch.valid
    if not bool(valid.any()):
        return float("nan")
    return float(values.detach().to(torch.float64)[valid].mean())
