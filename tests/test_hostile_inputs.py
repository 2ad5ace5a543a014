"""Hostile inputs, run as a user types them (docs/RELIABILITY.md, "Finite or refused" and "Sweeps
that mean what they say"): each ends in one line and exit code 2 before anything is written, or
in a run that stays true."""

import json
import subprocess
import sys

import pytest

from masktrl.io import sha256_file
from masktrl.rollout.storage import read_rollouts
from masktrl.runs.store import RunStore
from tests.conftest import cli, copy_run, masktrl_env, snapshot, tiny_yaml, write_tiny_config
from tests.test_readers import alias_bomb


def nothing_written(tmp_path) -> bool:
    return not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- YAML


def test_duplicate_section_in_a_config_is_refused_naming_key_and_file(tmp_path, cli_error):
    path = tmp_path / "dup.yaml"
    path.write_text(tiny_yaml() + "train:\n  steps: 7\n")  # a second train: section (the last used to win silently)
    line = cli_error("train", "--config", path, "--out", tmp_path / "out", "--run", "x")
    assert line.startswith(f"error: {path}: duplicate key 'train' (lines ") and line.endswith("give each key once")
    assert nothing_written(tmp_path)
    assert cli_error("config", "show", "--config", path).startswith(f"error: {path}: duplicate key 'train'")


@pytest.mark.parametrize(
    "kind, needle",
    [
        ("deep", "nested deeper than 64 levels"),
        ("recursive", "recursive alias *a (line 1)"),
        ("bomb", "its aliases expand to more than 100,000 values"),
    ],
)
def test_hostile_yaml_configs_are_one_line(tmp_path, cli_error, kind, needle):
    path = tmp_path / f"{kind}.yaml"
    path.write_text(
        {"deep": "train: " + "[" * 5000 + "]" * 5000 + "\n", "recursive": "a: &a [*a]\n", "bomb": alias_bomb()}[kind]
    )
    for args in (("config", "show", "--config", path), ("train", "--config", path, "--out", tmp_path / "out")):
        line = cli_error(*args)
        assert line.startswith(f"error: {path}: ") and needle in line, line
    assert nothing_written(tmp_path)


