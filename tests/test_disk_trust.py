"""What a run reads from disk is hashed and checked, nothing is read or written outside
``--out``, and the writer lock cannot be bypassed (docs/RELIABILITY.md, *Trust on disk*)."""

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from masktrl.errors import ArtifactError
from masktrl.runs.store import RunStore
from tests.conftest import cli, masktrl, masktrl_env, tiny_yaml

# finished: a module fixture of test_reliability.py
from tests.test_reliability import copy_run, finished, manifest, one_line, snapshot, start_training  # noqa: F401

EVAL = ("eval", "synthetic", "--k", "1", "--temperature", "0")


# --------------------------------------------------------------------------- everything read is hashed


@pytest.mark.parametrize(
    "name, content", [("special_tokens_map.json", '{"eos_token": "1"}'), ("added_tokens.json", '{"<x>": 17}')]
)
def test_a_file_added_to_a_checkpoint_is_refused_by_eval(finished, tmp_path, cli_error, name, content):
    _, out, root = copy_run(finished, tmp_path)
    (root / "checkpoints" / "000002" / name).write_text(content)
    line = one_line(
        cli_error(*EVAL, "--model", root), f"checkpoints/000002/{name}: not a file of stage checkpoint/000002"
    )
    assert "added after it was recorded" in line
    assert not (root / "eval").exists()


def test_a_changed_or_missing_checkpoint_file_is_refused(finished, tmp_path, cli_error):
    _, out, root = copy_run(finished, tmp_path)
    ckpt = root / "checkpoints" / "000002"
    (ckpt / "tokenizer_config.json").write_text(
        (ckpt / "tokenizer_config.json").read_text().replace("}", ', "x": 1}', 1)
    )
    one_line(cli_error(*EVAL, "--model", root), "tokenizer_config.json: content hash mismatch")
    (ckpt / "tokenizer_config.json").unlink()
    one_line(cli_error(*EVAL, "--model", root), "tokenizer_config.json: missing (stage checkpoint/000002)")


def test_a_file_added_to_the_warmstart_cache_rebuilds_the_entry(finished, tmp_path):
    config, out, root = copy_run(finished, tmp_path)
    [entry] = list((out / ".cache" / "warmstart").iterdir())
    (entry / "special_tokens_map.json").write_text('{"eos_token": "1"}')
    r = cli("train", "--config", config, "--out", out, "--run", "second")
    assert "special_tokens_map.json was added" in r.stderr and "building it again" in r.stderr
    assert not (entry / "special_tokens_map.json").exists()  # the rebuilt entry is exactly the recorded files
    before = RunStore(root).stage("eval/before")["accuracy"]
    assert RunStore(out / "second").stage("eval/before")["accuracy"] == before  # trained from the true warm start


def test_a_file_added_to_the_warmstart_cache_fails_the_runs_step0(finished, tmp_path, cli_error):
    _, out, root = copy_run(finished, tmp_path)
    [entry] = list((out / ".cache" / "warmstart").iterdir())
    m = manifest(root)
    m["stages"]["warmstart"]["info"]["path"] = str(entry)  # this copy's own cache
    (root / "manifest.json").write_text(json.dumps(m))
    (entry / "added_tokens.json").write_text('{"<x>": 17}')
    one_line(cli_error(*EVAL, "--model", root, "--step", "0", "--out", out), "added_tokens.json was added")


def test_an_edited_summary_is_refused_by_every_reader(finished, tmp_path, cli_error):
    _, out, root = copy_run(finished, tmp_path)
    summary = json.loads((root / "summary.json").read_text())
    (root / "summary.json").write_text(json.dumps({**summary, "eval_after": 0.99}))
    r = cli("runs", out)
    assert "damaged" in r.output and "summary.json: content hash mismatch" in r.output
    one_line(cli_error("analyze", "compare", root, "--out", out), "summary.json: content hash mismatch")


def test_a_changed_rollout_file_is_refused_by_every_reader(finished, tmp_path):
    _, out, root = copy_run(finished, tmp_path)
    path = root / "steps" / "000001" / "rollouts.parquet"
    path.write_bytes(path.read_bytes() + b"\0")
    with pytest.raises(ArtifactError, match="rollouts.parquet: content hash mismatch"):
        RunStore(root, writable=False).read_rollouts(1)
    m = manifest(root)
    del m["stages"]["step/000001/rollout"]  # a batch the manifest does not record is not read either
    (root / "manifest.json").write_text(json.dumps(m))
    store = RunStore(root, writable=False)
    assert 1 not in store.rollout_steps()
    with pytest.raises(ArtifactError, match="no rollouts recorded for step 1"):
        store.read_rollouts(1)


