"""The method registry (verl-style): one decorator, one ``get_method`` whose error lists the names.

A method is a kernel ``(batch, advantages, params, u) -> TokenLosses`` plus its params
dataclass. ``Method.bind(params, correction)`` gives a ``BoundMethod``: the method with its
params and its off-policy correction (docs/METHODS.md §14), whose queries take no params. The
trainer asks it everything method-specific (advantages, aggregation and its denominator, dynamic
sampling, whether it needs ``u``, reward shaping), so no ``if method == ...`` chain and no
aggregation mode is named outside this package. Formulas: docs/METHODS.md.

A rule written in a user's file uses the same decorator; ``collecting()`` gathers the methods a
file registers without adding them to the shipped names (``masktrl.method_spec`` loads files).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from masktrl.methods.advantages import group_advantages
from masktrl.methods.aggregation import (
    HORIZON_MODES,
    aggregate,
    aggregate_denominator,
    aggregate_denominator_from_counts,
    check_horizon,
)
from masktrl.methods.batch import TokenBatch, check_rule_name
from masktrl.methods.corrections import Correction, CorrectionParams, corrected_token_losses
from masktrl.methods.regularizers import Regularized, regularize


class TokenLosses(NamedTuple):
    loss: Tensor  # [N] per-token loss (value form of docs/METHODS.md §2-6); 0 on invalid tokens
    mask: Tensor  # [N] bool, the token's update is blocked (clip, divergence mask or invalid)
    divergence: Tensor | None  # [N] D used by the mask (dppo, pdm), detached
    ddot: Tensor | None  # [N] Ddot estimate used by the mask (pdm with tail agg or uniform), detached
    accepted: Tensor | None  # [N] bool, SIS acceptance (sis only)
    log_w: Tensor | None  # [N] per-token log w (SIS-modified where it applies); +inf on invalid
    ddot_lo: Tensor | None = None  # [N] lower end of the Ddot_KL bracket (pdm with tail=bracket)
    ddot_hi: Tensor | None = None  # [N] upper end of the Ddot_KL bracket (pdm with tail=bracket)


Kernel = Callable[[TokenBatch, Tensor, Any, "Tensor | None"], TokenLosses]


def overlong_penalty(response_len, max_len: int, buffer: int, penalty: float):
    """DAPO soft overlong punishment (Yu et al. 2025, Eq. 13): the reward delta for a response.

    0 if len <= max_len - buffer; -(len - (max_len - buffer)) / buffer * penalty inside the
    buffer; -penalty beyond max_len. ``buffer = 0`` turns it off (returns 0). Works on ints,
    floats or tensors of lengths.
    """
    if buffer <= 0:
        return response_len * 0.0
    expected = max_len - buffer
    if isinstance(response_len, Tensor):
        excess = (response_len.to(torch.float64) - expected).clamp(0, buffer)
        return -excess / buffer * penalty
    return -min(max(response_len - expected, 0), buffer) / buffer * penalty


@dataclass(frozen=True)
class Method:
    """A registered method. Every query takes the method's params object."""

    name: str
    params_cls: type
    kernel: Kernel
    help: str

    def make_params(self, **kw):
        """The params dataclass from keyword values; unknown keys raise ValueError naming them."""
        valid = [f.name for f in fields(self.params_cls)]
        for key in kw:
            if key not in valid:
                raise ValueError(f"unknown parameter method.{key} for method {self.name!r}; valid: {', '.join(valid)}")
        return self.params_cls(**kw)

    def _check(self, params) -> None:
        if not isinstance(params, self.params_cls):
            raise ValueError(
                f"params for method {self.name!r} must be {self.params_cls.__name__}, got {type(params).__name__}"
            )

    def aggregation(self, params) -> str:
        """The batch aggregation mode (§8) for ``aggregate``."""
        self._check(params)
        return params.agg_mode

    def aggregate(self, params, loss: Tensor, batch: TokenBatch, *, horizon: int | float) -> Tensor:
        """The scalar batch loss with this method's aggregation (§8).

        ``horizon``: the longest possible response (max new tokens), always given; only the
        constant-horizon mode (seq-mean-token-sum-norm, Dr.GRPO) divides by it.
        """
        mode = self.aggregation(params)
        check_horizon(horizon, mode, "horizon")
        return aggregate(loss, batch, mode, norm_len=horizon if mode in HORIZON_MODES else None)

    def denominator(self, params, valid_counts) -> int:
        """What ``aggregate`` divides by (§8.1), from a ``TokenBatch`` or from the valid-token
        count of each sequence (no forward pass needed): the valid tokens for token-mean, the
        sequences with a valid token otherwise."""
        mode = self.aggregation(params)
        if isinstance(valid_counts, TokenBatch):
            return aggregate_denominator(valid_counts, mode)
        return aggregate_denominator_from_counts(valid_counts, mode)

    def advantages(self, params, rewards, groups, lengths=None) -> Tensor:
        """[B] float64 advantages of B responses (§11) with this method's ``adv_norm``;
        ``groups`` [B] names each response's group (its prompt), ``lengths`` [B] the responses'
        token counts (the batch weights of reinforce++ and reinforce++-baseline; None: 1 each)."""
        self._check(params)
        return group_advantages(rewards, groups, norm=params.advantage_norm, lengths=lengths)

    # ---- regularisers (reference KL, entropy bonus: §13), the same for every method

    def regularize(
        self, params, loss: Tensor, batch: TokenBatch, *, ref_logp: Tensor | None = None, entropy: Tensor | None = None
    ) -> Regularized:
        """``loss`` [N] (``TokenLosses.loss``) plus the in-loss KL and the entropy bonus of
        ``params``; aggregate ``.loss`` with ``aggregate``. Returns ``loss`` itself when both are off."""
        self._check(params)
        return regularize(loss, batch, params, ref_logp=ref_logp, entropy=entropy)

    def needs_reference(self, params) -> bool:
        """Whether the update needs the reference policy's log-probabilities (kl_coef > 0)."""
        self._check(params)
        return params.uses_reference

    def needs_entropy_grad(self, params) -> bool:
        """Whether the policy forward must keep the entropy's gradient (entropy_coef > 0)."""
        self._check(params)
        return params.uses_entropy_grad

    def dynamic_sampling(self, params) -> bool:
        """Whether the trainer drops all-equal-reward groups and refills (DAPO)."""
        self._check(params)
        return params.uses_dynamic_sampling

    def needs_full_pi(self, params) -> bool:
        """Whether ``token_losses`` needs ``TokenBatch.pi_sq_sum`` (sum_V pi^2 of the training
        distribution; pdm tail=exact): the trainer computes it in its forward pass."""
        self._check(params)
        return params.uses_full_pi

    def needs_u(self, params) -> bool:
        """Whether ``token_losses`` needs per-token uniforms ``u`` (SIS)."""
        self._check(params)
        return params.uses_u

    def overlong(self, params) -> tuple[int, float]:
        """(buffer, penalty) of DAPO's overlong shaping; (0, 0.0) when off or not applicable."""
        self._check(params)
        return params.overlong

    def reward_delta(self, params, response_len, max_len: int):
        """The reward shaping delta for a response length (0 for methods without shaping)."""
        buffer, penalty = self.overlong(params)
        return overlong_penalty(response_len, max_len, buffer, penalty)

    def diagnostic_thresholds(self, params) -> tuple[float, float]:
        """(delta_pos, delta_neg) used by ``token_diagnostics`` (the method's own, else top-K KL's)."""
        self._check(params)
        return params.diag_deltas

    def token_losses(
        self, batch: TokenBatch, advantages: Tensor, params=None, *, u: Tensor | None = None
    ) -> TokenLosses:
        """Per-token losses with already-built params (None = defaults)."""
        params = self.params_cls() if params is None else params
        self._check(params)
        adv = check_advantages(advantages, batch)
        if params.uses_u and u is None:
            raise ValueError(f"u is required by method {self.name!r} (per-token uniforms in [0, 1), shape [N])")
        if u is not None:  # seeded streams are drawn on the CPU; every kernel (a user's too) reads u beside the batch
            u = u.to(batch.logp.device)
        return finalize(batch, self.kernel(batch, adv, params, u))

    def bind(self, params=None, correction: CorrectionParams | None = None) -> BoundMethod:
        """This method with its params (None = defaults) and its correction (None = kind none)."""
        params = self.params_cls() if params is None else params
        self._check(params)
        return BoundMethod(self, params, CorrectionParams() if correction is None else correction)


