"""Hostile input and flaky machines (docs/RELIABILITY.md): every probe of the table there, each
answered by one line and exit code 2, or by a run that stays true."""

import errno
import gc
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from masktrl.config import load_config
from masktrl.errors import ConfigError, MasktrlError
from masktrl.io import atomic_write_json, file_mode
from masktrl.rollout.storage import read_rollouts, write_rollouts
from masktrl.runs import locks
from masktrl.runs.store import RunStore, check_run_name
from tests.conftest import TIMING, cli, copy_run, masktrl_env, tiny_yaml


def one_line(line: str, needle: str) -> str:
    """``line``: the one stderr line of a command that exited with 2 (``cli_error``)."""
    assert needle in line, line
    return line


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A complete 2-step run (copy it before changing it)."""
    base = tmp_path_factory.mktemp("rel")
    config = base / "tiny.yaml"
    config.write_text(tiny_yaml())
    cli("train", "--config", config, "--out", base / "out", "--run", "r")
    return config, base / "out", base / "out" / "r"


def manifest(root):
    return json.loads((root / "manifest.json").read_text())


def metrics_rows(root):
    return [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]


def snapshot(root):
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}


# --------------------------------------------------------------------------- 1. one writer per run


HOLD_LOCK = """
import fcntl, os, sys, time
os.makedirs(sys.argv[1], exist_ok=True)
fd = os.open(sys.argv[1], os.O_RDONLY)  # the run folder: its writer lock
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(120)
"""


def test_second_writer_gets_one_line_naming_the_holder(finished, tmp_path, cli_error):
    _, out, root = copy_run(finished, tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(root)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = snapshot(root)
        line = one_line(cli_error("train", "--resume", "r", "--out", out), f"pid {holder.pid}")
        assert "being written" in line and snapshot(root) == before  # nothing changed
        r = cli("runs", out)
        assert "complete" in r.output  # a reader is never refused
    finally:
        holder.kill()
        holder.wait()
    cli("train", "--resume", "r", "--out", out)  # the holder is gone: its lock went with it


def test_stale_running_status_of_a_dead_process_is_taken_over(finished, tmp_path):
    _, out, root = copy_run(finished, tmp_path)
    m = manifest(root)
    (root / "manifest.json").write_text(json.dumps({**m, "status": "running", "pid": 2**22 + 12345}))
    (root / "summary.json").unlink()
    r = cli("runs", out)
    assert "interrupted" in r.output  # nobody holds the lock: the trainer is gone
    cli("train", "--resume", "r", "--out", out)
    assert manifest(root)["status"] == "complete"


def test_lock_is_taken_once_per_process_and_released_after(tmp_path):
    root = tmp_path / "run"
    locks.acquire(root)
    assert locks.holder(root) == os.getpid()
    with pytest.raises(MasktrlError, match="holds the run's lock already"):
        locks.acquire(root)
    assert locks.holds(root)
    locks.release(root)
    assert not locks.holds(root) and locks.holder(root) is None


def start_training(tmp_path, train: dict, name: str):
    """``masktrl train --run name`` in the background with the tiny config and ``train`` settings,
    once its first step is recorded: (the command without --run, its environment, the process,
    the run folder)."""
    config = tmp_path / "c.yaml"
    config.write_text(tiny_yaml({"train": train}))
    env = masktrl_env()
    cmd = [sys.executable, "-m", "masktrl.cli", "train", "--config", str(config), "--out", str(tmp_path / "out")]
    proc = subprocess.Popen([*cmd, "--run", name], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    root = tmp_path / "out" / name
    deadline = time.time() + 240
    while time.time() < deadline and not (
        (root / "manifest.json").exists() and "step/000001/train" in (root / "manifest.json").read_text()
    ):
        time.sleep(0.05)
    return cmd, env, proc, root


@pytest.mark.slow
def test_resume_while_the_run_trains_is_refused_and_the_run_stays_whole(tmp_path):
    cmd, env, first, root = start_training(tmp_path, {"steps": 5000, "checkpoint_every": 3}, "y")
    for args in (["--resume", "y"], ["--run", "y"]):  # a resume, and the same command again
        second = subprocess.run([*cmd, *args], env=env, capture_output=True, text=True, timeout=240)
        lines = [line for line in second.stderr.splitlines() if line.strip()]
        assert second.returncode == 2 and len(lines) == 1, second.stderr[-2000:]
        assert f"pid {first.pid}" in lines[0] or "training right now" in lines[0], lines
    assert first.poll() is None  # still training, undisturbed
    first.send_signal(signal.SIGINT)
    _, err = first.communicate(timeout=300)
    assert first.returncode == 130, err[-2000:]
    m = manifest(root)
    assert m["status"] == "interrupted"
    done = sorted(int(k.split("/")[1]) for k in m["stages"] if k.startswith("checkpoint/"))
    for step in done:
        assert (root / "checkpoints" / f"{step:06d}" / "model.safetensors").is_file()
    assert [r["step"] for r in metrics_rows(root)] == list(range(1, done[-1] + 1))  # no duplicated or lost rows


# --------------------------------------------------------------------------- 2. inputs verified


def test_rollouts_from_a_run_checks_its_manifest_hashes(finished, tmp_path, cli_error):
    config, out, root = copy_run(finished, tmp_path)
    path = root / "steps" / "000001" / "rollouts.parquet"
    samples, meta = read_rollouts(path)
    for s in samples:
        s.advantage = -s.advantage  # a valid file, with the advantages' sign flipped
    write_rollouts(path, samples, meta)
    line = one_line(
        cli_error("train", "--config", config, "--out", out, "--run", "replay", "--rollouts-from", root),
        "steps/000001/rollouts.parquet",
    )
    assert "hash mismatch" in line
    assert not (out / "replay").exists()  # refused before the run folder was created


def _bad_file(root, tmp_path, how):
    samples, meta = read_rollouts(root / "steps" / "000001" / "rollouts.parquet")
    gen = samples[1].gen
    if how == "positive logp":
        gen.logp[0] = 0.5
    elif how == "shifted top-K":  # every list one place along
        for sample in samples:
            sample.gen.topk_ids = [ids[1:] + ids[:1] for ids in sample.gen.topk_ids]
    elif how == "moved logp":  # the first token's behaviour log-prob moved to the next row
        firsts = [sample.gen.logp[0] for sample in samples]
        for sample, value in zip(samples, firsts[-1:] + firsts[:-1]):
            sample.gen.logp[0] = value
    elif how == "id outside the vocabulary":
        gen.topk_ids[0] = [999] + gen.topk_ids[0][1:]
    elif how == "NaN advantage":
        samples[2].advantage = float("nan")
    path = tmp_path / "bad.parquet"
    write_rollouts(path, samples, meta, check=False)  # a file masktrl would not write
    if how == "wrong column type":
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        i = table.column_names.index("advantage")
        pq.write_table(table.set_column(i, "advantage", table["advantage"].cast(pa.string())), path)
    return path


@pytest.mark.parametrize(
    "how, needle",
    [
        ("positive logp", "is not a log-probability"),
        ("shifted top-K", "top-K entry"),
        ("moved logp", "top-K entry"),
        ("id outside the vocabulary", "outside the vocabulary [0, 17)"),
        ("wrong column type", "advantage"),
        ("NaN advantage", "row 2: advantage is nan"),
    ],
)
def test_malformed_rollout_file_is_refused_before_the_run_folder(finished, tmp_path, cli_error, how, needle):
    config, _, root = finished
    path = _bad_file(root, tmp_path, how)
    one_line(
        cli_error("train", "--config", config, "--out", tmp_path / "out", "--run", "x", "--rollouts-from", path), needle
    )
    assert not (tmp_path / "out").exists()


def test_warmstart_cache_entry_that_changed_is_rebuilt_never_used(finished, tmp_path):
    config, out, root = copy_run(finished, tmp_path)
    [entry] = [p for p in (out / ".cache" / "warmstart").iterdir()]
    weights = entry / "model.safetensors"
    original = weights.read_bytes()
    data = bytearray(original)
    data[-256:] = bytes(256)  # 64 float32 weights zeroed
    weights.write_bytes(bytes(data))
    r = cli("train", "--config", config, "--out", out, "--run", "second")
    assert "fails its sha256 check" in r.stderr and "building it again" in r.stderr
    assert weights.read_bytes() == original  # rebuilt: the warm start is deterministic
    info = RunStore(out / "second").stage("warmstart")["info"]
    assert info["cached"] is False and info["files"]["model.safetensors"]
    a = load_file(root / "checkpoints" / "000002" / "model.safetensors")
    b = load_file(out / "second" / "checkpoints" / "000002" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)  # trained from the true warm start


def test_starting_policy_is_verified_against_the_run_record(finished, tmp_path):
    _, out, root = copy_run(finished, tmp_path)
    [entry] = [p for p in (out / ".cache" / "warmstart").iterdir()]
    m = manifest(root)
    m["stages"]["warmstart"]["info"]["path"] = str(entry)  # this copy's own cache
    (root / "manifest.json").write_text(json.dumps(m))
    assert RunStore(root).policy_path(0) == str(entry)
    (entry / "model.safetensors").write_bytes(b"x" + (entry / "model.safetensors").read_bytes()[1:])
    with pytest.raises(MasktrlError, match="fails its sha256 check"):
        RunStore(root).policy_path(0)


# --------------------------------------------------------------------------- 3. finite values


@pytest.mark.parametrize(
    "override, needle",
    [
        ("train.lr=1e400", "train.lr must be a finite number"),  # YAML reads 1e400 as inf
        ("train.weight_decay=.inf", "train.weight_decay must be a finite number"),
        ("rollout.temperature=.inf", "rollout.temperature must be a finite number"),
        ("rollout.top_p=.nan", "rollout.top_p must be a finite number"),
        ("seed=100000000000000000000000000", "seed is out of range"),
        ("seed=-1", "seed must be in [0, 4294967295]"),
        ("train.steps=99999999999", "train.steps is out of range"),
        ("rollout.gpu_memory_utilization=2", "rollout.gpu_memory_utilization must be in (0, 1]"),
        ("train.max_nonfinite_steps=0", "train.max_nonfinite_steps"),
    ],
)
def test_config_rejects_infinities_and_out_of_range_numbers(override, needle):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert needle in str(info.value)


def test_inf_learning_rate_is_one_line_before_anything_is_written(tmp_path, cli_error):
    line = one_line(cli_error("train", "--out", tmp_path / "out", "--run", "x", "--set", "train.lr=1e400"), "train.lr")
    assert "finite" in line and not (tmp_path / "out").exists()


def _nan_norm_at(monkeypatch, calls: set[int]):
    """Make the gradient norm of the given optimizer updates (0-based, in call order) NaN."""
    from masktrl.rl.distributed import Dist

    real = Dist.clip_grad_norm
    count = iter(range(10**6))

    def fake(self, model, max_norm):
        norm = real(self, model, max_norm)
        return float("nan") if next(count) in calls else norm

    monkeypatch.setattr(Dist, "clip_grad_norm", fake)


def test_nonfinite_update_is_skipped_and_counted(finished, tmp_path, monkeypatch):
    config, _, root = finished
    _nan_norm_at(monkeypatch, {1})  # step 2's update
    cli("train", "--config", config, "--out", tmp_path / "out", "--run", "nan")
    nan_root = tmp_path / "out" / "nan"
    rows = metrics_rows(nan_root)
    assert [r["skipped_updates"] for r in rows] == [0, 1] and [r["nonfinite_steps"] for r in rows] == [0, 1]
    one = load_file(nan_root / "checkpoints" / "000001" / "model.safetensors")
    two = load_file(nan_root / "checkpoints" / "000002" / "model.safetensors")
    assert all(torch.equal(one[k], two[k]) for k in one)  # step 2 was not applied
    ref_one = load_file(root / "checkpoints" / "000001" / "model.safetensors")
    assert all(torch.equal(one[k], ref_one[k]) for k in one)  # a finite step's arithmetic is unchanged
    assert manifest(nan_root)["status"] == "complete"


def test_consecutive_nonfinite_steps_fail_the_run_with_the_reason(finished, tmp_path, monkeypatch, cli_error):
    config, _, _ = finished
    _nan_norm_at(monkeypatch, set(range(100)))
    line = one_line(
        cli_error(
            "train",
            "--config",
            config,
            "--out",
            tmp_path / "out",
            "--run",
            "nan",
            "--set",
            "train.steps=5",
            "--set",
            "train.max_nonfinite_steps=2",
        ),
        "steps 1-2: 2 steps in a row",
    )
    root = tmp_path / "out" / "nan"
    m = manifest(root)
    assert m["status"] == "failed" and m["reason"] in line
    assert [r["nonfinite_steps"] for r in metrics_rows(root)] == [1, 2]


def test_diverged_weights_stop_the_run_as_failed(finished, tmp_path, cli_error):
    config, _, _ = finished
    one_line(
        cli_error(
            "train",
            "--config",
            config,
            "--out",
            tmp_path / "out",
            "--run",
            "big",
            "--set",
            "train.lr=1e30",
            "--set",
            "train.steps=4",
        ),
        "not finite",
    )
    m = manifest(tmp_path / "out" / "big")
    assert m["status"] == "failed" and "not finite" in m["reason"]


def test_checkpoint_with_nonfinite_weights_is_never_written(tmp_path):
    from masktrl.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model
    from masktrl.rl import train_state as ckpt

    tok = build_char_tokenizer("0123456789+=")
    model = build_tiny_model(tok, TinyModelConfig(16, 1, 2, 1, 32), seed=0)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0)
    store = RunStore(tmp_path / "run")
    with torch.no_grad():
        next(model.parameters())[0, 0] = float("nan")
    with pytest.raises(MasktrlError, match="not finite"):
        ckpt.save_step(store, 3, model, tok, opt, sched)
    assert not (tmp_path / "run" / "checkpoints").exists() and not store.is_done("checkpoint/000003")


# --------------------------------------------------------------------------- 4. metrics never silently lost


def test_corrupt_metrics_line_stops_resume_naming_the_line(finished, tmp_path, cli_error):
    _, out, root = copy_run(finished, tmp_path)
    lines = (root / "metrics.jsonl").read_text().splitlines()
    (root / "metrics.jsonl").write_text(lines[0][:-5] + "\n" + lines[1] + "\n")
    before = (root / "metrics.jsonl").read_bytes()
    one_line(cli_error("train", "--resume", "r", "--out", out), "metrics.jsonl: line 1 is not valid JSON")
    assert (root / "metrics.jsonl").read_bytes() == before  # nothing cut


def test_missing_metrics_rows_before_a_checkpoint_stop_resume(finished, tmp_path, cli_error):
    _, out, root = copy_run(finished, tmp_path)
    (root / "metrics.jsonl").write_text((root / "metrics.jsonl").read_text().splitlines()[1] + "\n")
    one_line(cli_error("train", "--resume", "r", "--out", out), "step 2 where step 1 belongs")


def test_torn_last_line_is_still_dropped(tmp_path):
    store = RunStore(tmp_path)
    store.append_metrics({"step": 1})
    with open(store.metrics_path, "a") as f:
        f.write('{"step": 2, "x')
    assert store.read_metrics() == [{"step": 1}]


def test_metrics_are_durable_before_a_checkpoint_is_recorded(tmp_path, monkeypatch):
    from masktrl.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model
    from masktrl.rl import train_state as ckpt

    tok = build_char_tokenizer("0123456789+=")
    model = build_tiny_model(tok, TinyModelConfig(16, 1, 2, 1, 32), seed=0)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0)
    store = RunStore(tmp_path / "run")
    store.append_metrics({"step": 1})
    events = []
    real_fsync, real_mark = os.fsync, store.mark_done
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd)))
    monkeypatch.setattr(store, "mark_done", lambda stage, *a, **k: (events.append(stage), real_mark(stage, *a, **k)))
    ckpt.save_step(store, 1, model, tok, opt, sched)
    synced = [i for i, e in enumerate(events) if e.endswith("metrics.jsonl")]
    assert synced and synced[-1] < events.index("checkpoint/000001")


# --------------------------------------------------------------------------- 5. results stay true


def test_extending_a_finished_run_reevaluates_and_accumulates_wall_time(finished, tmp_path):
    _, out, root = copy_run(finished, tmp_path)
    before = json.loads((root / "summary.json").read_text())
    cli("train", "--resume", "r", "--out", out, "--force", "--set", "train.steps=3")
    after = json.loads((root / "summary.json").read_text())
    m = manifest(root)
    assert m["stages"]["eval/after"]["step"] == 3 and after["steps"] == 3
    assert after["wall_time_s"] > before["wall_time_s"] and m["wall_time_s"] == after["wall_time_s"]
    cli("eval", "synthetic", "--model", root, "--step", 3, "--k", 1, "--temperature", 0)
    assert json.loads((root / "eval" / "synthetic-step3.json").read_text())["avg_at_k"] == after["eval_after"]


def test_resume_force_of_a_deepspeed_checkpoint_under_another_launch_changes_nothing(finished, tmp_path, cli_error):
    """The DeepSpeed state is compared with the launch before --force records the new config."""
    _, out, root = copy_run(finished, tmp_path)
    ckpt = root / "checkpoints" / "000002"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    (ckpt / "trainer_state.json").write_text(json.dumps({**state, "deepspeed": {"zero_stage": 2, "processes": 2}}))
    (ckpt / "deepspeed").mkdir()
    (ckpt / "deepspeed" / "latest").write_text("global_step2")
    RunStore(root).mark_done("checkpoint/000002", [ckpt], step=2)  # as a ZeRO-2 run on 2 processes records it
    before = snapshot(root)
    line = one_line(
        cli_error("train", "--resume", "r", "--out", out, "--force", "--set", "train.steps=3"),
        "ZeRO-2 with 2 processes",
    )
    assert "resume it under the same accelerate launch" in line and snapshot(root) == before


# --------------------------------------------------------------------------- 6. preemption and status


@pytest.mark.parametrize("exc", [RuntimeError("boom"), SystemExit(3), KeyboardInterrupt()])
def test_status_is_never_left_running(finished, tmp_path, monkeypatch, exc):
    config, _, _ = finished

    def broken(*args, **kwargs):
        raise exc

    monkeypatch.setattr("masktrl.recipes.train.make_engine", broken)
    r = cli("train", "--config", config, "--out", tmp_path / "out", "--run", "x", ok=False)
    assert r.exit_code != 0
    m = manifest(tmp_path / "out" / "x")
    want = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
    assert m["status"] == want, m
    if want == "failed":
        assert m["reason"] in ("RuntimeError: boom", "SystemExit: 3")


@pytest.mark.slow
def test_sigterm_finishes_the_step_checkpoints_and_resumes_exactly(tmp_path):
    cmd, env, proc, root = start_training(tmp_path, {"steps": 8, "checkpoint_every": 4}, "term")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    m = manifest(root)
    done = sorted(int(k.split("/")[1]) for k in m["stages"] if k.startswith("checkpoint/"))
    assert m["status"] == "interrupted" and done and done[-1] < 8 and len(metrics_rows(root)) == done[-1]
    assert subprocess.run([*cmd, "--run", "ref"], env=env, capture_output=True, timeout=300).returncode == 0
    r = subprocess.run([*cmd, "--resume", "term"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    a = load_file(tmp_path / "out" / "ref" / "checkpoints" / "000008" / "model.safetensors")
    b = load_file(root / "checkpoints" / "000008" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    strip = lambda rows: [{k: v for k, v in r.items() if k not in TIMING} for r in rows]  # noqa: E731
    assert strip(metrics_rows(tmp_path / "out" / "ref")) == strip(metrics_rows(root))


# --------------------------------------------------------------------------- 7. names stay inside


@pytest.mark.parametrize("name", ["../../escape", "/abs/path", "a\nb", ".hidden", "..", "a/b", ""])
def test_run_names_stay_inside_out(tmp_path, cli_error, name):
    out = tmp_path / "a" / "b" / "out"
    one_line(cli_error("train", "--out", out, "--run", name), "invalid run name")
    assert not any(tmp_path.rglob("*"))  # nothing created anywhere


def test_good_run_names_pass():
    assert check_run_name("grpo-seed0_x.1") == "grpo-seed0_x.1"


# --------------------------------------------------------------------------- 8. one line per failure


def test_out_that_is_a_file(tmp_path, cli_error):
    (tmp_path / "out").write_text("not a folder")
    one_line(cli_error("train", "--out", tmp_path / "out", "--run", "x"), "not a folder")


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EACCES, errno.EROFS])
def test_machine_errors_mid_run_are_one_line_naming_the_file(finished, tmp_path, monkeypatch, cli_error, err):
    import masktrl.io

    config, _, _ = finished
    real = masktrl.io.atomic_write_bytes

    def failing(path, data):
        if "checkpoints" in str(path) or str(path).endswith("summary.json"):
            raise OSError(err, os.strerror(err), str(path))
        return real(path, data)

    monkeypatch.setattr(masktrl.io, "atomic_write_bytes", failing)
    line = one_line(cli_error("train", "--config", config, "--out", tmp_path / "out", "--run", "x"), os.strerror(err))
    assert "trainer_state.json" in line
    m = manifest(tmp_path / "out" / "x")
    assert m["status"] == "failed" and os.strerror(err) in m["reason"]


@pytest.fixture
def small_disk(tmp_path):
    """A 256 KiB file system (a tmpfs: needs root, else the test is skipped)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)], capture_output=True)
    if r.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield disk
    gc.collect()
    subprocess.run(["umount", "-l", str(disk)], check=False)


