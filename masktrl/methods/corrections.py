"""Off-policy corrections against the behaviour policy mu, composable with any method (docs/METHODS.md §14).

A correction turns the per-token ratio rho = pi_ref / mu into a weight f (relative to mu) and a
keep mask; it multiplies the method's per-token loss by a stop-gradient factor c:

    decoupled mode:  the method's ratio is pi/pi_old, c = f * keep
    bypass mode:     the method's ratio is pi/mu, c = (f / rho) * keep

pi_ref is the training engine's pi_old (``ref: old``, recomputed by one extra forward) as in
every published definition (IcePop, verl's and TRL's TIS and masks, OpenRLHF), or, in bypass
mode only, the current policy sg(pi) (``ref: current``: masktrl's own variant for the ratio
kinds, and verl's bypass-mode convention for ``rs``, core_algos.py ``compute_policy_loss_bypass_mode``).
With ref old the token's weight relative to mu is f(pi_old/mu) * pi/pi_old in both modes and only
the anchor of the trust region differs (§14.3). Everything is pure torch and stop-gradient;
log-ratios are formed in log space and sequence products are sums of logs.

* ``CorrectionParams``: the frozen, validated ``method.correction`` block.
* ``correction_weights(params, ...)``: the per-token factor, mask and weight (``Correction``).
* ``corrected_token_losses(method, batch, advantages, params, correction, ...)``: a method's
  ``TokenLosses`` with the correction applied (the decoupled batch built from pi_old if given).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields, replace
from typing import NamedTuple

import torch
from torch import Tensor

from masktrl.methods.batch import TokenBatch, check_rule_name

CORRECTION_KINDS = ("none", "token-tis", "seq-tis", "token-mis", "seq-mis", "icepop", "rs", "opsm")
CORRECTION_MODES = ("bypass", "decoupled")
CORRECTION_REFS = ("old", "current")  # the policy the ratio rho = pi_ref / mu is taken from
CORRECTION_DENOMINATORS = ("all", "kept")  # kept: rejected tokens leave the aggregate's denominator (verl)
RATIO_KINDS = ("token-tis", "seq-tis", "token-mis", "seq-mis", "icepop", "rs")  # the kinds whose rho reads pi_ref
SEQ_STATS = ("product", "geometric")  # seq-mis: the sequence ratio R
SEQ_WEIGHTS = ("token", "sequence")  # seq-mis: the weight on kept tokens (rho_t or R)
RS_STATS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)  # verl's rollout_rs options
RS_LOG_BOUND = 20.0  # verl's SAFETY_BOUND: log rho is clamped to [-20, 20] before the k-statistics

# the keys each kind reads (besides ``kind`` and ``mode``), with their defaults (§14.1)
_KEYS: dict[str, dict[str, object]] = {
    "none": {},
    "token-tis": {"cap": 2.0, "floor": None},
    "seq-tis": {"cap": 2.0, "floor": None},
    "token-mis": {"lo": 0.0, "hi": 3.0},
    "seq-mis": {"lo": 0.0, "hi": 3.0, "stat": "product", "weight": "token"},
    "icepop": {"lo": 0.5, "hi": 5.0},
    "rs": {"stat": "seq_mean_k3", "lo": None, "hi": None},
    "opsm": {"delta": 0.5},
}
_RS_HI = {"k1": 1.001, "k2": 0.01, "k3": 0.01}  # verl's presets: geo RS 0.999_1.001, k3 RS 0.01


def kind_defaults(kind: str) -> dict[str, object]:
    """The keys ``kind`` reads besides ``kind`` and ``mode``, with their defaults (§14.1)."""
    return dict(_KEYS[kind] if kind in _KEYS else _CUSTOM[kind].keys)


# --------------------------------------------------------------------------- corrections of your own


@dataclass(frozen=True)
class CustomCorrection:
    """A correction written outside masktrl (docs/METHODS.md "Writing your own rule"):
    ``fn(log_rho, valid, seq_ids, adv, keys) -> (f, keep)``, each [N]: the token's weight
    relative to mu (return ``rho`` itself where it is not changed) and whether it is kept; ``keys``
    the correction keys it reads (a subset of the block's), with their defaults."""

    name: str
    fn: Callable
    keys: dict


_CUSTOM: dict[str, CustomCorrection] = {}  # by the kind that names it: a plain name, or path/to/rules.py:name
_COLLECTING: list[dict[str, CustomCorrection]] = []


def register_correction(name: str, keys: dict | None = None) -> Callable:
    """Decorator: ``fn`` is the correction ``kind: name`` (or, in a file loaded with
    ``--set method.correction.kind=path/to/rules.py:name``, that kind); ``keys``: the block keys
    it reads (cap, floor, lo, hi, stat, weight, delta) with their defaults."""
    check_rule_name("correction", name)
    keys = dict(keys or {})
    unknown = [k for k in keys if k not in _KEY_FIELDS]
    if unknown:
        raise ValueError(f"correction {name!r}: {unknown[0]} is not a correction key; valid: {', '.join(_KEY_FIELDS)}")

    def wrap(fn: Callable) -> Callable:
        target = _COLLECTING[-1] if _COLLECTING else _CUSTOM
        if name in target or (target is _CUSTOM and name in _KEYS):
            raise ValueError(f"correction {name!r} is already registered")
        target[name] = CustomCorrection(name, fn, keys)
        return fn

    return wrap


@contextlib.contextmanager
def collecting_corrections() -> Iterator[dict[str, CustomCorrection]]:
    """The corrections ``register_correction`` registers inside the block, kept apart."""
    scope: dict[str, CustomCorrection] = {}
    _COLLECTING.append(scope)
    try:
        yield scope
    finally:
        _COLLECTING.pop()


def install_correction(kind: str, rule: CustomCorrection) -> None:
    """Make ``rule`` the correction ``kind`` names (a file's rule under its spec string)."""
    _CUSTOM[kind] = rule


def _err(key: str, msg: str) -> ValueError:
    return ValueError(f"method.correction.{key} {msg}")


def _num(key: str, value, *, lo: float = 0.0, strict: bool = False, inf_ok: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _err(key, f"must be a number, got {value!r}")
    if math.isnan(value) or (math.isinf(value) and (not inf_ok or value < 0)):
        raise _err(key, f"must be a finite number{' or inf' if inf_ok else ''}, got {value!r}")
    if value < lo or (strict and value == lo):
        raise _err(key, f"must be {'>' if strict else '>='} {lo:g}, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class CorrectionParams:
    """The ``method.correction`` block (docs/METHODS.md §14.1). Keys left null take the kind's
    default; a key the kind does not read is an error naming it."""

    kind: str = "none"
    """none | token-tis | seq-tis | token-mis | seq-mis | icepop | rs | opsm."""
    mode: str = "bypass"
    """bypass (mu is the method's anchor, no extra forward) | decoupled (pi_old recomputed, one extra forward)."""
    cap: float | None = None
    """token-tis, seq-tis: truncate the weight at cap (C > 0; inf = no truncation). Default 2.0."""
    floor: float | None = None
    """token-tis, seq-tis: raise the weight to at least floor (TRL clip_min, OpenRLHF's lower bound); null = none."""
    lo: float | None = None
    """token-mis, seq-mis, icepop: keep iff lo <= ratio <= hi; rs k1 stats: lower ratio bound (default 1/hi)."""
    hi: float | None = None
    """token-mis, seq-mis, icepop: upper end of the kept range (inf allowed); rs: the threshold."""
    stat: str | None = None
    """seq-mis: product | geometric (the sequence ratio); rs: one of verl's
    token_k*, seq_sum_k*, seq_mean_k*, seq_max_k2/3."""
    weight: str | None = None
    """seq-mis: token (rho_t on kept tokens) | sequence (the sequence ratio R, TRL's sequence_mask)."""
    delta: float | None = None
    """opsm: mask a sequence with A < 0 whose mean log(mu/pi) exceeds delta (>= 0; inf = off). Default 0.5."""
    ref: str | None = None
    """The ratio kinds: old (rho = pi_old/mu, the anchors' definition; in bypass mode one extra forward)
    | current (bypass only: rho = sg(pi)/mu, masktrl's own variant; verl's bypass convention for rs).
    Default old, except rs in bypass mode: current."""
    denominator: str | None = None
    """all (rejected tokens stay in the aggregate's denominator) | kept (they leave it, as verl's
    ``modified_response_mask``). Default all."""

    def __post_init__(self) -> None:
        if self.kind not in CORRECTION_KINDS and self.kind not in _CUSTOM:
            raise _err(
                "kind", f"must be one of {', '.join(CORRECTION_KINDS)} (or path/to/rules.py:name); got {self.kind!r}"
            )
        if self.mode not in CORRECTION_MODES:
            raise _err("mode", f"must be one of {', '.join(CORRECTION_MODES)}; got {self.mode!r}")
        _check_ref_and_denominator(self)
        keys = kind_defaults(self.kind)
        for f in fields(self):
            if f.name in ("kind", "mode", "ref", "denominator") or getattr(self, f.name) is None or f.name in keys:
                continue
            valid = ", ".join(keys) or "none"
            raise _err(f.name, f"does not apply to kind={self.kind} (its keys: {valid})")
        r = self.resolved
        if self.kind in ("token-tis", "seq-tis"):
            _num("cap", r["cap"], strict=True)
            if r["floor"] is not None:
                _num("floor", r["floor"], inf_ok=False)
                if r["floor"] > r["cap"]:
                    raise _err("floor", f"must be <= cap = {r['cap']:g}, got {r['floor']!r}")
        if self.kind in ("token-mis", "seq-mis", "icepop"):
            _range(r["lo"], r["hi"])
        if self.kind == "seq-mis":
            if r["stat"] not in SEQ_STATS:
                raise _err("stat", f"must be one of {', '.join(SEQ_STATS)} for kind=seq-mis; got {r['stat']!r}")
            if r["weight"] not in SEQ_WEIGHTS:
                raise _err("weight", f"must be one of {', '.join(SEQ_WEIGHTS)}; got {r['weight']!r}")
        if self.kind == "rs":
            if r["stat"] not in RS_STATS:
                raise _err("stat", f"must be one of {', '.join(RS_STATS)} for kind=rs; got {r['stat']!r}")
            if r["stat"].endswith("k1"):
                _range(r["lo"], r["hi"])
            else:
                if self.lo is not None:
                    raise _err("lo", f"applies only to the k1 statistics of kind=rs, got stat={r['stat']}")
                _num("hi", r["hi"], strict=True)
        if self.kind == "opsm":
            _num("delta", r["delta"])

    @property
    def resolved(self) -> dict:
        """The kind's keys at their values, defaults filled in (rs: hi from the statistic, k1's lo = 1/hi)."""
        out = {
            k: (getattr(self, k) if getattr(self, k) is not None else v) for k, v in kind_defaults(self.kind).items()
        }
        if self.kind == "rs" and out["stat"] in RS_STATS:
            if out["hi"] is None:
                out["hi"] = _RS_HI[out["stat"][-2:]]
            if (
                out["stat"].endswith("k1")
                and out["lo"] is None
                and isinstance(out["hi"], (int, float))
                and out["hi"] > 0
            ):
                out["lo"] = 1.0 / out["hi"]
        return out

    @property
    def decoupled(self) -> bool:
        return self.mode == "decoupled"

    @property
    def ratio_ref(self) -> str | None:
        """The policy rho is taken from: old | current; None for kinds without a ratio (none, opsm)."""
        if self.kind not in RATIO_KINDS:
            return None
        if self.ref is not None:
            return self.ref
        return "current" if self.kind == "rs" and not self.decoupled else "old"

    @property
    def needs_old(self) -> bool:
        """Whether the update needs pi_old from the extra forward (decoupled mode, or a ratio on pi_old)."""
        return self.decoupled or self.ratio_ref == "old"

    @property
    def drops_rejected(self) -> bool:
        """Whether rejected tokens leave the aggregate's denominator (``denominator: kept``)."""
        return self.denominator == "kept"

    def describe(self) -> dict:
        """kind, mode, the ratio's policy (ratio kinds), the denominator (when kept) and the resolved keys."""
        out: dict = {"kind": self.kind, "mode": self.mode}
        if self.ratio_ref is not None:
            out["ref"] = self.ratio_ref
        if self.drops_rejected:
            out["denominator"] = "kept"
        return {**out, **self.resolved}

    @property
    def active(self) -> bool:
        """False only for kind=none in bypass mode: then the correction is exactly the identity."""
        return self.kind != "none" or self.decoupled


def _check_ref_and_denominator(p: CorrectionParams) -> None:
    if p.ref is not None:
        if p.ref not in CORRECTION_REFS:
            raise _err("ref", f"must be one of {', '.join(CORRECTION_REFS)}; got {p.ref!r}")
        if p.kind not in RATIO_KINDS:
            raise _err("ref", f"does not apply to kind={p.kind} (it applies to {', '.join(RATIO_KINDS)})")
        if p.ref == "current" and p.mode == "decoupled":
            raise _err("ref", "current applies to mode=bypass only (decoupled mode takes the ratio against pi_old)")
    if p.denominator is not None:
        if p.denominator not in CORRECTION_DENOMINATORS:
            raise _err("denominator", f"must be one of {', '.join(CORRECTION_DENOMINATORS)}; got {p.denominator!r}")
        if p.denominator == "kept" and p.kind in ("none", "token-tis", "seq-tis"):
            raise _err("denominator", f"kept applies to the kinds that reject tokens, not kind={p.kind}")


_KEY_FIELDS = ("cap", "floor", "lo", "hi", "stat", "weight", "delta")


def _range(lo, hi) -> None:
    _num("lo", lo, inf_ok=False)
    _num("hi", hi, strict=True)
    if lo >= hi:
        raise _err("lo", f"must be < hi (the kept range [lo, hi] is inverted or empty), got lo={lo!r}, hi={hi!r}")


def make_correction(block) -> CorrectionParams:
    """``CorrectionParams`` from a config block (a mapping, None or a ``CorrectionParams``);
    unknown keys raise ValueError naming them."""
    if block is None:
        return CorrectionParams()
    if isinstance(block, CorrectionParams):
        return block
    if not isinstance(block, dict):
        raise ValueError(f"method.correction must be a mapping such as {{kind: token-tis, cap: 2.0}}, got {block!r}")
    valid = [f.name for f in fields(CorrectionParams)]
    for key in block:
        if key not in valid:
            raise _err(str(key), f"is not a correction key; valid: {', '.join(valid)}")
    return CorrectionParams(**block)


# --------------------------------------------------------------------------- weights


class Correction(NamedTuple):
    """Per-token output of ``correction_weights`` ([N] each, detached)."""

    factor: Tensor  # c: what the method's per-token loss is multiplied by (0 where rejected; 1 on invalid tokens)
    keep: Tensor  # bool: the token is kept (True on invalid tokens, which no aggregate counts)
    weight: Tensor  # f * keep: the token's weight relative to mu (the same in both modes); 1 on invalid tokens
    log_rho: Tensor  # log(pi_ref / mu); 0 on invalid tokens


def _seq_sum(x: Tensor, inv: Tensor, g: int) -> Tensor:
    """[G] sum of x [N] over each sequence (x already 0 where it must not count)."""
    return torch.zeros(g, dtype=x.dtype, device=x.device).index_add_(0, inv, x)


def correction_weights(
    p: CorrectionParams,
    behavior_logp: Tensor,
    ref_logp: Tensor,
    seq_ids: Tensor,
    adv: Tensor,
    *,
    current_logp: Tensor | None = None,
) -> Correction:
    """The correction of §14.1 and §14.3 for N tokens.

    behavior_logp [N]: log mu (-inf = invalid token); ref_logp [N]: log pi_ref (pi_old, or the
    current policy under ``ref: current``); seq_ids [N]; adv [N] (opsm reads its sign);
    current_logp [N]: log pi of the current policy, for opsm's KL estimate (default ref_logp).
    Everything is detached and computed in the promoted dtype of the log-probabilities.
    """
    dt = torch.promote_types(behavior_logp.dtype, ref_logp.dtype)
    mu = behavior_logp.detach().to(dt)
    ref = ref_logp.detach().to(dt)
    valid = mu > float("-inf")  # [N]
    zero = torch.zeros_like(mu)
    log_rho = torch.where(valid, ref - torch.where(valid, mu, zero), zero)  # [N]; -inf where pi_ref = 0
    rho = log_rho.exp()  # [N]
    inv, g = seq_index_from_ids(seq_ids)
    r = p.resolved
    keep = torch.ones_like(valid)
    f = rho  # the weight relative to mu; rho unless the kind truncates or re-weights
    seq_level = False  # f is a per-sequence weight (not rho_t)
    if p.kind in ("token-tis", "seq-tis"):
        if p.kind == "seq-tis":
            f = _seq_sum(log_rho, inv, g).exp()[inv]  # [N] prod rho over the sequence, in log space
            seq_level = True
        f = f.clamp(min=r["floor"], max=r["cap"])
    elif p.kind in ("token-mis", "icepop"):
        keep = (rho >= r["lo"]) & (rho <= r["hi"])
    elif p.kind == "seq-mis":
        total = _seq_sum(log_rho, inv, g)  # [G]
        if r["stat"] == "geometric":
            total = total / _seq_sum(valid.to(dt), inv, g).clamp_min(1.0)
        log_lo = math.log(r["lo"]) if r["lo"] > 0 else float("-inf")
        keep = ((total >= log_lo) & (total <= math.log(r["hi"])))[inv]
        if r["weight"] == "sequence":
            f, seq_level = total.exp()[inv], True
    elif p.kind == "rs":
        keep = _rs_keep(r["stat"], r["lo"], r["hi"], log_rho, valid, inv, g)
    elif p.kind in _CUSTOM:  # a correction of the user's own
        f, keep = _CUSTOM[p.kind].fn(log_rho, valid, seq_ids, adv.detach(), r)
        keep = keep.to(torch.bool)
    elif p.kind == "opsm":
        cur = ref if current_logp is None else current_logp.detach().to(dt)
        k1 = torch.where(valid, torch.where(valid, mu, zero) - cur, zero)  # log mu - log pi, 0 on invalid
        kl = _seq_sum(k1, inv, g) / _seq_sum(valid.to(dt), inv, g).clamp_min(1.0)  # [G] mean over valid tokens
        keep = ~((adv.detach() < 0) & (kl[inv] > r["delta"]))
    keep = keep | ~valid
    one = torch.ones_like(mu)
    weight = torch.where(valid, torch.where(keep, f, zero), one)
    if p.decoupled:
        factor = weight
    elif f is rho:  # the method's ratio already carries rho: a pure mask
        factor = keep.to(dt)
    else:
        ratio = torch.where((rho > 0) & torch.isfinite(rho), f / rho, one)  # rho = 0: the method's weight is 0 anyway
        if not seq_level:
            ratio = torch.where(f == rho, one, ratio)  # not truncated: exactly 1
        factor = torch.where(valid, torch.where(keep, ratio, zero), one)
    return Correction(factor, keep, weight, log_rho)


def seq_index_from_ids(seq_ids: Tensor) -> tuple[Tensor, int]:
    """inv [N] (dense sequence index of each token) and the number of sequences G."""
    uniq, inv = torch.unique(seq_ids, return_inverse=True)
    return inv, uniq.shape[0]


def _rs_keep(stat: str, lo: float | None, hi: float, log_rho: Tensor, valid: Tensor, inv: Tensor, g: int) -> Tensor:
    """[N] bool: verl's rejection rule (``compute_rollout_rejection_mask``) for one option.

    With l = clamp(log rho, -20, 20): k1 = -l, k2 = l^2 / 2, k3 = exp(l) - 1 - l per token; a
    seq_sum / seq_mean / seq_max statistic sums / averages / maxes them over the valid tokens of
    a sequence. k1 statistics are kept iff log(lo) <= stat <= log(hi), the others iff stat <= hi.
    """
    dt = log_rho.dtype
    lr = log_rho.clamp(-RS_LOG_BOUND, RS_LOG_BOUND)
    k = {"k1": -lr, "k2": 0.5 * lr * lr, "k3": torch.expm1(lr) - lr}[stat[-2:]]  # [N]
    k = torch.where(valid, k, torch.zeros_like(k))
    if stat.startswith("token"):
        s = k
    elif stat.startswith("seq_sum"):
        s = _seq_sum(k, inv, g)[inv]
    elif stat.startswith("seq_mean"):
        s = (_seq_sum(k, inv, g) / _seq_sum(valid.to(dt), inv, g).clamp_min(1.0))[inv]
    else:  # seq_max of k2 or k3 (both >= 0, so the 0 start and the 0 on invalid tokens never win; verl: 0 when empty)
        s = torch.zeros(g, dtype=dt, device=k.device).scatter_reduce_(0, inv, k, "amax")[inv]
    if stat.endswith("k1"):
        log_lo = math.log(lo) if lo > 0 else float("-inf")
        return (s >= log_lo) & (s <= math.log(hi))
    return s <= hi


# --------------------------------------------------------------------------- decoupled batch and application


def decoupled_batch(batch: TokenBatch, old_logp: Tensor, old_topk_logp: Tensor) -> TokenBatch:
    """The method's batch in decoupled mode: the anchor (``behavior_logp`` / ``topk_behavior_logp``)
    is pi_old at the sampled and the behaviour's top-K ids ([N], [N, K], detached, from the
    trainer's extra forward); the list ids stay mu's. Tokens invalid under mu stay invalid."""
    if old_logp.shape != batch.behavior_logp.shape or old_topk_logp.shape != batch.topk_behavior_logp.shape:
        raise ValueError(
            f"pi_old log-probabilities must have shapes [N] = {list(batch.behavior_logp.shape)} and "
            f"[N, K] = {list(batch.topk_behavior_logp.shape)}, got "
            f"{list(old_logp.shape)}, {list(old_topk_logp.shape)}"
        )
    valid = batch.valid
    old = torch.where(valid, old_logp.detach().to(batch.behavior_logp.dtype), batch.behavior_logp)
    return replace(
        batch, behavior_logp=old, topk_behavior_logp=old_topk_logp.detach().to(batch.topk_behavior_logp.dtype)
    )


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the incoming gradient by ``c`` (detached)."""

    @staticmethod
    def forward(ctx, x: Tensor, c: Tensor) -> Tensor:
        ctx.save_for_backward(c)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (c,) = ctx.saved_tensors
        return grad * c, None


def scale_loss(loss: Tensor, factor: Tensor) -> Tensor:
    """[N] value loss * factor; the gradient is left to the caller (``corrected_token_losses``
    scales it where it enters log pi)."""
    return loss.detach() * factor + (loss - loss.detach())


def corrected_token_losses(
    method,
    batch: TokenBatch,
    advantages: Tensor,
    params,
    correction: CorrectionParams,
    *,
    old_logp: Tensor | None = None,
    old_topk_logp: Tensor | None = None,
    u: Tensor | None = None,
):
    """(TokenLosses, Correction | None, the batch the method saw): ``method``'s token losses with
    ``correction`` applied (§14.3).

    ``batch`` carries mu as its behaviour; decoupled mode needs ``old_logp`` [N] and
    ``old_topk_logp`` [N, K] (pi_old at the sampled and list ids) and runs the method on
    ``decoupled_batch``. The loss value is l * c; its gradient is c * dl/dlog pi, applied where
    the gradient enters log pi (every method's token loss depends on log pi only through its own
    token), so a factor of exactly 1 leaves every bit of the gradient unchanged. ``mask`` also
    marks the rejected tokens. ``kind=none`` in bypass mode returns the method's output as is.
    """
    if not correction.active:
        return method.token_losses(batch, advantages, params, u=u), None, batch
    if correction.decoupled and (old_logp is None or old_topk_logp is None):
        raise ValueError(
            "method.correction.mode=decoupled needs pi_old (old_logp, old_topk_logp) from the extra forward"
        )
    if correction.needs_old and old_logp is None:
        raise ValueError(
            f"method.correction.kind={correction.kind} with ref=old needs pi_old (old_logp) from the extra forward"
        )
    ref = old_logp if correction.needs_old else batch.logp.detach()
    corr = correction_weights(
        correction, batch.behavior_logp, ref, batch.seq_ids, advantages.detach(), current_logp=batch.logp.detach()
    )
    kb = decoupled_batch(batch, old_logp, old_topk_logp) if correction.decoupled else batch
    logp = batch.logp
    if logp.requires_grad:
        logp = _ScaleGrad.apply(logp, corr.factor.to(logp.dtype))
    kb = replace(kb, logp=logp)
    out = method.token_losses(kb, advantages, params, u=u)
    loss = scale_loss(out.loss, corr.factor.to(out.loss.dtype))
    return out._replace(loss=loss, mask=out.mask | ~corr.keep), corr, kb


def kept_batch(batch: TokenBatch, corr: Correction | None) -> TokenBatch:
    """``batch`` with the rejected tokens made invalid (log mu = -inf), for the aggregation and its
    denominator under ``denominator: kept`` (verl's ``modified_response_mask``); ``batch`` itself
    without a correction."""
    if corr is None:
        return batch
    return replace(
        batch,
        behavior_logp=torch.where(corr.keep, batch.behavior_logp, torch.full_like(batch.behavior_logp, float("-inf"))),
    )


def correction_diagnostics(corr: Correction | None, batch: TokenBatch) -> dict:
    """Per-step metrics (§14.4) over the valid tokens: ``corr_keep_frac`` (kept / valid) and
    ``corr_weight_mean`` (mean weight relative to mu, 0 on rejected tokens); {} without a correction."""
    if corr is None:
        return {}
    valid = batch.valid
    n = int(valid.sum())
    if n == 0:
        return {}
    return {
        "corr_keep_frac": float(corr.keep[valid].to(torch.float64).mean()),
        "corr_weight_mean": float(corr.weight[valid].to(torch.float64).mean()),
    }


__all__ = [
    "CORRECTION_DENOMINATORS",
    "CORRECTION_KINDS",
    "CORRECTION_MODES",
    "CORRECTION_REFS",
    "RATIO_KINDS",
    "kept_batch",
    "Correction",
    "CorrectionParams",
    "CustomCorrection",
    "RS_STATS",
    "correction_diagnostics",
    "kind_defaults",
    "register_correction",
    "correction_weights",
    "corrected_token_losses",
    "decoupled_batch",
    "make_correction",
    "scale_loss",
]
