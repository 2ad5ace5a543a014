"""masktrl.methods: pure-torch trust-region masks and losses for LLM RL (formulas: docs/METHODS.md).

No model, no I/O; imports only torch. Everything works per token on a flattened batch of N
response tokens (``TokenBatch``) and computes in the dtype of its inputs.

    from masktrl.methods import TokenBatch, get_method, make_params
    method = get_method("dppo").bind(make_params("dppo", divergence="topk-tv"))
    adv = method.advantages(rewards, groups)          # [B] per response (§11)
    out = method.token_losses(batch, adv_per_token)   # TokenLosses, [N] each
    loss = method.aggregate(out.loss, batch, horizon=max_new_tokens)  # scalar (§8)

A rule of your own: a frozen dataclass derived from ``MethodParams`` and a kernel
``(batch, advantages, params, u) -> TokenLosses`` under ``@register_method`` (docs/METHODS.md
"Writing your own rule"; ``--method path/to/file.py:name`` loads it).
"""

from masktrl.methods.advantages import ADV_NORMS, group_advantages
from masktrl.methods.aggregation import AGG_MODES, aggregate, aggregate_denominator, aggregate_denominator_from_counts
from masktrl.methods.batch import TokenBatch, log_ratio, log_ratio_live, support, truncate_topk, unit_ratio_log
from masktrl.methods.corrections import (
    CorrectionParams,
    CustomCorrection,
    corrected_token_losses,
    correction_weights,
    make_correction,
    register_correction,
)
from masktrl.methods.cov import ClipCovParams, KLCovParams
from masktrl.methods.divergence import (
    ddot_kl_bracket,
    ddot_topk_exact,
    divergence,
    divergence_full,
    divergence_rate,
    divergence_rate_full,
    square_mass,
)
from masktrl.methods.gmpo import GMPOParams
from masktrl.methods.gpg import GPGParams
from masktrl.methods.m2po import M2POParams
from masktrl.methods.objectives import token_losses
from masktrl.methods.params import (
    CISPOParams,
    DAPOParams,
    DPPOParams,
    GRPOParams,
    GSPOParams,
    MethodParams,
    PDMParams,
    SISParams,
    check_number,
)
from masktrl.methods.prime import PrimeDPPOParams, PrimeIPOParams
from masktrl.methods.registry import (
    BoundMethod,
    Method,
    TokenLosses,
    get_method,
    make_params,
    method_names,
    overlong_penalty,
    register_method,
)
from masktrl.methods.regularizers import (
    KL_ESTIMATORS,
    KL_PLACES,
    RegularizerParams,
    kl_estimate,
    kl_reward_penalty,
    reference_kl,
    regularize,
)

# the 2025-26 baselines register on import (docs/METHODS.md §16)
from masktrl.methods.sapo import SAPOParams
from masktrl.methods.sis import SISDecision, sis_accept
from masktrl.methods.topr import TOPRParams
from masktrl.methods.trm import TRMParams
from masktrl.methods.two_sided import TwoSidedParams

# The 2025-26 baselines a referee asks for (docs/METHODS.md §16), in the order the docs list them.
BASELINES = ("sapo", "gmpo", "clip-cov", "kl-cov", "topr", "m2po", "prime-dppo", "prime-ipo", "two-sided", "trm", "gpg")

__all__ = [
    "BASELINES",
    "CISPOParams",
    "CorrectionParams",
    "CustomCorrection",
    "corrected_token_losses",
    "correction_weights",
    "make_correction",
    "ADV_NORMS",
    "AGG_MODES",
    "KL_ESTIMATORS",
    "KL_PLACES",
    "DAPOParams",
    "DPPOParams",
    "GRPOParams",
    "GSPOParams",
    "BoundMethod",
    "Method",
    "MethodParams",
    "PDMParams",
    "RegularizerParams",
    "SISDecision",
    "SISParams",
    "SAPOParams",
    "GMPOParams",
    "ClipCovParams",
    "KLCovParams",
    "TOPRParams",
    "M2POParams",
    "PrimeDPPOParams",
    "PrimeIPOParams",
    "TwoSidedParams",
    "TRMParams",
    "GPGParams",
    "TokenBatch",
    "TokenLosses",
    "aggregate",
    "aggregate_denominator",
    "aggregate_denominator_from_counts",
    "check_number",
    "ddot_kl_bracket",
    "ddot_topk_exact",
    "divergence",
    "divergence_full",
    "divergence_rate",
    "divergence_rate_full",
    "square_mass",
    "get_method",
    "group_advantages",
    "kl_estimate",
    "log_ratio",
    "log_ratio_live",
    "kl_reward_penalty",
    "make_params",
    "method_names",
    "overlong_penalty",
    "reference_kl",
    "register_correction",
    "register_method",
    "regularize",
    "sis_accept",
    "support",
    "token_losses",
    "truncate_topk",
    "unit_ratio_log",
]
