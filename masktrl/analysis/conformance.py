"""The conformance check any rule can pass (``masktrl check-method NAME``; docs/METHODS.md §17).

A rule is a registered kernel plus its params dataclass (``masktrl.methods.registry``). On small
random float64 batches (ragged sequences, top-K lists with residual mass, padding entries, tokens
outside the list, invalid tokens, and ratios pi/mu from about 1e-30 to 1e30) the check runs the
rule through ``Method.token_losses`` exactly as the trainer does and reports one row per property:

    gradient = value          d sum(l)/d log pi_k (autograd) equals the central finite difference
                              of the per-token values, or (a policy-gradient estimator, §0) the
                              token's own value l = grad_coef; tokens at a kink (a mask flips
                              within the step) are skipped
    lists stop-gradient       the gradient reaches the logits only through log pi_k (§0):
                              grad_z = sum_t g_t (e_k - pi_t)
    invalid tokens            loss and gradient exactly 0 on invalid tokens, and the valid
                              tokens' loss, mask and gradient do not depend on what they hold
    finite                    loss, aggregate and gradient finite, in float64 and float32
    on-policy limit           mu = pi (one minibatch): the per-token gradient vs plain policy
                              gradient -A (reported, not judged)
    sequence order            permuting the sequences permutes the per-token results and leaves
                              the aggregate as it was
    packed = padded           the batch padded per sequence with invalid tokens (a [B, T]
                              layout) gives the packed batch's loss, gradient and aggregate
    params round-trip         the params dumped to run.yaml's method block load back equal, and the
                              class does not redeclare a key every method shares (kl_coef, ...)

Pure computation (torch, the config module for the round trip); ``commands/check_method.py``
prints the rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
import yaml

from masktrl.config import from_dict
from masktrl.methods import RegularizerParams, TokenBatch, get_method
from masktrl.methods.batch import NO_GRADIENT

F64 = torch.float64
SEEDS = (0, 1, 2)
FD_STEP = 1e-6  # central difference step in log pi
RTOL, ATOL = 1e-5, 1e-9
EXTREME_LOG_RATIO = 69.0  # ratios of about 1e30 and 1e-30
SHARED_KEYS = tuple(f.name for f in fields(RegularizerParams))  # every method's regularisers (§13)


@dataclass(frozen=True)
class Row:
    """One property's verdict: ok True (pass) / False (fail) / None (reported only)."""

    name: str
    ok: bool | None
    detail: str


@dataclass(frozen=True)
class Case:
    """A random batch in full-vocabulary form, from which every variant is built."""

    z: torch.Tensor  # [N, V] training logits
    z_mu: torch.Tensor  # [N, V] behaviour logits (may hold -inf)
    sampled: torch.Tensor  # [N] k
    topk_ids: torch.Tensor  # [N, K] the behaviour's top-K ids, some padded with -1
    seq_ids: torch.Tensor  # [N] contiguous blocks, one per sequence
    valid: torch.Tensor  # [N] bool; invalid tokens get behaviour log-prob -inf
    adv: torch.Tensor  # [N] one advantage per sequence
    u: torch.Tensor  # [N] uniforms in [0, 1)

    @property
    def n(self) -> int:
        return self.z.shape[0]


# --------------------------------------------------------------------------- random cases


