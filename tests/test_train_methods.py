"""Every method trained off-policy through the real trainer (2 minibatch updates per rollout
batch, so the second update sees pi != mu), each asserting its own diagnostics and, from the
trainer's own token losses, its own masking rule; then the trainer's handling of what methods
ask of it: overlong shaping of the stored rewards, the seq-mean-token-sum-norm horizon, a step
where dynamic sampling kept no group, and Ctrl-C once and twice.

All runs share one warm start (``warm_out``, a session fixture) and take about a second each."""

import json
import os
import signal

import pytest
import torch
from safetensors.torch import load_file

from masktrl.methods import BASELINES, make_params, overlong_penalty
from masktrl.methods.advantages import group_advantages
from masktrl.methods.batch import log_ratio
from masktrl.runs.store import RunStore
from tests.conftest import cli, write_tiny_config

OFF_POLICY = {"train": {"lr": 1.0e-2, "minibatches": 2, "checkpoint_every": 2}}
METHODS = ["grpo", "dapo", "gspo", "dppo", "pdm", "sis", "cispo", *BASELINES]


def _rows(root):
    return [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]


class TokenRecorder:
    """Wraps the trainer's ``token_diagnostics`` call: keeps, per micro-batch, what the method
    returned and what it was given (valid tokens, log r, sequence ids, advantages)."""

    def __init__(self, real):
        self.real, self.calls = real, []

    def __call__(self, batch, out, advantages, params=None, **kw):
        v = batch.valid
        self.calls.append(
            {
                "log_r": log_ratio(batch)[v],
                "seq": batch.seq_ids[v],
                "adv": advantages.detach()[v],
                "loss": out.loss.detach()[v],
                "mask": out.mask[v],
                **{
                    k: None if getattr(out, k) is None else getattr(out, k).detach()[v]
                    for k in ("divergence", "ddot", "accepted")
                },
            }
        )
        return self.real(batch, out, advantages, params, **kw)


def train_recorded(out, config, name, *args):
    """``masktrl train`` in-process with the token recorder in place; (run folder, recorded calls)."""
    import masktrl.rl.update as update

    recorder = TokenRecorder(update.token_diagnostics)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(update, "token_diagnostics", recorder)
        cli("train", "--config", config, "--out", out, "--run", name, *args)
    return out / name, recorder.calls


@pytest.fixture(scope="module")
def offpolicy(warm_out):
    config = write_tiny_config(warm_out.parent / "offpolicy.yaml", OFF_POLICY)
    return {m: train_recorded(warm_out, config, f"off-{m}", "--method", m) for m in METHODS}


def _cat(calls, key):
    return torch.cat([c[key] for c in calls])


@pytest.mark.parametrize("method", METHODS)
def test_every_method_trains_off_policy(offpolicy, method):
    root, calls = offpolicy[method]
    rows = _rows(root)
    assert [r["step"] for r in rows] == [1, 2]
    assert len(calls) == 4  # 2 steps x 2 minibatch updates, one micro-batch each
    for r in rows:
        assert 0.0 <= r["mask_frac"] <= 1.0 and "clip_frac" not in r
        assert all(
            key in r and r[key] == r[key] for key in ("loss", "grad_norm", "ppo_kl", "log_r_dev", "D_mean", "entropy")
        )
    # the first update of a batch is on-policy (pi = mu up to recomputation), the second is not
    assert calls[0]["log_r"].abs().max() < 1e-4
    assert calls[1]["log_r"].abs().max() > 0.05 and rows[0]["log_r_dev"] > 0.0
    start = load_file(next((root.parent / ".cache" / "warmstart").iterdir()) / "model.safetensors")
    end = load_file(root / "checkpoints" / "000002" / "model.safetensors")
    assert any(not torch.equal(start[k], end[k]) for k in start)


def test_grpo_clips_outside_its_ratio_band(offpolicy):
    _, calls = offpolicy["grpo"]
    p = make_params("grpo")
    r, adv, mask = _cat(calls, "log_r").exp(), _cat(calls, "adv"), _cat(calls, "mask")
    assert mask.any()  # the clip fired off-policy
    clipped = ((adv > 0) & (r > 1 + p.eps_high)) | ((adv < 0) & (r < 1 - p.eps_low))
    assert torch.equal(mask, clipped)


