"""Hostile pass 6: what a user's rule file hands back, the analyses, the run store and the
rollout files between commands. Each case is one line and exit code 2 (or a ``ConfigError``)
naming what is wrong, never a traceback from inside, never a result that silently differs."""

import pytest
import torch

from masktrl.config import resolve_method_spec
from masktrl.errors import ConfigError
from tests.conftest import cli
from tests.test_hostile_config_cases import RULE as KERNEL_RULE
from tests.test_hostile_config_cases import _batch


def rule(extra: str) -> str:
    """test_hostile_config_cases' rule file, its kernel returning ``TokenLosses(loss, mask, extra)``."""
    return KERNEL_RULE.format(returns=f"TokenLosses(loss, ~batch.valid, {extra})")


@pytest.mark.parametrize(
    "extra, says",
    [
        # each was a traceback from finalize (torch.where / bitwise_and) or from the diagnostics, exit code 1
        ("None, None, None, torch.zeros(batch.n + 1)", "TokenLosses.log_w that is a torch.float32 tensor of shape [6]"),
        ("None, None, None, torch.zeros(batch.n, dtype=torch.long)", "TokenLosses.log_w that is a torch.int64 tensor"),
        ("None, None, None, [0.0] * batch.n", "TokenLosses.log_w that is a list; it must be None or a float tensor"),
        ("None, None, torch.ones(batch.n), None", "TokenLosses.accepted that is a torch.float32 tensor of shape [5]"),
        ("torch.zeros(3), None, None, None", "TokenLosses.divergence that is a torch.float32 tensor of shape [3]"),
        ("None, None, None, None, torch.zeros(2), torch.zeros(2)", "TokenLosses.ddot_lo that is"),
    ],
)  # fmt: skip
def test_a_rule_files_kernel_with_a_bad_optional_field_is_one_line(tmp_path, extra, says):
    """A kernel's loss and mask were checked, its optional fields (divergence, ddot, accepted,
    log_w, the bracket) not: a log_w of another shape, an integer or a list, a float ``accepted``
    or a divergence of 3 entries was a traceback from ``finalize`` or the step's diagnostics."""
    path = tmp_path / "rules.py"
    path.write_text(rule(extra))
    bound = resolve_method_spec(f"{path}:mine")
    with pytest.raises(ConfigError, match=f"method '{path}:mine': its kernel returned") as exc:
        bound.token_losses(_batch(), torch.ones(5, dtype=torch.float64))
    checked = cli("check-method", f"{path}:mine", "--set", "method.scale=0.5", ok=False)
    assert checked.exit_code == 1 and "raised ConfigError" in checked.output and "mine fails" in checked.output
    assert says in str(exc.value), str(exc.value)


def test_a_rule_files_kernel_with_good_optional_fields_is_unchanged(tmp_path):
    path = tmp_path / "rules.py"
    path.write_text(rule("loss.detach(), None, (loss > 0), torch.zeros(batch.n)"))
    out = resolve_method_spec(f"{path}:mine").token_losses(_batch(), torch.ones(5, dtype=torch.float64))
    assert out.accepted.dtype == torch.bool and out.log_w.shape == (5,)


POST_INIT = """from dataclasses import dataclass
import sys
import torch
from masktrl.methods import MethodParams, TokenLosses, register_method, unit_ratio_log


@dataclass(frozen=True)
class P(MethodParams):
    scale: float = 1.0

    def __post_init__(self):
        if self.scale > 1:
            raise RuntimeError("too big")
        if self.scale < 0:
            sys.exit(3)
        super().__post_init__()


@register_method("mine", P)
def mine(batch, adv, p, u):
    if p.scale == 0.5:
        sys.exit(0)
    return TokenLosses(-adv * unit_ratio_log(batch), ~batch.valid, None, None, None, None)
"""


@pytest.mark.parametrize("scale, says", [("2", "RuntimeError: too big"), ("-1", "SystemExit: 3")])
def test_a_rule_files_params_class_that_raises_is_one_line(tmp_path, scale, says):
    """Only ValueError and TypeError from a params class were one line: a RuntimeError (or an
    assert) in its ``__post_init__`` was a traceback, and ``sys.exit(3)`` there ended ``train``
    and ``check-method`` with exit code 3 and no word."""
    from masktrl.config import load_config

    path = tmp_path / "rules.py"
    path.write_text(POST_INIT)
    with pytest.raises(ConfigError, match=f"^method '{path}:mine': its params raised {says}$"):
        load_config(None, [f"method.scale={scale}"], method=f"{path}:mine")


