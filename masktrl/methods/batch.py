"""The per-token input of every method, its validation, and the top-K support (docs/METHODS.md §0, §1, §10).

`TokenBatch` holds N flattened response tokens. `support()` turns its top-K lists into the
atoms of §1 (padding dropped, duplicates removed, the sampled token made an explicit atom)
and the two tail masses. Everything here is stop-gradient except `TokenBatch.logp`, and
everything computes in the batch's floating dtype.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

RULES = ("union", "replace_last")


def check_choice(field: str, value, choices: tuple[str, ...]) -> None:
    """ValueError naming `field` unless `value` is one of `choices`."""
    if value not in choices:
        raise ValueError(f"{field} must be one of {', '.join(choices)}; got {value!r}")


_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*")


def check_rule_name(what: str, name: Any) -> None:
    """ValueError unless ``name`` can be written where a method or correction is named: letters,
    digits, ``_ . + -``, not starting with a punctuation mark. A ``:`` would split ``rules.py:name:key=value``
    (and rich reads ``:name:`` as an emoji), a ``,`` a ``--methods`` list, and an empty name could not
    be written at all."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(
            f"{what} name {name!r}: use letters, digits and _ . + - (not starting with . + -), "
            "as names are written in path/to/rules.py:name:key=value and --methods a,b"
        )


@dataclass(frozen=True)
class TokenBatch:
    """N response tokens of a flattened batch (docs/METHODS.md §10).

    Validated on construction: shapes, dtypes, devices, K >= 1, no NaN (or +inf) log-probability
    outside padding, ids < vocab_size. Invalid tokens (``behavior_logp = -inf``) are allowed and
    are dropped by every method and aggregate.
    """

    logp: Tensor  # [N] log pi(k), training policy; carries the gradient
    behavior_logp: Tensor  # [N] log mu(k), recorded by the rollout engine
    sampled_ids: Tensor  # [N] k (long)
    topk_ids: Tensor  # [N, K] the behaviour's own top-K ids, descending mu; pad -1
    topk_behavior_logp: Tensor  # [N, K] log mu at topk_ids (-inf allowed: zero-mass atom)
    topk_logp: Tensor  # [N, K] log pi at topk_ids (stop-gradient is applied inside)
    seq_ids: Tensor  # [N] which response each token belongs to (long)
    vocab_size: int | None = None
    pi_sq_sum: Tensor | None = None  # [N] sum_V pi_j^2 of the training distribution (pdm tail=exact, §4.7); detached

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def n(self) -> int:
        return self.logp.shape[0]

    @property
    def k(self) -> int:
        return self.topk_ids.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        """The dtype everything is computed in: the promoted dtype of the four log-prob fields."""
        dt = self.logp.dtype
        for t in (self.behavior_logp, self.topk_behavior_logp, self.topk_logp):
            dt = torch.promote_types(dt, t.dtype)
        return dt

    @property
    def valid(self) -> Tensor:  # [N] bool: behaviour mass of the sampled token is > 0
        return self.behavior_logp > float("-inf")


