"""masktrl's rules as a verl policy loss (masktrl/integrations/verl.py, docs/ECOSYSTEM.md).

Two layers: (1) against a transcription of verl 0.9.1's registry and call (``verl/trainer/ppo/core_algos.py``
lines 37-85: ``PolicyLossFn``, ``POLICY_LOSS_REGISTRY``, ``register_policy_loss``, ``get_policy_loss_fn``;
``verl/workers/utils/losses.py`` lines 103-112: the actor's keyword call; ``compute_policy_loss_vanilla``
lines 1286-1377 and ``agg_loss`` lines 1140-1199), which CI runs; (2) against verl itself when
``verl.trainer.ppo.core_algos`` imports (a separate venv: docs/ECOSYSTEM.md), skipped otherwise."""

from __future__ import annotations

import pytest
import torch

from masktrl.config import resolve_method_spec
from masktrl.errors import ConfigError
from masktrl.integrations.verl import policy_loss, register
from masktrl.methods import TokenBatch

# --------------------------------------------------------------------------- transcription of verl 0.9.1

POLICY_LOSS_REGISTRY: dict = {}  # core_algos.py:50


def register_policy_loss(name):  # core_algos.py:53-67
    def decorator(func):
        POLICY_LOSS_REGISTRY[name] = func
        return func

    return decorator


def get_policy_loss_fn(name):  # core_algos.py:70-85
    if name not in POLICY_LOSS_REGISTRY:
        raise ValueError(f"Unsupported loss mode: {name}. Supported modes are: {list(POLICY_LOSS_REGISTRY.keys())}")
    return POLICY_LOSS_REGISTRY[name]


def masked_sum(x, mask):
    return (x * mask).sum()


def agg_loss(
    loss_mat, loss_mask, loss_agg_mode, dp_size=1, batch_num_tokens=None, global_batch_size=None, loss_scale_factor=None
):  # core_algos.py:1140-1199
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            batch_num_tokens = loss_mask.sum()
        return masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        seq_mask = (torch.sum(loss_mask, dim=-1) > 0).float()
        if global_batch_size is None:
            global_batch_size = seq_mask.sum()
        loss = masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size
        if loss_agg_mode == "seq-mean-token-sum-norm":
            loss /= loss_scale_factor if loss_scale_factor is not None else loss_mask.shape[-1]
        return loss
    seq_mask = torch.sum(loss_mask, dim=-1)  # seq-mean-token-mean
    seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / (seq_mask + 1e-8)
    seq_mask = (seq_mask > 0).float()
    if global_batch_size is None:
        global_batch_size = seq_mask.sum()
    return masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size


def vanilla(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, rollout_is_weights=None
):  # core_algos.py:1286-1377 (the loss; metrics left out)
    clip_ratio = config["clip_ratio"]
    lo = config.get("clip_ratio_low") or clip_ratio
    hi = config.get("clip_ratio_high") or clip_ratio
    clip_ratio_c = config.get("clip_ratio_c", 3.0)
    ratio = torch.exp(torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0))
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - lo, 1 + hi)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    clip_pg_losses2 = torch.min(-advantages * clip_ratio_c, clip_pg_losses1)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    return agg_loss(pg_losses, response_mask, loss_agg_mode, **config.get("global_batch_info", {})), {}


def actor_call(fn, data, loss_agg_mode, config, rollout_is_weights=None):  # workers/utils/losses.py:103-112
    return fn(
        old_log_prob=data["old_log_probs"],
        log_prob=data["log_prob"],
        advantages=data["advantages"],
        response_mask=data["response_mask"],
        loss_agg_mode=loss_agg_mode,
        config=config,
        rollout_is_weights=rollout_is_weights,
    )


# --------------------------------------------------------------------------- data