def test_a_rule_files_kernel_that_calls_sys_exit_is_one_line(tmp_path):
    """``sys.exit(0)`` in a kernel ended ``train`` with exit code 0 (status failed, reason
    ``SystemExit: 0``, nothing said), and ``check-method`` with exit code 0 and no table."""
    path = tmp_path / "rules.py"
    path.write_text(POST_INIT)
    bound = resolve_method_spec(f"{path}:mine:scale=0.5")
    with pytest.raises(ConfigError, match=f"^method '{path}:mine': its kernel raised SystemExit: 0 "):
        bound.token_losses(_batch(), torch.ones(5, dtype=torch.float64))
    checked = cli("check-method", f"{path}:mine", "--set", "method.scale=0.5", ok=False)
    assert checked.exit_code == 1 and "raised ConfigError" in checked.output and "mine fails" in checked.output


@pytest.mark.parametrize("key", ["name", "sha256", "correction"])
def test_a_rule_files_params_field_named_as_a_key_of_the_method_block_is_refused(tmp_path, key):
    """A params field ``name`` (or ``sha256``, ``correction``) could never be set: ``--set
    method.name=`` names the rule, ``method.sha256`` was read as the file's recorded hash. The
    run trained its default, and the resolved method a sweep and the analyses compare said
    ``name: x`` (the field's default) in place of the rule."""
    from masktrl.config import load_config

    path = tmp_path / "rules.py"
    path.write_text(POST_INIT.replace("    scale: float = 1.0\n", f"    scale: float = 1.0\n    {key}: str = 'x'\n"))
    with pytest.raises(ConfigError, match=f"its params class P has a field '{key}', a key the method block keeps"):
        load_config(None, [], method=f"{path}:mine")


def test_a_resume_on_a_rollout_file_changed_since_the_start_is_refused(tmp_path):
    """The run recorded only the path of its ``--rollouts-from`` file: a file regenerated in its
    place (``masktrl rollout --force``, another seed) between the start and ``--resume`` gave
    the remaining steps other rollouts than the run started on, without a word. Its sha256 is
    now recorded and checked; ``--force`` trains on the file as it is (and records it)."""
    from types import SimpleNamespace

    from masktrl.errors import MasktrlError
    from masktrl.runs.plan import _resume_rollouts_from, source_digest

    source = tmp_path / "b.parquet"
    source.write_bytes(b"first")
    store = SimpleNamespace(
        root=tmp_path / "r", manifest={"rollouts_from": str(source), "rollouts_from_sha256": source_digest(str(source))}
    )
    assert _resume_rollouts_from(store, None) == str(source)
    source.write_bytes(b"second")
    for given in (None, str(source)):
        with pytest.raises(MasktrlError, match=f"--rollouts-from {source} changed since this run started on it"):
            _resume_rollouts_from(store, given)
    assert _resume_rollouts_from(store, None, force=True) == str(source)
    del store.manifest["rollouts_from_sha256"]  # a run recorded before the hash was: as before
    assert _resume_rollouts_from(store, None) == str(source)


@pytest.mark.slow
def test_a_resumed_replay_refuses_its_file_regenerated_in_place(tmp_path):
    """End to end: a replay killed before its second batch, the file regenerated in its place."""
    from tests.conftest import masktrl, snapshot, write_tiny_config

    config, out = write_tiny_config(tmp_path / "t.yaml"), tmp_path / "out"
    cli("train", "--config", config, "--out", out, "--run", "r")
    made = [
        cli("rollout", "--model", "r", "--out", out, "--data", "synthetic", "--output", tmp_path / name,
            "--n", 4, "--logprobs-k", 5, "--prompts", 12, "--seed", seed)
        for name, seed in (("b.parquet", 0), ("b2.parquet", 5))
    ]  # fmt: skip
    assert all(m.exit_code == 0 for m in made)
    source = tmp_path / "src.parquet"
    source.write_bytes((tmp_path / "b.parquet").read_bytes())
    args = ("train", "--config", config, "--out", out, "--run", "rx", "--rollouts-from", source)
    assert masktrl(*args, env={"MASKTRL_CRASH_AT": "rollout-write:2"}).returncode != 0
    source.write_bytes((tmp_path / "b2.parquet").read_bytes())
    before = snapshot(out / "rx")
    r = masktrl("train", "--resume", "rx", "--out", out)
    assert r.returncode == 2 and "changed since this run started on it" in r.stderr, r.stderr
    assert snapshot(out / "rx") == before
    source.write_bytes((tmp_path / "b.parquet").read_bytes())
    assert masktrl("train", "--resume", "rx", "--out", out).returncode == 0


