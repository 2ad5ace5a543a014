"""Truncated sampling (rollout.top_p < 1, rollout.top_k): the kept set recorded by the engine, pi
renormalised over it in training (models/logprobs.py renormalise_over_kept), the naive ratio's
bias equal to the closed form log S of TRL #6789 and the fixed ratio's zero, storage, and the
up-front refusals."""

import json

import pytest
import torch

from masktrl.models.logprobs import renormalise_over_kept
from masktrl.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model
from masktrl.rl.policy import policy_token_batch
from masktrl.rollout.base import Generation, Sample, SamplingSettings, kept_sizes
from masktrl.rollout.hf import HFEngine
from masktrl.rollout.storage import read_rollouts, write_rollouts
from tests.conftest import masktrl, write_tiny_config


def nucleus(logits: torch.Tensor, top_p: float, top_k: int = 0) -> torch.Tensor:
    """float64 reference of the kept set [V] bool, from the definitions: the top_k most likely
    tokens (all when 0), then the smallest prefix of them by descending probability whose mass
    reaches top_p (the token crossing top_p included), as transformers' warpers keep it."""
    p = torch.softmax(logits.double(), -1)
    order = p.argsort(descending=True)
    keep = torch.zeros_like(p, dtype=torch.bool)
    n = top_k or len(p)
    q = p[order[:n]] / p[order[:n]].sum()
    cum = torch.cumsum(q, 0)
    m = int((cum < top_p).sum()) + 1  # tokens until the mass first reaches top_p
    keep[order[: min(m, n)]] = True
    return keep


def test_renormalise_limit_cases_and_gradient():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 10, generator=g, dtype=torch.float64, requires_grad=True)
    lp_full = logits.log_softmax(-1)
    topk = lp_full.topk(4, -1).indices  # [3, 4]
    ids = torch.cat([topk[:, 1:2], topk], 1)  # sampled = the second-most likely
    lp = lp_full.gather(1, ids)  # [3, 1+4]
    assert renormalise_over_kept(lp, None) is lp
    out = renormalise_over_kept(lp, torch.tensor([0, 4, 2]))
    assert torch.equal(out[0], lp[0])  # kept 0: the whole vocabulary, unchanged
    for i, k in ((1, 4), (2, 2)):
        ref = lp_full[i, topk[i, :k]].exp()
        ref = (ref / ref.sum()).log()  # pi~ over the kept set, float64 from its definition
        torch.testing.assert_close(out[i, 1 : 1 + k], ref, rtol=0, atol=1e-12)
        torch.testing.assert_close(out[i, 0], ref[1], rtol=0, atol=1e-12)
        assert torch.isinf(out[i, 1 + k :]).all()
    # autograd: the gradient of log pi~(k) w.r.t. the logits is e_k - pi~ on the kept set (0 elsewhere)
    out[2, 0].backward()
    pt = torch.zeros(10, dtype=torch.float64)
    pt[topk[2, :2]] = torch.softmax(logits[2, topk[2, :2]].detach(), -1)
    expect = -pt
    expect[topk[2, 1]] += 1
    torch.testing.assert_close(logits.grad[2], expect, rtol=0, atol=1e-12)


@pytest.mark.parametrize("top_p, top_k", [(0.9, 0), (0.6, 0), (1.0, 3), (0.8, 4)])
def test_naive_ratio_bias_is_log_s_and_renormalised_is_zero(top_p, top_k):
    """TRL #6789: the engine samples from mu~ = mu / S_mu on the kept set; the naive ratio divides
    the full pi by it, so per token log r_naive = log r_fixed + log S_pi. With pi = mu (no update,
    no mismatch: the engine is the model) the naive log-ratio is therefore log S exactly, S = pi's
    mass on the kept set (computed here in float64 from the warpers' definition), and the
    renormalised log-ratio log pi~ - log mu~ is 0. Checked on the engine's own records."""
    tok = build_char_tokenizer("0123456789+=")
    model = build_tiny_model(tok, TinyModelConfig(hidden_size=32, intermediate_size=64, num_layers=1), seed=0)
    engine = HFEngine(model, tok)
    prompts = [tok("12+3=", add_special_tokens=False)["input_ids"], tok("7+8=", add_special_tokens=False)["input_ids"]]
    v = len(tok)
    s = SamplingSettings(n=4, max_new_tokens=4, temperature=1.0, top_p=top_p, top_k=top_k, logprobs_k=v)
    gens = engine.generate(prompts, s, seed=0)
    samples = [Sample(str(i), "", "", prompts[i], i, g) for i, group in enumerate(gens) for g in group]
    assert all(g.kept is not None and len(g.kept) == len(g.response_ids) for grp in gens for g in grp)
    naive = policy_token_batch(
        model,
        [
            Sample(
                x.example_id,
                "",
                "",
                x.prompt_ids,
                x.group,
                Generation(x.gen.response_ids, x.gen.logp, x.gen.topk_ids, x.gen.topk_logp, x.gen.finished),
            )
            for x in samples
        ],
        1.0,
        64,
    ).batch
    fixed = policy_token_batch(model, samples, 1.0, 64).batch
    # closed form: S = pi's mass on the kept set, the kept set from the float64 reference of the warpers
    rows = [(x.prompt_ids + x.gen.response_ids, len(x.prompt_ids), len(x.gen.response_ids)) for x in samples]
    log_s = []
    for ids, p, t in rows:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].double()
        for j in range(t):
            keep = nucleus(logits[p - 1 + j], top_p, top_k)
            log_s.append(torch.logsumexp(logits[p - 1 + j].log_softmax(-1)[keep], 0))
    log_s = torch.stack(log_s)
    kept = kept_sizes(samples)
    sizes = []
    for ids, p, t in rows:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0]
        sizes += [int(nucleus(logits[p - 1 + j], top_p, top_k).sum()) for j in range(t)]
    assert kept.tolist() == sizes  # the recorded kept set is the warpers' kept set
    naive_bias = naive.logp.double() - naive.behavior_logp.double()  # [N]
    fixed_bias = fixed.logp.double() - fixed.behavior_logp.double()
    torch.testing.assert_close(naive_bias, log_s, rtol=0, atol=2e-5)  # the naive ratio's bias: log S < 0
    assert (log_s < -1e-3).any() and (log_s <= 1e-7).all()
    torch.testing.assert_close(fixed_bias, torch.zeros_like(fixed_bias), rtol=0, atol=2e-5)  # the fixed one: zero
    assert fixed_bias.abs().mean() < 0.05 * naive_bias.abs().mean()
    # the top-K lists: mu and pi~ both zero outside the kept set, equal inside
    inside = torch.isfinite(fixed.topk_behavior_logp)
    assert torch.equal(inside, torch.isfinite(fixed.topk_logp))
    torch.testing.assert_close(
        fixed.topk_logp[inside].double(), fixed.topk_behavior_logp[inside].double(), rtol=0, atol=2e-5
    )


