"""masktrl.methods: pure-torch trust-region masks and losses for LLM RL (see SPEC.md).

No model, no I/O; imports only torch. Everything works per token on a flattened batch of N
response tokens (``TokenBatch``) and computes in the dtype of its inputs.

    from masktrl.methods import TokenBatch, token_losses, aggregate, get_method
    out = token_losses("dppo", batch, advantages, divergence="topk-tv")
    loss = aggregate(out.loss, batch, get_method("dppo").aggregation(make_params("dppo")))
"""

from masktrl.methods.batch import TokenBatch, support
from masktrl.methods.divergence import ddot_kl_bracket, divergence, divergence_rate
from masktrl.methods.objectives import aggregate, aggregate_denominator, token_losses
from masktrl.methods.params import (
    AGG_MODES,
    DAPOParams,
    DPPOParams,
    GRPOParams,
    GSPOParams,
    PDMParams,
    SISParams,
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

__all__ = [
    "AGG_MODES",
    "DAPOParams",
    "DPPOParams",
    "GRPOParams",
    "GSPOParams",
    "Method",
    "PDMParams",
    "SISDecision",
    "SISParams",
    "TokenBatch",
    "TokenLosses",
    "aggregate",
    "aggregate_denominator",
    "ddot_kl_bracket",
    "divergence",
    "divergence_rate",
    "get_method",
    "make_params",
    "method_names",
    "overlong_penalty",
    "register_method",
    "sis_accept",
    "support",
    "token_losses",
]