def _with_meta(source, dest, **changes):
    """A copy of the rollout file ``source`` whose ``masktrl`` metadata has ``changes``."""
    import json

    import pyarrow.parquet as pq

    table = pq.read_table(source)
    kv = table.schema.metadata
    meta = {**json.loads(kv[b"masktrl"]), **changes}
    pq.write_table(table.replace_schema_metadata({**kv, b"masktrl": json.dumps(meta).encode()}), dest)
    return dest


@pytest.mark.parametrize(
    "changes, says",
    [
        # a ValueError / TypeError traceback from int() in the replay check, exit code 1
        ({"top_k": "abc"}, "its metadata records top_k='abc', not an integer >= 0 or null"),
        ({"top_k": [1]}, "its metadata records top_k=[1], not an integer >= 0 or null"),
        # "was sampled with rollout.n=4, this config has rollout.n=4; add --set rollout.n=4"
        ({"n": "4"}, "its metadata records n='4', not an integer >= 1"),
        ({"logprobs_k": True}, "its metadata records logprobs_k=True, not an integer >= 1"),
        # "add --set rollout.top_k=-3", a value the config refuses
        ({"top_k": -3}, "its metadata records top_k=-3, not an integer >= 0 or null"),
        ({"quantization": 5}, "its metadata records quantization=5, not text or null"),
    ],
)  # fmt: skip
def test_a_rollout_file_recording_a_setting_of_another_kind_is_one_line(finished, tmp_path, cli_error, changes, says):
    """A rollout file written by another tool (docs/ROLLOUTS.md gives its schema) whose metadata
    records a sampling setting as text, a list or a negative number was compared as it was: a
    traceback, or a refusal asking for the value the config already has."""
    config, _, root = finished
    bad = _with_meta(root / "steps" / "000001" / "rollouts.parquet", tmp_path / "bad.parquet", **changes)
    line = cli_error("train", "--config", config, "--out", tmp_path / "out", "--rollouts-from", bad, "--dry-run")
    assert line == f"error: {bad}: {says} (docs/ROLLOUTS.md)"


def test_a_rollout_file_of_no_rows_or_whose_metadata_is_no_object_is_named_so(finished, tmp_path, cli_error):
    """A file of 0 rows said "0 batches of 6 prompts, fewer than train.steps=2; add --set
    train.steps=0" (a value train refuses); metadata that is a JSON list said "unknown rollout
    file format 2 (this masktrl reads [1, 2])"."""
    import pyarrow.parquet as pq

    config, _, root = finished
    batch = root / "steps" / "000001" / "rollouts.parquet"
    empty = tmp_path / "empty.parquet"
    pq.write_table(pq.read_table(batch).slice(0, 0), empty)
    listed = tmp_path / "listed.parquet"
    table = pq.read_table(batch)
    pq.write_table(table.replace_schema_metadata({**table.schema.metadata, b"masktrl": b"[1, 2]"}), listed)
    args = ("train", "--config", config, "--out", tmp_path / "out", "--dry-run", "--rollouts-from")
    assert cli_error(*args, empty) == f"error: --rollouts-from {empty}: it holds no rollouts (0 rows)"
    assert cli_error(*args, listed) == f"error: {listed}: its metadata (key masktrl) is a list, not a JSON object"