def test_full_and_read_only_disks_are_one_line(finished, small_disk, cli_error):
    config, _, _ = finished
    out = small_disk / "out"
    line = one_line(
        cli_error("train", "--config", config, "--out", out, "--run", "x", "--set", "train.steps=30"),
        "No space left on device",
    )
    assert str(out) in line
    assert RunStore(out / "x").status() in ("failed", "interrupted")  # never running
    gc.collect()  # the failure's traceback may still hold a file open for writing, which blocks remount,ro
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    one_line(cli_error("train", "--config", config, "--out", out, "--run", "y"), "Read-only file system")
    r = cli("runs", out)
    assert "x" in r.output


def test_a_manifest_of_another_version_is_refused_in_one_line(finished, tmp_path, cli_error):
    _, out, root = copy_run(finished, tmp_path)
    m = manifest(root)
    (root / "manifest.json").write_text(json.dumps({**m, "version": 0}))
    one_line(cli_error("train", "--resume", "r", "--out", out), "manifest version 0; this masktrl reads version 1")


@pytest.mark.parametrize(
    "content, problem",
    [
        ("[]", "a JSON list, not an object"),
        ('{"stages": []}', "no 'stages' object"),
        ('{"stages": {"checkpoint/x": {"status": "done"}}}', "names no step"),
        ('{"stages": {"config": 5}}', "not an object with a status"),
    ],
)
def test_manifest_of_the_wrong_shape_is_one_line_and_runs_goes_on(finished, tmp_path, cli_error, content, problem):
    _, out, root = copy_run(finished, tmp_path)
    shutil.copytree(root, out / "healthy")
    (root / "manifest.json").write_text(content)
    line = one_line(cli_error("train", "--resume", "r", "--out", out), "not a masktrl manifest")
    assert problem in line
    r = cli("runs", out)
    assert "damaged" in r.output and "healthy" in r.output and "complete" in r.output, r.output


