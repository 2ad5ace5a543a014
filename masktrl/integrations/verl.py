"""masktrl's rules inside verl: a policy loss for verl's ``core_algos.py`` registry.

    from masktrl.integrations.verl import register
    register("masktrl_pdm", "pdm")   # then actor_rollout_ref.actor.policy_loss.loss_mode=masktrl_pdm

``policy_loss(method, correction=None, anchor="mu")`` returns a function with the signature of
verl's policy losses (verl 0.9.1, ``verl/trainer/ppo/core_algos.py``: ``PolicyLossFn`` lines
37-48, ``compute_policy_loss_vanilla`` lines 1286-1294)::

    fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
       config=None, rollout_is_weights=None) -> (loss: scalar tensor, metrics: dict[str, float])

all tensors [B, T] (the response tokens), as verl's actor calls it (``verl/workers/utils/losses.py``
lines 103-112: ``policy_loss_fn(old_log_prob=..., log_prob=..., advantages=..., response_mask=...,
loss_agg_mode=..., config=..., rollout_is_weights=...)``). ``register(name, ...)`` puts it in
verl's registry with verl's own ``register_policy_loss`` (lines 53-67), so ``get_policy_loss_fn``
(lines 70-85) returns it.

What the rule's anchor is (its ``behavior_logp``, the mu of docs/METHODS.md):

* ``anchor="mu"``: ``old_log_prob`` must hold the rollout engine's log-probs (verl's
  ``old_log_probs := rollout_log_probs`` substitution, ``rollout_corr_helper.py: apply_bypass_mode``
  line 1138), the setting of masktrl's own runs; masktrl's ``method.correction`` (bypass mode) applies.
* ``anchor="pi_old"``: ``old_log_prob`` is verl's recomputed pi_old; the rule's trust region is
  around pi_old and the correction toward mu is verl's ``rollout_is_weights`` (multiplied into the
  token losses as ``compute_policy_loss_vanilla`` does, line 1364); ``correction`` must be none.

The aggregation is verl's ``loss_agg_mode`` (token-mean, seq-mean-token-mean,
seq-mean-token-sum-norm) over the global batch verl describes in ``config.global_batch_info``
(``dp_size``, ``batch_num_tokens``, ``global_batch_size``, ``loss_scale_factor``; ``agg_loss``,
lines 1140-1199): masktrl's ``aggregate`` of the local tokens times (local denominator / global
denominator) times dp_size. With verl's ``loss_agg_mode`` set to the rule's own aggregation the loss
is masktrl's.

The top-K rules (pdm, sis, dppo with a top-K divergence, ...): verl's registry passes only the
sampled token's log-probs, so a top-K rule called through it is refused (one ``ConfigError``). The
contract that runs them (docs/ECOSYSTEM.md): vLLM sampling with ``logprobs=K``, the lists stored in
the DataProto batch as ``rollout_topk_ids`` / ``rollout_topk_log_probs`` [B, T, K], the actor's
forward gathering log pi at those ids as ``topk_log_prob`` [B, T, K], and these three and the
sampled ids (verl's ``responses`` [B, T]) passed to this function as keyword arguments of the same names.
sis's per-token uniforms, for which the signature has no stream, are drawn here (``Uniforms``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from masktrl.config import check_seed
from masktrl.errors import ConfigError
from masktrl.integrations.tokens import (
    bind,
    keyed_uniforms,
    needs_topk,
    padded_token_batch,
    rule_loss,
    token_advantages,
)
from masktrl.methods import AGG_MODES, BoundMethod, aggregate, aggregate_denominator

__all__ = ["ANCHORS", "Uniforms", "policy_loss", "register"]

ANCHORS = ("mu", "pi_old")


def _info(config: Any) -> dict:
    """verl's ``config.global_batch_info`` (``ActorConfig``, verl/workers/config/actor.py line 192) or {}."""
    if config is None:
        return {}
    info = (
        config.get("global_batch_info", None) if hasattr(config, "get") else getattr(config, "global_batch_info", None)
    )
    if info is None:
        return {}
    try:
        return dict(info)
    except (TypeError, ValueError):
        raise ConfigError(
            f"config.global_batch_info must be a mapping (dp_size, batch_num_tokens, ...), got {type(info).__name__}"
        ) from None


