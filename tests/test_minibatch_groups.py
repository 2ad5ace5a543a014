"""``train.minibatch_groups``: minibatches of whole prompt groups (``rl/update.py: group_minibatches``):
the partition, the update it makes, and a run that uses it."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import yaml

from masktrl.config import load_config
from masktrl.methods.registry import get_method
from masktrl.rl.update import Hooks, Learner, UpdateSettings, group_minibatches, make_optimizer, policy_update
from tests.conftest import masktrl, write_tiny_config
from tests.test_packing import make_samples


def _settings(minibatches: int, groups: bool = True, **kw) -> UpdateSettings:
    return UpdateSettings(
        minibatches=minibatches,
        grad_accum=kw.pop("grad_accum", 1),
        grad_clip=1e9,
        logprob_chunk=7,
        temperature=0.9,
        horizon=20,
        minibatch_groups=groups,
        method=get_method(kw.pop("method", "grpo")).bind(),
        seed=kw.pop("seed", 0),
        **kw,
    )


def _group_of(s) -> tuple:
    return (s.group, tuple(s.prompt_ids))


def test_the_minibatches_are_whole_groups_in_a_seeded_order():
    samples = make_samples(50, seed=3, groups=7, per_group=3)
    parts = [p.tolist() for p in group_minibatches(samples, _settings(3), step=4)]
    assert sorted(i for p in parts for i in p) == list(range(len(samples)))  # every sample once
    assert all(p == sorted(p) for p in parts)  # batch order inside a minibatch
    where = {}
    for k, p in enumerate(parts):
        for i in p:
            where.setdefault(_group_of(samples[i]), set()).add(k)
    assert len(where) == 7 and all(len(ks) == 1 for ks in where.values())  # a group in one minibatch
    assert sorted(len({_group_of(samples[i]) for i in p}) for p in parts) == [2, 2, 3]  # 7 groups in 3 parts
    again = [p.tolist() for p in group_minibatches(samples, _settings(3), step=4)]
    assert again == parts
    others = [
        [p.tolist() for p in group_minibatches(samples, _settings(3, seed=s), step=t)] for s, t in ((0, 5), (1, 4))
    ]
    assert all(o != parts for o in others)


def test_more_minibatches_than_groups_give_one_update_a_group():
    samples = make_samples(50, seed=1, groups=2, per_group=4)
    parts = group_minibatches(samples, _settings(5), step=1)
    assert len(parts) == 2 and all(len({_group_of(samples[i]) for i in p.tolist()}) == 1 for p in parts)


def test_a_group_index_shared_by_two_prompts_is_two_groups():
    """Samples of two rollout batches can carry the same ``group`` index: the prompt tells them apart."""
    samples = make_samples(50, seed=2, groups=2, per_group=2)
    clash = [dataclasses.replace(s, group=0) for s in samples]
    parts = group_minibatches(clash, _settings(2), step=1)
    assert len(parts) == 2 and all(len({tuple(clash[i].prompt_ids) for i in p.tolist()}) == 1 for p in parts)


def _learner(model):
    m = copy.deepcopy(model)
    opt, sched = make_optimizer(m, load_config(None, ["train.lr=1e-2", "train.minibatches=2"]).train)
    return Learner(m, opt, sched)


@pytest.mark.parametrize("name", ["grpo", "gspo"])
def test_the_update_is_the_plain_update_of_each_group_minibatch_in_turn(float64_tiny_model, name):
    """The step trains on ``group_minibatches``' parts, in their order, each with every prompt run
    once (the shared-prompt forward); its weights equal one-minibatch updates on those parts in
    turn (float64; summation order aside)."""
    model = float64_tiny_model
    samples = make_samples(model.config.vocab_size, seed=5, groups=5, per_group=3)
    settings = _settings(2, method=name)
    parts = [p.tolist() for p in group_minibatches(samples, settings, step=3)]
    seen, shared = [], []
    hooks = Hooks(
        before=lambda mb, idx, out, losses, u: shared.append(out.shared_prompt), after=lambda mb, idx: seen.append(idx)
    )
    got = _learner(model)
    policy_update(got, samples, settings, step=3, hooks=hooks)
    assert seen == parts and len(shared) == 2 and all(shared)
    ref = _learner(model)
    one = dataclasses.replace(settings, minibatches=1, minibatch_groups=False)
    for part in parts:
        policy_update(ref, [samples[i] for i in part], one, step=3)
    for (n, a), b in zip(ref.model.named_parameters(), got.model.parameters()):
        torch.testing.assert_close(b, a, atol=1e-12, rtol=1e-10, msg=n)
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), got.model.parameters()))


def test_a_run_with_group_minibatches_records_it(tmp_path):
    cfg = write_tiny_config(
        tmp_path / "c.yaml", {"train": {"steps": 2, "minibatches": 2, "minibatch_groups": True}, "rollout": {"n": 4}}
    )
    r = masktrl("train", "--config", str(cfg), "--out", str(tmp_path / "o"), "--run", "g")
    assert r.returncode == 0, r.stderr[-2000:]
    recorded = yaml.safe_load((tmp_path / "o" / "g" / "run.yaml").read_text())
    assert recorded["train"]["minibatch_groups"] is True