def test_dynamics_refuses_one_seed_counted_twice(finished, tmp_path, cli_error):
    """``analyze dynamics out/r copy/r`` (a copy, or a rerun of the same config and seed, as a
    folder of runs holds after a rerun under another --run) averaged the two as two seeds:
    ``seeds 0,0`` and a 95% band drawn from one run's evidence (compare refused the same pair)."""
    from tests.conftest import copy_run

    _, _, root = finished
    _, _, twin = copy_run(finished, tmp_path)
    line = cli_error("analyze", "dynamics", root, twin, "--output", tmp_path / "d")
    assert line == (
        f"error: {root} and {twin} are two runs of grpo with seed 0 (the same config: a copy or a rerun); "
        "the run is the unit of the comparison: give one of them"
    )
    assert not (tmp_path / "d").exists()


class _Unprintable:
    def __str__(self):
        raise RuntimeError("no str")

    __repr__ = __str__


class _UnprintableError(Exception):
    def __str__(self):
        raise RuntimeError("no str")


class _ReturnsUnprintable:
    def reset(self, example):
        pass

    def step(self, call):
        return _Unprintable()


class _RaisesUnprintable(_ReturnsUnprintable):
    def step(self, call):
        raise _UnprintableError()


@pytest.mark.parametrize("env", [_ReturnsUnprintable, _RaisesUnprintable])
def test_an_environment_failure_that_cannot_be_printed_is_counted(env):
    """A ``step`` returning an object whose ``str()`` raises stopped the run with that traceback
    (exit code 1: the reply's check printed it); one raising an exception whose ``str()`` raises
    ended the episode uncounted (``env_errors`` 0 while every call failed)."""
    from masktrl.tasks.envs import EnvStats, Episode

    stats = EnvStats()
    episode = Episode(env, stats, timeout_s=5.0)
    assert episode.reset({"prompt": "1+1=", "answer": "2"})
    assert episode.step("<calc>1</calc>") == ("", True)
    assert stats.errors == 1 and stats.calls == 0 and "whose str() raised" in stats.last_error


UNPRINTABLE = """class U(Exception):
    def __str__(self):
        raise RuntimeError("no str")


"""


def test_a_rule_files_exception_that_cannot_be_printed_is_one_line(tmp_path):
    """A kernel raising an exception whose ``str()`` raises stopped ``train`` with a traceback from
    the error handler itself (``memory_error_line`` printed it), exit code 1."""
    path = tmp_path / "rules.py"
    path.write_text(UNPRINTABLE + rule("None, None, None, None").replace("    loss = ", "    raise U()\n    loss = "))
    bound = resolve_method_spec(f"{path}:mine")
    with pytest.raises(ConfigError, match=f"^method '{path}:mine': its kernel raised U: <a U whose str\\(\\) raised> "):
        bound.token_losses(_batch(), torch.ones(5, dtype=torch.float64))


def test_a_reward_files_exception_that_cannot_be_printed_is_named(tmp_path):
    """The reward worker died formatting it: the failure read "timed out after 5s or crashed"."""
    from masktrl.tasks.rewards import make_reward

    path = tmp_path / "rw.py"
    path.write_text(UNPRINTABLE + "def score(prompts, completions, answers, **fields):\n    raise U()\n")
    reward = make_reward(f"{path}:score", timeout_s=30.0, workers=1)
    try:
        assert reward.score(["p"], ["4"], ["4"], [{}]) == [0.0]
        assert reward.errors == 1 and reward.last_error.endswith("U: <a U whose str() raised>"), reward.last_error
    finally:
        reward.close()


@pytest.mark.parametrize("key", ["train.lr", "warmstart.lr"])
def test_a_learning_rate_past_floats_range_is_refused(tmp_path, cli_error, key):
    """``--set train.lr=1e300`` (or 1e38) passed ``--dry-run``; the run made its folder and stopped
    at its first update with a traceback from inside Adam (``value cannot be converted to type
    float without overflow``), exit code 1."""
    from tests.conftest import write_tiny_config

    config = write_tiny_config(tmp_path / "t.yaml")
    line = cli_error("train", "--config", config, "--out", tmp_path / "out", "--dry-run", "--set", f"{key}=1e300")
    assert line == f"error: {key} must be at most 1e+30, got 1e+300"


def test_a_replay_learning_rate_past_floats_range_is_refused():
    """``analyze estimators --replay-lr 1e300``: the same traceback from the replayed update."""
    from masktrl.analysis.first_order import check_replay_optimizer
    from masktrl.errors import MasktrlError

    with pytest.raises(MasktrlError, match=r"^--replay-lr must be at most 1e\+30, got 1e\+300$"):
        check_replay_optimizer("adamw", 1e300)
    assert check_replay_optimizer("adamw", 1e-3).lr == 1e-3