def test_alias_bomb_does_not_hang_config_show(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(alias_bomb())
    r = subprocess.run(
        [sys.executable, "-m", "masktrl.cli", "config", "show", "--config", str(path)],
        capture_output=True,
        text=True,
        env=masktrl_env(),
        timeout=120,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr and "alias bomb" in r.stderr


def test_set_with_a_yaml_list_for_the_method_name_is_one_line(tmp_path, cli_error):
    assert (
        cli_error("config", "show", "--set", "method.name=[1]")
        == "error: unknown method '[1]'; valid methods: cispo, clip-cov, dapo, dppo, gmpo, gpg, "
        "grpo, gspo, kl-cov, m2po, pdm, "
        "prime-dppo, prime-ipo, sapo, sis, topr, trm, two-sided, or path/to/rules.py:name"
    )
    assert "unknown method '[1]'" in cli_error("train", "--set", "method.name=[1]", "--out", tmp_path / "out")
    assert nothing_written(tmp_path)


def test_set_value_with_a_duplicate_key_is_refused(cli_error):
    line = cli_error("config", "show", "--set", "task.chat_template_kwargs={a: 1, a: 2}")
    assert "duplicate key 'a'" in line and "--set task.chat_template_kwargs" in line


# --------------------------------------------------------------------------- names, data


def test_run_name_that_is_not_utf8_is_one_line(tmp_path):
    args = [sys.executable, "-m", "masktrl.cli", "train", "--run", b"r\xff", "--out", str(tmp_path / "out")]
    r = subprocess.run(args, capture_output=True, env=masktrl_env(), timeout=120)
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode == 2 and "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "invalid run name 'r\\udcff': it holds bytes that are not UTF-8" in lines[0], err
    assert nothing_written(tmp_path)


def dataset_args(path, *extra):
    return ["--set", "task.name=dataset", "--set", f"task.source={path}", "--set", "task.reward=exact-match", *extra]


@pytest.mark.parametrize(
    "name, data, needle",
    [
        (
            "latin.jsonl",
            b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "caf\xe9", "answer": "3"}\n',
            "latin.jsonl, line 2: not UTF-8 text (byte 0xe9)",
        ),
        ("empty.jsonl", b"", "empty.jsonl: empty file (no rows)"),
    ],
)
def test_dataset_that_is_not_utf8_or_empty_is_one_line(tmp_path, cli_error, name, data, needle):
    pytest.importorskip("datasets")
    path = tmp_path / name
    path.write_bytes(data)
    assert (
        cli_error("train", "--out", tmp_path / "out", "--run", "x", *dataset_args(path))
        == f"error: {tmp_path}/{needle}"
    )
    assert nothing_written(tmp_path)


def test_one_row_dataset_is_refused_before_the_run_folder(tmp_path, cli_error):
    pytest.importorskip("datasets")
    path = tmp_path / "one.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    line = cli_error("train", "--out", tmp_path / "out", "--run", "x", *dataset_args(path, "--set", "task.n_test=1"))
    assert (
        line == "error: task 'one': no training set (all 1 examples are held out; lower task.n_test or "
        "set "
        "task.test_split)"
    )
    assert nothing_written(tmp_path)


# --------------------------------------------------------------------------- files of a run


DEEP_JSON = '{"a": ' * 5000 + "1" + "}" * 5000


def test_deep_run_yaml_is_one_line_and_runs_goes_on(finished, tmp_path, cli_error):
    _, out, root = copy_run(finished, tmp_path)
    (root / "run.yaml").write_text("seed: " + "[" * 5000 + "]" * 5000 + "\n")
    line = cli_error("train", "--resume", "r", "--out", out)
    assert line.endswith(
        "run.yaml: content hash mismatch, file is corrupted (stage config)"
    )  # the hash check comes first
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["stages"]["config"]["files"]["run.yaml"] = sha256_file(root / "run.yaml")  # an edit that passes it
    (root / "manifest.json").write_text(json.dumps(manifest))
    line = cli_error("train", "--resume", "r", "--out", out)
    assert line.startswith(f"error: {root / 'run.yaml'}: ") and "nested deeper than 64 levels" in line
    r = cli("runs", out)
    assert "r" in r.output


def test_deep_summary_json_is_damaged_in_runs(finished, tmp_path, cli_error):
    from masktrl.runs.store import RunStore

    _, out, root = copy_run(finished, tmp_path)
    (root / "summary.json").write_text(DEEP_JSON)
    RunStore(root).mark_done("summary", [root / "summary.json"])  # its hash recorded: the depth limit refuses it
    r = cli("runs", out)
    assert "damaged" in r.output and "nested deeper than 64 levels" in r.output, r.output


def test_deep_warmstart_json_rebuilds_the_entry(finished, tmp_path):
    config, out, root = copy_run(finished, tmp_path)
    [entry] = list((out / ".cache" / "warmstart").iterdir())
    (entry / "warmstart.json").write_text(DEEP_JSON)
    r = cli("train", "--config", config, "--out", out, "--run", "second")
    assert "nested deeper than 64 levels" in r.stderr and "building it again" in r.stderr, r.stderr
    json.loads((entry / "warmstart.json").read_text())  # rebuilt


# --------------------------------------------------------------------------- numbers


WHY = "(below it sampling is greedy decoding but for ties, and logits / T can overflow), got "


@pytest.mark.parametrize(
    "flag, value, needle",
    [
        ("--temperature", "nan", f"--temperature must be a finite number >= 1e-05 or 0 (greedy) {WHY}nan"),
        ("--temperature", "inf", f"--temperature must be a finite number >= 1e-05 or 0 (greedy) {WHY}inf"),
        ("--temperature", "1e-320", f"--temperature must be a finite number >= 1e-05 or 0 (greedy) {WHY}1e-320"),
        ("--top-p", "0", "--top-p must be in (0, 1], got 0.0"),
        ("--top-p", "nan", "--top-p must be in (0, 1], got nan"),
    ],
)
def test_eval_refuses_non_finite_sampling(finished, tmp_path, cli_error, flag, value, needle):
    _, out, root = copy_run(finished, tmp_path)
    before = snapshot(root)
    assert cli_error("eval", "synthetic", "--model", root, "--k", "1", flag, value) == f"error: {needle}"
    assert snapshot(root) == before


@pytest.mark.parametrize(
    "flag, value, needle",
    [
        ("--temperature", "inf", f"--temperature must be a finite number >= 1e-05 {WHY}inf"),
        ("--temperature", "nan", f"--temperature must be a finite number >= 1e-05 {WHY}nan"),
        ("--temperature", "1e-320", f"--temperature must be a finite number >= 1e-05 {WHY}1e-320"),
        ("--top-p", "1.5", "--top-p must be in (0, 1], got 1.5"),
    ],
)
def test_rollout_refuses_non_finite_sampling(finished, tmp_path, cli_error, flag, value, needle):
    _, out, root = copy_run(finished, tmp_path)
    dest = tmp_path / "r.parquet"
    assert (
        cli_error("rollout", "--model", root, "--data", "synthetic", "--output", dest, flag, value)
        == f"error: {needle}"
    )
    assert not dest.exists()


def test_rollout_file_recording_an_infinite_temperature_is_refused(finished, tmp_path, cli_error):
    from masktrl.rollout.storage import write_rollouts

    config, _, root = finished
    samples, meta = read_rollouts(root / "steps" / "000001" / "rollouts.parquet")
    path = tmp_path / "old.parquet"
    write_rollouts(
        path, samples, {**meta, "temperature": float("inf")}
    )  # what `masktrl rollout --temperature inf` wrote
    line = cli_error("train", "--config", config, "--out", tmp_path / "out", "--run", "x", "--rollouts-from", path)
    assert (
        line == f"error: {path}: its recorded sampling cannot be trained on (temperature must be a "
        f"finite number >= 1e-05 {WHY}inf)"
    )
    assert nothing_written(tmp_path)


REWARD_FILE = """
def score(prompts, completions, answers, **fields):
    raise RuntimeError("grader offline")
"""


HUGE_REWARD_FILE = """
def score(prompts, completions, answers, **fields):
    return [1e308 if len(c) % 2 else -1e308 for c in completions]
"""


def reward_run_args(tmp_path, *extra, reward_file=REWARD_FILE):
    data = tmp_path / "sums.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n" for a in range(5) for b in range(5))
    )
    reward = tmp_path / "bad_reward.py"
    reward.write_text(reward_file)
    config = write_tiny_config(tmp_path / "tiny.yaml", {"warmstart": {"steps": 0}})
    return [
        "train",
        "--config",
        config,
        "--out",
        tmp_path / "out",
        "--run",
        "x",
        "--set",
        "task.name=dataset",
        "--set",
        f"task.source={data}",
        "--set",
        f"task.reward={reward}:score",
        "--set",
        "task.n_test=5",
        *extra,
    ]


