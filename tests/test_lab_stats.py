"""The lab statistics: behaviour residual mass, unlisted tokens, tokens over delta and disagreements."""

import math
from dataclasses import replace

import pytest
import torch

from masktrl.analysis.disagreement import over_delta, pair_set
from masktrl.analysis.token_replay import keep_decisions
from masktrl.methods import TokenBatch, divergence, divergence_rate
from masktrl.methods.batch import outside_list, residual_mass
from masktrl.rl.lab_stats import LabStats, behaviour_stats, lab_summary, update_counts
from masktrl.rollout.base import Generation, Sample


def _batch(n=400, vocab=12, k=4, spread=1.5, drift=1.0, seed=0):
    """Random behaviour/training softmaxes over ``vocab`` tokens, mu's top-k lists, k ~ mu."""
    g = torch.Generator().manual_seed(seed)
    z_mu = spread * torch.randn(n, vocab, generator=g, dtype=torch.float64)
    z = z_mu + drift * torch.randn(n, vocab, generator=g, dtype=torch.float64)
    mu_lp, pi_lp = z_mu.log_softmax(1), z.log_softmax(1)
    sampled = torch.multinomial(mu_lp.exp(), 1, generator=g)[:, 0]
    top = mu_lp.topk(k, dim=1).indices
    rows = torch.arange(n)
    batch = TokenBatch(
        logp=pi_lp[rows, sampled],
        behavior_logp=mu_lp[rows, sampled],
        sampled_ids=sampled,
        topk_ids=top,
        topk_behavior_logp=mu_lp.gather(1, top),
        topk_logp=pi_lp.gather(1, top),
        seq_ids=rows // 4,
        vocab_size=vocab,
    )
    adv = torch.randn(n // 4, generator=g, dtype=torch.float64).repeat_interleave(4)
    adv[:8] = 0.0  # two sequences without signal
    return batch, adv


def test_residual_mass_by_hand():
    ids = torch.tensor([[0, 1, -1], [2, 0, 1], [3, 3, -1]])  # a repeated id counts once
    lp = torch.log(torch.tensor([[0.5, 0.3, 0.9], [0.2, 0.3, 0.5], [1.0, 0.7, 0.7]], dtype=torch.float64))
    resid = residual_mass(lp, ids, vocab_size=4)
    # padding ignored (whatever its value); lists holding all the mass have tail 0
    torch.testing.assert_close(resid, torch.tensor([0.2, 0.0, 0.0], dtype=torch.float64))
    full = torch.tensor([[0, 1, 2, 3]])
    almost = torch.log(torch.tensor([[0.5, 0.2, 0.2, 0.0999]], dtype=torch.float64))
    assert residual_mass(almost, full, vocab_size=4).item() == 0.0  # the list is the whole vocabulary
    assert residual_mass(almost, full, vocab_size=None).item() == pytest.approx(1e-4)


def test_outside_list():
    ids = torch.tensor([[4, 5], [4, 5], [7, -1]])
    assert outside_list(torch.tensor([5, 6, -1]), ids).tolist() == [False, True, True]  # padding is no entry


def _sample(response, logp, topk_ids, topk_logp):
    return Sample("e", "p", "a", [1], 0, Generation(response, logp, topk_ids, topk_logp, True))


def test_behaviour_stats_of_a_rollout_batch():
    lp = math.log
    samples = [
        _sample(
            [5, 6], [lp(0.5), lp(0.1)], [[5, 7], [7, 5]], [[lp(0.5), lp(0.2)], [lp(0.6), lp(0.2)]]
        ),  # resid 0.3, 0.2; 6 unlisted
        _sample([7], [lp(0.995)], [[7, 5]], [[lp(0.995), lp(0.001)]]),  # resid 0.004
        _sample([], [], [], []),  # an empty response adds nothing
        _sample([8], [lp(0.5)], [[8]], [[lp(0.5)]]),  # a shorter list: resid 0.5
    ]
    stats = behaviour_stats(samples, vocab_size=100)
    assert stats["lab/outside_topk_frac"] == pytest.approx(1 / 4)
    assert stats["lab/resid_ge_0.01_frac"] == pytest.approx(3 / 4)
    resid = torch.tensor([0.3, 0.2, 0.004, 0.5], dtype=torch.float64)
    assert stats["lab/resid_p50"] == pytest.approx(float(torch.quantile(resid, 0.5)))
    assert stats["lab/resid_p10"] < stats["lab/resid_p50"] < stats["lab/resid_p90"]
    assert behaviour_stats([samples[2]], vocab_size=100) == {}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_update_counts_match_the_disagreement_study(seed):
    """The counts are the disagreement study's sets (analysis/disagreement.py) on the same tokens."""
    batch, adv = _batch(seed=seed)
    delta = 0.15
    counts = update_counts(batch, adv, delta)
    d = divergence(batch, "topk-kl")
    agg, uni = divergence_rate(batch, "kl", "agg"), divergence_rate(batch, "kl", "uniform")
    table = {"valid": batch.valid.numpy(), "d": d.numpy(), "adv": adv.numpy()}
    for c, keep in keep_decisions(adv, batch.logp - batch.behavior_logp, agg, uni).items():
        table[f"keep_{c}"] = keep.numpy()
    ratio_agg, ratio_uni = pair_set(table, "ratio", "ddot_agg", delta), pair_set(table, "ratio", "ddot_uniform", delta)
    assert counts["over_delta"] == int(over_delta(table, delta).sum()) > 50
    assert counts["disagree_ratio_agg"] == int(ratio_agg.sum()) > 0
    assert counts["disagree"] == int((ratio_agg | ratio_uni).sum()) >= counts["disagree_ratio_agg"]
    assert counts["tails_differ"] == int((torch.sign(agg) != torch.sign(uni)).sum()) > 0


def test_without_a_vocabulary_size_only_the_aggregated_tail_counts():
    batch, adv = _batch()
    counts = update_counts(replace(batch, vocab_size=None), adv)
    full = update_counts(batch, adv)
    assert (
        counts["over_delta"] == full["over_delta"]
        and counts["disagree"] == counts["disagree_ratio_agg"] == full["disagree_ratio_agg"]
    )
    assert counts["tails_differ"] == 0


def test_on_policy_tokens_are_never_over_delta():
    batch, adv = _batch(drift=0.0)
    counts = update_counts(batch, adv)
    assert counts["over_delta"] == counts["disagree"] == counts["disagree_ratio_agg"] == 0


def test_counter_sums_minibatches_and_resets_per_step():
    class Out:
        def __init__(self, seed, drift):
            self.batch, self.advantages = _batch(seed=seed, drift=drift)

    lab = LabStats(vocab_size=12, topk=4)
    first, second = Out(0, 0.0), Out(1, 1.0)
    lab(0, None, first, None, None)
    lab(1, None, second, None, None)
    row = lab.row([])
    expected = update_counts(second.batch, second.advantages)
    assert row["lab/over_delta"] == expected["over_delta"] and row["lab/over_delta_first_mb"] == 0.0
    assert row["lab/disagree"] == expected["disagree"]
    lab(0, None, second, None, None)
    again = lab.row([])  # the next step starts from zero
    assert again["lab/over_delta"] == again["lab/over_delta_first_mb"] == expected["over_delta"]


def test_lab_summary_over_steps():
    rows = [
        {"step": 1, "lab/resid_p50": 0.2, "lab/resid_ge_0.01_frac": 0.8, "lab/over_delta": 100.0, "lab/disagree": 10.0},
        {"step": 2, "lab/resid_p50": 0.4, "lab/resid_ge_0.01_frac": 0.6, "lab/over_delta": 300.0, "lab/disagree": 30.0},
    ]
    s = lab_summary(rows, vocab_size=2004, topk=20)
    assert s["vocab_size"] == 2004 and s["topk"] == 20 and s["steps"] == 2 and s["delta"] == 0.15
    assert s["resid_p50_mean"] == pytest.approx(0.3)
    assert s["resid_ge_0.01_frac"] == {"mean": pytest.approx(0.7), "min": 0.6, "first": 0.8, "last": 0.6}
    assert s["over_delta_per_step"] == {"mean": 200.0, "min": 100.0, "max": 300.0}
    assert s["disagree_per_step"]["mean"] == 20.0
    assert s["outside_topk_frac_mean"] is None  # absent from the rows
    assert s["tails_differ_per_step"] == {"mean": None, "min": None, "max": None}