def random_case(
    seed: int,
    *,
    n_seq: int = 6,
    max_len: int = 7,
    vocab: int = 12,
    k: int = 4,
    extreme: bool = False,
    on_policy: bool = False,
    invalid: float = 0.15,
) -> Case:
    """A ragged batch of ``n_seq`` sequences (1..max_len tokens) over ``vocab`` tokens, lists of
    ``k`` with residual mass. ``extreme``: a third of the tokens get log r = ±69 (r ~ 1e±30);
    ``on_policy``: mu = pi exactly and no invalid token."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_len + 1, (n_seq,), generator=gen)
    seq_ids = torch.repeat_interleave(torch.arange(n_seq), lens)  # [N]
    n = int(lens.sum())
    z = 1.5 * torch.randn(n, vocab, generator=gen, dtype=F64)  # [N, V]
    z_mu = z.clone() if on_policy else z + 0.6 * torch.randn(n, vocab, generator=gen, dtype=F64)
    sampled = torch.multinomial(torch.softmax(z_mu, -1), 1, generator=gen).squeeze(1)  # [N]
    if extreme:
        rows = torch.arange(n)[torch.rand(n, generator=gen) < 1 / 3]
        sign = torch.where(torch.rand(rows.numel(), generator=gen) < 0.5, 1.0, -1.0).to(F64)
        lift = torch.zeros(rows.numel(), dtype=F64) + EXTREME_LOG_RATIO + 3.0
        z_mu[rows, sampled[rows]] -= torch.where(sign > 0, lift, torch.zeros_like(lift))  # mu_k tiny: r ~ 1e30
        z[rows, sampled[rows]] -= torch.where(sign < 0, lift, torch.zeros_like(lift))  # pi_k tiny: r ~ 1e-30
    topk_ids = torch.log_softmax(z_mu, -1).topk(k, dim=-1).indices  # [N, K]
    pad = torch.rand(n, generator=gen) < 0.2
    topk_ids[pad, -1] = -1  # some rows carry fewer genuine entries
    valid = torch.ones(n, dtype=torch.bool) if on_policy else torch.rand(n, generator=gen) >= invalid
    rewards = torch.randn(n_seq, generator=gen, dtype=F64)
    adv = (rewards - rewards.mean())[seq_ids]  # [N]
    u = torch.rand(n, generator=gen, dtype=F64)
    return Case(z, z_mu, sampled, topk_ids, seq_ids, valid, adv, u)


def build(
    case: Case,
    dtype=F64,
    *,
    logp: torch.Tensor | None = None,
    lists_from: torch.Tensor | None = None,
    junk: int | None = None,
) -> TokenBatch:
    """The TokenBatch of ``case`` in ``dtype``. ``logp`` [N]: log pi_k to use (a leaf for
    gradients); ``lists_from`` [N, V]: log pi whose list entries carry a graph (default
    detached); ``junk``: a seed that fills the invalid tokens with other random content."""
    z, z_mu = case.z, case.z_mu
    if junk is not None:
        g = torch.Generator().manual_seed(1000 + junk)
        bad = ~case.valid
        z = torch.where(bad[:, None], 3 * torch.randn(z.shape, generator=g, dtype=F64), z)
        z_mu = torch.where(bad[:, None], 3 * torch.randn(z.shape, generator=g, dtype=F64), z_mu)
    lp = torch.log_softmax(z, -1)  # [N, V]
    mu_lp = torch.log_softmax(z_mu, -1)
    lp_lists = lp if lists_from is None else lists_from
    ids = case.topk_ids.clamp_min(0)
    if logp is None:
        logp = lp.gather(1, case.sampled[:, None]).squeeze(1)
    blp = mu_lp.gather(1, case.sampled[:, None]).squeeze(1)
    blp = torch.where(case.valid, blp, torch.full_like(blp, float("-inf")))
    real = case.topk_ids >= 0
    tb = torch.where(real, mu_lp.gather(1, ids), torch.full_like(ids, float("-inf"), dtype=F64))
    tp = torch.where(real, lp_lists.gather(1, ids), torch.full_like(ids, float("-inf"), dtype=F64))
    pi_sq = torch.softmax(z.detach(), -1).square().sum(-1).to(dtype).clamp(0.0, 1.0)
    return TokenBatch(
        logp.to(dtype),
        blp.to(dtype),
        case.sampled,
        case.topk_ids,
        tb.to(dtype),
        tp.to(dtype),
        case.seq_ids,
        z.shape[1],
        pi_sq,
    )


def sampled_logp(case: Case) -> torch.Tensor:
    """[N] log pi_k as a float64 leaf requiring grad."""
    return torch.log_softmax(case.z, -1).gather(1, case.sampled[:, None]).squeeze(1).detach().requires_grad_(True)


# --------------------------------------------------------------------------- evaluation


class Rule:
    """A method with its params: ``out(batch, adv, u)`` runs it as the trainer does."""

    def __init__(self, method, params=None, spec: str | None = None):
        self.method = get_method(method) if isinstance(method, str) else method
        self.params = self.method.params_cls() if params is None else params
        self.spec = spec or self.method.name  # as run.yaml's method.name writes it (a rule file: path.py:name)

    def out(self, batch: TokenBatch, adv: torch.Tensor, u: torch.Tensor):
        uu = u.to(batch.dtype) if self.method.needs_u(self.params) else None
        return self.method.token_losses(batch, adv.to(batch.dtype), self.params, u=uu)

    def aggregate(self, loss: torch.Tensor, batch: TokenBatch, horizon: int) -> torch.Tensor:
        return self.method.aggregate(self.params, loss, batch, horizon=horizon)


def _grad(loss_sum: torch.Tensor, leaf: torch.Tensor) -> torch.Tensor:
    if not loss_sum.requires_grad:
        return torch.zeros_like(leaf)
    (g,) = torch.autograd.grad(loss_sum, leaf, allow_unused=True)
    return torch.zeros_like(leaf) if g is None else g


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float = RTOL, atol: float = ATOL) -> torch.Tensor:
    """Elementwise |a - b| <= atol + rtol max(|a|, |b|), with equal infinities close."""
    same = a == b
    return same | ((a - b).abs() <= atol + rtol * torch.maximum(a.abs(), b.abs()))


def _fmt(x: float) -> str:
    return f"{x:.2e}"


# --------------------------------------------------------------------------- properties


def check_gradient(rule: Rule, cases: list[Case]) -> Row:
    """autograd of sum(l) w.r.t. log pi_k vs the central finite difference of the per-token values
    (or the value itself, for an estimator of the §0 form)."""
    checked = kinks = 0
    for case in cases:
        leaf = sampled_logp(case)
        batch = build(case, logp=leaf)
        out = rule.out(batch, case.adv, case.u)
        if not out.loss.requires_grad:
            return Row("gradient = value", False, f"the kernel returned {NO_GRADIENT}")
        g = _grad(out.loss.sum(), leaf).detach()  # [N]
        value = out.loss.detach()
        for t in torch.nonzero(case.valid).flatten().tolist():
            step = torch.zeros(case.n, dtype=F64)
            step[t] = FD_STEP
            with torch.no_grad():
                hi = rule.out(build(case, logp=leaf.detach() + step), case.adv, case.u)
                lo = rule.out(build(case, logp=leaf.detach() - step), case.adv, case.u)
            if not (torch.equal(hi.mask, out.mask) and torch.equal(lo.mask, out.mask)):
                kinks += 1
                continue
            fd = ((hi.loss - lo.loss) / (2 * FD_STEP)).sum()
            checked += 1
            if not bool(torch.isfinite(fd)):
                continue  # the value overflows within the step; the finite row judges the point itself
            if bool(_close(g[t], fd)) or bool(_close(g[t], value[t])):
                continue
            return Row(
                "gradient = value",
                False,
                f"token {t}: autograd {float(g[t]):.6g}, finite difference {float(fd):.6g}, "
                f"value {float(value[t]):.6g}",
            )
    return Row("gradient = value", True, f"{checked} tokens, {kinks} at a kink skipped")


def check_lists(rule: Rule, cases: list[Case]) -> Row:
    """The gradient reaches the logits only through log pi_k: grad_z = sum_t g_t (e_k - pi_t)."""
    worst = 0.0
    for case in cases:
        z = case.z.clone().requires_grad_(True)
        lp = torch.log_softmax(z, -1)
        logp = lp.gather(1, case.sampled[:, None]).squeeze(1)
        batch = build(case, logp=logp, lists_from=lp)
        gz = _grad(rule.out(batch, case.adv, case.u).loss.sum(), z).detach()  # [N, V]
        leaf = sampled_logp(case)
        g = _grad(rule.out(build(case, logp=leaf), case.adv, case.u).loss.sum(), leaf).detach()  # [N]
        pi = torch.softmax(case.z, -1)
        onehot = torch.zeros_like(pi).scatter_(1, case.sampled[:, None], 1.0)
        want = g[:, None] * (onehot - pi)  # [N, V]
        ok = _close(gz, want)
        if not bool(ok.all()):
            bad = (gz - want).abs().max()
            return Row(
                "lists stop-gradient",
                False,
                f"the logits get a gradient through the top-K lists (max |diff| {_fmt(float(bad))})",
            )
        worst = max(worst, float((gz - want).abs().max()))
    return Row("lists stop-gradient", True, f"max |diff| {_fmt(worst)}")


def check_invalid(rule: Rule, cases: list[Case], horizon: int) -> Row:
    """Loss and gradient 0 on invalid tokens; the valid tokens' results ignore their content."""
    for case in cases:
        if bool(case.valid.all()):
            continue
        results = []
        for junk in (None, 1, 2):
            leaf = build(case, junk=junk).logp.detach().clone().requires_grad_(True)
            batch = build(case, logp=leaf, junk=junk)
            out = rule.out(batch, case.adv, case.u)
            agg = rule.aggregate(out.loss, batch, horizon)
            g = _grad(out.loss.sum(), leaf).detach()
            results.append((out.loss.detach(), out.mask, g, agg.detach()))
        bad = ~case.valid
        loss0, mask0, g0, agg0 = results[0]
        if bool((loss0[bad] != 0).any()) or bool((g0[bad] != 0).any()):
            return Row("invalid tokens", False, "nonzero loss or gradient on an invalid token")
        for loss, mask, g, agg in results[1:]:
            v = case.valid
            if not (
                bool(_close(loss[v], loss0[v]).all())
                and torch.equal(mask[v], mask0[v])
                and bool(_close(g[v], g0[v]).all())
                and bool(_close(agg, agg0))
            ):
                return Row(
                    "invalid tokens",
                    False,
                    "the valid tokens' loss, mask or gradient change with the invalid tokens' content",
                )
    return Row("invalid tokens", True, "loss = grad = 0 there; no influence on valid tokens")