def _validate(b: TokenBatch) -> None:
    vectors = ("logp", "behavior_logp", "sampled_ids", "seq_ids")
    lists = ("topk_ids", "topk_behavior_logp", "topk_logp")
    for name in vectors + lists:
        if not isinstance(getattr(b, name), Tensor):
            raise ValueError(f"TokenBatch.{name} must be a torch.Tensor, got {type(getattr(b, name)).__name__}")
    n = b.logp.shape[0] if b.logp.dim() == 1 else -1
    for name in vectors:
        t = getattr(b, name)
        if t.dim() != 1 or t.shape[0] != n:
            raise ValueError(f"TokenBatch.{name} must have shape [N] = [{n}] (as logp), got {list(t.shape)}")
    if b.topk_ids.dim() != 2 or b.topk_ids.shape[0] != n:
        raise ValueError(f"TokenBatch.topk_ids must have shape [N, K] with N = {n}, got {list(b.topk_ids.shape)}")
    if b.topk_ids.shape[1] == 0:
        raise ValueError("TokenBatch.topk_ids must have K >= 1 columns, got K = 0 (pad rows with -1 instead)")
    for name in lists[1:]:
        t = getattr(b, name)
        if t.shape != b.topk_ids.shape:
            raise ValueError(
                f"TokenBatch.{name} must have the shape of topk_ids {list(b.topk_ids.shape)}, got {list(t.shape)}"
            )
    for name in ("logp", "behavior_logp", "topk_behavior_logp", "topk_logp"):
        if not getattr(b, name).is_floating_point():
            raise ValueError(f"TokenBatch.{name} must be a floating tensor, got {getattr(b, name).dtype}")
    for name in ("sampled_ids", "topk_ids", "seq_ids"):
        t = getattr(b, name)
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise ValueError(f"TokenBatch.{name} must be an integer (long) tensor, got {t.dtype}")
    for name in vectors[1:] + lists:
        if getattr(b, name).device != b.logp.device:
            raise ValueError(f"TokenBatch.{name} is on {getattr(b, name).device}, logp on {b.logp.device}")
    real = b.topk_ids >= 0  # [N, K] padding entries are ignored whatever their values
    checks = (
        ("logp", b.logp.detach(), None),
        ("behavior_logp", b.behavior_logp, None),
        ("topk_behavior_logp", b.topk_behavior_logp, real),
        ("topk_logp", b.topk_logp.detach(), real),
    )
    for name, t, where in checks:
        bad = torch.isnan(t) | (t == float("inf"))
        if where is not None:
            bad = bad & where
        if bool(bad.any()):
            raise ValueError(f"TokenBatch.{name} contains NaN or +inf log-probabilities")
    valid = b.behavior_logp > float("-inf")
    if bool((valid & (b.sampled_ids < 0)).any()):
        raise ValueError("TokenBatch.sampled_ids must be >= 0 on valid tokens (behavior_logp > -inf)")
    if b.pi_sq_sum is not None:
        t = b.pi_sq_sum
        if not isinstance(t, Tensor) or t.shape != (n,) or not t.is_floating_point():
            raise ValueError(
                f"TokenBatch.pi_sq_sum must be a floating tensor of shape [N] = [{n}] or None, got "
                f"{getattr(t, 'shape', type(t).__name__)}"
            )
        if bool((torch.isnan(t) | (t < 0) | (t > 1 + 1e-5)).any()):
            raise ValueError("TokenBatch.pi_sq_sum must hold sums of squared probabilities, in [0, 1]")
    if b.vocab_size is not None:
        if isinstance(b.vocab_size, bool) or not isinstance(b.vocab_size, int) or b.vocab_size < 1:
            raise ValueError(f"TokenBatch.vocab_size must be a positive int or None, got {b.vocab_size!r}")
        if n and bool((b.sampled_ids >= b.vocab_size).any()):
            raise ValueError(f"TokenBatch.sampled_ids has ids >= vocab_size = {b.vocab_size}")
        if n and bool((b.topk_ids >= b.vocab_size).any()):
            raise ValueError(f"TokenBatch.topk_ids has ids >= vocab_size = {b.vocab_size}")


def seq_index(batch: TokenBatch) -> tuple[Tensor, int]:
    """inv [N] (dense sequence index of each token) and the number of sequences G."""
    uniq, inv = torch.unique(batch.seq_ids, return_inverse=True)
    return inv, uniq.shape[0]


# --------------------------------------------------------------------------- support


class Support(NamedTuple):
    """The atoms of S (§1) as K+1 columns: the K list slots and one slot for an appended k.

    Columns that are not in S hold log-probability -inf in both ``mu_lp`` and ``pi_lp``, so
    they carry zero mass and drop out of every sum. All tensors are detached.
    """

    mu_lp: Tensor  # [N, K+1] log mu of each atom (-inf off S, or a zero-mass atom)
    pi_lp: Tensor  # [N, K+1] log pi of each atom
    member: Tensor  # [N, K+1] bool, atom is in S
    is_k: Tensor  # [N, K+1] bool, exactly one True per row: the sampled token's atom
    mu_tail: Tensor  # [N] mu_T = max(0, 1 - mu(S)), exactly 0 when m == 0
    pi_tail: Tensor  # [N] pi_T
    m: Tensor | None  # [N] number of unseen tokens |V| - |S| (None when vocab_size is unknown)
    mu_cap: Tensor  # [N] min over the genuine (kept) list entries of mu_i; +inf for an empty list


def genuine_entries(topk_ids: Tensor) -> Tensor:
    """[N, K] bool: id >= 0 and the first occurrence of that id in its row."""
    ids = topk_ids.masked_fill(topk_ids < 0, -1)  # [N, K]
    sorted_ids, perm = torch.sort(ids, dim=1, stable=True)  # stable: first occurrence sorts first
    dup_sorted = torch.zeros_like(sorted_ids, dtype=torch.bool)  # [N, K]
    dup_sorted[:, 1:] = sorted_ids[:, 1:] == sorted_ids[:, :-1]
    dup = torch.zeros_like(dup_sorted).scatter_(1, perm, dup_sorted)  # back to list order
    return (ids >= 0) & ~dup


