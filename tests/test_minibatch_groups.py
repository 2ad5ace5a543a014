"""``train.minibatch_groups``: minibatches of whole prompt groups, or of parts of g samples of each
group (``rl/update.py: group_minibatches``): the partition, the update it makes, the config's
values, and a run that uses it."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import yaml

from masktrl.config import load_config
from masktrl.methods.registry import get_method
from masktrl.rl.update import Hooks, Learner, UpdateSettings, group_minibatches, make_optimizer, policy_update
from masktrl.seeding import stream_seed
from tests.conftest import masktrl, write_tiny_config
from tests.test_packing import make_samples


def _settings(minibatches: int, groups: bool | int = True, **kw) -> UpdateSettings:
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


def test_the_sample_split_cuts_parts_of_ceil_n_over_minibatches_as_its_key_says():
    """train.minibatches' documentation: parts of ceil(N / minibatches), every sample once, so 30
    minibatches of 512 sequences are 29 updates (28 of 18 and one of 8)."""
    from masktrl.rl.update import _minibatches

    samples = [None] * 512  # the split reads only how many there are
    parts = _minibatches(samples, _settings(30, groups=False), step=1)
    assert [len(p) for p in parts] == [18] * 28 + [8]
    assert sorted(i for p in parts for i in p.tolist()) == list(range(512))
    assert [len(p) for p in _minibatches(samples, _settings(8, groups=False), step=1)] == [64] * 8


@pytest.mark.parametrize("n", [4, 14, 24, 100, 512])
def test_the_split_note_names_the_updates_the_sample_split_makes(n):
    """Where the sample split makes fewer updates than train.minibatches names, the dry run reports
    it and the run warns (``checks.minibatch_split_note``): the count it names is the split's own,
    for every number of minibatches up to the step's sequences, and it is silent where they agree."""
    from masktrl.config import from_dict
    from masktrl.rl.checks import minibatch_split_note
    from masktrl.rl.update import _minibatches

    for m in range(1, n + 1):
        cfg = from_dict({"rollout": {"prompts_per_step": n // 2, "n": 2}, "train": {"minibatches": m}})
        made = len(_minibatches([None] * n, _settings(m, groups=False), step=1))
        note = minibatch_split_note(cfg)
        assert (note is None) == (made == m)
        if note is not None:
            assert f"{made} updates a step, not {m} (train.minibatches={made} makes the same split)" in note
            again = len(_minibatches([None] * n, _settings(made, groups=False), step=1))
            assert again == made
    grouped = from_dict(
        {"rollout": {"prompts_per_step": 64, "n": 8}, "train": {"minibatches": 30, "minibatch_groups": True}}
    )
    assert minibatch_split_note(grouped) is None  # the group split cuts into as many parts as named


def test_a_group_index_shared_by_two_prompts_is_two_groups():
    """Samples of two rollout batches can carry the same ``group`` index: the prompt tells them apart."""
    samples = make_samples(50, seed=2, groups=2, per_group=2)
    clash = [dataclasses.replace(s, group=0) for s in samples]
    parts = group_minibatches(clash, _settings(2), step=1)
    assert len(parts) == 2 and all(len({tuple(clash[i].prompt_ids) for i in p.tolist()}) == 1 for p in parts)


def test_parts_of_g_samples_cut_each_group_and_shuffle_the_parts():
    """g = 2 on groups of 3: each group gives a part of 2 and a part of 1 (consecutive in batch
    order); the parts are shuffled and dealt out as evenly as can be, so a group can span
    minibatches but a part never does."""
    samples = make_samples(50, seed=3, groups=6, per_group=3)
    members: dict[tuple, list[int]] = {}
    for i, s in enumerate(samples):
        members.setdefault(_group_of(s), []).append(i)
    expected_parts = sorted(tuple(m[k : k + 2]) for m in members.values() for k in (0, 2))
    minibatches = [p.tolist() for p in group_minibatches(samples, _settings(4, groups=2), step=4)]
    assert sorted(i for p in minibatches for i in p) == list(range(len(samples)))
    assert all(p == sorted(p) for p in minibatches)
    where = {i: k for k, p in enumerate(minibatches) for i in p}
    for part in expected_parts:
        assert len({where[i] for i in part}) == 1  # a part in one minibatch
    sizes = sorted(sum(1 for part in expected_parts if where[part[0]] == k) for k in range(4))
    assert sizes == [3, 3, 3, 3]  # 12 parts in 4 minibatches
    spans = [len({where[i] for i in m}) for m in members.values()]
    assert max(spans) == 2  # this seed splits some group between two minibatches
    assert minibatches != [p.tolist() for p in group_minibatches(samples, _settings(4, groups=2), step=5)]


@pytest.mark.parametrize("g", [True, 3, 4, 100])
def test_g_at_least_the_group_size_is_whole_groups_bit_for_bit(g):
    samples = make_samples(50, seed=4, groups=7, per_group=3)
    whole = [p.tolist() for p in group_minibatches(samples, _settings(3, groups=True), step=2)]
    assert [p.tolist() for p in group_minibatches(samples, _settings(3, groups=g), step=2)] == whole


def test_g_1_is_a_random_split_of_single_samples_from_the_group_stream():
    """g = 1: every part one sample, so each minibatch is as many samples in the group stream's
    order (another order than the default split's, the same distribution)."""
    samples = make_samples(50, seed=6, groups=8, per_group=4)
    parts = [p.tolist() for p in group_minibatches(samples, _settings(4, groups=1), step=1)]
    assert [len(p) for p in parts] == [8, 8, 8, 8]
    members: dict[tuple, list[int]] = {}
    for i, s in enumerate(samples):
        members.setdefault(_group_of(s), []).append(i)
    singles = [i for m in members.values() for i in m]  # the parts: groups in order of first appearance
    order = torch.randperm(32, generator=torch.Generator().manual_seed(stream_seed(0, "group-order", 1)))
    assert parts == [sorted(singles[j] for j in p.tolist()) for p in order.tensor_split(4)]


@pytest.mark.parametrize(
    "value, ok",
    [(True, True), (False, True), (1, True), (4, True), (0, False), (-2, False), ("2", False), (1.5, False)],
)
def test_the_config_takes_true_false_or_a_positive_integer(value, ok):
    from masktrl.errors import ConfigError

    if ok:
        got = load_config(None, direct_train(value)).train.minibatch_groups
        assert got == value and type(got) is type(value)
    else:
        with pytest.raises(ConfigError, match="train.minibatch_groups must be true, false or a positive integer"):
            load_config(None, direct_train(value))


def direct_train(value) -> list[str]:
    return [f"train.minibatch_groups={yaml.safe_dump(value).splitlines()[0]}"]


def _learner(model):
    m = copy.deepcopy(model)
    opt, sched = make_optimizer(m, load_config(None, ["train.lr=1e-2", "train.minibatches=2"]).train)
    return Learner(m, opt, sched)


@pytest.mark.parametrize("name, groups", [("grpo", True), ("gspo", True), ("grpo", 2)])
def test_the_update_is_the_plain_update_of_each_group_minibatch_in_turn(float64_tiny_model, name, groups):
    """The step trains on ``group_minibatches``' parts, in their order, each with every prompt run
    once (the shared-prompt forward); its weights equal one-minibatch updates on those parts in
    turn (float64; summation order aside)."""
    model = float64_tiny_model
    samples = make_samples(model.config.vocab_size, seed=5, groups=5, per_group=3)
    settings = _settings(2, groups, method=name)
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


@pytest.mark.parametrize("groups", [True, 2])
def test_a_run_with_group_minibatches_records_it(tmp_path, groups):
    cfg = write_tiny_config(
        tmp_path / "c.yaml", {"train": {"steps": 2, "minibatches": 2, "minibatch_groups": groups}, "rollout": {"n": 4}}
    )
    r = masktrl("train", "--config", str(cfg), "--out", str(tmp_path / "o"), "--run", "g")
    assert r.returncode == 0, r.stderr[-2000:]
    recorded = yaml.safe_load((tmp_path / "o" / "g" / "run.yaml").read_text())
    got = recorded["train"]["minibatch_groups"]
    assert got == groups and type(got) is type(groups)


@pytest.mark.parametrize("value", ["0", "2.5", "auto"])
def test_a_bad_value_is_one_line_and_exit_2(tmp_path, value):
    cfg = write_tiny_config(tmp_path / "c.yaml", {"train": {"steps": 1}})
    r = masktrl("train", "--config", str(cfg), "--out", str(tmp_path / "o"), "--set", f"train.minibatch_groups={value}")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "train.minibatch_groups must be true, false or a positive integer" in r.stderr
    assert not (tmp_path / "o").exists()