def padded(seed=0, b=5, t=7, k=4, v=12, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    mu = torch.log_softmax(torch.randn(b, t, v, generator=gen, dtype=dtype) * 2, -1)
    pi = torch.log_softmax(mu + torch.randn(b, t, v, generator=gen, dtype=dtype) * 0.4, -1)
    responses = torch.multinomial(mu.exp().reshape(-1, v), 1, generator=gen).reshape(b, t)
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[1, 4:] = False
    mask[3, 2:] = False
    adv = torch.randn(b, generator=gen, dtype=dtype)
    topk_mu, topk_ids = mu.topk(k, dim=-1)
    return {
        "mu": mu,
        "pi": pi,
        "responses": responses,
        "response_mask": mask,
        "adv_seq": adv,
        "advantages": adv[:, None].expand(b, t).clone(),
        "topk_ids": topk_ids,
        "topk_mu": topk_mu,
        "old_log_probs": mu.gather(-1, responses[..., None]).squeeze(-1),
    }


def with_grad(d):
    lp = d["pi"].gather(-1, d["responses"][..., None]).squeeze(-1).clone().requires_grad_(True)
    return {**d, "log_prob": lp}


def contract_lists(d):
    """The verl contract's keyword arguments of a top-K rule (docs/ECOSYSTEM.md)."""
    return {
        "responses": d["responses"],
        "rollout_topk_ids": d["topk_ids"],
        "rollout_topk_log_probs": d["topk_mu"],
        "topk_log_prob": d["pi"].gather(-1, d["topk_ids"]),
    }


def own(method, d, lp, topk=False, u=None):
    """masktrl's own loss, token by token: its methods on a TokenBatch built here (``u``: sis's
    uniforms, one per response token in row order)."""
    rows = [
        (i, j)
        for i in range(d["responses"].shape[0])
        for j in range(d["responses"].shape[1])
        if d["response_mask"][i, j]
    ]
    n = len(rows)
    if topk:
        ids = torch.stack([d["topk_ids"][i, j] for i, j in rows])
        mu_k = torch.stack([d["topk_mu"][i, j] for i, j in rows])
        pi_k = torch.stack([d["pi"][i, j][d["topk_ids"][i, j]] for i, j in rows])
    else:
        ids, mu_k, pi_k = (
            torch.full((n, 1), -1),
            torch.full((n, 1), float("-inf"), dtype=lp.dtype),
            torch.full((n, 1), float("-inf"), dtype=lp.dtype),
        )
    batch = TokenBatch(
        logp=torch.stack([lp[i, j] for i, j in rows]),
        behavior_logp=torch.stack([d["old_log_probs"][i, j] for i, j in rows]),
        sampled_ids=torch.stack([d["responses"][i, j] for i, j in rows]),
        topk_ids=ids,
        topk_behavior_logp=mu_k,
        topk_logp=pi_k,
        seq_ids=torch.tensor([i for i, _ in rows]),
    )
    adv = torch.stack([d["adv_seq"][i] for i, _ in rows])
    return method.aggregate(method.token_losses(batch, adv, u=u).loss, batch, horizon=d["responses"].shape[1])


SAMPLED_RULES = ["grpo", "dapo", "dppo:divergence=binary-tv", "cispo", "gspo", "sapo", "prime-dppo"]


@pytest.mark.parametrize("spec", SAMPLED_RULES)
def test_registered_through_the_transcribed_registry_equals_masktrl(spec):
    method = resolve_method_spec(spec)
    register_policy_loss(f"masktrl_{spec}")(policy_loss(spec))
    d = with_grad(padded())
    loss, metrics = actor_call(get_policy_loss_fn(f"masktrl_{spec}"), d, method.aggregation, {"global_batch_info": {}})
    (g,) = torch.autograd.grad(loss, d["log_prob"])
    lp = d["log_prob"].detach().clone().requires_grad_(True)
    want = own(method, d, lp)
    (gw,) = torch.autograd.grad(want, lp)
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(g, gw, rtol=1e-12, atol=1e-14)
    assert 0.0 <= metrics["actor/masktrl_masked_frac"] <= 1.0


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_grpo_dual_clip_equals_verl_vanilla_in_every_aggregation(mode):
    """masktrl's grpo with verl's dual clip (c = 3) through the adapter is verl's vanilla loss, value and gradient."""
    fn = policy_loss("grpo:eps_low=0.2:eps_high=0.28:dual_clip=3")
    cfg = {
        "clip_ratio": 0.2,
        "clip_ratio_low": 0.2,
        "clip_ratio_high": 0.28,
        "clip_ratio_c": 3.0,
        "global_batch_info": {},
    }
    d = with_grad(padded(seed=2))
    d["log_prob"] = d["log_prob"] * 1.0  # keep the leaf below
    leaf = d["log_prob"]
    got, _ = actor_call(fn, d, mode, cfg)
    want, _ = vanilla(d["old_log_probs"], leaf, d["advantages"], d["response_mask"].double(), mode, cfg)
    torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-12)  # verl's seq-mean adds 1e-8 to each count
    (g1,) = torch.autograd.grad(got, leaf, retain_graph=True)
    (g2,) = torch.autograd.grad(want, leaf)
    torch.testing.assert_close(g1, g2, rtol=1e-7, atol=1e-12)