def check_finite(rule: Rule, cases: list[Case], horizon: int) -> Row:
    """Loss, aggregate and gradient finite in float64 and float32 (extreme ratios included)."""
    for case in cases:
        for dtype in (F64, torch.float32):
            leaf = sampled_logp(case).detach().to(dtype).requires_grad_(True)
            batch = build(case, dtype, logp=leaf)
            out = rule.out(batch, case.adv, case.u)
            agg = rule.aggregate(out.loss, batch, horizon)
            g = _grad(agg, leaf)
            for what, t in (("loss", out.loss), ("aggregate", agg), ("gradient", g)):
                if not bool(torch.isfinite(t.detach()).all()):
                    lr = (batch.logp.detach() - batch.behavior_logp).abs().max()
                    return Row(
                        "finite",
                        False,
                        f"{what} is not finite in {str(dtype).removeprefix('torch.')} (|log r| up to {float(lr):.0f})",
                    )
    return Row("finite", True, "float64 and float32, ratios 1e-30..1e30")


def check_on_policy(rule: Rule, seeds=SEEDS) -> Row:
    """mu = pi: the per-token gradient vs plain policy gradient (d l/d log pi = -A), reported."""
    worst, blocked = 0.0, 0
    for seed in seeds:
        case = random_case(seed, on_policy=True)
        leaf = sampled_logp(case)
        out = rule.out(build(case, logp=leaf), case.adv, case.u)
        g = _grad(out.loss.sum(), leaf).detach()
        diff = (g + case.adv).abs()
        worst = max(worst, float(diff.max()))
        blocked += int(((g == 0) & (case.adv != 0)).sum())
    if worst <= 1e-9:
        return Row("on-policy limit", None, "equals plain policy gradient (d l/d log pi = -A)")
    return Row(
        "on-policy limit",
        None,
        f"differs from plain policy gradient: max |g + A| {_fmt(worst)}, {blocked} tokens with A != 0 get no gradient",
    )


