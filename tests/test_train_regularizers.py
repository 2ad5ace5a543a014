"""The regularisers and advantage estimators through the real trainer (docs/METHODS.md §13): the
reference KL in the loss (kl_ref 0 on the first update, where pi is the reference, then > 0) and in
the reward (the update's advantages are the penalised rewards' advantages), the entropy bonus, the
estimators on the stored batches, rollout.mask_truncated, the limit case kl_coef = entropy_coef = 0
bit for bit, and bad values refused before anything is written.

All runs share one warm start (``warm_out``) and take a few seconds each."""

import copy
import json

import pytest
import torch
from safetensors.torch import load_file

from masktrl.config import load_config
from masktrl.methods import group_advantages
from masktrl.runs.store import RunStore
from tests.conftest import TIMING, cli, write_tiny_config

TWO_UPDATES = {"train": {"minibatches": 2, "lr": 1.0e-2}}


def _rows(root):
    return [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]


def _weights(root, step=2):
    return load_file(root / "checkpoints" / f"{step:06d}" / "model.safetensors")


class Recorder:
    """Wraps a function of ``masktrl.rl.update`` and keeps its arguments."""

    def __init__(self, real):
        self.real, self.calls = real, []

    def __call__(self, *args, **kw):
        self.calls.append(args)
        return self.real(*args, **kw)


def train(out, config, name, *args, record: str | None = None):
    """``masktrl train`` in-process; with ``record``, the calls of that ``rl.update`` function."""
    import masktrl.rl.update as update

    with pytest.MonkeyPatch.context() as mp:
        rec = None
        if record:
            rec = Recorder(getattr(update, record))
            mp.setattr(update, record, rec)
        cli("train", "--config", config, "--out", out, "--run", name, *args)
    return out / name, (rec.calls if rec else None)


@pytest.fixture(scope="module")
def plain(warm_out):
    config = write_tiny_config(warm_out.parent / "reg.yaml", TWO_UPDATES)
    root, _ = train(warm_out, config, "reg-plain")
    return config, root


def test_zero_coefficients_reproduce_the_run_bit_for_bit(warm_out, plain):
    config, base = plain
    for i, extra in enumerate(
        [
            ("--set", "method.kl_coef=0", "--set", "method.entropy_coef=0", "--set", "method.kl_estimator=k2"),
            ("--set", "method.kl_in=reward", "--set", "method.kl_is_correction=false"),
        ]
    ):
        root, _ = train(warm_out, config, f"reg-zero-{i}", *extra)
        for a, b in zip(_rows(base), _rows(root)):
            assert {k: v for k, v in a.items() if k not in TIMING} == {k: v for k, v in b.items() if k not in TIMING}
        wa, wb = _weights(base), _weights(root)
        assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_kl_in_the_loss_is_zero_at_the_reference_and_pulls_back_later(warm_out, plain):
    config, base = plain
    root, calls = train(warm_out, config, "reg-kl", "--set", "method.kl_coef=0.5", record="regularizer_diagnostics")
    rows = _rows(root)
    assert all(r["kl_ref"] >= 0 for r in rows)  # low_var_kl is non-negative
    kl = [reg.kl[batch.valid] for batch, reg, _ in calls]
    assert len(kl) == 4  # 2 steps x 2 minibatch updates
    assert torch.equal(kl[0], torch.zeros_like(kl[0]))  # the first update: pi is the reference, bit for bit
    assert all(bool((k > 0).any()) for k in kl[1:])
    assert rows[1]["kl_ref"] > 0
    wa, wb = _weights(base), _weights(root)
    assert any(not torch.equal(wa[k], wb[k]) for k in wa)


def test_kl_in_the_reward_penalises_the_rewards_before_the_advantages(warm_out):
    from masktrl.rl.reference import FrozenReference, penalise_kl, reference_logprobs
    from masktrl.rl.warmstart import prepare_policy
    from masktrl.tasks import make_task

    config = write_tiny_config(warm_out.parent / "reg-reward.yaml", {"train": {"lr": 1.0e-2}})
    args = ("--set", "method.kl_coef=0.5", "--set", "method.kl_in=reward", "--set", "method.kl_estimator=k1")
    root, calls = train(warm_out, config, "reg-reward", *args, record="token_diagnostics")
    rows = _rows(root)
    assert all("kl_ref" in r and "kl_penalty" in r for r in rows)
    assert abs(rows[0]["kl_penalty"]) < 1e-5  # step 1: mu is the starting policy, the reference
    assert rows[1]["kl_penalty"] != 0.0
    # recompute step 2's penalised advantages from the stored batch and the starting policy
    cfg = load_config(config, overrides=list(args[1::2]))
    model, _, _ = prepare_policy(cfg, make_task(cfg.task, cfg.model), warm_out)
    ref = FrozenReference(model, cfg.rollout.temperature, cfg.train.logprob_chunk)
    samples, _ = RunStore(root).read_rollouts(2)
    stored = [s.advantage for s in samples]
    stats = penalise_kl(samples, reference_logprobs(ref, samples, len(samples)), cfg.method.bind())
    assert stats["kl_penalty"] == pytest.approx(rows[1]["kl_penalty"], rel=1e-9)
    assert [s.advantage for s in samples] != stored  # the stored batch keeps the unpenalised values
    batch, _, adv = calls[1][:3]  # the update's [N] advantages (in the policy's float32)
    per_seq = [float(adv[batch.seq_ids == i][0]) for i in range(len(samples))]
    assert sorted(per_seq) == pytest.approx(sorted(s.advantage for s in samples), abs=1e-6)
    assert sorted(per_seq) != pytest.approx(sorted(stored), abs=1e-3)