def test_global_batch_info_as_verl_aggregates():
    """dp_size and the global denominators of config.global_batch_info scale as verl's agg_loss does."""
    fn = policy_loss("grpo:dual_clip=3")
    d = with_grad(padded(seed=3))
    for mode, info in (
        ("token-mean", {"dp_size": 2, "batch_num_tokens": 50}),
        ("seq-mean-token-mean", {"dp_size": 4, "global_batch_size": 17}),
        ("seq-mean-token-sum-norm", {"dp_size": 2, "global_batch_size": 9, "loss_scale_factor": 11}),
    ):
        cfg = {"clip_ratio": 0.2, "clip_ratio_high": 0.28, "global_batch_info": info}
        got, _ = actor_call(fn, d, mode, cfg)
        want, _ = vanilla(d["old_log_probs"], d["log_prob"], d["advantages"], d["response_mask"].double(), mode, cfg)
        torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-12)


def test_pi_old_anchor_with_rollout_is_weights_equals_masktrl_decoupled_tis():
    """anchor=pi_old: verl's truncated IS weights w = min(pi_old/mu, 2) times the rule around pi_old is masktrl's
    decoupled token-tis correction (cap 2) with mu as the behaviour and pi_old from the extra forward."""
    d = padded(seed=4)
    gen = torch.Generator().manual_seed(9)
    old_full = torch.log_softmax(d["mu"] + 0.3 * torch.randn(d["mu"].shape, generator=gen, dtype=d["mu"].dtype), -1)
    old = old_full.gather(-1, d["responses"][..., None]).squeeze(-1)
    lp = d["pi"].gather(-1, d["responses"][..., None]).squeeze(-1).clone().requires_grad_(True)
    w = torch.exp(old - d["old_log_probs"]).clamp(max=2.0)
    fn = policy_loss("dapo", anchor="pi_old")
    got, _ = fn(old, lp, d["advantages"], d["response_mask"], "token-mean", {"global_batch_info": {}}, w)
    method = resolve_method_spec("dapo", {"kind": "token-tis", "mode": "decoupled", "cap": 2.0})
    rows = d["response_mask"]
    n = int(rows.sum())
    batch = TokenBatch(
        logp=lp[rows],
        behavior_logp=d["old_log_probs"][rows],
        sampled_ids=d["responses"][rows],
        topk_ids=torch.full((n, 1), -1),
        topk_behavior_logp=torch.full((n, 1), float("-inf"), dtype=lp.dtype),
        topk_logp=torch.full((n, 1), float("-inf"), dtype=lp.dtype),
        seq_ids=torch.arange(rows.shape[0])[:, None].expand(rows.shape)[rows],
    )
    adv = d["advantages"][rows]
    losses, _, _ = method.corrected_token_losses(
        batch, adv, old=(old[rows], torch.full((n, 1), float("-inf"), dtype=lp.dtype))
    )
    want = method.aggregate(losses.loss, batch, horizon=7)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("spec", ["pdm", "dppo:divergence=topk-tv", "dppo:divergence=topk-kl"])
def test_topk_rules_with_the_contract_kwargs_equal_masktrl(spec):
    method = resolve_method_spec(spec)
    fn = policy_loss(spec)
    d = with_grad(padded(seed=5))
    kw = contract_lists(d)
    with pytest.raises(ConfigError, match="top-K lists"):
        actor_call(fn, d, method.aggregation, {"global_batch_info": {}})
    loss, _ = fn(
        d["old_log_probs"], d["log_prob"], d["advantages"], d["response_mask"], method.aggregation, None, None, **kw
    )
    (g,) = torch.autograd.grad(loss, d["log_prob"])
    lp = d["log_prob"].detach().clone().requires_grad_(True)
    want = own(method, d, lp, topk=True)
    (gw,) = torch.autograd.grad(want, lp)
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(g, gw, rtol=1e-12, atol=1e-14)


def test_sis_draws_its_uniforms_per_call_and_equals_masktrl_with_them():
    """verl's signature carries no random stream: the adapter draws sis's uniforms itself
    (``Uniforms``: call c of a process, seeded by sha256(seed, rank, c)). With the same draws the
    loss and its gradient are masktrl's own; a second call draws new ones; a new loss of the same
    seed repeats the first call's."""
    from masktrl.integrations.verl import Uniforms

    method = resolve_method_spec("sis")
    d = with_grad(padded(seed=7))
    kw = contract_lists(d)
    n = int(d["response_mask"].sum())
    draws = Uniforms(3)
    u1, u2 = draws(n), draws(n)
    assert not torch.equal(u1, u2) and torch.equal(Uniforms(3)(n), u1) and not torch.equal(Uniforms(4)(n), u1)
    fn = policy_loss("sis", seed=3)
    args = (d["old_log_probs"], d["log_prob"], d["advantages"], d["response_mask"], method.aggregation, None, None)
    for u in (u1, u2):  # the loss's first and second calls
        loss, _ = fn(*args, **kw)
        (g,) = torch.autograd.grad(loss, d["log_prob"])
        lp = d["log_prob"].detach().clone().requires_grad_(True)
        want = own(method, d, lp, topk=True, u=u)
        (gw,) = torch.autograd.grad(want, lp)
        torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(g, gw, rtol=1e-12, atol=1e-14)
    lp = d["log_prob"].detach()
    assert not torch.equal(own(method, d, lp, topk=True, u=u1), own(method, d, lp, topk=True, u=u2))  # u matters
    first, _ = policy_loss("sis", seed=3)(*args, **kw)
    again, _ = policy_loss("sis", seed=3)(*args, **kw)
    assert torch.equal(first, again)