def test_a_warm_start_that_diverges_is_named_and_not_cached(tmp_path, cli_error):
    """``--set warmstart.lr=1e6``: the warm start's weights went NaN, were cached, and the run
    stopped saying "Qwen3ForCausalLM: its logits are not the linear head of its last hidden state
    (max difference nan); not supported" (an architecture it supports); every later run of the
    config read the NaN cache and said the same."""
    from tests.conftest import write_tiny_config

    config = write_tiny_config(tmp_path / "t.yaml", {"warmstart": {"steps": 10, "lr": 1.0e6}})
    line = cli_error("train", "--config", config, "--out", tmp_path / "out", "--run", "r")
    assert line.startswith("error: the warm start diverged: its weights are not finite"), line
    assert line.endswith("; lower warmstart.lr=1e+06 (nothing was cached)"), line
    assert not (tmp_path / "out" / ".cache" / "warmstart").exists() or not any(
        (tmp_path / "out" / ".cache" / "warmstart").iterdir()
    )


def test_a_replay_of_a_run_whose_rule_file_was_edited_is_refused(tmp_path, cli_error):
    """``analyze estimators --update-method run`` on a run trained with ``rules.py:mine`` replayed
    the file as it is now (edited since: twice the loss) and recorded the update as the run's;
    ``--resume`` refuses the same edit."""
    from tests.conftest import snapshot, write_tiny_config

    rules = tmp_path / "rules.py"
    rules.write_text(rule("None, None, None, None"))
    config, out = write_tiny_config(tmp_path / "t.yaml"), tmp_path / "out"
    cli("train", "--config", config, "--out", out, "--run", "g", "--method", f"{rules}:mine")
    rules.write_text(rules.read_text().replace("loss = -adv", "loss = -2 * adv"))
    before = snapshot(out / "g")
    line = cli_error(
        "analyze", "estimators", "--run", "g", "--out", out, "--update-method", "run", "--output", tmp_path / "e"
    )
    assert line.startswith(f"error: {out / 'g'}: the rule file {rules} changed since the run recorded it: sha256 "), (
        line
    )
    assert line.endswith("...; the replay would not be the run's update: restore it"), line
    assert snapshot(out / "g") == before and not (tmp_path / "e").exists()
    cli("analyze", "estimators", "--run", "g", "--out", out, "--output", tmp_path / "u")  # unmasked: not the rule


def test_a_resume_after_the_reward_or_data_file_changed_is_refused(tmp_path):
    """A run's reward file (``task.reward=rw.py:score``), environment file and data file were read
    by path on every start: one edited between a run's start and its ``--resume`` gave the
    remaining steps another reward (or other prompts) without a word, while an edited rule file
    was refused. Their sha256 are now recorded as the run starts (``task_files``) and checked."""
    import json

    from tests.conftest import masktrl, snapshot
    from tests.test_hostile_inputs import reward_run_args

    args = reward_run_args(
        tmp_path,
        reward_file="def score(prompts, completions, answers, **kw):\n"
        "    return [float(c.strip() == a) for c, a in zip(completions, answers)]\n",
    )
    reward, out = tmp_path / "bad_reward.py", tmp_path / "out"
    killed = masktrl(*args, env={"MASKTRL_CRASH_AT": "update:2"})
    assert killed.returncode != 0
    recorded = json.loads((out / "x" / "manifest.json").read_text())["task_files"]
    assert set(recorded) == {"task.reward", "task.source"}
    reward.write_text(reward.read_text().replace("float(", "2 * float("))
    before = snapshot(out / "x")
    r = masktrl("train", "--resume", "x", "--out", out)
    assert r.returncode == 2 and r.stderr.strip().startswith(
        f"error: {out / 'x'}: task.reward {reward}:score changed since this run started on it"
    ), r.stderr
    assert "its remaining steps would train on another reward" in r.stderr and snapshot(out / "x") == before
    assert masktrl("train", "--resume", "x", "--out", out, "--force").returncode == 0  # on purpose: goes on, records it
    assert json.loads((out / "x" / "manifest.json").read_text())["task_files"]["task.reward"] != recorded["task.reward"]


