"""The anchors' default GRPO presets (configs/methods/verl-grpo.yaml, verl-bypass.yaml, trl-grpo.yaml)
resolve to the anchors' own defaults key by key (issue #40.1)."""

from __future__ import annotations

import pytest

from masktrl.config import load_config

# volcengine/verl b178a3cd, verl/trainer/config/actor/actor.yaml, the policy-loss keys (lines 36-111):
VERL_ACTOR_YAML = {
    "clip_ratio": 0.2,
    "clip_ratio_low": 0.2,
    "clip_ratio_high": 0.2,
    "clip_ratio_c": 3.0,
    "policy_loss": {"loss_mode": "vanilla"},
    "loss_agg_mode": "token-mean",
    "entropy_coeff": 0,
    "use_kl_loss": False,
    "kl_loss_coef": 0.001,
    "kl_loss_type": "low_var_kl",
    "ppo_epochs": 1,
}
# verl/trainer/config/algorithm (AlgoConfig): adv_estimator grpo with norm_adv_by_std_in_grpo: true

# huggingface/trl f2cd5771, trl/trainer/grpo_config.py defaults (lines 671-1040):
TRL_GRPO_CONFIG = {
    "beta": 0.0,
    "epsilon": 0.2,
    "epsilon_high": None,  # = epsilon (grpo_trainer.py line 921)
    "delta": None,
    "loss_type": "dapo",
    "scale_rewards": "group",
    "importance_sampling_level": "token",
    "vllm_importance_sampling_correction": True,
    "vllm_importance_sampling_mode": "sequence_mask",
    "vllm_importance_sampling_clip_max": 3.0,
    "vllm_importance_sampling_clip_min": None,
}


def verl_to_masktrl(actor: dict, bypass: bool) -> dict:
    """What each actor.yaml key is in masktrl's resolved method (docs/METHODS.md §2, §8, §13, §14)."""
    assert actor["policy_loss"]["loss_mode"] == "vanilla" and actor["ppo_epochs"] == 1
    out = {
        "name": "grpo",
        "eps_low": actor["clip_ratio_low"],
        "eps_high": actor["clip_ratio_high"],
        "dual_clip": actor["clip_ratio_c"],  # compute_policy_loss_vanilla applies it on every A < 0 token
        "loss_agg": actor["loss_agg_mode"],
        "kl_coef": actor["kl_loss_coef"] if actor["use_kl_loss"] else 0.0,
        "entropy_coef": float(actor["entropy_coeff"]),
        "adv_norm": "group-std",
        "dynamic_sampling": False,
    }
    if not bypass:  # old_log_prob recomputed by the actor: three policies, mu not read
        out["correction"] = {"kind": "none", "mode": "decoupled"}
    return out


def trl_to_masktrl(c: dict) -> dict:
    assert c["importance_sampling_level"] == "token" and c["delta"] is None
    return {
        "name": "grpo",
        "eps_low": c["epsilon"],
        "eps_high": c["epsilon"] if c["epsilon_high"] is None else c["epsilon_high"],
        "dual_clip": None,
        "loss_agg": {"dapo": "token-mean"}[c["loss_type"]],
        "kl_coef": c["beta"],
        "entropy_coef": 0.0,
        "adv_norm": {"group": "group-std"}[c["scale_rewards"]],
        "dynamic_sampling": False,
        "correction": {
            "kind": "seq-mis",
            "mode": "decoupled",
            "ref": "old",
            "stat": "product",
            "weight": "sequence",
            "lo": 0.0 if c["vllm_importance_sampling_clip_min"] is None else c["vllm_importance_sampling_clip_min"],
            "hi": c["vllm_importance_sampling_clip_max"],
        },
    }


@pytest.mark.parametrize(
    "preset,want",
    [
        ("methods/verl-grpo", verl_to_masktrl(VERL_ACTOR_YAML, bypass=False)),
        ("methods/verl-bypass", verl_to_masktrl(VERL_ACTOR_YAML, bypass=True)),
        ("methods/trl-grpo", trl_to_masktrl(TRL_GRPO_CONFIG)),
    ],
)
def test_preset_resolves_to_the_anchor_defaults_key_by_key(preset, want):
    got = load_config(["tiny", preset]).resolved_method()
    for key, value in want.items():
        assert key in got, (preset, key)
        assert got[key] == value, (preset, key, got[key], value)
    if "correction" not in want:
        assert "correction" not in got  # bypass, no correction: verl applies no IS weight with ppo_clip


def test_masktrl_grpo_is_not_verl_default():
    """masktrl's grpo keeps its own clip-higher and aggregation; the preset is what names verl."""
    got = load_config(["tiny", "methods/grpo"]).resolved_method()
    assert (got["eps_high"], got["loss_agg"], got["dual_clip"]) == (0.28, "seq-mean-token-mean", None)