def test_untruncated_sampling_records_no_kept_set_and_storage_round_trip(tmp_path):
    tok = build_char_tokenizer("0123456789+=")
    model = build_tiny_model(tok, TinyModelConfig(hidden_size=32, intermediate_size=64, num_layers=1), seed=0)
    engine = HFEngine(model, tok)
    prompts = [tok("12+3=", add_special_tokens=False)["input_ids"]]
    plain = engine.generate(prompts, SamplingSettings(n=4, max_new_tokens=4, logprobs_k=5), seed=0)
    assert all(g.kept is None for g in plain[0])
    for fmt in (1, 2):
        samples = [Sample("0", "p", "a", prompts[0], 0, g) for g in plain[0]]
        write_rollouts(tmp_path / f"plain{fmt}.parquet", samples, {}, fmt=fmt)
        back, _ = read_rollouts(tmp_path / f"plain{fmt}.parquet")
        assert all(s.gen.kept is None for s in back)
        trunc = engine.generate(prompts, SamplingSettings(n=4, max_new_tokens=4, logprobs_k=5, top_k=3), seed=0)
        samples = [Sample("0", "p", "a", prompts[0], 0, g) for g in trunc[0]]
        assert all(1 <= k <= 3 for s in samples for k in s.gen.kept)
        write_rollouts(tmp_path / f"t{fmt}.parquet", samples, {}, fmt=fmt)
        back, _ = read_rollouts(tmp_path / f"t{fmt}.parquet")
        assert [s.gen.kept for s in back] == [s.gen.kept for s in samples]
        assert [s.gen.topk_logp for s in back] == [s.gen.topk_logp for s in samples]


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--set", "rollout.top_p=0.9", "--set", "rollout.logprobs_k=5"], "more than the 5"),
        (["--set", "rollout.top_k=8", "--set", "rollout.logprobs_k=5"], "rollout.top_k <="),
        (["--set", "rollout.top_k=-1"], "rollout.top_k"),
    ],
)
def test_kept_set_larger_than_k_is_refused_up_front(tmp_path, tiny_config, args, needle):
    r = masktrl("train", "--config", tiny_config, *args, "--out", tmp_path / "out", cwd=tmp_path)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_top_p_run_trains_with_no_gap(tmp_path, warm_out):
    cfg = write_tiny_config(tmp_path / "c.yaml", {"rollout": {"top_p": 0.9, "top_k": 4, "mismatch": "always"}})
    r = masktrl("train", "--config", cfg, "--out", warm_out, "--run", "topp", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in (warm_out / "topp" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    assert all(row["mismatch/logp_abs_mean"] < 1e-4 for row in rows)  # pi_old renormalised over the kept set == mu


def test_a_kept_set_larger_than_the_list_is_marked_and_never_renormalised(tmp_path):
    """Sampling outside training's checks (masktrl rollout --top-p) can keep more tokens than K:
    such a token's size is recorded as K + 1 ("more than K"), stored, and refused by training."""
    from masktrl.errors import ConfigError
    from masktrl.rl.checks import kept_set_bound

    tok = build_char_tokenizer("0123456789+=")
    model = build_tiny_model(tok, TinyModelConfig(hidden_size=32, intermediate_size=64, num_layers=1), seed=0)
    prompts = [tok("12+3=", add_special_tokens=False)["input_ids"]]
    gens = HFEngine(model, tok).generate(
        prompts, SamplingSettings(n=4, max_new_tokens=4, logprobs_k=3, top_p=0.999), seed=0
    )
    samples = [Sample("0", "p", "a", prompts[0], 0, g) for g in gens[0]]
    sizes = [k for s in samples for k in s.gen.kept]
    assert 4 in sizes and all(1 <= k <= 4 for k in sizes)
    write_rollouts(tmp_path / "b.parquet", samples, {})
    back, _ = read_rollouts(tmp_path / "b.parquet")
    assert [s.gen.kept for s in back] == [s.gen.kept for s in samples]
    with pytest.raises(ValueError, match="more tokens than the top-K list"):
        policy_token_batch(model, back, 1.0, 64)
    with pytest.raises(ConfigError, match="more than the 3"):
        kept_set_bound("--rollouts-from x was sampled with top_p=0.999, top_k=0", "hf", 0, 3, len(tok))
    assert kept_set_bound("w", "hf", 3, 3, len(tok)) == 3
    with pytest.raises(ConfigError, match="hf engine only"):
        kept_set_bound("w", "vllm", 3, 5, len(tok))
