"""Chunked policy log-probabilities: log softmax(h W^T / T) at a few ids per token.

Never materialises the [N, V] logits of all tokens. The forward pass computes one chunk of
``chunk_size`` tokens at a time (logits -> logsumexp -> gather) and keeps only the logsumexp;
a custom ``autograd.Function`` recomputes each chunk's logits in the backward pass, so
backward also holds one chunk's [chunk, V] buffer at a time:

    d logp_j / d logits = e_{id_j} - p,   grad_logits = scatter(g) - p * sum_j g_j

Where all N tokens fit in one chunk and their logits in ``KEEP_LOGITS_BYTES`` (the lab's
micro-batch of 320 tokens x 2,004 ids: 2.5 MB), the forward keeps that one buffer for the
backward instead of freeing it, and the backward skips the recomputing GEMM: the same values bit
for bit (the same product of the same chunk), one [chunk, V] buffer as before, held a little
longer (tests/test_logprobs.py).

The entropy H = lse - sum_i p_i x_i comes out of the same pass. With ``entropy_grad=True`` it is
differentiable too: dH/dx_i = -p_i (log p_i + H), added to the same recomputed chunk in the
backward pass, which then holds a second [chunk, V] buffer (log p and p), still never [N, V].

Logits are computed in float32 at least (float64 inputs stay float64); the result has that
dtype. Padding ids (< 0) give **0.0** with zero gradient (0.0 rather than -inf so that nothing
downstream turns into NaN; mask them yourself).
"""

from __future__ import annotations

import torch
from torch import Tensor

KEEP_LOGITS_BYTES = 64 * 2**20  # the most a forward keeps for its backward (one chunk of logits)


def _compute_dtype(*ts: Tensor | None) -> torch.dtype:
    dt = torch.float32
    for t in ts:
        if t is not None:
            dt = torch.promote_types(dt, t.dtype)
    return dt


def _check(hidden: Tensor, weight: Tensor, ids: Tensor | None, temperature: float, chunk_size: int, bias) -> None:
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"weight must be [V, H] with H = hidden.shape[-1] = {hidden.shape[-1]}, got {list(weight.shape)}"
        )
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must have shape [V] = [{weight.shape[0]}], got {list(bias.shape)}")
    if not (isinstance(temperature, (int, float)) and 0 < temperature < float("inf")):
        raise ValueError(f"temperature must be a positive finite number, got {temperature!r}")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if ids is not None:
        if ids.is_floating_point() or ids.shape[:-1] != hidden.shape[:-1] or ids.dim() != hidden.dim():
            raise ValueError(
                "ids must be an integer tensor [..., J] with leading dims "
                f"{list(hidden.shape[:-1])}, got {ids.dtype} {list(ids.shape)}"
            )
        if ids.numel() and int(ids.max()) >= weight.shape[0]:
            raise ValueError(f"ids must be < V = {weight.shape[0]}")


def _chunk_logits(h: Tensor, w: Tensor, b: Tensor | None, inv_t: float, out: Tensor) -> Tensor:
    """out[:n] = (h W^T + b) / T for a chunk h [n, H]; returns the view [n, V]."""
    buf = out[: h.shape[0]]
    h = h * inv_t if inv_t != 1.0 else h
    if b is None:
        return torch.matmul(h, w.t(), out=buf)
    return torch.addmm(b * inv_t, h, w.t(), out=buf)