def policy_loss(method: Any = "grpo", correction: dict | None = None, *, anchor: str = "mu", seed: int = 0) -> Callable:
    """A verl policy-loss function running masktrl rule ``method`` (module docstring); ``seed``: the
    stream of a rule's per-token uniforms (sis; ``Uniforms``)."""
    bound = bind(method, correction)
    check_seed("seed", seed)
    if anchor not in ANCHORS:
        raise ConfigError(f"anchor must be one of {', '.join(ANCHORS)}, got {anchor!r}")
    if anchor == "pi_old" and bound.correction.active:
        raise ConfigError(
            "anchor=pi_old: the correction toward mu is verl's rollout_is_weights; give no masktrl correction"
        )
    if bound.correction.needs_old:
        raise ConfigError(
            f"method.correction.kind={bound.correction.kind} needs pi_old besides mu, which verl's policy-loss "
            "signature does not carry; use anchor=pi_old with verl's rollout correction instead"
        )
    if bound.kl_in_loss or bound.needs_entropy_grad:
        raise ConfigError(
            "the reference KL and the entropy bonus are verl's (actor.use_kl_loss, actor.entropy_coeff); "
            "give the rule kl_coef=0 and entropy_coef=0"
        )
    draws = Uniforms(seed) if bound.needs_u else None
    topk = needs_topk(bound)

    def masktrl_policy_loss(
        old_log_prob: Tensor,
        log_prob: Tensor,
        advantages: Tensor,
        response_mask: Tensor,
        loss_agg_mode: str = "token-mean",
        config: Any = None,
        rollout_is_weights: Tensor | None = None,
        *,
        responses: Tensor | None = None,
        rollout_topk_ids: Tensor | None = None,
        rollout_topk_log_probs: Tensor | None = None,
        topk_log_prob: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Any]]:
        if loss_agg_mode not in AGG_MODES:
            raise ConfigError(
                f"loss_agg_mode {loss_agg_mode!r}: a masktrl rule aggregates with one of {', '.join(AGG_MODES)}"
            )
        lists = (responses, rollout_topk_ids, rollout_topk_log_probs, topk_log_prob)
        if topk and any(x is None for x in lists):
            raise ConfigError(
                f"method {bound.name!r} reads the behaviour's top-K lists: pass responses, rollout_topk_ids, "
                "rollout_topk_log_probs and topk_log_prob (docs/ECOSYSTEM.md, the verl contract)"
            )
        if anchor == "mu" and rollout_is_weights is not None:
            raise ConfigError(
                "anchor=mu: old_log_prob is mu itself; verl's rollout_is_weights apply with anchor=pi_old"
            )
        _check_tensors(
            {"old_log_prob": old_log_prob, "log_prob": log_prob, "response_mask": response_mask},
            advantages,
            {"rollout_is_weights": rollout_is_weights, "responses": responses},
            {
                "rollout_topk_ids": rollout_topk_ids,
                "rollout_topk_log_probs": rollout_topk_log_probs,
                "topk_log_prob": topk_log_prob,
            }
            if topk
            else {},
        )
        mask = response_mask.bool()
        sampled = (
            responses if responses is not None else torch.zeros_like(mask, dtype=torch.long)
        )  # read only with the lists
        batch = padded_token_batch(
            log_prob,
            old_log_prob,
            sampled,
            mask,
            topk_ids=rollout_topk_ids if topk else None,
            topk_behavior_logp=rollout_topk_log_probs,
            topk_logp=topk_log_prob,
        )
        info = _info(config)
        horizon = info.get("loss_scale_factor")
        if horizon is None:
            horizon = mask.shape[-1]
        else:
            horizon = _check_positive("loss_scale_factor", horizon)
        method = bound if bound.aggregation == loss_agg_mode else _with_aggregation(bound, loss_agg_mode)
        adv = token_advantages(advantages, mask)
        u = draws(batch.n) if draws is not None else None
        out = (
            rule_loss(method, batch, adv, horizon=horizon, u=u)
            if rollout_is_weights is None
            else _weighted(method, batch, adv, rollout_is_weights[mask].detach(), horizon, u)
        )
        loss = out.loss
        dp = info.get("dp_size")
        dp = 1 if dp is None else _check_positive("dp_size", dp, integer=True)
        den_key = "batch_num_tokens" if loss_agg_mode == "token-mean" else "global_batch_size"
        global_den = info.get(den_key)
        if global_den is not None:
            _check_positive(den_key, global_den)
        if global_den is not None or dp > 1:
            local = aggregate_denominator(out.batch, loss_agg_mode)
            if global_den is None:
                raise ConfigError(
                    "dp_size > 1 needs global_batch_info's batch_num_tokens (token-mean) or global_batch_size"
                )
            loss = loss * (local / float(global_den)) * dp
        valid = batch.valid
        masked = (out.losses.mask & valid).float().sum() / valid.float().sum().clamp_min(1)
        # verl's ppo_kl: the mean of -(log pi - log old) clamped to [-20, 20], as compute_policy_loss_vanilla
        # logs it (core_algos.py lines 1286-1377: negative_approx_kl clamped before the ratio and the metric)
        kl = (old_log_prob - log_prob.detach()).clamp(-20.0, 20.0)[mask].mean() if mask.any() else torch.zeros(())
        return loss, {"actor/masktrl_masked_frac": masked.item(), "actor/ppo_kl": kl.item()}

    masktrl_policy_loss.__doc__ = f"masktrl rule {bound.name!r} (anchor {anchor}) as a verl policy loss."
    masktrl_policy_loss.masktrl_method = bound
    return masktrl_policy_loss