def test_ppo_kl_is_verls_clamped_metric():
    """actor/ppo_kl means what verl's vanilla loss logs: masked_mean(-negative_approx_kl) with
    negative_approx_kl = clamp(log_prob - old_log_prob, -20, 20) (core_algos.py, transcribed); an
    unclamped mean was inf where a token's old log-prob was -inf."""
    d = with_grad(padded(seed=2))
    old = d["old_log_probs"].clone()
    old[0, 0] = float("-inf")  # a token mu gave no mass
    old[0, 1] = old[0, 1] - 30.0
    _, metrics = policy_loss("grpo")(old, d["log_prob"], d["advantages"], d["response_mask"], "token-mean", None)
    mask = d["response_mask"].float()
    negative_approx_kl = torch.clamp(d["log_prob"].detach() - old, min=-20.0, max=20.0)
    want = (-negative_approx_kl * mask).sum() / (mask.sum() + 1e-8)  # verl_F.masked_mean
    assert metrics["actor/ppo_kl"] == pytest.approx(float(want), rel=1e-6)


def test_bad_input_is_one_config_error():
    with pytest.raises(ConfigError, match="anchor"):
        policy_loss("grpo", anchor="nope")
    with pytest.raises(ConfigError, match="rollout_is_weights"):
        policy_loss("grpo", {"kind": "token-tis"}, anchor="pi_old")
    with pytest.raises(ConfigError, match="pi_old"):
        policy_loss("grpo", {"kind": "token-tis"})  # ref old: needs pi_old besides mu
    with pytest.raises(ConfigError, match="no such file"):
        policy_loss("missing.py:rule")
    d = with_grad(padded())
    with pytest.raises(ConfigError, match="loss_agg_mode"):
        actor_call(policy_loss("grpo"), d, "token-sum", None)


# --------------------------------------------------------------------------- verl itself (its own venv)


def test_verl_registry_itself():
    core = pytest.importorskip(
        "verl.trainer.ppo.core_algos",
        reason="verl is not installed (CI does not install it; docs/ECOSYSTEM.md: how this ran)",
    )
    from omegaconf import OmegaConf

    fn = register("masktrl_grpo_dual", "grpo:eps_low=0.2:eps_high=0.28:dual_clip=3")
    assert core.get_policy_loss_fn("masktrl_grpo_dual") is fn
    cfg = OmegaConf.create(
        {
            "clip_ratio": 0.2,
            "clip_ratio_low": 0.2,
            "clip_ratio_high": 0.28,
            "clip_ratio_c": 3.0,
            "global_batch_info": {},
        }
    )
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        d = with_grad(padded(seed=6))
        got, _ = actor_call(core.get_policy_loss_fn("masktrl_grpo_dual"), d, mode, cfg)
        want, _ = actor_call(core.get_policy_loss_fn("vanilla"), d, mode, cfg)
        torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-12)
        (g1,) = torch.autograd.grad(got, d["log_prob"], retain_graph=True)
        (g2,) = torch.autograd.grad(want, d["log_prob"])
        torch.testing.assert_close(g1, g2, rtol=1e-7, atol=1e-12)
    # masktrl's dppo binary-tv (its own rule, vs mu) through verl's registry equals masktrl's own loss
    register("masktrl_dppo_btv", "dppo:divergence=binary-tv")
    method = resolve_method_spec("dppo:divergence=binary-tv")
    d = with_grad(padded(seed=7))
    got, _ = actor_call(core.get_policy_loss_fn("masktrl_dppo_btv"), d, method.aggregation, cfg)
    torch.testing.assert_close(got, own(method, d, d["log_prob"]), rtol=1e-12, atol=1e-14)


def test_register_without_verl_is_one_config_error():
    try:
        import verl.trainer.ppo.core_algos  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match="needs verl"):
            register("x", "grpo")
    else:
        pytest.skip("verl is installed: register works (test_verl_registry_itself)")