def _keeps_logits(n: int, v: int, chunk: int, dtype: torch.dtype) -> bool:
    """Whether the forward keeps the logits for the backward: one chunk, within KEEP_LOGITS_BYTES."""
    return 0 < n <= chunk and n * v * (torch.finfo(dtype).bits // 8) <= KEEP_LOGITS_BYTES


@torch.no_grad()
def _forward(h, w, b, ids, inv_t: float, chunk: int, want_entropy: bool, keep: bool = False):
    """logp [N, J] (0 at padding), lse [N], entropy [N] or None, and with ``keep`` (one chunk)
    the logits [N, V] untouched, else None; all in h's (compute) dtype."""
    n, v = h.shape[0], w.shape[0]
    j = ids.shape[1]
    logp = torch.zeros(n, j, dtype=h.dtype, device=h.device)  # [N, J]
    lse = torch.empty(n, dtype=h.dtype, device=h.device)  # [N]
    ent = torch.empty(n, dtype=h.dtype, device=h.device) if want_entropy else None
    buf = torch.empty(min(chunk, n), v, dtype=h.dtype, device=h.device)  # [C, V] reused
    ebuf = torch.empty_like(buf) if want_entropy else None
    kept = torch.empty_like(buf) if keep else None  # [N, V]: the logits, for the backward
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        raw = _chunk_logits(h[s:e], w, b, inv_t, buf if kept is None else kept)  # [c, V]
        pad = ids[s:e] < 0  # [c, J]
        picked = raw.gather(1, ids[s:e].clamp_min(0))  # [c, J]
        mx = raw.amax(dim=1, keepdim=True)  # [c, 1]
        x = raw.sub_(mx) if kept is None else torch.sub(raw, mx, out=buf[: e - s])
        if want_entropy:
            ex = torch.exp(x, out=ebuf[: e - s])  # [c, V]
            tot = ex.sum(dim=1)  # [c]
            dot = ex.mul_(x).nan_to_num_(nan=0.0).sum(dim=1)  # [c] sum e^x x (0 * -inf -> 0)
            ent[s:e] = tot.log() - dot / tot
        else:
            tot = x.exp_().sum(dim=1)  # [c]
        lse[s:e] = mx.squeeze(1) + tot.log()
        logp[s:e] = (picked - lse[s:e, None]).masked_fill_(pad, 0.0)
    return logp, lse, ent, kept


class _ChunkedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, inv_t, chunk, want_entropy, entropy_grad=False, grad_mode=True):
        dt = _compute_dtype(hidden, weight, bias)
        h, w = hidden.to(dt), weight.to(dt)
        b = None if bias is None else bias.to(dt)
        keep = grad_mode and any(ctx.needs_input_grad[:3]) and _keeps_logits(h.shape[0], w.shape[0], chunk, h.dtype)
        logp, lse, ent, kept = _forward(h, w, b, ids, inv_t, chunk, want_entropy, keep)
        ctx.inv_t, ctx.chunk = inv_t, chunk
        ctx.kept = kept  # an intermediate, not an input or output: held on ctx, used up by the backward
        ctx.entropy_grad = bool(entropy_grad and ent is not None)
        if ctx.entropy_grad:
            ctx.save_for_backward(hidden, weight, bias, ids, lse, ent)
            ctx.set_materialize_grads(False)
        else:
            ctx.save_for_backward(hidden, weight, bias, ids, lse)
            if ent is not None:
                ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logp, grad_ent):
        if ctx.entropy_grad:
            hidden, weight, bias, ids, lse, ent = ctx.saved_tensors
        else:
            (hidden, weight, bias, ids, lse), ent = ctx.saved_tensors, None
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        dt = lse.dtype
        h, w = hidden.to(dt), weight.to(dt)
        b = None if bias is None else bias.to(dt)
        inv_t, chunk = ctx.inv_t, ctx.chunk
        n, v = h.shape[0], w.shape[0]
        if grad_logp is None:  # only the entropy is used (set_materialize_grads(False))
            grad_logp = torch.zeros(ids.shape, dtype=dt, device=h.device)
        g = grad_logp.to(dt).masked_fill(ids < 0, 0.0)  # [N, J]
        gsum = g.sum(dim=1)  # [N]
        g_ent = None if ent is None or grad_ent is None else grad_ent.to(dt)  # [N]
        safe_ids = ids.clamp_min(0)
        grad_h = torch.empty_like(h) if need_h else None  # [N, H]
        grad_w = torch.zeros_like(w) if need_w else None  # [V, H]
        grad_b = torch.zeros(v, dtype=dt, device=h.device) if need_b else None  # [V]
        kept, ctx.kept = ctx.kept, None  # a second backward (retain_graph) recomputes
        buf = torch.empty(min(chunk, n), v, dtype=dt, device=h.device) if kept is None else None  # [C, V] reused
        pbuf = torch.empty(min(chunk, n), v, dtype=dt, device=h.device) if g_ent is not None else None  # [C, V] p
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            if kept is None:  # the chunk's logits again, then log p in place
                x = _chunk_logits(h[s:e], w, b, inv_t, buf).sub_(lse[s:e, None])  # [c, V]
            else:  # the forward's logits (one chunk), used up in place
                x = kept[s:e].sub_(lse[s:e, None])
            if g_ent is None:
                x.exp_()  # p
                x.mul_(-gsum[s:e, None])
            else:  # p * (-sum_j g_j - g_H (log p + H)): the log-probs' and the entropy's terms at once
                p = torch.exp(x, out=pbuf[: e - s])  # [c, V]
                x.add_(ent[s:e, None]).mul_(-g_ent[s:e, None]).sub_(gsum[s:e, None]).mul_(p)
            x.scatter_add_(1, safe_ids[s:e], g[s:e])  # d loss / d logits
            if need_h:
                torch.matmul(x, w, out=grad_h[s:e]).mul_(inv_t)
            if need_w:
                grad_w.addmm_(x.t(), h[s:e], alpha=inv_t)
            if need_b:
                grad_b.add_(x.sum(dim=0), alpha=inv_t)
        out_h = None if grad_h is None else grad_h.to(hidden.dtype)
        out_w = None if grad_w is None else grad_w.to(weight.dtype)
        out_b = None if grad_b is None else grad_b.to(bias.dtype)
        return out_h, out_w, out_b, None, None, None, None, None, None


