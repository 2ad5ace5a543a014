"""One frozen, validated parameter dataclass per method (names as on the command line).

Every class shares a small read-only protocol used by the registry (``registry.Method``):
``agg_mode``, ``advantage_norm``, ``uses_dynamic_sampling``, ``uses_u``, ``overlong`` and
``diag_deltas``. Formulas and defaults: docs/METHODS.md (§3 and §4 for the thresholds).
Validation errors are ``ValueError`` naming the field, e.g.
"method.eps_low must be >= 0, got -1".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from masktrl.methods.advantages import ADV_NORMS
from masktrl.methods.aggregation import AGG_MODES
from masktrl.methods.divergence import DIVERGENCE_KINDS, RATE_KINDS, TAILS
from masktrl.methods.regularizers import RegularizerParams, check_regularizers

SIS_BASES = ("grpo", "dapo", "gspo")
PDM_TAILS = TAILS + (
    "bracket",
    "exact",
)  # bracket: the certified-sign mask (§4.6); exact: the top-K KL's own Ḋ (§4.7); kl only
UNCERTAIN = ("keep", "mask")
DELTA_TV = 0.15  # TV divergences (public DPPO example)
DELTA_KL = 0.15  # top-K KL and PDM-KL: the predictive-mask paper's main value (0.05 was its sensitivity study)
DELTA_BINARY_KL = 0.05  # binary KL: the public DPPO example's value; binary KL <= top-K KL (§3)
DELTA_DIAG = 0.15  # the diagnostics' D > delta threshold for methods without their own


# --------------------------------------------------------------------------- field checks


def _number(name: str, value, *, lo: float | None = None, hi: float | None = None, inf_ok: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"method.{name} must be a number, got {value!r}")
    if math.isnan(value) or (math.isinf(value) and not inf_ok):
        raise ValueError(f"method.{name} must be finite, got {value!r}")
    if lo is not None and value < lo:
        raise ValueError(f"method.{name} must be >= {lo:g}, got {value!r}")
    if hi is not None and value > hi:
        raise ValueError(f"method.{name} must be <= {hi:g}, got {value!r}")


def _choice(name: str, value, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"method.{name} must be one of {', '.join(choices)}; got {value!r}")


def _flag(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"method.{name} must be true or false, got {value!r}")


def _eps(p) -> None:
    _number("eps_low", p.eps_low, lo=0, hi=1)
    _number("eps_high", p.eps_high, lo=0, inf_ok=True)


def _dual_clip(p) -> None:
    if p.dual_clip is not None:
        _number("dual_clip", p.dual_clip, inf_ok=True)
        if p.dual_clip <= 1:
            raise ValueError(f"method.dual_clip must be > 1 (or null for none), got {p.dual_clip!r}")


def _common(p) -> None:
    _choice("loss_agg", p.loss_agg, AGG_MODES)
    _flag("dynamic_sampling", p.dynamic_sampling)
    _choice("adv_norm", p.adv_norm, ADV_NORMS)
    check_regularizers(p)  # the reference KL and entropy fields every method shares (§13)


def _deltas(p) -> None:
    for name in ("delta_pos", "delta_neg"):
        if getattr(p, name) is not None:
            _number(name, getattr(p, name), lo=0, inf_ok=True)
    if p.ratio_cap is not None:
        _number("ratio_cap", p.ratio_cap, lo=0, inf_ok=True)
        if p.ratio_cap == 0:
            raise ValueError("method.ratio_cap must be > 0 (or null for no cap), got 0")


def default_delta(kind: str) -> float:
    """The default threshold for a divergence kind (§3): 0.15, except 0.05 for binary-kl."""
    return DELTA_BINARY_KL if kind == "binary-kl" else DELTA_TV if kind.endswith("tv") else DELTA_KL


def _resolve_deltas(p, kind: str) -> tuple[float, float]:
    default = default_delta(kind)
    pos = default if p.delta_pos is None else float(p.delta_pos)
    neg = default if p.delta_neg is None else float(p.delta_neg)
    return pos, neg


class _Protocol(RegularizerParams):
    """Read-only answers the registry asks of any params object; its only fields are the
    regularisers every method shares (``RegularizerParams``: kl_coef, kl_estimator, kl_in,
    kl_is_correction, entropy_coef; keyword-only, listed after the method's own)."""

    @property
    def agg_mode(self) -> str:
        return self.loss_agg

    @property
    def advantage_norm(self) -> str:
        return self.adv_norm

    @property
    def uses_dynamic_sampling(self) -> bool:
        return self.dynamic_sampling

    @property
    def uses_u(self) -> bool:
        return False

    @property
    def uses_full_pi(self) -> bool:
        """Whether the kernel needs TokenBatch.pi_sq_sum from the trainer's full pi (pdm tail=exact)."""
        return False

    @property
    def overlong(self) -> tuple[int, float]:
        """(buffer tokens, max penalty) of DAPO's soft overlong punishment; (0, 0.0) = off."""
        return 0, 0.0

    @property
    def diag_deltas(self) -> tuple[float, float]:
        """(delta_pos, delta_neg) for the diagnostics' D > delta fraction (0.15 without own thresholds)."""
        return DELTA_DIAG, DELTA_DIAG


@dataclass(frozen=True, kw_only=True)
class MethodParams(_Protocol):
    """The base of a rule's params written outside masktrl (docs/METHODS.md "Writing your own
    rule"): the fields every method shares, keyword-only after the rule's own. A subclass that
    defines ``__post_init__`` calls ``super().__post_init__()`` so these are checked too."""

    loss_agg: str = "token-mean"
    """Batch aggregation (§8): seq-mean-token-mean | token-mean | seq-mean-token-sum-norm."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal and refill the batch (DAPO)."""
    adv_norm: str = "group-std"
    """Advantages (§11, §13.4): group-std (GRPO) | none (Dr.GRPO) | rloo | batch-std | reinforce++[-baseline]."""

    def __post_init__(self) -> None:
        _common(self)


def check_number(name: str, value, *, lo: float | None = None, hi: float | None = None, inf_ok: bool = False) -> None:
    """ValueError "method.NAME must be ..." unless ``value`` is a number in [lo, hi] (finite unless ``inf_ok``)."""
    _number(name, value, lo=lo, hi=hi, inf_ok=inf_ok)


# --------------------------------------------------------------------------- methods


@dataclass(frozen=True)
class GRPOParams(_Protocol):
    """GRPO: PPO clip with clip-higher (docs/METHODS.md §2)."""

    eps_low: float = 0.2
    """Ratios w < 1 - eps_low are clipped (masked) when A < 0."""
    eps_high: float = 0.28
    """Ratios w > 1 + eps_high are clipped (masked) when A > 0 (clip-higher)."""
    dual_clip: float | None = None
    """Dual-clip bound c > 1 for A < 0: the loss is capped at -A c, so tokens with w > c are blocked
    (verl's clip_ratio_c, default 3.0 there; null = no dual clip, §2)."""
    loss_agg: str = "seq-mean-token-mean"
    """Batch aggregation (§8): seq-mean-token-mean | token-mean | seq-mean-token-sum-norm."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal and refill the batch (DAPO)."""
    adv_norm: str = "group-std"
    """Advantages (§11, §13.4): group-std (GRPO) | none (Dr.GRPO) | rloo | batch-std | reinforce++[-baseline]."""

    def __post_init__(self) -> None:
        _eps(self)
        _dual_clip(self)
        _common(self)


@dataclass(frozen=True)
class DAPOParams(_Protocol):
    """DAPO: GRPO's per-token loss, token-mean aggregation, dynamic sampling, overlong shaping."""

    eps_low: float = 0.2
    """Ratios w < 1 - eps_low are clipped (masked) when A < 0."""
    eps_high: float = 0.28
    """Ratios w > 1 + eps_high are clipped (masked) when A > 0 (clip-higher)."""
    dual_clip: float | None = None
    """Dual-clip bound c > 1 for A < 0: the loss is capped at -A c, so tokens with w > c are blocked
    (verl's clip_ratio_c, default 3.0 there; null = no dual clip, §2)."""
    loss_agg: str = "token-mean"
    """Batch aggregation (§8); DAPO's own is token-mean."""
    dynamic_sampling: bool = True
    """Drop groups whose rewards are all equal and refill the batch."""
    adv_norm: str = "group-std"
    """Advantages (§11, §13.4): group-std (GRPO) | none (Dr.GRPO) | rloo | batch-std | reinforce++[-baseline]."""
    overlong_buffer: int = 0
    """Soft overlong punishment: length of the buffer before max_new_tokens, in tokens (0 = off)."""
    overlong_penalty: float = 1.0
    """Reward penalty at (and beyond) max_new_tokens; it ramps up linearly over the buffer."""

    def __post_init__(self) -> None:
        _eps(self)
        _dual_clip(self)
        _common(self)
        if (
            isinstance(self.overlong_buffer, bool)
            or not isinstance(self.overlong_buffer, int)
            or self.overlong_buffer < 0
        ):
            raise ValueError(f"method.overlong_buffer must be an int >= 0, got {self.overlong_buffer!r}")
        _number("overlong_penalty", self.overlong_penalty, lo=0)

    @property
    def overlong(self) -> tuple[int, float]:
        return self.overlong_buffer, float(self.overlong_penalty)


@dataclass(frozen=True)
class GSPOParams(_Protocol):
    """GSPO: sequence-level ratio s = exp(mean log w), sequence clip (§5)."""

    eps_low: float = 3e-4
    """Sequences with s < 1 - eps_low are clipped (masked) when A < 0."""
    eps_high: float = 4e-4
    """Sequences with s > 1 + eps_high are clipped (masked) when A > 0."""
    loss_agg: str = "seq-mean-token-mean"
    """Batch aggregation (§8)."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal and refill the batch (DAPO)."""
    adv_norm: str = "group-std"
    """Advantages (§11, §13.4): group-std (GRPO) | none (Dr.GRPO) | rloo | batch-std | reinforce++[-baseline]."""

    def __post_init__(self) -> None:
        _eps(self)
        _common(self)


@dataclass(frozen=True)
class DPPOParams(_Protocol):
    """DPPO: mask = D > delta(A) and sign(A (r - 1)) > 0; loss -A (1 - mask) sg(w) pi_k/sg(pi_k) (§3)."""

    divergence: str = "topk-kl"
    """D(mu||pi): binary-tv | binary-kl | topk-tv | topk-kl."""
    delta_pos: float | None = None
    """Threshold for A > 0; null = 0.15 (topk-kl, topk-tv, binary-tv), 0.05 (binary-kl). inf masks nothing."""
    delta_neg: float | None = None
    """Threshold for A <= 0; null = 0.15 (topk-kl, topk-tv, binary-tv), 0.05 (binary-kl)."""
    ratio_cap: float | None = None
    """Truncate the weight w = min(r, ratio_cap); null = no cap."""
    rule: str = "union"
    """Top-K support when k is outside the list: union (append k) | replace_last (adapters)."""
    loss_agg: str = "token-mean"
    """Batch aggregation (§8); the public DPPO script uses seq-mean-token-sum-norm."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal and refill the batch (DAPO)."""
    adv_norm: str = "group-std"
    """Advantages (§11, §13.4): group-std (GRPO) | none (Dr.GRPO) | rloo | batch-std | reinforce++[-baseline]."""

    def __post_init__(self) -> None:
        _choice("divergence", self.divergence, DIVERGENCE_KINDS)
        _choice("rule", self.rule, ("union", "replace_last"))
        _deltas(self)
        _common(self)

    @property
    def deltas(self) -> tuple[float, float]:
        """Resolved (delta_pos, delta_neg)."""
        return _resolve_deltas(self, self.divergence)

    @property
    def diag_deltas(self) -> tuple[float, float]:
        return self.deltas


@dataclass(frozen=True)
class PDMParams(_Protocol):
    """Predictive divergence mask: mask = D > delta(A) and sign(A Ddot) > 0; DPPO's loss (§4)."""

    divergence: str = "kl"
    """kl | tv: the top-K divergence (union support) and its Ddot."""
    tail: str = "agg"
    """Tail of Ddot: agg (one bucket, no vocab size needed) | uniform (spread over |V|-|S| tokens) |
    bracket (kl only: mask only where the bracket of §4.4 fixes the sign of the full-vocabulary
    Ddot_KL, computed from the list's own mu values; it does not bound the top-K KL's Ddot, and with
    lists recorded by another engine it holds beyond that engine's error in mu, §4.6) | exact (kl
    only: the exact Ddot of the top-K KL the mask uses, from the trainer's full pi, §4.7)."""
    uncertain: str | None = None
    """tail=bracket only: keep | mask a token (D > delta) whose bracket straddles 0; null = keep."""
    delta_pos: float | None = None
    """Threshold for A > 0; null = 0.15 (kl and tv; the paper's main value)."""
    delta_neg: float | None = None
    """Threshold for A <= 0; null = 0.15 (kl and tv)."""
    ratio_cap: float | None = None
    """Truncate the weight w = min(r, ratio_cap); null = no cap."""
    loss_agg: str = "token-mean"
    """Batch aggregation (§8)."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal and refill the batch (DAPO)."""
    adv_norm: str = "group-std"
    """Advantages (§11, §13.4): group-std (GRPO) | none (Dr.GRPO) | rloo | batch-std | reinforce++[-baseline]."""

    def __post_init__(self) -> None:
        _choice("divergence", self.divergence, RATE_KINDS)
        _choice("tail", self.tail, PDM_TAILS)
        if self.tail == "bracket" and self.divergence != "kl":
            raise ValueError(
                f"method.tail=bracket requires method.divergence=kl (the bracket bounds Ddot_KL), got {self.divergence}"
            )
        if self.tail == "exact" and self.divergence != "kl":
            raise ValueError(
                "method.tail=exact requires method.divergence=kl (the exact Ddot of the top-K KL), "
                f"got {self.divergence}"
            )
        if self.uncertain is not None:
            _choice("uncertain", self.uncertain, UNCERTAIN)
            if self.tail != "bracket":
                raise ValueError(f"method.uncertain applies only with method.tail=bracket, got tail={self.tail}")
        _deltas(self)
        _common(self)

    @property
    def uses_full_pi(self) -> bool:
        return self.tail == "exact"

    @property
    def uncertain_rule(self) -> str:
        """What tail=bracket does where the bracket does not fix the sign: keep (default) | mask."""
        return self.uncertain or "keep"

    @property
    def deltas(self) -> tuple[float, float]:
        return _resolve_deltas(self, self.divergence)

    @property
    def diag_deltas(self) -> tuple[float, float]:
        return self.deltas


_BASE_PARAMS = {"grpo": GRPOParams, "dapo": DAPOParams, "gspo": GSPOParams}


@dataclass(frozen=True)
class SISParams(_Protocol):
    """SIS on a base objective: accepted tokens get weight pi_k/sg(pi_k) = 1 (§6). Needs ``u``.

    Fields left null take the base method's default.
    """

    base: str = "grpo"
    """Base objective: grpo | dapo | gspo."""
    eps_low: float | None = None
    """The base's eps_low (null = the base's default)."""
    eps_high: float | None = None
    """The base's eps_high (null = the base's default)."""
    dual_clip: float | None = None
    """The base's dual-clip bound (grpo or dapo only; null = none)."""
    loss_agg: str | None = None
    """Batch aggregation (null = the base's)."""
    dynamic_sampling: bool | None = None
    """Dynamic sampling (null = the base's: true for dapo)."""
    overlong_buffer: int | None = None
    """DAPO soft overlong buffer in tokens (null = the base's; only with base dapo)."""
    overlong_penalty: float | None = None
    """DAPO overlong penalty (null = the base's; only with base dapo)."""
    adv_norm: str | None = None
    """Advantages (§11, §13.4): group-std | none | rloo | batch-std | reinforce++[-baseline]; null: the base's."""
    k: int | None = None
    """Envelope list size: re-cut the stored behaviour lists to their first k entries for the
    envelope and the acceptance test (§6.2); null = the stored K. At most rollout.logprobs_k."""

    def __post_init__(self) -> None:
        _choice("base", self.base, SIS_BASES)
        if self.k is not None and (isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1):
            raise ValueError(f"method.k must be an integer >= 1 or null, got {self.k!r}")
        if self.base == "gspo" and self.dual_clip is not None:
            raise ValueError("method.dual_clip applies only with method.base=grpo or dapo, got base=gspo")
        if self.base != "dapo":
            for name in ("overlong_buffer", "overlong_penalty"):
                if getattr(self, name) is not None:
                    raise ValueError(f"method.{name} applies only with method.base=dapo, got base={self.base}")
        self.base_params  # noqa: B018  validates every override through the base class
        check_regularizers(self)  # the regularisers are the sis method's own, not its base's

    @property
    def base_params(self):
        """The base method's params with this method's overrides applied (validated)."""
        overrides = {
            k: getattr(self, k)
            for k in (
                "eps_low",
                "eps_high",
                "dual_clip",
                "loss_agg",
                "dynamic_sampling",
                "overlong_buffer",
                "overlong_penalty",
                "adv_norm",
            )
            if getattr(self, k) is not None
        }
        return _BASE_PARAMS[self.base](**overrides)

    @property
    def agg_mode(self) -> str:
        return self.base_params.loss_agg

    @property
    def advantage_norm(self) -> str:
        return self.base_params.adv_norm

    @property
    def uses_dynamic_sampling(self) -> bool:
        return self.base_params.dynamic_sampling

    @property
    def uses_u(self) -> bool:
        return True

    @property
    def overlong(self) -> tuple[int, float]:
        return self.base_params.overlong


# --------------------------------------------------------------------------- CISPO (MiniMax-M1)


@dataclass(frozen=True)
class CISPOParams(_Protocol):
    """CISPO: l = -sg(clip(r, 1-eps_low, 1+eps_high)) A log pi on every token (§15)."""

    eps_low: float = 1.0
    """Lower clip of the IS weight at 1 - eps_low; 1.0 = no lower bound (MiniMax-M1 sets it large)."""
    eps_high: float = 4.0
    """Upper clip of the IS weight at 1 + eps_high; 4.0 = a cap of 5 (TRL's recommended epsilon_high for cispo)."""
    loss_agg: str = "token-mean"
    """Batch aggregation (§8); MiniMax-M1 normalises by the batch's token count."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal and refill the batch (DAPO)."""
    adv_norm: str = "group-std"
    """Advantages (§11, §13.4): group-std (GRPO) | none (Dr.GRPO) | rloo | batch-std | reinforce++[-baseline]."""

    def __post_init__(self) -> None:
        _eps(self)
        _common(self)