def test_a_run_file_replaced_by_a_fifo_or_a_device_is_damage_not_a_hang(finished, tmp_path):
    """manifest.json or metrics.jsonl replaced by a FIFO made ``masktrl runs`` (and every reader of
    the run) wait forever; one linked to /dev/zero read until memory ran out. Each is now the
    run's damage in one line (summary.json was already refused so)."""
    import os
    import shutil

    from tests.conftest import copy_run, masktrl

    _, out, root = copy_run(finished, tmp_path)
    for name, make in (("a", "manifest.json"), ("b", "metrics.jsonl"), ("c", "metrics.jsonl")):
        shutil.copytree(root, out / name)
        (out / name / make).unlink()
    os.mkfifo(out / "a" / "manifest.json")
    os.mkfifo(out / "b" / "metrics.jsonl")
    (out / "c" / "metrics.jsonl").symlink_to("/dev/zero")
    listed = masktrl("runs", "--out", out, timeout=120)  # it hung here
    assert listed.returncode == 0, listed.stderr
    for name, make in (("a", "manifest.json"), ("b", "metrics.jsonl"), ("c", "metrics.jsonl")):
        assert (
            f"damaged {name}: {make}: not a regular file (a FIFO, a device or a folder in its place)" in listed.stdout
        )
    r = masktrl("analyze", "dynamics", "b", "--out", out, "--output", tmp_path / "d", timeout=120)
    assert (
        r.returncode == 2
        and r.stderr.strip()
        == f"error: {out / 'b' / 'metrics.jsonl'}: not a regular file (a FIFO, a device or a folder in its place)"
    )


def test_a_rule_file_under_a_shipped_rules_name_is_labelled_by_its_rule():
    """Runs of ``fake.py:grpo`` (a file's rule registered as ``grpo``, which a file may do) beside
    runs of grpo were labelled ``grpo[loss_agg=token-mean]`` and ``grpo[loss_agg=seq-mean-token-mean]``:
    the table said they differ in a parameter, not in the rule."""
    from masktrl.analysis.io import distinguishing_keys

    configs = [
        {"method.name": "grpo", "method.loss_agg": "seq-mean-token-mean", "seed": 0},
        {"method.name": "/x/fake.py:grpo", "method.loss_agg": "token-mean", "seed": 0},
    ]
    assert distinguishing_keys(configs) == ["method.name"]
    configs[1]["method.name"] = "grpo"  # one rule: the parameter tells them apart, as before
    assert distinguishing_keys(configs) == ["method.loss_agg"]


def test_an_output_inside_a_warm_start_cache_entry_is_refused(tmp_path):
    """``analyze dynamics r --output out/.cache/warmstart/<entry>`` (rollout's and eval's --output
    alike) wrote there; the next run found a file the entry does not record, built the warm start
    again and replaced the entry: the analysis's files were deleted without a word."""
    from masktrl.errors import ConfigError
    from masktrl.runs.resolve import refuse_inside_run

    entry = tmp_path / "out" / ".cache" / "warmstart" / "v3-abc-seed0"
    entry.mkdir(parents=True)
    for path in (entry, entry / "sub", entry / "x.parquet"):
        with pytest.raises(
            ConfigError, match=f"lies inside the warm-start cache entry {entry}; its files are masktrl's own"
        ):
            refuse_inside_run(path, analysis_ok=True)
    refuse_inside_run(tmp_path / "out" / ".cache" / "elsewhere")  # not an entry


def test_what_a_rule_or_environment_file_prints_on_import_stays_off_stdout(tmp_path):
    """A rule file that prints on import (a debugging line) put that line at the head of
    ``masktrl config show``'s YAML (``config show > run.yaml`` then held it); an environment
    file alike. What a user's file prints on import now goes to stderr."""
    import yaml

    from tests.conftest import masktrl

    path = tmp_path / "rules.py"
    path.write_text('print("hello from import")\n' + rule("None, None, None, None"))
    shown = masktrl("config", "show", "--method", f"{path}:mine")
    assert shown.returncode == 0 and "hello from import" in shown.stderr, shown.stderr
    assert yaml.safe_load(shown.stdout)["method"]["name"] == f"{path}:mine"