def test_dapo_keeps_only_groups_with_a_signal(offpolicy):
    root, _ = offpolicy["dapo"]
    rows = _rows(root)
    assert all(r["groups_generated"] >= r["groups_kept"] > 0 for r in rows)
    assert any(r["groups_generated"] > 6 for r in rows)  # a refill drew more prompts
    for step, r in enumerate(rows, 1):
        samples, _ = RunStore(root).read_rollouts(step)
        groups = {}
        for s in samples:
            groups.setdefault(s.group, []).append(s.reward)
        assert len(groups) == r["groups_kept"] and all(len(set(g)) > 1 for g in groups.values())


def test_gspo_masks_whole_sequences(offpolicy):
    _, calls = offpolicy["gspo"]
    assert _cat(calls, "mask").any()
    for c in calls:
        for seq in c["seq"].unique():
            m = c["mask"][c["seq"] == seq]
            assert bool(m.all()) or not bool(m.any())  # one decision per sequence


@pytest.mark.parametrize("method", ["dppo", "pdm"])
def test_divergence_masks_fire_only_outside_the_trust_region(offpolicy, method):
    root, calls = offpolicy[method]
    rows = _rows(root)
    assert all(k in r for r in rows for k in ("D_mean", "D_p95", "frac_D_over_delta"))
    assert any(r["frac_D_over_delta"] > 0 for r in rows)
    delta_pos, delta_neg = make_params(method).deltas
    d, adv, mask = _cat(calls, "divergence"), _cat(calls, "adv"), _cat(calls, "mask")
    assert mask.any()
    outside = d > torch.where(adv > 0, torch.tensor(delta_pos, dtype=d.dtype), torch.tensor(delta_neg, dtype=d.dtype))
    direction = _cat(calls, "log_r") if method == "dppo" else _cat(calls, "ddot")  # sign(r - 1) = sign(log r)
    assert torch.equal(mask, outside & (adv * torch.sign(direction) > 0))
    if method == "pdm":
        assert torch.isfinite(_cat(calls, "ddot")).all()
        assert all("ddot_ratio_disagree_frac" in r for r in rows if r["frac_D_over_delta"] > 0)


def test_sis_accepts_some_tokens_and_shrinks_the_log_deviation(offpolicy):
    root, calls = offpolicy["sis"]
    for r in _rows(root):
        assert 0.0 < r["sis_accept_rate"] <= 1.0
        assert r["log_w_dev"] < r["log_r_dev"]
    accepted = _cat(calls, "accepted")
    assert accepted.any() and not accepted.all()


def test_cispo_blocks_nothing_and_weights_by_the_clipped_ratio(offpolicy):
    root, calls = offpolicy["cispo"]
    p = make_params("cispo")
    assert all(r["mask_frac"] == 0.0 for r in _rows(root))
    for c in calls:
        w = c["log_r"].exp().clamp(1 - p.eps_low, 1 + p.eps_high)
        assert not c["mask"].any() and torch.allclose(c["loss"], -c["adv"] * w, rtol=1e-5, atol=1e-7)


def test_seq_mean_token_sum_norm_divides_by_the_horizon(warm_out):
    """Dr.GRPO's aggregation through the trainer: (1/G) sum_seq sum_t l_t / max_new_tokens."""
    config = write_tiny_config(warm_out.parent / "sumnorm.yaml", OFF_POLICY)
    root, calls = train_recorded(warm_out, config, "sum-norm", "--set", "method.loss_agg=seq-mean-token-sum-norm")
    horizon = 4  # rollout.max_new_tokens of the tiny config
    nonzero = 0
    for step, r in enumerate(_rows(root)):
        by_hand, token_mean = [], []
        for c in calls[2 * step : 2 * step + 2]:
            seqs = c["seq"].unique()
            by_hand.append(sum(float(c["loss"][c["seq"] == s].sum()) for s in seqs) / horizon / len(seqs))
            token_mean.append(float(c["loss"].mean()))
        assert r["loss"] == pytest.approx(
            sum(by_hand) / 2, rel=1e-5, abs=1e-7
        )  # the step's loss: mean over its 2 updates
        if abs(r["loss"]) > 1e-6:
            nonzero += 1
            assert r["loss"] != pytest.approx(sum(token_mean) / 2, rel=1e-3)  # not some other aggregation
    assert nonzero