def test_entropy_bonus_reports_and_changes_the_update(warm_out, plain):
    config, base = plain
    root, _ = train(warm_out, config, "reg-ent", "--set", "method.entropy_coef=0.05", "--method", "dppo")
    rows = _rows(root)
    assert all(
        r["entropy_bonus"] == pytest.approx(0.05 * r["entropy"], rel=0.3) for r in rows
    )  # mean over valid vs all tokens
    dppo, _ = train(warm_out, config, "reg-ent-off", "--method", "dppo")
    wa, wb = _weights(dppo), _weights(root)
    assert any(not torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.parametrize("norm", ["rloo", "reinforce++", "reinforce++-baseline", "batch-std"])
def test_advantage_estimators_on_the_stored_batches(warm_out, norm):
    config = write_tiny_config(warm_out.parent / "reg-adv.yaml")
    root, _ = train(warm_out, config, f"reg-adv-{norm}", "--set", f"method.adv_norm={norm}")
    for step in (1, 2):
        samples, _ = RunStore(root).read_rollouts(step)
        want = group_advantages(
            [s.reward for s in samples],
            [s.group for s in samples],
            norm=norm,
            lengths=[len(s.gen.response_ids) for s in samples],
        )
        assert [s.advantage for s in samples] == want.tolist()


def test_mask_truncated_gives_truncated_responses_no_gradient(warm_out):
    config = write_tiny_config(warm_out.parent / "reg-trunc.yaml", {"rollout": {"max_new_tokens": 2}})
    root, calls = train(
        warm_out, config, "reg-trunc", "--set", "rollout.mask_truncated=true", record="token_diagnostics"
    )
    assert len(calls) == 2
    some_cut = False
    for step, (batch, out, _) in zip((1, 2), (c[:3] for c in calls)):
        samples, _ = RunStore(root).read_rollouts(step)
        some_cut |= any(not s.gen.finished for s in samples)
        assert int(batch.valid.sum()) == sum(len(s.gen.response_ids) for s in samples if s.gen.finished)
        assert bool((out.loss[~batch.valid] == 0).all())
    assert some_cut


@pytest.mark.parametrize(
    "override,message",
    [
        ("method.kl_estimator=k4", "method.kl_estimator must be one of k1, k2, k3, low_var_kl; got 'k4'"),
        ("method.kl_coef=-0.1", "method.kl_coef must be >= 0, got -0.1"),
        ("method.entropy_coef=-1", "method.entropy_coef must be >= 0, got -1"),
        ("method.kl_in=advantage", "method.kl_in must be one of loss, reward; got 'advantage'"),
        ("method.adv_norm=reinforce_plus_plus", "method.adv_norm must be one of"),
        ("rollout.mask_truncated=maybe", "rollout.mask_truncated must be true or false"),
    ],
)
def test_bad_values_one_line_exit_2_nothing_written(tmp_path, tiny_config, cli_error, override, message):
    line = cli_error("train", "--config", tiny_config, "--out", tmp_path, "--run", "bad", "--set", override)
    assert message in line
    assert not (tmp_path / "bad").exists()


def test_config_keys_document_the_new_keys():
    from masktrl.config import config_keys

    keys = {k.key: k for k in config_keys("sis")}
    for name in ("kl_coef", "kl_estimator", "kl_in", "kl_is_correction", "entropy_coef"):
        assert keys[f"method.{name}"].doc, name
    assert keys["rollout.mask_truncated"].default is False and keys["rollout.mask_truncated"].doc
    assert copy.deepcopy(keys["method.kl_estimator"].default) == "low_var_kl"


@pytest.mark.parametrize("kl_in", ["loss", "reward"])
def test_a_step_replay_of_a_kl_run_reproduces_its_checkpoint(warm_out, plain, kl_in):
    from masktrl.analysis.step_replay import load_replay, replay_step

    config, _ = plain
    root, _ = train(
        warm_out,
        config,
        f"reg-replay-{kl_in}",
        "--set",
        "method.kl_coef=0.5",
        "--set",
        f"method.kl_in={kl_in}",
        "--set",
        "method.entropy_coef=0.01",
    )
    for step in (1, 2):
        replay = load_replay(root, step)
        assert replay.reference is not None
        replay_step(replay, replay.cfg.seed, replay.cfg.train.minibatches)
        stored = _weights(root, step)
        now = replay.model.state_dict()
        assert all(torch.equal(now[k], stored[k]) for k in stored)


@pytest.mark.slow  # three subprocess runs: about a minute
@pytest.mark.parametrize("kl_in", ["loss", "reward"])
def test_killed_and_resumed_kl_run_is_bit_identical(warm_out, kl_in):
    """The reference stays the starting policy on resume: the resumed run equals the uninterrupted one."""
    from tests.conftest import masktrl

    config = write_tiny_config(
        warm_out.parent / f"reg-resume-{kl_in}.yaml",
        {
            "train": {"steps": 4, "checkpoint_every": 2, "minibatches": 2, "lr": 1.0e-2},
            "method": {"name": "grpo", "kl_coef": 0.5, "kl_in": kl_in, "entropy_coef": 0.01},
        },
    )
    ref = masktrl("train", "--config", config, "--out", warm_out, "--run", f"reg-full-{kl_in}")
    assert ref.returncode == 0, ref.stderr[-2000:]
    crash = masktrl(
        "train",
        "--config",
        config,
        "--out",
        warm_out,
        "--run",
        f"reg-cut-{kl_in}",
        env={"MASKTRL_CRASH_AT": "update:3"},
    )
    assert crash.returncode == -9, crash.stderr[-2000:]
    again = masktrl("train", "--resume", f"reg-cut-{kl_in}", "--out", warm_out)
    assert again.returncode == 0, again.stderr[-2000:]
    a, b = _weights(warm_out / f"reg-full-{kl_in}", 4), _weights(warm_out / f"reg-cut-{kl_in}", 4)
    assert all(torch.equal(a[k], b[k]) for k in a)
    rows_a, rows_b = _rows(warm_out / f"reg-full-{kl_in}"), _rows(warm_out / f"reg-cut-{kl_in}")
    assert [{k: v for k, v in r.items() if k not in TIMING} for r in rows_a] == [
        {k: v for k, v in r.items() if k not in TIMING} for r in rows_b
    ]
    assert all(r["kl_ref"] > 0 for r in rows_b[2:])


@pytest.mark.slow  # an accelerate launch of two processes and two one-process runs: about a minute
@pytest.mark.parametrize("kl_in", ["loss", "reward"])
def test_two_processes_match_one_process_with_kl_and_entropy(warm_out, kl_in):
    """Under DDP each process asks the reference for its own micro-batches (in the loss) or the
    whole batch (in the reward): the update is the one-process update."""
    from tests.conftest import masktrl
    from tests.test_distributed import CPU_DDP, assert_same_weights, launch, train_lr

    config = write_tiny_config(
        warm_out.parent / f"reg-ddp-{kl_in}.yaml",
        {"train": {"minibatches": 2}, "method": {"name": "grpo", "kl_coef": 0.5, "kl_in": kl_in, "entropy_coef": 0.01}},
    )
    one = masktrl("train", "--config", config, "--out", warm_out, "--run", f"reg-ddp1-{kl_in}")
    assert one.returncode == 0, one.stderr[-2000:]
    two = launch(
        CPU_DDP,
        "--config",
        str(config),
        "--out",
        str(warm_out),
        "--run",
        f"reg-ddp2-{kl_in}",
        "--rollouts-from",
        str(warm_out / f"reg-ddp1-{kl_in}"),
    )
    assert two.returncode == 0, two.stdout[-2000:] + two.stderr[-3000:]
    a, b = _weights(warm_out / f"reg-ddp1-{kl_in}"), _weights(warm_out / f"reg-ddp2-{kl_in}")
    assert_same_weights(a, b, lr=train_lr(warm_out / f"reg-ddp1-{kl_in}"))
    for x, y in zip(_rows(warm_out / f"reg-ddp1-{kl_in}"), _rows(warm_out / f"reg-ddp2-{kl_in}")):
        assert abs(x["kl_ref"] - y["kl_ref"]) < 1e-6 and abs(x["loss"] - y["loss"]) < 1e-6
