"""Environment tokens of multi-turn rollouts (a tool's reply, appended as tokens) are never
trained on and never counted (docs/ROLLOUTS.md, "Multi-turn rollouts").

The interleaving-invariance test builds the same policy tokens with and without environment
spans between them and checks that every registered rule, under every correction kind and
mode, gives the same per-policy-token loss, mask, scalar loss, diagnostics and gradient, and
that no environment token gets a gradient. Float64 throughout.
"""

from __future__ import annotations

import math
import random
import zlib

import pytest
import torch

import masktrl.methods  # noqa: F401  (registers the methods)
from masktrl.errors import MasktrlError
from masktrl.methods import TokenBatch
from masktrl.methods.corrections import CORRECTION_KINDS, CORRECTION_MODES, CorrectionParams, correction_diagnostics
from masktrl.methods.diagnostics import token_diagnostics
from masktrl.methods.registry import get_method, method_names
from masktrl.rl.lab_stats import behaviour_stats
from masktrl.rl.policy import behaviour_logp, policy_token_batch
from masktrl.rollout.base import ENVIRONMENT, POLICY, Generation, Sample, policy_tokens

V, K = 12, 4
NON_VACUOUS = {"trm": {"delta": 1e3}}  # as tests/test_packing.py: TRM's default masks every sequence of random tokens


def _dist(rng: random.Random, sharp: float = 2.0) -> list[float]:
    z = [rng.gauss(0, sharp) for _ in range(V)]
    m = max(z)
    s = math.log(sum(math.exp(x - m) for x in z)) + m
    return [x - s for x in z]


def _policy_token(rng: random.Random) -> dict:
    """One sampled token: mu, pi, pi_old over V; k ~ mu; mu's top-K list."""
    mu, pi, old = _dist(rng), _dist(rng), _dist(rng)
    pi = [0.5 * a + 0.5 * b for a, b in zip(mu, pi)]  # pi near mu, so rules keep some tokens
    s = math.log(sum(math.exp(x) for x in pi))
    pi = [x - s for x in pi]
    old = [0.7 * a + 0.3 * b for a, b in zip(mu, old)]
    s = math.log(sum(math.exp(x) for x in old))
    old = [x - s for x in old]
    k = rng.choices(range(V), weights=[math.exp(x) for x in mu])[0]
    top = sorted(range(V), key=lambda j: -mu[j])[:K]
    return {
        "k": k,
        "mu": mu[k],
        "pi": pi[k],
        "old": old[k],
        "ids": top,
        "mu_top": [mu[j] for j in top],
        "pi_top": [pi[j] for j in top],
        "old_top": [old[j] for j in top],
        "u": rng.random(),
    }


def _env_token(rng: random.Random) -> dict:
    """A tool's reply token: what the forward computes there is finite, what was recorded is
    padding (and a finite garbage log mu, which ``behaviour_logp`` must ignore)."""
    return {
        "k": rng.randrange(V),
        "mu": -rng.uniform(0.1, 3),
        "pi": -rng.uniform(0.1, 3),
        "old": -rng.uniform(0.1, 3),
        "ids": [-1] * K,
        "mu_top": [float("-inf")] * K,
        "pi_top": [-rng.uniform(0.1, 3) for _ in range(K)],
        "old_top": [-rng.uniform(0.1, 3) for _ in range(K)],
        "u": rng.random(),
    }


def make_batches(seed: int, groups: int = 2, per_group: int = 3):
    """(plain samples, interleaved samples, their tokens): the same policy tokens; the interleaved
    responses hold 1-3 environment spans (1-4 tokens each) between and after them."""
    rng = random.Random(seed)
    plain, mixed = [], []
    for g in range(groups):
        for _ in range(per_group):
            pol = [_policy_token(rng) for _ in range(rng.randrange(2, 9))]
            adv = rng.uniform(-1, 1)
            toks, src, turn, t = [], [], [], 0
            cuts = sorted(rng.sample(range(1, len(pol) + 1), min(len(pol), rng.randrange(1, 4))))
            start = 0
            for c in cuts:
                toks += pol[start:c]
                src += [POLICY] * (c - start)
                turn += [t] * (c - start)
                n = rng.randrange(1, 5)
                toks += [_env_token(rng) for _ in range(n)]
                src += [ENVIRONMENT] * n
                turn += [t] * n
                t += 1
                start = c
            toks += pol[start:]
            src += [POLICY] * (len(pol) - start)
            turn += [t] * (len(pol) - start)
            for out, tk, s, tr in ((plain, pol, None, None), (mixed, toks, src, turn)):
                gen = Generation(
                    [x["k"] for x in tk],
                    [x["mu"] for x in tk],
                    [x["ids"] for x in tk],
                    [x["mu_top"] for x in tk],
                    True,
                    source=s,
                    turn=tr,
                )
                out.append((Sample(f"e{g}", "", "", [1, 2], g, gen, advantage=adv), tk))
    return plain, mixed