def tail_mass(lp: Tensor) -> Tensor:
    """[N] max(0, -expm1(logsumexp(lp))) over the last dim: 1 - listed mass, accurate for small tails."""
    return (-torch.expm1(torch.logsumexp(lp, dim=-1))).clamp_min(0.0)


def residual_mass(lp_list: Tensor, topk_ids: Tensor, vocab_size: int | None) -> Tensor:
    """[N] 1 - p(genuine top-K list), from [N, K] log-probabilities at the list ids (in their
    dtype); exactly 0 where the genuine list is the whole vocabulary."""
    genuine = genuine_entries(topk_ids)  # [N, K]
    resid = tail_mass(lp_list.masked_fill(~genuine, float("-inf")))  # [N]
    if vocab_size is not None:
        resid = torch.where(genuine.sum(dim=1) == vocab_size, torch.zeros_like(resid), resid)
    return resid


def outside_list(sampled_ids: Tensor, topk_ids: Tensor) -> Tensor:
    """[N] bool: the sampled token is not among its row's genuine top-K ids ([N, K], padding < 0)."""
    return ~(genuine_entries(topk_ids) & (topk_ids == sampled_ids[:, None])).any(dim=1)


def list_logps(batch: TokenBatch) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The genuine list with the sampled token's entry taken from (behavior_logp, logp).

    Returns genuine [N, K] bool, k_pos [N, K] bool (genuine entry equal to k), mu_lp and
    pi_lp [N, K] (detached, -inf on non-genuine entries), in ``batch.dtype``.
    """
    dt = batch.dtype
    genuine = genuine_entries(batch.topk_ids)  # [N, K]
    k_pos = genuine & (batch.topk_ids == batch.sampled_ids[:, None])  # [N, K]
    mu_k = batch.behavior_logp.detach().to(dt)[:, None]  # [N, 1]
    pi_k = batch.logp.detach().to(dt)[:, None]  # [N, 1]
    neg_inf = torch.tensor(float("-inf"), dtype=dt, device=mu_k.device)
    mu_lp = torch.where(k_pos, mu_k, batch.topk_behavior_logp.detach().to(dt))  # [N, K]
    pi_lp = torch.where(k_pos, pi_k, batch.topk_logp.detach().to(dt))  # [N, K]
    return genuine, k_pos, torch.where(genuine, mu_lp, neg_inf), torch.where(genuine, pi_lp, neg_inf)


def support(batch: TokenBatch, rule: str = "union") -> Support:
    """The support S of §1 under ``rule`` ("union" or "replace_last"), with its tails.

    replace_last: when k is not in the list, S = top_{K-1}(mu) ∪ {k}, where top_{K-1} are the
    first K-1 genuine (non-padding, deduplicated) entries. A row with fewer than K genuine
    entries therefore loses nothing: k takes a padding slot, exactly as the adapters write it.

    Computed once per batch and rule: a minibatch's loss, its diagnostics and the lab statistics
    each ask for it (every field is detached, and a ``TokenBatch`` is not changed after it is
    built), and later calls return the first one's tensors.
    """
    check_choice("rule", rule, RULES)
    memo = batch.__dict__.setdefault("_supports", {})
    if rule not in memo:
        memo[rule] = _support(batch, rule)
    return memo[rule]


def _support(batch: TokenBatch, rule: str) -> Support:
    dt = batch.dtype
    genuine, k_pos, mu_lp, pi_lp = list_logps(batch)  # [N, K] each
    k_in = k_pos.any(dim=1)  # [N]
    member = genuine  # [N, K]
    if rule == "replace_last":
        rank = genuine.long().cumsum(dim=1) - 1  # [N, K] rank among genuine entries
        member = genuine & (k_in[:, None] | (rank < batch.k - 1))
    neg_inf = torch.tensor(float("-inf"), dtype=dt, device=mu_lp.device)
    mu_lp = torch.where(member, mu_lp, neg_inf)
    pi_lp = torch.where(member, pi_lp, neg_inf)
    extra = ~k_in  # [N] k appended as column K
    mu_x = torch.where(extra, batch.behavior_logp.detach().to(dt), neg_inf)  # [N]
    pi_x = torch.where(extra, batch.logp.detach().to(dt), neg_inf)  # [N]
    mu_all = torch.cat([mu_lp, mu_x[:, None]], dim=1)  # [N, K+1]
    pi_all = torch.cat([pi_lp, pi_x[:, None]], dim=1)  # [N, K+1]
    member_all = torch.cat([member, extra[:, None]], dim=1)  # [N, K+1]
    is_k = torch.cat([k_pos, extra[:, None]], dim=1)  # [N, K+1]
    mu_tail, pi_tail = tail_mass(mu_all), tail_mass(pi_all)  # [N]
    m = None
    if batch.vocab_size is not None:
        m = batch.vocab_size - member_all.sum(dim=1)  # [N]
        mu_tail = torch.where(m == 0, torch.zeros_like(mu_tail), mu_tail)
        pi_tail = torch.where(m == 0, torch.zeros_like(pi_tail), pi_tail)
    pos_inf = torch.tensor(float("inf"), dtype=dt, device=mu_lp.device)
    mu_cap = torch.where(member, mu_lp, pos_inf).amin(dim=1).exp()  # [N]; exp(-inf)=0 for zero-mass entries
    return Support(mu_all, pi_all, member_all, is_k, mu_tail, pi_tail, m, mu_cap)


def truncate_topk(batch: TokenBatch, k: int) -> TokenBatch:
    """The batch with every top-K list re-cut to its first ``k`` genuine entries (§1.1).

    Padding and repeated ids are dropped first, so each row keeps the k largest-mu entries an
    engine asked for top-k would have returned (the list is in descending mu); rows with fewer
    genuine entries keep them all and are padded with id -1. The sampled token stays in the
    list only if it is among those k; otherwise it becomes a token outside the list, and the
    support rule (§1: union appends it, replace_last puts it in the k-th slot) applies to the
    new list exactly as to a recorded top-k list. ``k >= batch.k`` returns ``batch`` itself.
    Everything else (log pi at the sampled token, seq_ids, vocab_size) is unchanged;
    ``topk_logp`` keeps its autograd graph.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")
    if k >= batch.k:
        return batch
    genuine = genuine_entries(batch.topk_ids)  # [N, K]
    order = torch.sort((~genuine).to(torch.int8), dim=1, stable=True).indices[:, :k]  # [N, k] genuine first, in order
    keep = genuine.gather(1, order)  # [N, k]
    ids = batch.topk_ids.gather(1, order).masked_fill(~keep, -1)  # [N, k]
    mu = batch.topk_behavior_logp.gather(1, order).masked_fill(~keep, float("-inf"))  # [N, k]
    pi = batch.topk_logp.gather(1, order).masked_fill(~keep, float("-inf"))  # [N, k]
    return TokenBatch(
        batch.logp,
        batch.behavior_logp,
        batch.sampled_ids,
        ids,
        mu,
        pi,
        batch.seq_ids,
        batch.vocab_size,
        batch.pi_sq_sum,
    )


