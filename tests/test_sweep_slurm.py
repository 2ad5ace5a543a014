"""``masktrl sweep --launcher slurm`` and ``--print-commands``: one sbatch job per run still to
do, with the sweep's resume rules; a job still queued or running is never submitted twice."""

import json
import os
import shlex
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from masktrl.cli import app
from masktrl.errors import MasktrlError
from masktrl.recipes import slurm
from masktrl.recipes import sweep as sweep_stage
from tests.test_sweep import _copy, swept  # noqa: F401  (the module fixture: grpo-seed0 and dppo-seed0, complete)

runner = CliRunner()


def _interrupt(root):
    (root / "summary.json").unlink()
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["status"] = "interrupted"
    (root / "manifest.json").write_text(json.dumps(manifest))


@pytest.fixture()
def grid(swept, tmp_path):
    """grpo-seed0 complete, dppo-seed0 interrupted (resumable), seed 1 of both not started."""
    config, out = _copy(swept, tmp_path)
    _interrupt(out / "dppo-seed0")
    return config, out


@pytest.fixture()
def fake_slurm(tmp_path):
    """sbatch and squeue stand-ins on the PATH: sbatch logs its arguments and answers job ids
    101, 102, ...; squeue prints what the test writes into squeue.txt."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log, queue = tmp_path / "sbatch.log", tmp_path / "squeue.txt"
    queue.write_text("")
    (bin_dir / "sbatch").write_text(f'#!/bin/bash\necho "$@" >> {log}\necho $((100 + $(wc -l < {log})))\n')
    (bin_dir / "squeue").write_text(f"#!/bin/bash\ncat {queue}\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "COLUMNS": "250"}
    return env, log, queue


def sweep(config, out, *args, env=None):
    """``masktrl sweep`` in this process; a ``MasktrlError`` is ``result.exception`` (the CLI's
    boundary turns it into one line and exit 2, tests/test_cli_errors.py)."""
    argv = ["sweep", "--methods", "grpo,dppo", "--seeds", "2", "--config", str(config), "--out", str(out), *args]
    return runner.invoke(app, argv, env=env or {"COLUMNS": "250"})


def failed(result, needle):
    return (
        isinstance(result.exception, MasktrlError)
        and needle in str(result.exception)
        and "\n" not in str(result.exception)
    )


def test_print_commands_lists_each_run_still_to_do_and_starts_nothing(grid):
    config, out = grid
    before = sorted(p.name for p in out.iterdir())
    r = sweep(config, out, "--print-commands", "--set", "train.lr=0.001")
    assert r.exit_code == 0, r.output
    lines = r.output.strip().splitlines()
    assert lines[0] == "# grpo-seed0: complete" and len(lines) == 4  # plan order: grpo seeds 0, 1, then dppo
    py = shlex.quote(sys.executable)
    assert (
        lines[1] == f"{py} -m masktrl.cli train --method grpo --seed 1 --config {config} --set train.lr=0.001 --out "
        f"{out} --run grpo-seed1"
    )
    assert lines[2] == f"{py} -m masktrl.cli train --resume {out / 'dppo-seed0'} --out {out}"
    assert lines[3].endswith("--run dppo-seed1")
    assert sorted(p.name for p in out.iterdir()) == before  # nothing written


def test_slurm_submits_one_job_per_run_and_never_twice_while_queued(grid, fake_slurm):
    config, out = grid
    env, log, queue = fake_slurm
    r = sweep(config, out, "--launcher", "slurm", "--slurm", "partition=gpu", "--slurm", "gres=gpu:8", env=env)
    assert r.exit_code == 0, r.output
    assert "skip grpo-seed0 (complete)" in r.output and "submitted dppo-seed0 as job 102, resuming" in r.output
    calls = log.read_text().splitlines()
    assert len(calls) == 3 and all(c.startswith("--parsable ") for c in calls)
    jobs = json.loads((out / ".sweep" / "slurm" / "jobs.json").read_text())
    assert jobs == {"grpo-seed1": "101", "dppo-seed0": "102", "dppo-seed1": "103"}
    script = (out / ".sweep" / "slurm" / "grpo-seed1.sbatch").read_text().splitlines()
    assert (
        "#SBATCH --partition=gpu" in script
        and "#SBATCH --gres=gpu:8" in script
        and "#SBATCH --job-name=masktrl-grpo-seed1" in script
    )
    [planned] = sweep_stage.plan(out, ["grpo"], [1], config)
    assert script[-1].startswith("exec ") and shlex.split(script[-1])[1:] == slurm.train_command(
        planned, out=out, config=config, overrides=[]
    )
    assert f"cd {shlex.quote(os.getcwd())}" in script

    queue.write_text("101 PENDING\n102 RUNNING\n")  # 103 finished (or died): squeue no longer lists it
    r = sweep(config, out, "--launcher", "slurm", env=env)
    assert r.exit_code == 0, r.output
    assert "skip grpo-seed1: job 101 PENDING" in r.output and "skip dppo-seed0: job 102 RUNNING" in r.output
    assert "submitted dppo-seed1 as job 104" in r.output and len(log.read_text().splitlines()) == 4


def test_slurm_without_sbatch_is_one_line_and_writes_nothing(grid, tmp_path):
    config, out = grid
    empty = tmp_path / "empty"
    empty.mkdir()
    env = {"PATH": str(empty), "COLUMNS": "250"}
    r = sweep(config, out, "--launcher", "slurm", env=env)
    assert failed(r, "sbatch is not on the PATH") and not (out / ".sweep").exists()
    r = sweep(config, out, "--launcher", "slurm", "--no-submit", env=env)
    assert r.exit_code == 0 and sorted(p.name for p in (out / ".sweep" / "slurm").glob("*.sbatch")) == [
        "dppo-seed0.sbatch",
        "dppo-seed1.sbatch",
        "grpo-seed1.sbatch",
    ]


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--launcher", "pbs"], "--launcher must be local or slurm"),
        (["--launcher", "slurm", "--no-submit", "--slurm", "output=x.log"], "set by masktrl"),
        (["--launcher", "slurm", "--no-submit", "--slurm", "=3"], "expected KEY=VALUE"),
        (["--accelerate-config", "nosuch.yaml", "--print-commands"], "no such file"),
    ],
)
def test_bad_launcher_options(grid, args, needle):
    config, out = grid
    r = sweep(config, out, *args)
    assert failed(r, needle), (r.exception, r.output)


def test_a_written_script_resumes_the_interrupted_run(grid):
    """The job's command, run as the script would run it, completes the run; the sweep then
    finds every run of seed 0 complete and prints the compare table."""
    config, out = grid
    r = runner.invoke(
        app,
        [
            "sweep",
            "--methods",
            "grpo,dppo",
            "--seeds",
            "1",
            "--config",
            str(config),
            "--out",
            str(out),
            "--launcher",
            "slurm",
            "--no-submit",
        ],
        env={"COLUMNS": "250"},
    )
    assert r.exit_code == 0, r.output
    script = out / ".sweep" / "slurm" / "dppo-seed0.sbatch"
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (out / "dppo-seed0" / "summary.json").is_file()
    r = runner.invoke(
        app,
        [
            "sweep",
            "--methods",
            "grpo,dppo",
            "--seeds",
            "1",
            "--config",
            str(config),
            "--out",
            str(out),
            "--launcher",
            "slurm",
        ],
        env={"COLUMNS": "250"},
    )
    assert r.exit_code == 0 and "2 complete, 0 to run" in r.output and (out / "analysis" / "compare.json").is_file(), (
        r.output
    )


def test_slurm_leaves_a_run_that_is_training_alone(grid, fake_slurm):
    """A run whose lock is held (its job, or any other process, trains it now) is neither
    submitted again nor a reason to stop: the local launcher refuses it with one line."""
    from tests.test_reliability import HOLD_LOCK

    config, out = grid
    env, log, _ = fake_slurm
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(out / "dppo-seed0")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        r = sweep(config, out, "--launcher", "slurm", env=env)
        assert r.exit_code == 0, r.output
        assert f"skip dppo-seed0: being trained right now by pid {holder.pid}" in r.output
        assert len(log.read_text().splitlines()) == 2 and "dppo-seed0" not in log.read_text()
        assert failed(sweep(config, out), f"is being trained right now (pid {holder.pid})")
    finally:
        holder.kill()
        holder.wait()