def _run(hidden, weight, ids, temperature, chunk_size, bias, want_entropy, entropy_grad=False):
    _check(hidden, weight, ids, temperature, chunk_size, bias)
    lead = hidden.shape[:-1]
    h2 = hidden.reshape(-1, hidden.shape[-1])  # [N, H]
    ids2 = ids.reshape(h2.shape[0], ids.shape[-1]).long()  # [N, J]
    logp, ent = _ChunkedLogProbs.apply(
        h2,
        weight,
        bias,
        ids2,
        1.0 / float(temperature),
        chunk_size,
        want_entropy,
        entropy_grad,
        torch.is_grad_enabled(),
    )
    return logp.reshape(*lead, ids.shape[-1]), None if ent is None else ent.reshape(lead)


def token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    ids: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    bias: Tensor | None = None,
) -> Tensor:
    """[..., J] log softmax(hidden @ weight^T / T + bias / T) gathered at ``ids`` [..., J].

    hidden [..., H]: final hidden states (after the model's final norm); weight [V, H]: the
    lm_head; ids: long, entries < 0 are padding (returned as 0.0, zero gradient).
    Differentiable w.r.t. hidden, weight and bias; peak memory O(chunk_size * V).
    """
    return _run(hidden, weight, ids, temperature, chunk_size, bias, False)[0]


def token_logprobs_and_entropy(
    hidden: Tensor,
    weight: Tensor,
    ids: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    bias: Tensor | None = None,
    entropy_grad: bool = False,
) -> tuple[Tensor, Tensor]:
    """``token_logprobs`` plus the entropy [...] of softmax(logits / T) per token, in the same
    single pass over the vocabulary. ``entropy_grad``: the entropy is differentiable too (an
    entropy bonus); otherwise it carries no gradient and the backward pass is unchanged."""
    return _run(hidden, weight, ids, temperature, chunk_size, bias, True, entropy_grad)