def test_overlong_shaping_is_in_the_stored_rewards(warm_out):
    """DAPO's soft overlong penalty shapes the reward the batch is trained on and stored with:
    reward = score + penalty(length), and the advantages come from the shaped rewards."""
    config = write_tiny_config(
        warm_out.parent / "overlong.yaml", {"method": {"name": "dapo", "overlong_buffer": 2, "overlong_penalty": 0.5}}
    )
    cli("train", "--config", config, "--out", warm_out, "--run", "overlong")
    store = RunStore(warm_out / "overlong")
    shaped = 0
    for step in (1, 2):
        samples, _ = store.read_rollouts(step)
        for s in samples:
            score = float(s.text.strip() == s.answer)  # the plain arithmetic task's score
            penalty = overlong_penalty(len(s.gen.response_ids), 4, 2, 0.5)
            assert s.reward == score + penalty, (s.text, s.answer, s.reward)
            shaped += penalty < 0
        adv = group_advantages([s.reward for s in samples], [s.group for s in samples])
        assert adv.tolist() == pytest.approx([s.advantage for s in samples], abs=1e-12)
    assert shaped > 0  # responses past max_new_tokens - buffer were penalised


def test_a_step_where_dynamic_sampling_kept_no_group(warm_out, monkeypatch):
    """Every group has equal rewards: after all refills nothing is trained, the step is still
    recorded (no update, an empty batch stored) and the run goes on."""
    import masktrl.rl.collect as collect

    def equal_rewards(task, examples, groups):
        for g in groups:
            for s in g:
                s.reward = 1.0
                s.extra["score"] = 1.0

    monkeypatch.setattr(collect, "score_groups", equal_rewards)
    config = write_tiny_config(warm_out.parent / "nogroup.yaml", {"method": {"name": "dapo"}, "train": {"steps": 1}})
    cli("train", "--config", config, "--out", warm_out, "--run", "no-group")
    root = warm_out / "no-group"
    [row] = _rows(root)
    assert row["groups_kept"] == 0 and row["groups_generated"] == collect.MAX_REFILLS * 6
    assert "loss" not in row and "mask_frac" not in row and row["reward_mean"] == 1.0
    assert RunStore(root).read_rollouts(1, verify=True)[0] == []
    start = load_file(next((warm_out / ".cache" / "warmstart").iterdir()) / "model.safetensors")
    end = load_file(root / "checkpoints" / "000001" / "model.safetensors")
    assert all(torch.equal(start[k], end[k]) for k in start)  # nothing was trained


@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_once_finishes_the_step_twice_stops_at_once(warm_out, presses):
    """Ctrl-C as step 2 starts: once, the step is finished, checkpointed and the run stops;
    twice, it stops there: step 2 is neither trained, recorded nor checkpointed."""
    import masktrl.recipes.train as train

    real, calls, handler = train.rl_step, [], signal.getsignal(signal.SIGINT)

    def interrupted(s, step):
        calls.append(step)
        if step == 2:
            for _ in range(presses):
                os.kill(os.getpid(), signal.SIGINT)  # the handler runs in this (the main) thread, now
        return real(s, step)

    config = write_tiny_config(warm_out.parent / "ctrlc.yaml", {"train": {"steps": 5, "checkpoint_every": 10}})
    name = f"ctrl-c-{presses}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train, "rl_step", interrupted)
        result = cli("train", "--config", config, "--out", warm_out, "--run", name, ok=False)
    assert result.exit_code == 130 and calls == [1, 2]  # the exit code of an interrupted program
    store = RunStore(warm_out / name)
    assert store.manifest["status"] == "interrupted"
    if presses == 1:
        assert [r["step"] for r in _rows(store.root)] == [1, 2] and store.checkpoints() == [2]
    else:
        assert [r["step"] for r in _rows(store.root)] == [1] and store.checkpoints() == []
        assert not store.is_done("step/000002/train")
    assert signal.getsignal(signal.SIGINT) is handler  # the previous handler is back
