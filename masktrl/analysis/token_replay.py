"""Every token of a replayed update, as columns: what each direction criterion decided, the exact
full-vocabulary values, and how D then moved.

``record_tokens`` replays one rollout batch (``step_replay.replay_step``: the minibatch updates
of ``rl.update.policy_update``) and, for every token, at the forward pass its own
minibatch trains on (the policy the method sees):

    adv, d (top-K KL, docs/METHODS.md §3), log_ratio, ddot_agg, ddot_uniform (§4.2),
    bracket_lo, bracket_hi (§4.4)                    from the stored behaviour lists, as the method sees them
    d_full, ddot_exact (§4.5)                         with ``exact``: from the full log-probabilities (float64)
                                                      of pi and of the behaviour policy (its checkpoint)
    ddot_topk_exact (§4.7)                            the exact Ḋ of the top-K KL the mask uses (stored list,
                                                      float64 pi and sum_V pi^2)
    mu_list_mass_diff                                 sum_S |mu stored - mu recomputed| over the union support
    keep_<criterion>                                  the direction rules (``keep_decisions``)
    d_one                                             D just after the token's own minibatch update
    d_all                                             D after all the step's minibatch updates

With ``ks``, also the tail estimators and the bracket at other list sizes K (``estimates_at_k``),
all in float64 from the full log-probabilities: ``ddot_agg_k{K}``, ``ddot_uniform_k{K}``,
``ddot_topk_exact_k{K}``, ``bracket_lo_k{K}``, ``bracket_hi_k{K}``, the same bracket from the
recomputed mu at the list's ids (``bracket_lo_same_mu_k{K}``, ``bracket_hi_same_mu_k{K}``), the
containment tolerance ``contain_tol_k{K}`` (``estimates_at_k``), ``pi_tail_k{K}`` (1 - pi(list)). A K up to the stored
list size re-cuts the stored list (``truncate_topk``, §1.1); a larger K takes the behaviour's
top-K of the recomputed distribution (``source_k{K}`` says which).

Columns are numpy arrays of one length N (the batch's tokens in sample order).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
from torch import Tensor

from masktrl.errors import MasktrlError
from masktrl.methods import (
    TokenBatch,
    ddot_kl_bracket,
    ddot_topk_exact,
    divergence,
    divergence_full,
    divergence_rate,
    divergence_rate_full,
    square_mass,
    support,
    truncate_topk,
)
from masktrl.methods.batch import log_ratio
from masktrl.methods.diagnostics import keep_decisions  # (the direction rules; imported from here too)
from masktrl.rl.policy import full_logprobs, lm_head_weight, response_hidden

CRITERIA = ("ratio", "ddot_agg", "ddot_uniform")  # the paper's three direction rules
EXACT_CRITERIA = ("ddot_exact", "ddot_topk_exact")  # need the full vocabulary: full-KL Ḋ, the top-K KL's own Ḋ
BRACKET_CRITERIA = ("bracket_keep", "bracket_mask")  # pdm tail=bracket, uncertain=keep | mask (§4.6)
CONTAIN_FLOOR = 1e-12  # float64 rounding of the bracket and the exact value
FULL_ROW_BUDGET = 1 << 24  # float64 entries of one [rows, V] chunk of full log-probabilities (128 MiB)


def chunk_rows(vocab: int, budget: int = FULL_ROW_BUDGET) -> int:
    return max(1, budget // max(vocab, 1))


def list_batch(batch: TokenBatch, pi_full: Tensor, mu_full: Tensor | None = None, k: int | None = None) -> TokenBatch:
    """A float64 copy of ``batch`` whose pi values come from the full log-probabilities ``pi_full``
    [N, V]. With ``k`` and ``mu_full``: the behaviour's top-k list of ``mu_full`` instead of the
    stored one (log mu_k recomputed too), for a k above the stored list size."""
    dt = torch.float64
    if k is not None:
        kk = min(k, mu_full.shape[1])
        ids = mu_full.topk(kk, dim=1).indices  # [N, k] descending mu
        return TokenBatch(
            logp=pi_full.gather(1, batch.sampled_ids[:, None])[:, 0],
            behavior_logp=mu_full.gather(1, batch.sampled_ids[:, None])[:, 0],
            sampled_ids=batch.sampled_ids,
            topk_ids=ids,
            topk_behavior_logp=mu_full.gather(1, ids),
            topk_logp=pi_full.gather(1, ids),
            seq_ids=batch.seq_ids,
            vocab_size=batch.vocab_size,
        )
    ids = batch.topk_ids
    return replace(
        batch,
        logp=pi_full.gather(1, batch.sampled_ids[:, None])[:, 0],
        behavior_logp=batch.behavior_logp.detach().to(dt),
        topk_behavior_logp=batch.topk_behavior_logp.detach().to(dt),
        topk_logp=pi_full.gather(1, ids.clamp_min(0)).masked_fill(ids < 0, 0.0),
    )


def same_mu(b: TokenBatch, mu_full: Tensor) -> TokenBatch:
    """``b`` with its behaviour values (list and sampled token) replaced by the recomputed
    distribution ``mu_full`` [N, V] at the same ids: the list the bracket would have seen had the
    engine's numerics been the trainer's."""
    ids = b.topk_ids
    return replace(
        b,
        behavior_logp=mu_full.gather(1, b.sampled_ids[:, None])[:, 0],
        topk_behavior_logp=mu_full.gather(1, ids.clamp_min(0)).masked_fill(ids < 0, float("-inf")),
    )


def list_mass_diff(b: TokenBatch, b_re: TokenBatch) -> Tensor:
    """[N] sum over the union support S of |mu_i stored - mu_i recomputed| (probabilities)."""
    s, r = support(b, "union"), support(b_re, "union")
    diff = (s.mu_lp.exp() - r.mu_lp.exp()).abs()  # [N, K+1]; -inf on both off S
    return torch.where(s.member, diff, torch.zeros_like(diff)).sum(dim=1)


def estimates_at_k(batch64: TokenBatch, pi_full: Tensor, mu_full: Tensor, k: int, stored_k: int) -> dict[str, Tensor]:
    """The tail estimators, the exact top-K Ḋ, the bracket (from the list as stored and with the
    recomputed mu at the same ids), its containment tolerance and 1 - pi(list) for a behaviour
    list of size ``k``.

    ``contain_tol_k{K}`` = 2 sum_S |mu_stored - mu_recomputed| + 1e-12: lo and hi are affine in the
    list's mu (base through mu_k and sum_S pi_i mu_i, hi's tail term through min(mu_cap, mu_T)),
    each moved by at most that sum, so a bracket from the stored list contains the exact value of
    the recomputed mu within this tolerance whenever the bracket itself is right.
    """
    b = truncate_topk(batch64, k) if k <= stored_k else list_batch(batch64, pi_full, mu_full, k)
    b_re = same_mu(b, mu_full)
    lo, hi = ddot_kl_bracket(b)
    lo_re, hi_re = ddot_kl_bracket(b_re)
    genuine = b.topk_ids >= 0
    pi_list = torch.where(genuine, b.topk_logp, torch.full_like(b.topk_logp, float("-inf"))).logsumexp(dim=1)
    return {
        f"ddot_agg_k{k}": divergence_rate(b, "kl", "agg"),
        f"ddot_uniform_k{k}": divergence_rate(b, "kl", "uniform"),
        f"ddot_topk_exact_k{k}": ddot_topk_exact(b, square_mass(pi_full)),
        f"bracket_lo_k{k}": lo,
        f"bracket_hi_k{k}": hi,
        f"bracket_lo_same_mu_k{k}": lo_re,
        f"bracket_hi_same_mu_k{k}": hi_re,
        f"contain_tol_k{k}": 2.0 * list_mass_diff(b, b_re) + CONTAIN_FLOOR,
        f"pi_tail_k{k}": (-torch.expm1(pi_list)).clamp_min(0.0),
    }


def _np(t: Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


def record_tokens(
    replay,
    seed_value: int,
    minibatches: int,
    *,
    behaviour=None,
    ks: tuple[int, ...] = (),
    decompose_delta: float | None = None,
    own_tokens: int = 0,
    recut_ks: tuple[int, ...] = (),
) -> dict[str, np.ndarray]:
    """Replay the step once from checkpoint P; the columns described in the module docstring.

    ``behaviour``: a ``step_replay.Behaviour`` (the full behaviour distribution) turns on the
    exact columns; ``ks`` needs it. ``decompose_delta``: also the first-order parts of every
    token's ΔD (``first_order.decompose_minibatch``: ``fo_*`` columns), the own term on up to
    ``own_tokens`` tokens per minibatch, those with D > decompose_delta and A != 0 first.
    ``recut_ks``: the study at other list sizes K <= the stored K, from the lists re-cut
    (``truncate_topk``): ``d_k{K}``, ``d_one_k{K}`` (the top-K KL at that K before and after the
    token's own minibatch update) and ``keep_ddot_agg_k{K}``, ``keep_ddot_uniform_k{K}``.
    """
    from masktrl.analysis import first_order as fo
    from masktrl.analysis.step_replay import policy_outputs, replay_step, token_index

    if ks and behaviour is None:
        raise ValueError("estimates at other K need the behaviour distribution")
    if decompose_delta is not None and replay.cfg.train.grad_accum != 1:
        raise MasktrlError("the first-order decomposition needs train.grad_accum = 1 (one micro-batch per minibatch)")
    if decompose_delta is not None and (replay.method.kl_in_loss or replay.method.params.entropy_coef):
        raise MasktrlError(
            "the first-order decomposition covers the policy-gradient loss only: replay an update "
            "without the "
            "in-loss reference KL and entropy bonus (--update-method unmasked)"
        )
    pending: dict[int, tuple] = {}
    replay.restore()
    n = replay.n_tokens
    cols: dict[str, np.ndarray] = {}
    order: list[list[int]] = []
    temperature = replay.cfg.rollout.temperature

    def put(name: str, tok: np.ndarray, values: Tensor) -> None:
        v = _np(values)
        if name not in cols:
            cols[name] = np.zeros(n, dtype=v.dtype) if v.dtype == bool else np.full(n, np.nan, dtype=np.float64)
        cols[name][tok] = v

    def before(mb, idx, out, losses, u):
        b = out.batch
        tok = _np(token_index(replay, idx))
        adv = out.advantages.detach()
        lr = log_ratio(b).detach()
        agg, uni = divergence_rate(b, "kl", "agg").detach(), divergence_rate(b, "kl", "uniform").detach()
        lo, hi = (t.detach() for t in ddot_kl_bracket(b))
        put("minibatch", tok, torch.full_like(adv, mb))
        put("valid", tok, b.valid)
        put("adv", tok, adv)
        put("d", tok, divergence(b, "topk-kl").detach())
        put("log_ratio", tok, lr)
        put("ddot_agg", tok, agg)
        put("ddot_uniform", tok, uni)
        put("bracket_lo", tok, lo)
        put("bracket_hi", tok, hi)
        exact = topk_exact = None
        if behaviour is not None:
            exact, topk_exact = _exact_columns(replay, behaviour, idx, tok, b, ks, temperature, put)
        keeps = keep_decisions(adv, lr, agg, uni, lo, hi, exact)
        if topk_exact is not None:
            keeps["ddot_topk_exact"] = ~(torch.sign(adv.to(topk_exact.dtype) * topk_exact) > 0)
        for c, keep in keeps.items():
            put(f"keep_{c}", tok, keep)
        for k in recut_ks:
            bk = truncate_topk(b, k)
            put(f"d_k{k}", tok, divergence(bk, "topk-kl").detach())
            for tail in ("agg", "uniform"):
                put(f"keep_ddot_{tail}_k{k}", tok, ~(torch.sign(adv * divergence_rate(bk, "kl", tail).detach()) > 0))
        if decompose_delta is not None:
            total = replay.method.aggregate(losses.loss, b, horizon=replay.cfg.rollout.max_new_tokens)
            (coef,) = torch.autograd.grad(total, b.logp, retain_graph=True, allow_unused=True)
            coef = torch.zeros_like(b.logp) if coef is None else coef.detach()
            d_now = divergence(b, "topk-kl").detach()
            over = (b.valid & torch.isfinite(d_now) & (d_now > decompose_delta) & (adv != 0)).cpu().numpy()
            pending[mb] = (fo.snapshot(replay.optimizer), coef, fo.choose_own(over, own_tokens, seed_value * 1000 + mb))

    d_one: dict[int, Tensor] = {}

    def after(mb, idx):
        order.append(idx)
        d_one[mb] = divergence(policy_outputs(replay, idx).batch, "topk-kl")
        tok = _np(token_index(replay, idx))
        put("d_one", tok, d_one[mb])
        if recut_ks:
            after_batch = policy_outputs(replay, idx).batch
            for k in recut_ks:
                put(f"d_one_k{k}", tok, divergence(truncate_topk(after_batch, k), "topk-kl"))
        if decompose_delta is not None:
            snap, coef, own = pending.pop(mb)
            for name, values in fo.decompose_minibatch(replay, idx, snap, coef, own).items():
                put(name, tok, torch.from_numpy(values))

    replay_step(replay, seed_value, minibatches, before, after)
    for idx in order:
        put("d_all", _np(token_index(replay, idx)), divergence(policy_outputs(replay, idx).batch, "topk-kl"))
    seen = np.concatenate([_np(token_index(replay, idx)) for idx in order])
    if sorted(seen.tolist()) != list(range(n)):
        raise AssertionError("minibatches do not cover every token exactly once")
    seq = np.concatenate([np.full(len(s.gen.response_ids), i) for i, s in enumerate(replay.samples)])
    pos = np.concatenate([np.arange(len(s.gen.response_ids)) for s in replay.samples])
    cols["minibatch"] = cols["minibatch"].astype(np.int64)
    return {"sample": seq, "position": pos, **cols}


@torch.no_grad()
def _exact_columns(replay, behaviour, idx, tok: np.ndarray, b: TokenBatch, ks, temperature: float, put) -> Tensor:
    """d_full, ddot_exact (and the K columns) of the tokens ``tok``; returns ddot_exact [n]."""
    h_pi = response_hidden(replay.model, [replay.samples[i] for i in idx])  # [n, H]
    w_pi = lm_head_weight(replay.model)
    h_mu = behaviour.hidden[torch.as_tensor(tok)]
    step = chunk_rows(w_pi.shape[0])
    stored_k = int(b.topk_ids.shape[1])
    pieces: list[dict[str, Tensor]] = []
    for s in range(0, len(tok), step):
        e = min(s + step, len(tok))
        pi_full = full_logprobs(h_pi[s:e], w_pi, temperature)  # [c, V] float64
        mu_full = full_logprobs(h_mu[s:e], behaviour.weight, temperature)
        rows = _rows(b, s, e)
        sampled = rows.sampled_ids
        b64 = list_batch(rows, pi_full)
        piece = {
            "d_full": divergence_full(mu_full, pi_full, "kl"),
            "ddot_exact": divergence_rate_full(mu_full, pi_full, sampled, "kl"),
            "ddot_topk_exact": ddot_topk_exact(b64, square_mass(pi_full)),
            "mu_logp_recomputed": mu_full.gather(1, sampled[:, None])[:, 0],
            "mu_list_mass_diff": list_mass_diff(b64, same_mu(b64, mu_full)),
        }
        if ks:
            for k in ks:
                piece.update(estimates_at_k(b64, pi_full, mu_full, k, stored_k))
        pieces.append(piece)
    out = {k: torch.cat([p[k] for p in pieces]) for k in pieces[0]}
    for k, v in out.items():
        put(k, tok, v)
    return out["ddot_exact"], out["ddot_topk_exact"]


def _rows(b: TokenBatch, s: int, e: int) -> TokenBatch:
    """Rows s:e of a batch (detached)."""
    return TokenBatch(
        logp=b.logp[s:e].detach(),
        behavior_logp=b.behavior_logp[s:e],
        sampled_ids=b.sampled_ids[s:e],
        topk_ids=b.topk_ids[s:e],
        topk_behavior_logp=b.topk_behavior_logp[s:e],
        topk_logp=b.topk_logp[s:e].detach(),
        seq_ids=b.seq_ids[s:e],
        vocab_size=b.vocab_size,
    )