@torch.no_grad()
def token_entropy(
    hidden: Tensor, weight: Tensor, *, temperature: float = 1.0, chunk_size: int = 1024, bias: Tensor | None = None
) -> Tensor:
    """[...] entropy of softmax((hidden @ weight^T + bias) / T) per token, chunked, no gradient."""
    _check(hidden, weight, None, temperature, chunk_size, bias)
    dt = _compute_dtype(hidden, weight, bias)
    h2 = hidden.reshape(-1, hidden.shape[-1]).to(dt)
    ids = torch.zeros(h2.shape[0], 0, dtype=torch.long, device=h2.device)
    b = None if bias is None else bias.to(dt)
    ent = _forward(h2, weight.to(dt), b, ids, 1.0 / float(temperature), chunk_size, True)[2]
    return ent.reshape(hidden.shape[:-1])


@torch.no_grad()
def token_square_mass(
    hidden: Tensor, weight: Tensor, *, temperature: float = 1.0, chunk_size: int = 1024, bias: Tensor | None = None
) -> Tensor:
    """[...] sum_j p_j^2 of p = softmax((hidden @ weight^T + bias) / T) per token, chunked, no
    gradient (the ``pi_sq_sum`` of ``masktrl.methods.ddot_topk_exact``): sum_j e^{2(x_j - max)} /
    (sum_j e^{x_j - max})^2 over one [chunk, V] buffer at a time."""
    _check(hidden, weight, None, temperature, chunk_size, bias)
    dt = _compute_dtype(hidden, weight, bias)
    h2 = hidden.reshape(-1, hidden.shape[-1]).to(dt)
    w = weight.to(dt)
    b = None if bias is None else bias.to(dt)
    n = h2.shape[0]
    out = torch.empty(n, dtype=dt, device=h2.device)
    buf = torch.empty(min(chunk_size, max(n, 1)), w.shape[0], dtype=dt, device=h2.device)
    inv_t = 1.0 / float(temperature)
    for s in range(0, n, chunk_size):
        e = min(s + chunk_size, n)
        x = _chunk_logits(h2[s:e], w, b, inv_t, buf)  # [c, V]
        x.sub_(x.amax(dim=1, keepdim=True)).exp_()
        tot = x.sum(dim=1)  # [c]
        out[s:e] = x.square_().sum(dim=1) / (tot * tot)
    return out.reshape(hidden.shape[:-1])


def renormalise_over_kept(lp: Tensor, kept: Tensor | None) -> Tensor:
    """log pi renormalised over each token's kept set (truncated sampling, docs/ROLLOUTS.md).

    ``lp`` [N, 1+K]: log pi at the sampled id then the behaviour's top-K ids (the policy
    forward's output); ``kept`` [N]: the kept set is the first ``kept[i]`` entries of row i's
    top-K list (0: the whole vocabulary, the row is returned as it is; more than K: ValueError,
    a kept set the list does not hold); None: nothing truncated, ``lp`` itself is returned. With S_i = sum_{j < kept[i]}
    pi(topk_ij) (the policy's mass on
    the kept set), the result is log pi - log S for the sampled token and the kept entries, and
    -inf for the list entries outside the kept set (the renormalised pi~ puts no mass there, as
    mu does). The gradient flows through log S too: d log pi~ = d log pi - d log S."""
    if kept is None:
        return lp
    topk = lp[:, 1:]  # [N, K]
    if bool((kept > topk.shape[1]).any()):
        raise ValueError(
            f"a kept set holds more tokens than the top-K list (K = {topk.shape[1]}): pi cannot be renormalised over it"
        )
    inside = torch.arange(topk.shape[1], device=lp.device)[None, :] < kept[:, None]  # [N, K]
    neg_inf = torch.tensor(float("-inf"), dtype=lp.dtype, device=lp.device)
    log_s = torch.logsumexp(torch.where(inside, topk, neg_inf), dim=1)  # [N] (-inf for kept = 0: replaced below)
    truncated = kept > 0  # [N]
    log_s = torch.where(truncated, log_s, torch.zeros_like(log_s))
    out = lp - log_s[:, None]  # [N, 1+K]
    return torch.cat([out[:, :1], torch.where(inside | ~truncated[:, None], out[:, 1:], neg_inf)], dim=1)