def token_batch(pairs):
    """(TokenBatch with a leaf logp, advantages [N], u [N], old (logp, topk) ) as
    ``policy_token_batch`` builds it from the samples (behaviour log mu via ``behaviour_logp``)."""
    samples = [s for s, _ in pairs]
    toks = [x for _, tk in pairs for x in tk]
    dt = torch.float64
    logp = torch.tensor([x["pi"] for x in toks], dtype=dt, requires_grad=True)
    topk_logp = torch.tensor([x["pi_top"] for x in toks], dtype=dt, requires_grad=True)
    batch = TokenBatch(
        logp=logp,
        behavior_logp=torch.tensor([v for s in samples for v in behaviour_logp(s)], dtype=dt),
        sampled_ids=torch.tensor([x["k"] for x in toks]),
        topk_ids=torch.tensor([x["ids"] for x in toks]),
        topk_behavior_logp=torch.tensor([x["mu_top"] for x in toks], dtype=dt),
        topk_logp=topk_logp,
        seq_ids=torch.tensor([i for i, s in enumerate(samples) for _ in s.gen.response_ids]),
        vocab_size=V,
    )
    adv = torch.tensor([s.advantage for s in samples for _ in s.gen.response_ids], dtype=dt)
    u = torch.tensor([x["u"] for x in toks], dtype=dt)
    old = (torch.tensor([x["old"] for x in toks], dtype=dt), torch.tensor([x["old_top"] for x in toks], dtype=dt))
    own = torch.tensor([p for s in samples for p in policy_tokens(s.gen)])
    return batch, adv, u, old, own, (logp, topk_logp)


def _run(name: str, correction: CorrectionParams, pairs):
    method = get_method(name)
    bound = method.bind(method.make_params(**NON_VACUOUS.get(name, {})), correction)
    batch, adv, u, old, own, leaves = token_batch(pairs)
    losses, corr, seen = bound.corrected_token_losses(batch, adv, old=old, u=u if bound.needs_u else None)
    loss = bound.aggregate(losses.loss, batch, horizon=20)
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    grads = [torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves)]
    diag = {**token_diagnostics(seen, losses, adv, bound.params), **correction_diagnostics(corr, batch)}
    return losses, loss.detach(), grads, diag, own


def _corrections():
    out = []
    for kind in CORRECTION_KINDS:
        for mode in CORRECTION_MODES:
            try:
                out.append(CorrectionParams(kind=kind, mode=mode))
            except (MasktrlError, ValueError):  # a combination the block refuses
                pass
    return out