def test_rewards_of_plus_minus_1e308_train_on_finite_advantages(tmp_path):
    cli(*reward_run_args(tmp_path, reward_file=HUGE_REWARD_FILE))
    store = RunStore(tmp_path / "out" / "x")
    assert store.status() == "complete"
    for step in (1, 2):
        samples, _ = store.read_rollouts(step, verify=True)
        advantages = [s.advantage for s in samples]
        assert {s.reward for s in samples} <= {1e308, -1e308}
        assert all(abs(a) < 10 for a in advantages) and any(
            a != 0 for a in advantages
        )  # group-std of ±1e308: ±0.87, ±1.5


def test_reward_failing_on_every_completion_stops_the_run(tmp_path, cli_error):
    line = cli_error(*reward_run_args(tmp_path))
    assert line.startswith("error: step 1: the reward failed on 24 of 24 completions (100%; last: ")
    assert line.endswith("the run stops (task.max_reward_error_frac=0.5): fix task.reward"), line
    store = RunStore(tmp_path / "out" / "x")
    assert store.status() == "failed" and "the reward failed on 24 of 24" in store.manifest["reason"]
    assert not store.is_done("step/000001/rollout")  # the failed step's batch was not recorded


def test_reward_failures_below_the_threshold_warn_and_the_run_completes(tmp_path):
    r = cli(*reward_run_args(tmp_path, "--set", "task.max_reward_error_frac=1.0"))
    assert "warning: step 1: the reward failed on 24 of 24 completions (100%; last: " in r.output, r.output
    assert RunStore(tmp_path / "out" / "x").status() == "complete"