def test_an_edited_metrics_row_is_refused_by_every_reader(finished, tmp_path, cli_error):
    _, out, root = copy_run(finished, tmp_path)
    lines = (root / "metrics.jsonl").read_text().splitlines()
    row = json.loads(lines[0])
    lines[0] = json.dumps({**row, "reward_mean": 0.99}, sort_keys=True)
    (root / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    r = cli("runs", out)
    assert "damaged" in r.output and "metrics.jsonl: the rows up to summary fail their sha256 check" in r.output
    one_line(cli_error("analyze", "dynamics", root, "--out", out), "fail their sha256 check")


def test_duplicate_rows_after_the_last_checkpoint_fail_the_resume_check(finished, tmp_path, cli_error):
    _, out, root = copy_run(finished, tmp_path)
    m = manifest(root)
    del m["stages"]["summary"]  # as if the run had stopped after its checkpoint 2
    (root / "manifest.json").write_text(json.dumps({**m, "status": "interrupted"}))
    (root / "summary.json").unlink()
    lines = (root / "metrics.jsonl").read_text().splitlines()
    (root / "metrics.jsonl").write_text("\n".join(lines + lines) + "\n")  # steps 1, 2 appended again
    before = snapshot(root)
    one_line(cli_error("train", "--resume", "r", "--out", out), "a row of step 1 follows step 2")
    assert snapshot(root) == before


# --------------------------------------------------------------------------- nothing outside --out


def _interrupted_without_checkpoints(root):
    """The copied run as a run killed before its first checkpoint."""
    m = manifest(root)
    m["stages"] = {k: v for k, v in m["stages"].items() if not k.startswith(("checkpoint/", "summary", "eval/after"))}
    shutil.rmtree(root / "checkpoints")
    (root / "summary.json").unlink()
    return {**m, "status": "interrupted"}


@pytest.mark.parametrize("rel", ["../../victim.txt", "/VICTIM", "steps/../../../victim.txt"])
def test_a_manifest_path_that_leaves_the_run_is_refused_and_deletes_nothing(finished, tmp_path, cli_error, rel):
    config, out, root = copy_run(finished, tmp_path)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    m = _interrupted_without_checkpoints(root)
    m["stages"]["evil"] = {"status": "done", "files": {rel.replace("/VICTIM", str(victim)): "0" * 64}}
    (root / "manifest.json").write_text(json.dumps(m))
    line = one_line(
        cli_error("train", "--config", config, "--out", out, "--run", "r", "--set", "train.lr=2e-3"),
        "leaves the run folder",
    )
    assert "manifest.json" in line
    assert victim.read_text() == "keep me"


def test_a_symlink_inside_the_run_is_refused_not_followed(finished, tmp_path, cli_error):
    config, out, root = copy_run(finished, tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim.txt").write_text("keep me")
    m = _interrupted_without_checkpoints(root)
    m["stages"]["eval/synthetic/000000"] = {"status": "done", "files": {"eval/victim.txt": "0" * 64}}
    (root / "manifest.json").write_text(json.dumps(m))
    (root / "eval").symlink_to(outside)
    one_line(
        cli_error("train", "--config", config, "--out", out, "--run", "r", "--set", "train.lr=2e-3"),
        "a symbolic link inside",
    )
    assert (outside / "victim.txt").read_text() == "keep me"


def test_a_symlinked_eval_or_checkpoints_folder_is_refused(finished, tmp_path, cli_error):
    _, out, root = copy_run(finished, tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "eval").symlink_to(outside)
    one_line(cli_error(*EVAL, "--model", root), f"{root}/eval: a symbolic link inside")
    assert list(outside.iterdir()) == []
    (root / "eval").unlink()
    shutil.move(root / "checkpoints", outside / "checkpoints")
    (root / "checkpoints").symlink_to(outside / "checkpoints")
    one_line(cli_error(*EVAL, "--model", root), f"{root}/checkpoints: a symbolic link inside")
    one_line(cli_error("train", "--resume", root), f"{root}/checkpoints: a symbolic link inside")


def test_run_names_resolve_under_out_only(finished, tmp_path, monkeypatch, cli_error):
    _, out, root = copy_run(finished, tmp_path)
    here = tmp_path / "here"
    here.mkdir()
    shutil.copytree(root, here / "r0")
    other = tmp_path / "other"
    other.mkdir()
    monkeypatch.chdir(here)
    before = snapshot(here)
    one_line(
        cli_error("train", "--resume", "r0", "--out", other),
        f"unknown run r0: no such folder under {other} (a run elsewhere is given as a path: ./r0)",
    )
    one_line(cli_error(*EVAL, "--model", "r0", "--out", other), "a run elsewhere is given as a path (./r0)")
    one_line(cli_error("analyze", "dynamics", "r0", "--out", other), "unknown run r0")
    assert snapshot(here) == before and not (here / ".cache").exists() and list(other.iterdir()) == []
    cli(*EVAL, "--model", "./r0", "--out", other)  # a path is a path
    assert (here / "r0" / "eval" / "synthetic-step2.json").is_file()


def _tree(path):
    """Every path under ``path`` with its size and mtime (what a write would change)."""
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in [path, *path.rglob("*")]}


@pytest.mark.slow  # eight commands in their own processes: about a minute
def test_the_whole_cli_writes_nothing_outside_out_with_a_read_only_home(tmp_path):
    pytest.importorskip("datasets")
    pytest.importorskip("matplotlib")
    home, work = tmp_path / "home", tmp_path / "work"
    for d in (home / ".cache", home / ".config", home / ".local" / "share", work):
        d.mkdir(parents=True)
    config = work / "tiny.yaml"
    config.write_text(tiny_yaml())
    data = work / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(16)))
    out = tmp_path / "out"
    env = {
        "HOME": str(home),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_DATA_HOME": str(home / ".local" / "share"),
    }
    for p in [home, *home.rglob("*")]:
        p.chmod(0o555)
    before_home, before_work = _tree(home), _tree(work)
    dataset = [
        "--set",
        "task.name=dataset",
        "--set",
        f"task.source={data}",
        "--set",
        "task.reward=exact-match",
        "--set",
        "task.n_test=4",
    ]
    commands = [
        ["train", "--config", config, "--out", out, "--run", "r"],
        ["train", "--config", config, "--out", out, "--run", "d", "--dry-run", *dataset],
        [*EVAL, "--model", "r", "--out", out],
        [
            "rollout",
            "--model",
            "r",
            "--out",
            out,
            "--data",
            "dataset",
            *dataset,
            "--output",
            out / "gen.parquet",
            "--n",
            "2",
            "--prompts",
            "4",
        ],
        ["analyze", "dynamics", "r", "--out", out, "--output", out / "dyn"],
        ["analyze", "dynamics", out / "r", "--output", out / "dyn-path"],  # no --out: a run given by path
        ["analyze", "dynamics", out / "r"],  # no --out, no --output: the run's folder's analysis/
        ["runs", out],
    ]
    try:
        for args in commands:
            if args[:2] == ["analyze", "dynamics"] and "--out" not in args:
                work.chmod(0o555)  # from a read-only current folder (root writes anyway: the tree check below holds)
            r = masktrl(*args, env=env, cwd=work)
            assert r.returncode == 0 and "Matplotlib" not in r.stderr, (args, r.stderr[-2000:])
    finally:
        work.chmod(0o755)
        for p in [home, *home.rglob("*")]:
            p.chmod(0o755)
    assert _tree(home) == before_home  # nothing in $HOME or the XDG folders
    assert _tree(work) == before_work  # nor in the current folder
    assert (out / ".cache" / "matplotlib").is_dir()  # matplotlib's cache: under --out
    assert (out / "dyn-path" / ".cache" / "matplotlib").is_dir()  # without --out: beside the figure