@dataclass(frozen=True)
class BoundMethod:
    """A method bound to its params and its off-policy correction: every query takes no params.

    What the trainer, the rollout collector and the analyses hold (``Config.method.bind()``)."""

    method: Method
    params: Any
    correction: CorrectionParams

    @property
    def name(self) -> str:
        return self.method.name

    @property
    def aggregation(self) -> str:
        """The batch aggregation mode (§8)."""
        return self.params.agg_mode

    @property
    def needs_u(self) -> bool:
        """Whether the token losses need per-token uniforms ``u`` (SIS)."""
        return self.params.uses_u

    @property
    def needs_reference(self) -> bool:
        """Whether the update needs the reference policy's log-probabilities (kl_coef > 0)."""
        return self.params.uses_reference

    @property
    def kl_in_loss(self) -> bool:
        """Whether the reference KL joins the loss (kl_coef > 0 with kl_in=loss)."""
        return self.params.kl_in_loss

    @property
    def needs_entropy_grad(self) -> bool:
        """Whether the policy forward must keep the entropy's gradient (entropy_coef > 0)."""
        return self.params.uses_entropy_grad

    @property
    def needs_full_pi(self) -> bool:
        """Whether the token losses need ``TokenBatch.pi_sq_sum`` (pdm tail=exact)."""
        return self.params.uses_full_pi

    @property
    def dynamic_sampling(self) -> bool:
        """Whether the trainer drops all-equal-reward groups and refills (DAPO)."""
        return self.params.uses_dynamic_sampling

    @property
    def overlong(self) -> tuple[int, float]:
        """(buffer, penalty) of DAPO's overlong shaping; (0, 0.0) when off or not applicable."""
        return self.params.overlong

    @property
    def diagnostic_thresholds(self) -> tuple[float, float]:
        """(delta_pos, delta_neg) used by ``token_diagnostics``."""
        return self.params.diag_deltas

    def advantages(self, rewards, groups, lengths=None) -> Tensor:
        """[B] float64 advantages (§11); see ``Method.advantages``."""
        return self.method.advantages(self.params, rewards, groups, lengths)

    def reward_delta(self, response_len, max_len: int):
        """The reward shaping delta for a response length (0 for methods without shaping)."""
        return self.method.reward_delta(self.params, response_len, max_len)

    def aggregate(self, loss: Tensor, batch: TokenBatch, *, horizon: int | float) -> Tensor:
        """The scalar batch loss with this method's aggregation (§8); see ``Method.aggregate``."""
        return self.method.aggregate(self.params, loss, batch, horizon=horizon)

    def denominator(self, valid_counts) -> int:
        """What ``aggregate`` divides by (§8.1); see ``Method.denominator``."""
        return self.method.denominator(self.params, valid_counts)

    def regularize(
        self, loss: Tensor, batch: TokenBatch, *, ref_logp: Tensor | None = None, entropy: Tensor | None = None
    ) -> Regularized:
        """``loss`` [N] plus the in-loss KL and the entropy bonus (§13)."""
        return self.method.regularize(self.params, loss, batch, ref_logp=ref_logp, entropy=entropy)

    def token_losses(self, batch: TokenBatch, advantages: Tensor, *, u: Tensor | None = None) -> TokenLosses:
        """Per-token losses without the correction (``Method.token_losses``)."""
        return self.method.token_losses(batch, advantages, self.params, u=u)

    def corrected_token_losses(
        self, batch: TokenBatch, advantages: Tensor, *, old: tuple | None = None, u: Tensor | None = None
    ) -> tuple[TokenLosses, Correction | None, TokenBatch]:
        """(token losses with the correction applied, the correction or None, the batch the method
        saw): ``corrections.corrected_token_losses``; ``old``: (log pi_old [N], at the top-K ids
        [N, K]) in decoupled mode."""
        old_logp, old_topk = (None, None) if old is None else old
        return corrected_token_losses(
            self.method, batch, advantages, self.params, self.correction, old_logp=old_logp, old_topk_logp=old_topk, u=u
        )