def _same(a, b):
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == pytest.approx(b, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("correction", _corrections(), ids=lambda c: f"{c.kind}-{c.mode}")
@pytest.mark.parametrize("name", method_names())
def test_interleaved_environment_tokens_change_nothing(name, correction):
    plain, mixed = make_batches(seed=zlib.crc32(f"{name}/{correction.kind}/{correction.mode}".encode()) % 1000)
    la, loss_a, ga, da, _ = _run(name, correction, plain)
    lb, loss_b, gb, db, own = _run(name, correction, mixed)
    assert int(own.sum()) == la.loss.shape[0] < lb.loss.shape[0]  # the interleaving is not vacuous
    torch.testing.assert_close(lb.loss[own], la.loss, atol=1e-12, rtol=1e-12)
    assert torch.equal(lb.mask[own], la.mask)
    assert bool(lb.mask[~own].all())  # environment tokens count as masked-out, never as kept
    assert float(lb.loss[~own].detach().abs().sum()) == 0.0
    torch.testing.assert_close(loss_b, loss_a, atol=1e-12, rtol=1e-12)
    for a, b in zip(ga, gb):
        torch.testing.assert_close(b[own], a, atol=1e-12, rtol=1e-10)
        assert float(b[~own].abs().sum()) == 0.0  # no environment token gets a gradient
    if correction.kind == "none":  # not vacuous (a correction may legitimately reject every token of a small batch)
        assert ga[0].abs().sum() > 0
    assert da.keys() == db.keys()
    for key in da:
        assert _same(db[key], da[key]), key


def test_policy_forward_gives_environment_tokens_no_gradient():
    """Through ``policy_token_batch`` on a tiny model: environment tokens are invalid (behaviour
    -inf whatever was recorded), and d loss / d log pi is 0 there for every rule."""
    from masktrl.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer("0123456789+=")
    model = build_tiny_model(
        tok, TinyModelConfig(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32), seed=0
    ).double()
    vocab = model.config.vocab_size
    _, mixed = make_batches(seed=3)
    samples = []
    for s, _ in mixed:
        gen = s.gen
        gen.response_ids = [t % vocab for t in gen.response_ids]
        gen.topk_ids = [[j % vocab if j >= 0 else -1 for j in row] for row in gen.topk_ids]
        samples.append(s)
    for share in (False, True):
        out = policy_token_batch(model, samples, 1.0, 7, share=share)
        own = torch.tensor([p for s in samples for p in policy_tokens(s.gen)])
        assert torch.equal(out.batch.valid, own)
        for name in method_names():
            method = get_method(name)
            bound = method.bind(method.make_params(**NON_VACUOUS.get(name, {})))
            u = (
                torch.rand(out.batch.n, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
                if bound.needs_u
                else None
            )
            losses = bound.token_losses(out.batch, out.advantages, u=u)
            loss = bound.aggregate(losses.loss, out.batch, horizon=20)
            (g,) = torch.autograd.grad(loss, out.batch.logp, retain_graph=True)
            assert float(g[~own].abs().sum()) == 0.0, name


def test_batch_statistics_leave_environment_tokens_out():
    plain, mixed = make_batches(seed=5)
    a = behaviour_stats([s for s, _ in plain], V)
    b = behaviour_stats([s for s, _ in mixed], V)
    assert a == b


def test_single_turn_generation_is_all_policy():
    gen = Generation([3, 4], [-0.1, -0.2], [[3, 1], [4, 1]], [[-0.1, -3.0], [-0.2, -2.0]], True)
    assert policy_tokens(gen) == [True, True]
    assert behaviour_logp(Sample("e", "", "", [1], 0, gen)) is gen.logp  # untouched: single-turn runs are bit-identical


# --------------------------------------------------------------------------- the rollout file


def test_multi_turn_rollouts_round_trip(tmp_path):
    import pyarrow.parquet as pq

    from masktrl.rollout.storage import read_rollouts, write_rollouts

    _, mixed = make_batches(seed=7)
    samples = [s for s, _ in mixed]
    for s in samples:  # what an engine records: no log mu at an environment token
        s.gen.logp = behaviour_logp(s)
    for fmt in (1, 2):
        path = tmp_path / f"mt{fmt}.parquet"
        write_rollouts(path, samples, {"step": 0}, fmt=fmt)
        assert {"source", "turn"} <= set(pq.read_schema(path).names)
        back, _ = read_rollouts(path, vocab_size=V)
        for a, b in zip(samples, back):
            assert (b.gen.source, b.gen.turn) == (a.gen.source, a.gen.turn)
            assert b.gen.response_ids == a.gen.response_ids
            assert b.gen.logp == [float(torch.tensor(x, dtype=torch.float32)) for x in a.gen.logp]
            assert b.gen.topk_ids == a.gen.topk_ids


def test_single_turn_rollouts_have_no_turn_columns(tmp_path):
    import pyarrow.parquet as pq

    from masktrl.rollout.storage import read_rollouts, write_rollouts

    plain, _ = make_batches(seed=8)
    path = tmp_path / "st.parquet"
    write_rollouts(path, [s for s, _ in plain], {"step": 0})
    assert not {"source", "turn"} & set(
        pq.read_schema(path).names
    )  # the file is what it was before the columns existed
    back, _ = read_rollouts(path, vocab_size=V)
    assert all(s.gen.source is None and s.gen.turn is None for s in back)


def test_an_environment_token_with_a_behaviour_logprob_is_refused(tmp_path):
    from masktrl.errors import ArtifactError
    from masktrl.rollout.storage import read_rollouts, write_rollouts

    _, mixed = make_batches(seed=9)
    samples = [s for s, _ in mixed]  # environment tokens still hold a finite (garbage) log mu
    path = tmp_path / "bad.parquet"
    write_rollouts(path, samples, {"step": 0})
    with pytest.raises(ArtifactError, match="environment token has a behaviour log-prob"):
        read_rollouts(path)