def test_deep_json_in_data_is_one_line(finished, tmp_path, cli_error):
    _, _, root = finished
    data = tmp_path / "deep.jsonl"
    data.write_text('{"problem": ' + "[" * 100000 + "]" * 100000 + ', "answer": "1"}\n')
    one_line(cli_error("eval", "gsm8k", "--model", root, "--data", data, "--out", tmp_path), "JSON nested too deeply")


def test_deep_json_in_a_dataset_task_is_one_line_not_a_crash(tmp_path, cli_error):
    pytest.importorskip("datasets")
    data = tmp_path / "deep.jsonl"
    data.write_text('{"prompt": ' + "[" * 100000 + "]" * 100000 + ', "answer": "1"}\n')
    one_line(
        cli_error(
            "train",
            "--out",
            tmp_path / "out",
            "--run",
            "x",
            "--set",
            "task.name=dataset",
            "--set",
            f"task.source={data}",
            "--set",
            "task.reward=exact-match",
        ),
        "JSON nested too deeply",
    )
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- 9. bounded inputs


def test_files_are_written_with_the_users_umask(finished):
    _, out, root = finished
    want = file_mode()  # 0o644 under the usual umask 022
    modes = {p.relative_to(out): stat.S_IMODE(p.stat().st_mode) for p in out.rglob("*") if p.is_file()}
    assert modes and {p: m for p, m in modes.items() if m != want} == {}
    mask = os.umask(0o022)
    os.umask(mask)
    assert want == 0o666 & ~mask


