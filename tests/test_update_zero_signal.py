"""A minibatch without signal (every advantage 0) still steps AdamW, which carries the last
gradient's momentum: what docs/LAB.md's scratchpad runs show when one rewarded group follows many
batches without reward. A documented behaviour (the field's GRPO does the same), checked here so
a change to it is seen."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

import masktrl.methods  # noqa: F401  (registers the methods)
from masktrl.config import load_config
from masktrl.methods.registry import get_method
from masktrl.rl.policy import PolicyForward
from masktrl.rl.update import Learner, UpdateSettings, make_optimizer, policy_update
from tests.test_packing import make_samples

LR = 3e-4  # the lab's


@pytest.fixture(scope="module")
def model():
    from masktrl.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer("0123456789+=")
    cfg = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
    return build_tiny_model(tok, cfg, 0)


def _moves(model, before: int, after: int) -> tuple[torch.Tensor, torch.Tensor]:
    """|Δθ| / lr per coordinate over the one update with signal, and over it and ``after`` updates
    without signal, when ``before`` updates without signal came first."""
    samples = make_samples(model.config.vocab_size, seed=3, groups=4, per_group=4)
    zero = [dataclasses.replace(s, advantage=0.0) for s in samples]
    lone = [dataclasses.replace(s, advantage=2.0 if i == 0 else 0.0) for i, s in enumerate(samples)]
    m = copy.deepcopy(model)
    opt, sched = make_optimizer(m, load_config(None, [f"train.lr={LR}"]).train)
    settings = UpdateSettings(
        minibatches=1,
        grad_accum=1,
        grad_clip=1.0,
        logprob_chunk=7,
        temperature=1.0,
        horizon=20,
        method=get_method("grpo").bind(),
    )
    learner = Learner(PolicyForward(m), opt, sched)

    def flat() -> torch.Tensor:
        return torch.cat([p.detach().flatten().clone() for p in m.parameters()])

    for i in range(before):
        policy_update(learner, zero, settings, step=1 + i)
    start = flat()
    assert torch.equal(start, torch.cat([p.detach().flatten() for p in model.parameters()]))  # no signal, no move
    policy_update(learner, lone, settings, step=before + 1)
    one = (flat() - start).abs() / LR
    for i in range(after):
        policy_update(learner, zero, settings, step=before + 2 + i)
    return one, (flat() - start).abs() / LR


def adamw_sign_steps(t: int, after: int) -> list[float]:
    """The float64 reference: |Δθ| / lr of AdamW (betas 0.9, 0.999, eps neglected) at updates t,
    t + 1, ..., t + after, when the gradient was 0 before update t, g at it and 0 after it:
    m = 0.1 g 0.9^j, v = 0.001 g² 0.999^j, each with its bias correction at update t + j."""
    return [
        (0.1 * 0.9**j / (1 - 0.9 ** (t + j))) / math.sqrt(0.001 * 0.999**j / (1 - 0.999 ** (t + j)))
        for j in range(after + 1)
    ]


def test_a_lone_gradient_moves_every_weight_and_its_momentum_carries_on(model):
    """After 8 updates without signal, one minibatch with one non-zero advantage moves nearly every
    weight, whatever the size of its gradient, by what AdamW's closed form gives for a lone
    gradient (it normalises each coordinate by that gradient's own size), and the 16 updates
    without signal after it move each weight on in the same direction, as the closed form's
    decaying moments give: the lone group's update is applied about 8 times over."""
    steps = adamw_sign_steps(t=9, after=16)
    one, total = _moves(model, before=8, after=16)
    moved = one > 0
    assert moved.float().mean() > 0.95
    assert one[moved].median().item() == pytest.approx(steps[0], rel=0.02)
    assert total[moved].median().item() == pytest.approx(sum(steps), rel=0.02)
    assert sum(steps) / steps[0] > 8