LOGP_SLACK = 0.1
"""How far above 0 a log-probability may be and still be read as rounding: fp32 log-softmax is
within ~1e-6 of its value, one computed in bf16 within a few hundredths; probabilities or logits
handed over as log-probabilities exceed it almost surely."""


def _shape(t: Tensor) -> str:
    return "[" + ", ".join(map(str, t.shape)) + "]"


def _check_tensors(logps: dict, advantages: Any, per_token: dict, lists: dict) -> None:
    """ConfigError (one line) unless the tensors verl hands over fit together: ``old_log_prob``,
    ``log_prob`` and ``response_mask`` one shape [B, T], ``advantages`` [B, T] or [B], the optional
    per-token tensors [B, T], the top-K lists [B, T, K] of one K, and no log-probability above
    ``LOGP_SLACK`` on a response token (or a listed entry). Without it a mismatch was a raw
    IndexError or RuntimeError from inside the loss, and probabilities passed as log-probs trained."""
    given = {**logps, "advantages": advantages, **per_token, **lists}
    for name, t in given.items():
        if t is not None and not isinstance(t, Tensor):
            raise ConfigError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    device = logps["log_prob"].device
    for name, t in given.items():
        if t is not None and t.device != device:
            raise ConfigError(f"{name} is on {t.device}, log_prob on {device}: give every tensor on one device")
    for name in ("old_log_prob", "log_prob", "rollout_topk_log_probs", "topk_log_prob"):
        t = given.get(name)
        if t is not None and not t.is_floating_point():
            raise ConfigError(f"{name} must be a floating-point tensor, got {t.dtype}")
    mask = logps["response_mask"]
    if mask.dim() != 2:
        raise ConfigError(f"response_mask must be [B, T] (the response tokens), got {_shape(mask)}")
    if bool(((mask != 0) & (mask != 1)).any()):
        raise ConfigError(
            "response_mask must hold 0 and 1 only (verl weighs a token's loss by its mask value; a masktrl rule "
            "does not)"
        )
    b, t = mask.shape
    for name, x in {**logps, **per_token}.items():
        if x is not None and tuple(x.shape) != (b, t):
            raise ConfigError(f"{name} must have response_mask's shape [{b}, {t}], got {_shape(x)}")
    if tuple(advantages.shape) not in ((b, t), (b,)):
        raise ConfigError(
            f"advantages must be [{b}, {t}] (per token) or [{b}] (per sequence), got {_shape(advantages)}"
        )
    k = lists["rollout_topk_ids"].shape[-1] if lists else None
    for name, x in lists.items():
        if tuple(x.shape) != (b, t, k):
            raise ConfigError(f"{name} must be [{b}, {t}, K] with rollout_topk_ids' K = {k}, got {_shape(x)}")
    sel = mask.bool()
    checks = [(name, logps[name][sel]) for name in ("old_log_prob", "log_prob")]
    if lists:
        real = sel.unsqueeze(-1) & (lists["rollout_topk_ids"] >= 0)
        checks += [(name, lists[name][real]) for name in ("rollout_topk_log_probs", "topk_log_prob")]
    for name, x in checks:
        if bool(torch.isnan(x.detach()).any()):
            raise ConfigError(f"{name} holds NaN on a response token")
        if x.numel() and bool((x.detach() > LOGP_SLACK).any()):
            raise ConfigError(
                f"{name} holds {float(x.detach().max()):.4g} on a response token: log-probabilities are <= 0 "
                "(these look like probabilities or logits)"
            )
    adv = advantages[sel] if advantages.dim() == 2 else advantages[sel.any(-1)]
    if not bool(torch.isfinite(adv.detach()).all()):
        raise ConfigError("advantages hold NaN or inf on a response token: the loss would be NaN")
    weights = per_token.get("rollout_is_weights")
    if weights is not None:
        w = weights.detach()[sel]
        if not bool((torch.isfinite(w) & (w >= 0)).all()):
            bad = w[~(torch.isfinite(w) & (w >= 0))][0]
            raise ConfigError(
                f"rollout_is_weights holds {float(bad):.4g} on a response token: importance weights are finite "
                "and >= 0 (NaN made the loss NaN, a negative one flipped the token's gradient)"
            )