_METHODS: dict[str, Method] = {}
_COLLECTING: list[dict[str, Method]] = []  # open ``collecting()`` scopes: where registrations go instead


def register_method(name: str, params_cls: type, help: str = "") -> Callable[[Kernel], Kernel]:
    """Decorator: register ``kernel`` under ``name`` with its params dataclass.

    Inside ``collecting()`` (a user's rule file being loaded) the method goes to that scope only."""
    check_rule_name("method", name)

    def wrap(kernel: Kernel) -> Kernel:
        target = _COLLECTING[-1] if _COLLECTING else _METHODS
        if name in target:
            raise ValueError(f"method {name!r} is already registered")
        target[name] = Method(name, params_cls, kernel, help or (kernel.__doc__ or "").strip().split("\n")[0])
        return kernel

    return wrap


@contextlib.contextmanager
def collecting() -> Iterator[dict[str, Method]]:
    """The methods ``register_method`` registers inside the block, by name, kept out of the
    shipped registry (so a user's file may be loaded again, and may reuse a shipped name)."""
    scope: dict[str, Method] = {}
    _COLLECTING.append(scope)
    try:
        yield scope
    finally:
        _COLLECTING.pop()


RESERVED_KEYS = ("name", "correction", "sha256")
"""The method block's own keys (the rule, its correction, its file's hash): no parameter's name."""