# --------------------------------------------------------------------------- the lock cannot be bypassed


def test_deleting_every_file_the_run_does_not_need_does_not_release_the_lock(tmp_path, cli_error):
    cmd, env, proc, root = start_training(tmp_path, {"steps": 5000, "checkpoint_every": 1000}, "y")
    try:
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        needed = {"manifest.json", "run.yaml", "metrics.jsonl"}
        for p in list(root.iterdir()):
            # .manifest.lock, a stale .lock, anything else; not a write in flight (".<name>.<random>.tmp", replaced
            # into place a moment later: deleting it fails that write, a race this test is not about)
            if p.is_file() and p.name not in needed and not p.name.endswith(".tmp"):
                p.unlink()
        line = one_line(cli_error("train", "--resume", "y", "--out", tmp_path / "out"), f"pid {proc.pid}")
        assert "being written" in line
        assert proc.poll() is None  # still training: the refusal was the lock's, not a finished run's
    finally:
        proc.send_signal(signal.SIGTERM)  # the step in progress is checkpointed
        proc.wait(timeout=600)
    assert proc.returncode == 128 + signal.SIGTERM
    rows = [json.loads(x)["step"] for x in (root / "metrics.jsonl").read_text().splitlines()]
    assert rows == list(range(1, len(rows) + 1))  # one writer: every step once
    assert RunStore(root).status() == "interrupted"


def test_a_second_writer_is_refused_by_the_folder_lock(tmp_path):
    from masktrl.runs import locks

    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time\nfd = os.open(sys.argv[1], os.O_RDONLY)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('locked', "
            "flush=True)\ntime.sleep(60)",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=masktrl_env(),
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(locks.RunBusyError, match=f"pid {holder.pid}"):
            locks.acquire(tmp_path, wait_s=0.1)
        assert locks.holder(tmp_path) == holder.pid
        assert not os.path.exists(tmp_path / ".lock")  # nothing written for the lock
    finally:
        holder.kill()
        holder.wait()
