"""Hostile pass 4: the library integrations used as docs/ECOSYSTEM.md shows, user plug-ins and data
files for tasks, and the run store tampered with between commands. Each case is one line (a
``ConfigError`` or exit code 2) naming what is wrong, or a correct result; never a traceback from
inside, never NaN silently trained."""

import os
import re

import pytest
import torch

from masktrl.errors import ConfigError
from tests.conftest import cli, copy_run


def _verl_args(b: int = 2, t: int = 3):
    old = torch.full((b, t), -1.0, dtype=torch.float64)
    return [old, (old + 0.1).requires_grad_(), torch.tensor([1.0, 0.5], dtype=torch.float64)[:b], torch.ones(b, t)]


def _nan_at(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().clone()
    t.view(-1)[0] = float("nan")
    return t


@pytest.mark.parametrize(
    "index, value, says",
    [
        (0, torch.full((2, 3), -1, dtype=torch.long), "old_log_prob must be a floating-point tensor, got torch.int64"),
        (0, _nan_at(torch.full((2, 3), -1.0)), "old_log_prob holds NaN on a response token"),
        (1, _nan_at(torch.full((2, 3), -1.0)).requires_grad_(), "log_prob holds NaN on a response token"),
        (2, torch.tensor([float("nan"), 1.0]), "advantages hold NaN or inf on a response token"),
        (2, torch.full((2, 3), float("inf")), "advantages hold NaN or inf on a response token"),
        (3, torch.full((2, 3), 0.5), "response_mask must hold 0 and 1 only"),
        (3, torch.ones(2, 3, device="meta"), "response_mask is on meta, log_prob on cpu"),
    ],
)
def test_the_verl_loss_refuses_dtypes_nan_and_devices_in_one_line(index, value, says):
    """Integer log-probs were a raw RuntimeError (`value cannot be converted to type int64_t`), NaN
    ones and NaN advantages a ValueError naming masktrl's internals (TokenBatch.behavior_logp), a
    tensor on another device a NotImplementedError or RuntimeError from torch, and a mask of 0.5 or
    2 trained as 1 where verl weighs the token by it."""
    from masktrl.integrations.verl import policy_loss

    fn = policy_loss("grpo")
    args = _verl_args()
    assert torch.isfinite(fn(*args)[0])
    args[index] = value
    with pytest.raises(ConfigError, match=re.escape(says)):
        fn(*args)


def test_the_verl_loss_takes_half_precision_and_non_contiguous_tensors():
    from masktrl.integrations.verl import policy_loss

    fn = policy_loss("grpo")
    old, new, adv, mask = _verl_args()
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        lp = new.detach().to(dtype).requires_grad_()
        loss, _ = fn(old.to(dtype), lp, adv.to(dtype), mask)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
    tr = old.t().contiguous().t()  # same values, not contiguous
    assert not tr.is_contiguous()
    torch.testing.assert_close(fn(tr, new, adv, mask)[0], fn(old, new, adv, mask)[0])
    empty = torch.zeros(0, 3, dtype=torch.float64)
    loss, _ = fn(empty, empty.clone().requires_grad_(), torch.zeros(0, dtype=torch.float64), torch.zeros(0, 3))
    assert loss.item() == 0.0


@pytest.mark.parametrize("weight, shown", [(float("nan"), "nan"), (-1.0, "-1"), (float("inf"), "inf")])
def test_the_verl_loss_refuses_importance_weights_that_are_not_finite_or_negative(weight, shown):
    """anchor=pi_old with a NaN rollout_is_weights entry returned a NaN loss, a negative one a loss of
    the other sign (gradient ascent on that token), both without a word."""
    from masktrl.integrations.verl import policy_loss

    fn = policy_loss("grpo", anchor="pi_old")
    args = _verl_args()
    weights = torch.ones(2, 3, dtype=torch.float64)
    assert torch.isfinite(fn(*args, rollout_is_weights=weights)[0])
    weights[0, 1] = weight
    with pytest.raises(ConfigError, match=f"rollout_is_weights holds {shown} on a response token"):
        fn(*args, rollout_is_weights=weights)
    mask = args[3].clone()
    mask[0, 1] = 0  # padding: not read
    assert torch.isfinite(fn(*args[:3], mask, rollout_is_weights=weights)[0])


@pytest.mark.parametrize(
    "mode, info, says",
    [
        ("token-mean", 5, "config.global_batch_info must be a mapping (dp_size, batch_num_tokens, ...), got int"),
        ("token-mean", {"dp_size": 2.5, "batch_num_tokens": 6}, "dp_size must be a number > 0, a whole one"),
        ("token-mean", {"dp_size": "2", "batch_num_tokens": 6}, "dp_size must be a number > 0, a whole one"),
        ("seq-mean-token-sum-norm", {"loss_scale_factor": 0}, "loss_scale_factor must be a number > 0, got 0"),
        ("seq-mean-token-sum-norm", {"loss_scale_factor": -1}, "loss_scale_factor must be a number > 0, got -1"),
        ("seq-mean-token-sum-norm", {"loss_scale_factor": "x"}, "loss_scale_factor must be a number > 0, got 'x'"),
    ],
)
def test_the_verl_loss_refuses_a_global_batch_info_it_cannot_read(mode, info, says):
    """A global_batch_info that is not a mapping, or a dp_size given as text, raised a TypeError from
    inside; a dp_size of 2.5 scaled the loss by 2.5; a loss_scale_factor of 0 (verl divides by it)
    was replaced by the response length without a word, and a negative one was a ValueError naming
    masktrl's norm_len."""
    from masktrl.integrations.verl import policy_loss

    fn = policy_loss("grpo")
    with pytest.raises(ConfigError, match=re.escape(says)):
        fn(*_verl_args(), mode, {"global_batch_info": info})
    loss, _ = fn(*_verl_args(), "seq-mean-token-sum-norm", {"global_batch_info": {"loss_scale_factor": 7}})
    assert torch.isfinite(loss)


def test_the_verl_loss_runs_a_rule_that_draws_uniforms_and_checks_its_seed():
    """policy_loss("sis") was made, and every call raised a ValueError from inside
    (`u is required by method 'sis'`): verl's signature carries no random stream. The adapter now
    draws them (``Uniforms``; equality with masktrl's loss: tests/test_integrations_verl.py), and a
    seed no generator takes is one line."""
    from masktrl.integrations.verl import policy_loss

    assert policy_loss("sis").masktrl_method.needs_u
    for seed in (-1, 2**32):
        with pytest.raises(ConfigError, match="seed must be in"):
            policy_loss("sis", seed=seed)


@pytest.mark.parametrize("temperature", [0.0, -1.0, float("inf")])
def test_the_trl_trainer_refuses_a_temperature_it_cannot_divide_by(tmp_path, temperature):
    """GRPOConfig(temperature=0) made the trainer, and its first step raised transformers' ValueError
    from the recorder's TemperatureLogitsWarper (the loss divides the logits by it too)."""
    pytest.importorskip("trl", reason="trl is not installed (pip install -e '.[trl]')")
    from tests.test_integrations_trl import trainer

    with pytest.raises(ConfigError, match="GRPOConfig.temperature must be a finite number > 0"):
        trainer(tmp_path, n=4, temperature=temperature)


class _Surrogate:
    def reset(self, example):
        pass

    def step(self, call):
        return "p1 \ud800 c3", False


class _Sub(str):
    def __len__(self):
        raise RuntimeError("len boom")


class _SubReply(_Surrogate):
    def step(self, call):
        return _Sub("p1 c3"), False


def test_a_reply_that_is_not_valid_text_ends_its_episode_and_is_counted():
    """A tool reply holding a lone surrogate passed the (str, bool) check and made the tokenizer raise
    `TypeError: TextEncodeInput must be Union[...]`: the run stopped with a traceback (exit 1). It is
    now an environment error like any bad reply; a str subclass is read as the plain text it holds
    (its len raised inside the tokenizer)."""
    from masktrl.models.tiny import build_char_tokenizer
    from masktrl.rollout.multiturn import reply_tokens
    from masktrl.tasks.envs import EnvStats, Episode

    stats = EnvStats()
    ep = Episode(_Surrogate, stats)
    assert ep.reset({"prompt": "q"})
    assert ep.step("call") == ("", True)
    assert (stats.errors, stats.calls) == (1, 0) and "not valid text" in stats.last_error

    stats = EnvStats()
    ep = Episode(_SubReply, stats)
    assert ep.reset({"prompt": "q"})
    reply, done = ep.step("call")
    assert type(reply) is str and reply == "p1 c3" and done is False
    assert (stats.errors, stats.calls) == (0, 1)
    ids, cut = reply_tokens(build_char_tokenizer("pc13 "), reply, 10)
    assert len(ids) == 5 and not cut


@pytest.mark.parametrize(
    "name, text, says",
    [
        ("two.jsonl", '{"problem": "1+1=", "answer": "2", "problem": "9+9="}\n', "two.jsonl, line 1: key 'problem'"),
        ("two.json", '[{"problem": "1+1=", "answer": "2", "answer": "3"}]', "two.json: key 'answer'"),
    ],
)
def test_a_data_row_giving_a_key_twice_is_one_line(tmp_path, name, text, says):
    """`eval --data` with a row whose problem (or answer) is given twice evaluated the last one
    without a word (Python's json keeps it), as YAML files refuse a key given twice."""
    from masktrl.tasks.math_data import DataError, load_math_file

    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(DataError, match=re.escape(f"{tmp_path}/{says} is given twice in one object; give each key")):
        load_math_file(path)


def test_a_nan_answer_is_no_answer(tmp_path):
    """An answer of NaN (JSON's NaN; pandas' missing value in a parquet float column) was graded as
    the text 'nan'; it is missing: the next answer field is read, or the row is refused."""
    from masktrl.tasks.math_data import DataError, load_math_file

    path = tmp_path / "nan.jsonl"
    path.write_text('{"problem": "1+1=", "answer": NaN}\n')
    with pytest.raises(DataError, match="line 1: missing answer"):
        load_math_file(path)
    path.write_text(
        '{"problem": "1+1=", "answer": Infinity, "solution": "so \\\\boxed{2}"}\n{"problem": "2+2=", "answer": 4}\n'
    )
    assert [e.answer for e in load_math_file(path)] == ["2", "4"]


@pytest.mark.parametrize("damage", ["deleted", "fifo", "/dev/zero", "outside"])
def test_a_recorded_summary_that_is_gone_or_not_a_file_is_damage(finished, tmp_path, cli_error, damage):
    """A complete run whose summary.json was deleted (or replaced by a FIFO, or a link to /dev/zero)
    was listed `complete` by `masktrl runs`, and `analyze compare` said `no complete run to compare`;
    one linked to a file outside the run was read before it was refused (a link to /etc/passwd:
    `not valid JSON`). Each is now the run's damage, one line naming summary.json."""
    _, out, root = copy_run(finished, tmp_path)
    summary = root / "summary.json"
    outside = tmp_path / "elsewhere.json"
    outside.write_bytes(summary.read_bytes())
    summary.unlink()
    if damage == "fifo":
        os.mkfifo(summary)
    elif damage != "deleted":
        summary.symlink_to(damage if damage.startswith("/") else outside)
    says = "summary.json: a symbolic link inside" if damage.startswith(("/", "out")) else "summary.json: missing"
    listing = cli("runs", "--out", out).output
    assert "damaged r" in listing and says.replace(" inside", "") in listing
    line = cli_error("analyze", "compare", root, "--out", out)
    assert line.startswith("error: ") and says in line


def test_a_recorded_rollout_batch_that_is_gone_is_named_not_skipped(finished, tmp_path, cli_error):
    """A stored batch the manifest records, deleted: the store listed the step as not stored, so an
    analysis ran on the other steps without a word (or, with none left, said `no step S with both
    rollouts S and checkpoint S-1`). Reading it now names the file."""
    from masktrl.errors import ArtifactError
    from masktrl.runs.store import RunStore

    _, out, root = copy_run(finished, tmp_path)
    (root / "steps" / "000001" / "rollouts.parquet").unlink()
    store = RunStore(root, writable=False)
    assert 1 in store.rollout_steps()
    with pytest.raises(ArtifactError, match="rollouts.parquet: missing \\(stage step/000001/rollout\\)"):
        store.read_rollouts(1)
    line = cli_error("analyze", "sis", "--run", root, "--step", "1", "--out", out)
    assert line.endswith("steps/000001/rollouts.parquet: missing (stage step/000001/rollout)")