def test_atomic_writes_follow_the_umask(tmp_path):
    atomic_write_json(tmp_path / "a.json", {"x": 1})
    assert stat.S_IMODE((tmp_path / "a.json").stat().st_mode) == file_mode() != 0o600


def test_megabyte_problem_in_eval_is_skipped_before_generation(finished, tmp_path, cli_error):
    _, _, root = copy_run(finished, tmp_path)
    data = tmp_path / "long.jsonl"
    data.write_text(
        json.dumps({"problem": "1+1=" * 250_000, "answer": "2"})
        + "\n"
        + json.dumps({"problem": "1+1", "answer": "2"})
        + "\n"
    )
    r = cli("eval", "gsm8k", "--model", root, "--data", data, "--k", 1, "--max-new-tokens", 4)
    report = json.loads((root / "eval" / "gsm8k-step2.json").read_text())
    assert report["prompts_too_long"] == 1 and report["n_problems"] == 1
    assert "prompt longer than the context" in r.output
    data.write_text(json.dumps({"problem": "1+1=" * 250_000, "answer": "2"}) + "\n")
    one_line(cli_error("eval", "gsm8k", "--model", root, "--data", data, "--force"), "longer than the model's context")


def test_engine_refuses_a_prompt_that_does_not_fit_the_context():
    from masktrl.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model
    from masktrl.rollout.base import SamplingSettings
    from masktrl.rollout.hf import HFEngine

    tok = build_char_tokenizer("0123456789+=")
    model = build_tiny_model(tok, TinyModelConfig(16, 1, 2, 1, 32, max_positions=32), seed=0)
    engine = HFEngine(model, tok)
    with pytest.raises(MasktrlError, match="1 of 2 prompts do not fit the model's context"):
        engine.generate(
            [[5] * 40, [5] * 3], SamplingSettings(n=2, max_new_tokens=2, temperature=1.0, top_p=1.0, logprobs_k=2), 0
        )