def _check_positive(key: str, value: Any, *, integer: bool = False) -> float:
    """``global_batch_info[key]`` as a number; ConfigError unless it is a finite number > 0 (an
    integer with ``integer``): the loss is divided by the denominators and multiplied by
    ``dp_size``, so 0 divided by zero, NaN made the loss NaN and a negative one flipped its sign
    (gradient ascent), each without a word; a ``dp_size`` of 2.5 scaled the loss by 2.5 and one of
    '2' (text) raised a TypeError from inside the loss."""
    try:
        number = float(value) if not isinstance(value, str) else math.nan
    except (TypeError, ValueError, RuntimeError):
        number = math.nan
    ok = not isinstance(value, bool) and math.isfinite(number) and number > 0
    if ok and integer and number != int(number):
        ok = False
    if not ok:
        whole = ", a whole one (the count of data-parallel ranks)" if integer else ""
        raise ConfigError(f"config.global_batch_info's {key} must be a number > 0{whole}, got {value!r}")
    return int(number) if integer else number


class _Aggregated(BoundMethod):
    """A bound method aggregating with verl's ``loss_agg_mode`` instead of its own."""

    mode: str = "token-mean"

    @property
    def aggregation(self) -> str:
        return self.mode

    def aggregate(self, loss, batch, *, horizon):
        return aggregate(loss, batch, self.mode, norm_len=horizon)


def _with_aggregation(bound: BoundMethod, mode: str) -> BoundMethod:
    out = _Aggregated(bound.method, bound.params, bound.correction)
    object.__setattr__(out, "mode", mode)
    return out


def _weighted(method, batch, adv, weights: Tensor, horizon, u: Tensor | None = None):
    """``rule_loss`` with verl's rollout_is_weights multiplying the token losses (vanilla, line 1364)."""
    from masktrl.integrations.tokens import RuleLoss

    losses = method.token_losses(batch, adv, u=u)
    token_loss = losses.loss * weights.to(losses.loss.dtype)
    return RuleLoss(method.aggregate(token_loss, batch, horizon=horizon), token_loss, losses, batch)


class Uniforms:
    """A rule's per-token uniforms (sis's accept/reject test) inside verl, whose policy-loss signature
    carries no random stream: call c of a process draws ``n`` float64 uniforms from a generator
    seeded with sha256(seed, data-parallel rank, c), so every micro-batch of every rank gets draws
    of its own, the same ones when a run is repeated with the same seed and order of calls. The
    count starts at 0 in each process: a resumed verl run draws other uniforms than the run it
    continues (masktrl's own training keys them by step and minibatch instead)."""

    def __init__(self, seed: int):
        self.seed, self.calls = seed, 0

    def __call__(self, n: int) -> Tensor:
        dist = torch.distributed
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.calls += 1
        return keyed_uniforms(f"{self.seed}:{rank}:{self.calls - 1}", n)


def register(
    name: str, method: Any = "grpo", correction: dict | None = None, *, anchor: str = "mu", seed: int = 0
) -> Callable:
    """``policy_loss(...)`` registered in verl's policy-loss registry under ``name`` (needs verl)."""
    try:
        from verl.trainer.ppo.core_algos import register_policy_loss
    except ImportError as exc:
        raise ConfigError(
            f"masktrl.integrations.verl.register needs verl ({exc}); policy_loss() works without it"
        ) from None
    return register_policy_loss(name)(policy_loss(method, correction, anchor=anchor, seed=seed))
