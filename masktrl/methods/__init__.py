"""masktrl.methods: pure-torch trust-region masks and losses for LLM RL (formulas: docs/METHODS.md).

No model, no I/O; imports only torch. Everything works per token on a flattened batch of N
response tokens (``TokenBatch``) and computes in the dtype of its inputs.

    from masktrl.methods import TokenBatch, get_method, make_params
    method = get_method("dppo")
    params = make_params("dppo", divergence="topk-tv")
    adv = method.advantages(params, rewards, groups)          # [B] per response (§11)
    out = method.token_losses(batch, adv_per_token, params)   # TokenLosses, [N] each
    loss = method.aggregate(params, out.loss, batch, horizon=max_new_tokens)  # scalar (§8)
"""

from masktrl.methods.advantages import ADV_NORMS, group_advantages
from masktrl.methods.aggregation import (
    AGG_MODES,
    aggregate,
    aggregate_denominator,
    aggregate_denominator_from_counts,
)
from masktrl.methods.batch import TokenBatch, support, truncate_topk
from masktrl.methods.divergence import (
    ddot_kl_bracket,
    ddot_topk_exact,
    divergence,
    divergence_full,
    divergence_rate,
    divergence_rate_full,
    square_mass,
)
from masktrl.methods.objectives import token_losses
from masktrl.methods.corrections import CorrectionParams, corrected_token_losses, correction_weights, make_correction
from masktrl.methods.params import (
    CISPOParams,
    DAPOParams,
    DPPOParams,
    GRPOParams,
    GSPOParams,
    PDMParams,
    SISParams,
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
from masktrl.methods.registry import (
    Method,
    TokenLosses,
    get_method,
    make_params,
    method_names,
    overlong_penalty,
    register_method,
)
from masktrl.methods.sis import SISDecision, sis_accept
# the 2025-26 baselines register on import (docs/METHODS.md §16)
from masktrl.methods.sapo import SAPOParams
from masktrl.methods.gmpo import GMPOParams
from masktrl.methods.cov import ClipCovParams, KLCovParams
from masktrl.methods.topr import TOPRParams
from masktrl.methods.m2po import M2POParams
from masktrl.methods.prime import PrimeDPPOParams, PrimeIPOParams
from masktrl.methods.two_sided import TwoSidedParams
from masktrl.methods.trm import TRMParams
from masktrl.methods.gpg import GPGParams

__all__ = [
    "CISPOParams",
    "CorrectionParams",
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
    "Method",
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
    "kl_reward_penalty",
    "make_params",
    "method_names",
    "overlong_penalty",
    "reference_kl",
    "register_method",
    "regularize",
    "sis_accept",
    "support",
    "token_losses",
    "truncate_topk",
]