def _permute(case: Case, order: list[int]) -> tuple[Case, torch.Tensor]:
    """``case`` with its sequences in ``order`` (relabelled 0..G-1); returns the token index map."""
    idx = torch.cat([torch.nonzero(case.seq_ids == s).flatten() for s in order])  # new position -> old token
    new_seq = torch.repeat_interleave(
        torch.arange(len(order)), torch.tensor([int((case.seq_ids == s).sum()) for s in order])
    )
    return Case(
        case.z[idx],
        case.z_mu[idx],
        case.sampled[idx],
        case.topk_ids[idx],
        new_seq,
        case.valid[idx],
        case.adv[idx],
        case.u[idx],
    ), idx


def _run(rule: Rule, case: Case, horizon: int):
    leaf = sampled_logp(case)
    batch = build(case, logp=leaf)
    out = rule.out(batch, case.adv, case.u)
    agg = rule.aggregate(out.loss, batch, horizon)
    g = _grad(agg, leaf).detach()
    return out.loss.detach(), out.mask, g, agg.detach()


def check_order(rule: Rule, cases: list[Case], horizon: int) -> Row:
    """Permuting the sequences permutes the results and keeps the aggregate."""
    for i, case in enumerate(cases):
        g_count = int(case.seq_ids.max()) + 1
        order = torch.randperm(g_count, generator=torch.Generator().manual_seed(7 + i)).tolist()
        base = _run(rule, case, horizon)
        perm_case, idx = _permute(case, order)
        loss, mask, g, agg = _run(rule, perm_case, horizon)
        if not (
            bool(_close(loss, base[0][idx]).all())
            and torch.equal(mask, base[1][idx])
            and bool(_close(g, base[2][idx]).all())
            and bool(_close(agg, base[3]))
        ):
            return Row(
                "sequence order",
                False,
                f"reordering the sequences changes the result (aggregate {float(base[3]):.6g} -> {float(agg):.6g})",
            )
    return Row("sequence order", True, "per-token results follow their sequence; aggregate unchanged")