# --------------------------------------------------------------------------- live log-ratios


NO_GRADIENT = (
    "a loss with no gradient through log pi (detached, or built from Python numbers): the update could not "
    "step; a loss of value 0 with a gradient is c * unit_ratio_log(batch)"
)
"""What a rule whose loss lost its gradient is told (``check-method`` and a run's guarded kernel)."""


def unit_ratio_log(batch: TokenBatch) -> Tensor:
    """[N] log(pi_k / sg(pi_k)): value exactly 0, gradient 1 w.r.t. logp (0 where logp = -inf)."""
    lp = batch.logp.to(batch.dtype)
    finite = torch.isfinite(lp)
    safe = torch.where(finite, lp, torch.zeros_like(lp))
    return safe - safe.detach()


def log_ratio_live(batch: TokenBatch) -> Tensor:
    """[N] log r = logp - behavior_logp with gradient; 0 (no gradient) on invalid tokens."""
    lp = batch.logp.to(batch.dtype)
    blp = batch.behavior_logp.to(batch.dtype)
    valid = batch.valid
    safe_b = torch.where(valid, blp, torch.zeros_like(blp))
    return torch.where(valid, lp - safe_b, torch.zeros_like(lp))


def log_ratio(batch: TokenBatch) -> Tensor:
    """[N] log r (detached); +inf on invalid tokens (mu_k = 0)."""
    lr = batch.logp.detach().to(batch.dtype) - batch.behavior_logp.to(batch.dtype)
    return torch.where(batch.valid, lr, torch.full_like(lr, float("inf")))