def check_method(method: Method) -> str | None:
    """What is wrong with a method's contract, in one phrase, or None: the params class must be a
    frozen dataclass built with no arguments that answers the registry's questions (a subclass of
    ``MethodParams``), the kernel a callable taking (batch, advantages, params, u)."""
    cls = method.params_cls
    if not isinstance(cls, type) or not is_dataclass(cls):
        return f"its params class {getattr(cls, '__name__', cls)!r} is not a dataclass"
    try:
        params = cls()
    except (Exception, SystemExit) as exc:  # a user's class: any error is the answer (sys.exit too)
        return f"its params class {cls.__name__} cannot be built with its defaults ({type(exc).__name__}: {exc})"
    missing = [
        a
        for a in (
            "agg_mode",
            "advantage_norm",
            "uses_dynamic_sampling",
            "uses_u",
            "uses_full_pi",
            "overlong",
            "diag_deltas",
            "uses_reference",
            "uses_entropy_grad",
            "kl_in_loss",
        )
        if not hasattr(params, a)
    ]
    if missing:
        return (
            f"its params class {cls.__name__} lacks {', '.join(missing)} (derive it from masktrl.methods.MethodParams)"
        )
    reserved = [f.name for f in fields(cls) if f.name in RESERVED_KEYS]
    if reserved:
        return (
            f"its params class {cls.__name__} has a field {reserved[0]!r}, a key the method block keeps for "
            f"itself (method.{reserved[0]}); give the parameter another name"
        )
    if not callable(method.kernel):
        return "its kernel is not callable"
    try:
        inspect.signature(method.kernel).bind(None, None, None, None)
    except (TypeError, ValueError):
        return f"its kernel {getattr(method.kernel, '__name__', '?')} must take (batch, advantages, params, u)"
    return None


def method_names() -> list[str]:
    return sorted(_METHODS)


def get_method(name: str) -> Method:
    """The registered method; ValueError listing the valid names otherwise."""
    if not isinstance(name, str) or name not in _METHODS:
        raise ValueError(f"unknown method {name!r}; valid methods: {', '.join(method_names())}")
    return _METHODS[name]


def make_params(name: str, **kw):
    """``get_method(name).make_params(**kw)``."""
    return get_method(name).make_params(**kw)


def check_advantages(advantages, batch: TokenBatch) -> Tensor:
    """[N] advantages in the batch dtype; ValueError naming ``advantages`` on a bad shape or NaN."""
    if not isinstance(advantages, Tensor):
        raise ValueError(f"advantages must be a tensor of shape [N] = [{batch.n}], got {type(advantages).__name__}")
    if advantages.shape != (batch.n,):
        raise ValueError(f"advantages must have shape [N] = [{batch.n}], got {list(advantages.shape)}")
    adv = advantages.detach().to(batch.dtype)
    if not bool(torch.isfinite(adv).all()):
        raise ValueError("advantages must be finite (found NaN or inf)")
    return adv


def finalize(batch: TokenBatch, out: TokenLosses) -> TokenLosses:
    """Apply the invalid-token rule (§7): loss 0 with no gradient, mask True, log_w +inf."""
    valid = batch.valid
    loss = torch.where(valid, out.loss, torch.zeros_like(out.loss))
    mask = out.mask | ~valid
    log_w = None
    if out.log_w is not None:
        log_w = torch.where(valid, out.log_w, torch.full_like(out.log_w, float("inf")))
    accepted = None if out.accepted is None else out.accepted & valid
    return out._replace(loss=loss, mask=mask, accepted=accepted, log_w=log_w)