# --------------------------------------------------------------------------- checks before writing


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--set", "task.name=foo"], "foo"),
        (["--set", "model.path=/nonexistent/model"], "no such model folder"),
        (["--set", "model.path=nosuchorg/nosuchmodel"], "local hub cache"),
        (["--set", "task.name=gsm8k"], "gsm8k"),
        (["--rollouts-from", "/nonexistent/run"], "no such run folder or parquet file"),
        (
            ["--set", "rollout.engine=vllm", "--set", "rollout.logprobs_k=30"],
            "rollout.logprobs_k=30 exceeds the model's vocabulary (17)",
        ),
        (["--set", "rollout.max_new_tokens=300"], "leaves no room for a prompt in the model's context (256 positions)"),
        (
            ["--set", "rollout.max_new_tokens=254"],
            "held-out prompts: 16 of 16 are longer than the model's context allows",
        ),
    ],
)
def test_bad_inputs_fail_before_the_run_folder_exists(finished, tmp_path, cli_error, args, needle):
    config, _, _ = finished
    out = tmp_path / "out"
    one_line(cli_error("train", "--config", config, "--out", out, "--run", "x", *args), needle)
    assert not (out / "x").exists() and not (out / ".cache").exists()


def test_a_failed_run_continues_when_the_same_command_is_run_again(finished, tmp_path, monkeypatch, cli_error):
    config, _, ref = finished
    out = tmp_path / "out"
    from masktrl.rl import train_state as checkpoint

    real = checkpoint.save
    monkeypatch.setattr(
        checkpoint,
        "save",
        lambda dest, *a, **k: (
            (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device", str(dest)))
            if str(dest).endswith("000002")
            else real(dest, *a, **k)
        ),
    )
    one_line(cli_error("train", "--config", config, "--out", out, "--run", "x"), "No space left on device")
    m = manifest(out / "x")
    assert m["status"] == "failed" and "No space left" in m["reason"]
    monkeypatch.setattr(checkpoint, "save", real)  # the disk has room again
    r = cli("train", "--config", config, "--out", out, "--run", "x")
    assert "continuing it" in r.output and manifest(out / "x")["status"] == "complete"
    a = load_file(ref / "checkpoints" / "000002" / "model.safetensors")
    b = load_file(out / "x" / "checkpoints" / "000002" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_failed_run_without_checkpoint_restarts_in_place_with_a_fixed_config(
    finished, tmp_path, monkeypatch, cli_error
):
    config, _, ref = finished
    out = tmp_path / "out"
    from masktrl.recipes import train as train_stage

    real = train_stage.make_engine
    monkeypatch.setattr(
        train_stage, "make_engine", lambda *a, **k: (_ for _ in ()).throw(MasktrlError("engine failed to start"))
    )
    one_line(
        cli_error("train", "--config", config, "--out", out, "--run", "x", "--set", "rollout.batch_size=7"),
        "engine failed",
    )
    assert manifest(out / "x")["reason"] == "engine failed to start"
    monkeypatch.setattr(train_stage, "make_engine", real)
    r = cli("train", "--config", config, "--out", out, "--run", "x")  # the "fix": another config
    assert "starting it again in place" in r.output
    m = manifest(out / "x")
    assert m["status"] == "complete" and m["attempts"][0]["reason"] == "engine failed to start"
    assert (out / "x" / "run.yaml").read_text() == (ref / "run.yaml").read_text()


def test_a_complete_run_is_never_overwritten(finished, cli_error):
    config, out, root = finished
    before = snapshot(root)
    one_line(cli_error("train", "--config", config, "--out", out, "--run", "r"), "holds a complete run")
    assert snapshot(root) == before


def test_dry_run_prints_the_config_and_writes_nothing(finished, tmp_path, cli_error):
    config, out, root = finished
    r = cli("train", "--config", config, "--out", tmp_path / "out", "--run", "x", "--dry-run")
    assert "nothing was written" in r.output and "hidden_size: 32" in r.output and "projected disk use" in r.output
    assert "run total <=" in r.output  # retention.project on the policy's parameter count
    assert not (tmp_path / "out").exists()
    before = snapshot(out)
    # the run trained on its own rollouts: another source on resume takes --force (else refused)
    r = cli("train", "--resume", "r", "--out", out, "--dry-run", "--force", "--rollouts-from", root)
    assert "resume it" in r.output and "2 batches, verified" in r.output
    assert snapshot(out) == before
    one_line(
        cli_error("train", "--config", config, "--out", tmp_path / "out", "--dry-run", "--set", "task.name=foo"), "foo"
    )