def _pad(case: Case) -> tuple[Case, torch.Tensor]:
    """``case`` in a padded [B, T] layout: each sequence followed by invalid tokens up to the
    longest; returns the positions of the original tokens."""
    counts = torch.bincount(case.seq_ids)
    width = int(counts.max())
    pieces, where, pos = [], [], 0
    for s in range(counts.numel()):
        tok = torch.nonzero(case.seq_ids == s).flatten()
        extra = width - tok.numel()
        pieces.append(torch.cat([tok, tok[:1].repeat(extra)]))
        where.extend(range(pos, pos + tok.numel()))
        pos += width
    idx = torch.cat(pieces)
    valid = case.valid[idx].clone()
    keep = torch.zeros(idx.numel(), dtype=torch.bool)
    keep[torch.tensor(where)] = True
    valid &= keep
    return Case(
        case.z[idx],
        case.z_mu[idx],
        case.sampled[idx],
        case.topk_ids[idx],
        case.seq_ids[idx],
        valid,
        case.adv[idx],
        case.u[idx],
    ), torch.tensor(where)


def check_padded(rule: Rule, cases: list[Case], horizon: int) -> Row:
    """The padded layout (invalid filler tokens) gives the packed batch's results."""
    for case in cases:
        base = _run(rule, case, horizon)
        padded, where = _pad(case)
        loss, mask, g, agg = _run(rule, padded, horizon)
        if not (
            bool(_close(loss[where], base[0]).all())
            and torch.equal(mask[where], base[1])
            and bool(_close(g[where], base[2]).all())
            and bool(_close(agg, base[3]))
        ):
            return Row(
                "packed = padded",
                False,
                f"padding changes the result (aggregate {float(base[3]):.6g} -> {float(agg):.6g})",
            )
    return Row("packed = padded", True, "loss, gradient and aggregate equal")


def check_round_trip(rule: Rule) -> Row:
    """The params, written as run.yaml's method block and loaded back, are equal; and the class
    does not redeclare a key every method shares (the reference KL, the entropy bonus, §13)."""
    shadowed = sorted(set(vars(rule.method.params_cls).get("__annotations__", {})) & set(SHARED_KEYS))
    if shadowed:
        return Row(
            "params round-trip",
            False,
            f"{rule.method.params_cls.__name__} redeclares the shared key(s) "
            f"{', '.join('method.' + k for k in shadowed)} (docs/METHODS.md §13); give "
            "the rule's own a name of its own",
        )
    given = {f.name: getattr(rule.params, f.name) for f in fields(rule.params)}
    cfg = from_dict({"method": {"name": rule.spec, **given}})
    text = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
    back = from_dict(yaml.safe_load(text))
    if back.method.params != rule.params:
        return Row("params round-trip", False, f"run.yaml gives {back.method.params!r}, not {rule.params!r}")
    return Row("params round-trip", True, f"{len(given)} fields through run.yaml")


# --------------------------------------------------------------------------- entry point


def _guard(name: str, fn: Callable[[], Row]) -> Row:
    """A property whose run raises fails with the exception's first line."""
    try:
        return fn()
    except Exception as exc:  # a rule that raises fails the property it broke
        return Row(name, False, f"raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")


def check_method(method, params=None, *, seeds=SEEDS, spec: str | None = None) -> list[Row]:
    """Every property of the module docstring for ``method`` (a registered name, or a ``Method``
    such as a rule loaded from a file, ``spec`` naming it as run.yaml does) with ``params`` (None:
    its defaults). Returns one ``Row`` per property."""
    rule = Rule(method, params, spec)
    horizon = 8
    plain = [random_case(s) for s in seeds]
    extreme = [random_case(100 + s, extreme=True) for s in seeds]
    return [
        _guard("gradient = value", lambda: check_gradient(rule, plain + extreme)),
        _guard("lists stop-gradient", lambda: check_lists(rule, plain)),
        _guard("invalid tokens", lambda: check_invalid(rule, plain, horizon)),
        _guard("finite", lambda: check_finite(rule, plain + extreme, horizon)),
        _guard("on-policy limit", lambda: check_on_policy(rule, seeds)),
        _guard("sequence order", lambda: check_order(rule, plain, horizon)),
        _guard("packed = padded", lambda: check_padded(rule, plain, horizon)),
        _guard("params round-trip", lambda: check_round_trip(rule)),
    ]


def passed(rows: list[Row]) -> bool:
    """No row failed (reported-only rows do not count)."""
    return all(r.ok is not False for r in rows)


__all__ = ["Row", "check_method", "passed", "random_case", "build"]
