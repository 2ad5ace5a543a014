"""How the transformers engine's own decode loops draw a token from a row's scores
(``rollout.draw``): ``torch.multinomial`` as ``generate`` draws it, or inverse transform
sampling with one uniform per row (rollout/fused.py explains both)."""

from __future__ import annotations

import torch

from masktrl.errors import MasktrlError

DRAWS = ("multinomial", "inverse_cdf")


def not_finite() -> MasktrlError:
    return MasktrlError(
        "the policy's next-token probabilities are not finite (NaN or inf): its weights have diverged, "
        "or a sampling temperature near 0 made logits / T overflow"
    )


BLOCK = 64  # tokens per block of the inverse-CDF draw


def inverse_cdf(lp: torch.Tensor, buffer: torch.Tensor | None = None, u: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of log-probabilities ``lp`` [R, V] (``-inf``: never drawn), by inverse
    transform sampling with one float64 uniform ``u`` per row: the first token whose cumulative
    probability exceeds ``u`` times the row's total. In two stages, so that no [R, V] float64
    cumulative sum is needed: the blocks of ``BLOCK`` tokens are summed in float64 and the block
    holding ``u`` x total is found among their cumulative sums, then the token within that
    block's own float64 cumulative sum; every token is drawn with its probability up to float64
    rounding, a zero-mass token never. MasktrlError for a row whose probabilities are not finite
    or sum to zero. ``buffer``: a float32 tensor of at least R rows of ``BLOCK``-padded V entries
    (``draw_buffer``), zero past V, computed in. ``u``: the rows' uniforms [R, 1] (float64),
    drawn here when not given."""
    rows, vocab = lp.shape
    if buffer is None:
        buffer = draw_buffer(rows, vocab, lp.device)
    probs = buffer[:rows]  # [R, nb * BLOCK], zeros past V
    torch.exp(lp, out=probs[:, :vocab])
    blocks = probs.view(rows, -1, BLOCK)  # [R, nb, BLOCK]
    block_cdf = blocks.sum(-1, dtype=torch.float64).cumsum_(-1)  # [R, nb]
    total = block_cdf[:, -1:]
    if not bool((torch.isfinite(total) & (total > 0)).all()):
        raise not_finite()
    if u is None:
        u = torch.rand(rows, 1, dtype=torch.float64, device=lp.device)
    x = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))  # < total, also after rounding
    b = torch.searchsorted(block_cdf, x, right=True)  # [R, 1]: the block whose interval holds x (it has mass)
    before = torch.where(b > 0, block_cdf.gather(1, (b - 1).clamp_min(0)), torch.zeros_like(x))
    within = blocks.gather(1, b[:, :, None].expand(rows, 1, BLOCK)).squeeze(1)  # [R, BLOCK]
    j = torch.searchsorted(within.cumsum(-1, dtype=torch.float64), x - before, right=True)
    # x - before can reach the block's own sum through rounding (its cumulative sum adds in
    # another order): then the block's last token with mass
    last = BLOCK - 1 - (within > 0).flip(-1).to(torch.uint8).argmax(-1, keepdim=True)
    return (b * BLOCK + torch.where(j >= BLOCK, last, j)).squeeze(1)


def draw_buffer(rows: int, vocab: int, device) -> torch.Tensor:
    """The buffer ``inverse_cdf`` computes in for ``rows`` rows of ``vocab`` tokens."""
    return torch.zeros(rows, -(-vocab // BLOCK) * BLOCK, device=device)


def draw_buffers(draw: str, rows: int, vocab: int, device) -> torch.Tensor | None:
    """The buffer a batch of ``rows`` draws in (None for draws that need none)."""
    return draw_buffer(rows, vocab, device) if draw == "inverse_cdf" else None


def draw_tokens(
    scores: torch.Tensor,
    lp: torch.Tensor,
    do_sample: bool,
    draw: str,
    buffers=None,
    live: torch.Tensor | None = None,
    batch: int | None = None,
) -> torch.Tensor:
    """The next token of each row: ``argmax`` (greedy), ``torch.multinomial`` of
    ``softmax(scores)`` as ``generate`` draws it, or ``inverse_cdf`` of the log-probs ``lp``
    (in ``buffers``, ``draw_buffers``).

    ``live``: where the rows of ``scores`` stand in a batch of ``batch`` rows whose others have
    ended (rollout/decode.py). The random numbers are then drawn for the whole batch, as if no
    row had left, and the live rows' are used: ``multinomial`` over a [batch, V] tensor (the
    ended rows given any distribution: their draws are discarded), ``inverse_cdf`` with the live
    rows' uniforms of ``batch``. So a row's token depends on its own scores and the seed only,
    not on which rows have ended: with the same scores, the tokens of a loop that keeps every row
    (``generate``, rollout/fused.py)."""
    if not do_sample:
        return scores.argmax(dim=-1)
    whole_batch = batch if live is not None and batch is not None and live.shape[0] < batch else None
    if draw == "inverse_cdf":
        u = None
        if whole_batch is not None:
            u = torch.rand(whole_batch, 1, dtype=torch.float64, device=lp.device)[live]
        return inverse_cdf(lp, buffers, u)
    probs = torch.softmax(scores, dim=-1)
    if whole_batch is not None:
        whole = probs.new_zeros(whole_batch, probs.shape[1])
        whole[:, 0] = 1.0  # the ended rows' (discarded) draws
        whole[live] = probs
        return torch.multinomial(whole, num_samples=1).squeeze(1)[live]
    return torch.multinomial(probs, num_samples=1).squeeze(1)