def test_model_too_large_for_memory_is_one_line(tmp_path, cli_error):
    line = cli_error(
        "train",
        "--out",
        tmp_path / "out",
        "--run",
        "big",
        "--set",
        "model.intermediate_size=2000000000",
        "--set",
        "warmstart.steps=0",
        "--set",
        "train.steps=1",
    )
    assert line.startswith("error: out of memory (") and "rollout.batch_size" in line, line


def test_a_model_larger_than_the_free_space_is_a_full_disk(tmp_path, cli_error):
    disk = tmp_path / "disk"
    disk.mkdir()
    if (
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)], capture_output=True).returncode
        != 0
    ):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:  # a 4 MB model on a 2 MiB disk: safetensors fails and removes its partial file, so the disk looks free again
        line = cli_error(
            "train",
            "--out",
            disk / "out",
            "--run",
            "x",
            "--set",
            "model.hidden_size=256",
            "--set",
            "model.intermediate_size=1024",
            "--set",
            "model.num_layers=1",
            "--set",
            "warmstart.steps=1",
        )
        assert line.startswith(f"error: {disk / 'out' / '.cache' / 'warmstart'}/") and line.endswith(
            ".tmp: No space left on device"
        ), line
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_proc_is_not_a_writable_folder(tmp_path, cli_error):
    line = cli_error("train", "--out", "/proc/masktrl-out", "--run", "x")
    assert line == (
        "error: /proc: not a writable folder (a proc file system, the kernel's own) "
        "(cannot write the run folder /proc/masktrl-out/x)"
    )


# --------------------------------------------------------------------------- resume


def test_resume_of_a_complete_run_is_a_no_op_that_says_so(finished, tmp_path):
    _, out, root = copy_run(finished, tmp_path)
    before = snapshot(root)
    r = cli("train", "--resume", "r", "--out", out)
    assert "run r is complete (2 of 2 steps): nothing to do" in r.output, r.output
    assert snapshot(root) == before  # summary.json and the manifest untouched


def test_resume_force_with_other_sampling_regenerates_the_stored_batches(tmp_path):
    config = write_tiny_config(tmp_path / "tiny.yaml")
    out = tmp_path / "out"
    env = masktrl_env({"MASKTRL_CRASH_AT": "update:2"})  # killed after storing step 2's batch, before its update
    r = subprocess.run(
        [sys.executable, "-m", "masktrl.cli", "train", "--config", str(config), "--out", str(out), "--run", "c"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert r.returncode == -9, r.stderr
    store = RunStore(out / "c")
    assert store.is_done("step/000002/rollout") and store.checkpoints() == [1]
    r = cli("train", "--resume", "c", "--out", out, "--force", "--set", "rollout.temperature=0.5")
    assert (
        "the stored rollout batch of step 2 was sampled with other settings (rollout.temperature): sampling it again"
    ) in r.output + r.stderr, r.output
    _, meta = read_rollouts(out / "c" / "steps" / "000002" / "rollouts.parquet")
    assert meta["temperature"] == 0.5


# --------------------------------------------------------------------------- sweeps


@pytest.mark.parametrize(
    "args, needle",
    [
        (
            ["--seeds", "2", "--set", "seed=5"],
            "--set seed=5 conflicts with --seeds (every run of a sweep takes its seed from --seeds): drop one",
        ),
        (["--seeds", "99999999999999999999"], "--seeds 99999999999999999999: at most 1000 seeds"),
        (["--seeds", "0,4294967296"], "--seeds: seed 4294967296 is out of range [0, 4294967295]"),
        (["--methods", "grpo,sis", "--baseline", "dppo"], "--baseline dppo is not among the swept methods (grpo, sis)"),
        (["--no-submit"], "--no-submit goes with --launcher slurm (the local launcher submits nothing)"),
    ],
)
def test_sweep_flags_are_checked_before_the_first_run(tmp_path, cli_error, args, needle):
    config = write_tiny_config(tmp_path / "tiny.yaml")
    line = cli_error(
        "sweep",
        "--config",
        config,
        "--out",
        tmp_path / "out",
        *(["--methods", "grpo"] if "--methods" not in args else []),
        *args,
    )
    assert line == f"error: {needle}"
    assert nothing_written(tmp_path)
