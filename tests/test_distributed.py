"""Training under ``accelerate launch`` on CPU (gloo): two processes reproduce one process on
the same global batch; rollouts are sharded by whole groups; only the main process writes;
bad launch configs are one-line errors that change nothing stored."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from masktrl.rl.update import micro_batches
from masktrl.rollout.storage import read_rollouts
from tests.conftest import TIMING, masktrl, masktrl_env, write_tiny_config

ROOT = Path(__file__).resolve().parent.parent
CPU_DDP = ROOT / "configs" / "accelerate" / "cpu_ddp.yaml"
OVERLAY = {"method": {"name": "sis", "base": "dapo"}, "train": {"minibatches": 2}}


def _env(**extra):
    return masktrl_env(extra)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(config_file, *args, processes=2, env=None):
    """``accelerate launch --config_file ... -m masktrl.cli train ...``."""
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(config_file),
        "--num_processes",
        str(processes),
        "--main_process_port",
        str(_free_port()),
        "-m",
        "masktrl.cli",
        "train",
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, env=env or _env(), timeout=600)


def metrics(root):
    return [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]


def train_lr(root) -> float:
    return yaml.safe_load((root / "run.yaml").read_text())["train"]["lr"]


def assert_same_weights(a, b, lr, atol=1e-6):
    """Two checkpoints hold the same update up to float rounding. Two processes sum the micro-batch
    gradients in another order than one process does; AdamW's step is ±lr wherever the gradient is
    well above its eps, and there rounding is invisible, but where a gradient is near eps or changes
    sign between minibatches (a rare token's embedding row) it shows as a small fraction of lr. So:
    every element within ``atol``, except at most one in a thousand, and those within lr/100.
    (Measured on one CPU, with the KL and entropy terms on: one of 10,432 elements off, by 2.1e-6 at lr 1e-3.)"""
    assert a.keys() == b.keys()
    diff = {k: (a[k] - b[k]).abs() for k in a}
    worst = max(diff, key=lambda k: diff[k].max())
    assert diff[worst].max() <= lr / 100, (worst, diff[worst].max())
    loose = sum(int((d > atol).sum()) for d in diff.values())
    assert loose * 1000 <= sum(d.numel() for d in diff.values()), (loose, worst, diff[worst].max())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A one-process 2-step run: its stored rollouts are the global batch both runs train on."""
    base = tmp_path_factory.mktemp("dist")
    cfg = write_tiny_config(base / "c.yaml", OVERLAY)
    r = masktrl("train", "--config", str(cfg), "--out", str(base / "out"), "--run", "ref")
    assert r.returncode == 0, r.stderr[-3000:]
    return base, cfg, base / "out" / "ref"


@pytest.mark.parametrize(
    "sets",
    [
        ["--set", "train.grad_accum=2"],
        # slow (15-20 s each), as the fused AdamW case (against the one-process foreach run:
        # rounding only): keeps the fast suite under ~15 min; the first case stays fast
        pytest.param(["--method", "grpo", "--set", "train.minibatches=1"], marks=pytest.mark.slow),
        pytest.param(["--set", "train.packing=true", "--set", "train.micro_batch_tokens=40"], marks=pytest.mark.slow),
        pytest.param(["--set", "train.adamw=fused"], marks=pytest.mark.slow),
    ],
    ids=[
        "sis-dapo-token-mean-2-minibatches-grad-accum-2",
        "grpo-seq-mean-1-minibatch",
        "sis-dapo-packed-token-budget",
        "sis-dapo-fused-adamw",
    ],
)
def test_two_processes_match_one_process_on_the_same_rollouts(reference, sets):
    base, cfg, ref = reference
    if "grpo" in sets:  # the reference trained SIS: replay its rollouts with GRPO in one process too
        r = masktrl(
            "train",
            "--config",
            str(cfg),
            "--out",
            str(base / "out"),
            "--run",
            "ref-grpo",
            "--rollouts-from",
            str(ref),
            *sets,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        ref = base / "out" / "ref-grpo"
    name = "two-" + "-".join(s.replace("=", "-").replace(".", "-") for s in sets if not s.startswith("--"))
    r = launch(
        CPU_DDP,
        "--config",
        str(cfg),
        "--out",
        str(base / "out"),
        "--run",
        name,
        "--rollouts-from",
        str(base / "out" / "ref"),
        *sets,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert r.stdout.count(f"masktrl train run {name}") == 1, r.stdout[-2000:]  # the header once, not once per process
    two = base / "out" / name

    a = load_file(ref / "checkpoints" / "000002" / "model.safetensors")
    b = load_file(two / "checkpoints" / "000002" / "model.safetensors")
    assert_same_weights(a, b, lr=train_lr(ref))
    assert any(
        not torch.equal(a[k], load_file(ref / "checkpoints" / "000001" / "model.safetensors")[k]) for k in a
    )  # it trained
    one_rows, two_rows = metrics(ref), metrics(two)
    assert [r["step"] for r in two_rows] == [1, 2]
    for x, y in zip(one_rows, two_rows):
        assert abs(x["loss"] - y["loss"]) < 1e-6 and abs(x["grad_norm"] - y["grad_norm"]) < 1e-5
        assert abs(x["n_valid"] - y["n_valid"]) < 1e-9
        shares = y["sequences_per_process"]  # every minibatch split evenly over the 2 processes
        assert len(shares) == 2 and shares[0] == shares[1] and sum(shares) == 4 * y["groups_kept"]
        assert "sequences_per_process" not in x
    assert json.loads((two / "manifest.json").read_text())["processes"] == 2


@pytest.mark.slow  # about 15 s: keeps the fast suite under its 15 minutes (861 s on a 2-core AMD EPYC with it)
def test_two_process_rollouts_are_sharded_by_group_and_written_once(reference):
    """Each process generates every other prompt's group; the gathered batch is stored once,
    with whole groups and group-normalised advantages (DAPO: dynamic sampling on the whole batch).
    Here with stale batches (both sampled at step 1, every process deciding alike which batch to
    sample ahead) and the lab statistics (counts summed over the processes)."""
    base, cfg, _ = reference
    r = launch(
        CPU_DDP,
        "--config",
        str(cfg),
        "--out",
        str(base / "out"),
        "--run",
        "gen2",
        "--method",
        "dapo",
        "--set",
        "rollout.staleness=1",
        "--set",
        "train.lab_stats=true",
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    root = base / "out" / "gen2"
    for step in (1, 2):
        samples, meta = read_rollouts(root / "steps" / f"{step:06d}" / "rollouts.parquet")
        groups = {}
        for s in samples:
            groups.setdefault(s.group, []).append(s)
        assert sorted(groups) == list(range(len(groups))) and all(len(g) == 4 for g in groups.values())
        for g in groups.values():
            assert len({s.example_id for s in g}) == 1 and abs(sum(s.advantage for s in g)) < 1e-6
            assert len({s.reward for s in g}) > 1  # dynamic sampling dropped constant-reward groups
    rows = metrics(root)
    assert [row["step"] for row in rows] == [1, 2]  # one writer: no duplicated rows
    assert all(sum(row["sequences_per_process"]) == row["groups_kept"] * 4 for row in rows)
    assert rows[0]["lab/over_delta_first_mb"] == 0 and all(
        "lab/resid_p50" in row and "lab/disagree" in row for row in rows
    )
    assert not list(root.rglob("*.tmp"))
    assert (root / "summary.json").is_file() and json.loads((root / "manifest.json").read_text())[
        "status"
    ] == "complete"


@pytest.mark.slow  # the fast suite's longest test (~33 s); the single-process kill windows stay fast (test_resume.py)
def test_two_process_run_killed_then_resumed_is_bit_identical(reference):
    """SIGKILL during step 3's update (both processes), then --resume under the same launch."""
    base, cfg, _ = reference
    out = str(base / "out")
    args = ["--config", str(cfg), "--out", out, "--set", "train.steps=3"]
    r = launch(CPU_DDP, *args, "--run", "full3")
    assert r.returncode == 0, r.stderr[-3000:]
    r = launch(CPU_DDP, *args, "--run", "crash3", env=_env(MASKTRL_CRASH_AT="update:3"))
    assert r.returncode != 0 and not (base / "out" / "crash3" / "summary.json").exists()
    r = launch(CPU_DDP, "--resume", "crash3", "--out", out)
    assert r.returncode == 0, r.stderr[-3000:]
    a = load_file(base / "out" / "full3" / "checkpoints" / "000003" / "model.safetensors")
    b = load_file(base / "out" / "crash3" / "checkpoints" / "000003" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    strip = lambda rows: [{k: v for k, v in row.items() if k not in TIMING} for row in rows]  # noqa: E731
    assert strip(metrics(base / "out" / "full3")) == strip(metrics(base / "out" / "crash3"))


def test_micro_batches_cover_a_minibatch_once_and_refuse_empty_parts():
    parts = [micro_batches(10, r, 2, 2) for r in range(2)]
    assert parts == [[[0, 2], [4, 6, 8]], [[1, 3], [5, 7, 9]]]
    assert micro_batches(5, 0, 1, 1) == [[0, 1, 2, 3, 4]]
    with pytest.raises(Exception, match="train.grad_accum"):
        micro_batches(3, 0, 2, 2)


def _unchanged_after(root, run):
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    r = run()
    after = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    assert after == before
    return r


@pytest.mark.parametrize(
    "content, needle",
    [
        ("{not json", "invalid DeepSpeed config"),
        ('{"zero_optimization": {"stage": 5}}', "stage must be 0-3"),
        (None, "not found"),
    ],
)
def test_invalid_deepspeed_config_is_one_line_naming_the_file(reference, tmp_path, content, needle):
    """As ``accelerate launch`` hands over a config's deepspeed_config_file; checked before any write."""
    base, cfg, ref = reference
    ds = tmp_path / "ds_config.json"
    if content is not None:
        ds.write_text(content)
    env = _env(
        ACCELERATE_MIXED_PRECISION="no", ACCELERATE_USE_DEEPSPEED="true", ACCELERATE_DEEPSPEED_CONFIG_FILE=str(ds)
    )
    if content is None:  # a new run: no folder is left behind
        r = masktrl("train", "--config", str(cfg), "--out", str(tmp_path / "out"), "--run", "x", env=env)
        assert not (tmp_path / "out" / "x").exists()
    else:  # resuming a stored run: nothing in it changes
        r = _unchanged_after(
            base / "out", lambda: masktrl("train", "--resume", "ref", "--out", str(base / "out"), env=env)
        )
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and str(ds) in lines[0] and needle in lines[0], r.stderr[-2000:]


def test_invalid_launch_setting_is_one_line(reference, tmp_path):
    base, cfg, _ = reference
    env = _env(ACCELERATE_MIXED_PRECISION="no", ACCELERATE_USE_DEEPSPEED="true", ACCELERATE_DEEPSPEED_ZERO_STAGE="7")
    r = masktrl("train", "--config", str(cfg), "--out", str(tmp_path / "out"), "--run", "x", env=env)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "ACCELERATE_DEEPSPEED_ZERO_STAGE=7" in lines[0], r.stderr[-2000:]
    assert "ZeRO stage must be 0-3" in lines[0] and not (tmp_path / "out" / "x").exists()


@pytest.mark.parametrize(
    "launch_env, engine",
    [
        ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"}, "DeepSpeed"),
        ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}, "FSDP2"),
    ],
)
def test_fused_adamw_is_refused_under_deepspeed_and_fsdp2_before_any_write(tmp_path, launch_env, engine):
    """train.adamw=fused under a DeepSpeed or FSDP2 launch: one line naming the key, exit 2, no run folder."""
    cfg = write_tiny_config(tmp_path / "c.yaml", {"train": {"steps": 1, "adamw": "fused"}})
    env = _env(ACCELERATE_MIXED_PRECISION="no", **launch_env)
    r = masktrl("train", "--config", str(cfg), "--out", str(tmp_path / "out"), "--run", "x", env=env)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]
    assert f"train.adamw=fused is not supported under {engine}" in lines[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # the launch sets DeepSpeed up before the config checks: the slow suite has it installed
def test_fp8_training_is_refused_under_zero3_before_any_write(tmp_path):
    """train.quantization under a DeepSpeed ZeRO-3 launch (rl/checks.py): one line, exit 2, no run folder."""
    pytest.importorskip("deepspeed")
    cfg = write_tiny_config(tmp_path / "c.yaml", {"train": {"steps": 1, "quantization": "fp8"}})
    env = _env(ACCELERATE_MIXED_PRECISION="no", ACCELERATE_USE_DEEPSPEED="true", ACCELERATE_DEEPSPEED_ZERO_STAGE="3")
    r = masktrl("train", "--config", str(cfg), "--out", str(tmp_path / "out"), "--run", "x", env=env)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]
    assert "train.quantization under DeepSpeed ZeRO-3" in lines[0] and not (tmp_path / "out").exists()


DS_CPU = """\
compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config: {{zero_stage: {stage}, offload_optimizer_device: none, offload_param_device: none,
  zero3_init_flag: false, zero3_save_16bit_model: true}}
num_machines: 1
machine_rank: 0
num_processes: 2
mixed_precision: 'no'
rdzv_backend: static
same_network: true
use_cpu: false
"""


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_two_cpu_processes_match_one_process(reference, tmp_path, stage):
    """ZeRO-2 (sharded optimizer state and gradients) and ZeRO-3 (weights too: gathered for the
    checkpoint and the rollout engine) on 2 CPU processes, same rollouts as the one-process
    reference. Slow: DeepSpeed compiles its shared-memory op (~35 s) on first use."""
    pytest.importorskip("deepspeed")
    base, cfg, ref = reference
    acc = tmp_path / f"zero{stage}_cpu.yaml"
    acc.write_text(DS_CPU.format(stage=stage))
    env = _env(TORCH_EXTENSIONS_DIR=str(base / "torch_extensions"))  # compiled once for the module
    name = f"zero{stage}"
    r = launch(
        acc, "--config", str(cfg), "--out", str(base / "out"), "--run", name, "--rollouts-from", str(ref), env=env
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    two = base / "out" / name
    a = load_file(ref / "checkpoints" / "000002" / "model.safetensors")
    b = load_file(two / "checkpoints" / "000002" / "model.safetensors")
    assert_same_weights(a, b, lr=train_lr(ref))
    for x, y in zip(metrics(ref), metrics(two), strict=True):
        assert abs(x["loss"] - y["loss"]) < 1e-6
        shares = y["sequences_per_process"]  # DeepSpeed really ran 2 processes, each on half
        assert len(shares) == 2 and shares[0] == shares[1] > 0
    assert "optimizer" not in torch.load(two / "checkpoints" / "000002" / "trainer_state.pt", weights_only=True)


def _dist(stage, world):
    """A Dist that looks like a launch of ``world`` processes under DeepSpeed ZeRO-``stage`` (None: no DeepSpeed)."""
    from masktrl.rl.distributed import Dist

    d = Dist()
    d.world, d.deepspeed = world, stage is not None
    d.zero3 = stage == 3
    d.acc = (
        None
        if stage is None
        else type("A", (), {"state": type("S", (), {"deepspeed_plugin": type("P", (), {"zero_stage": stage})})})()
    )
    return d


def test_resume_refuses_a_checkpoint_whose_deepspeed_state_does_not_fit_the_launch(tmp_path):
    from masktrl.errors import MasktrlError

    _dist(2, 2).check_engine_state({"zero_stage": 2, "processes": 2}, tmp_path)  # same launch: fine
    _dist(None, 2).check_engine_state(None, tmp_path)  # DDP checkpoint, DDP launch
    cases = [
        (_dist(3, 2), {"zero_stage": 2, "processes": 2}, "ZeRO-2 with 2 processes, this launch is ZeRO-3 with 2"),
        (_dist(2, 4), {"zero_stage": 2, "processes": 2}, "resume with the same stage and process count"),
        (_dist(2, 2), None, "has no DeepSpeed optimizer state"),
        (_dist(None, 1), {"zero_stage": 3, "processes": 2}, "written under DeepSpeed ZeRO-3 with 2 processes"),
    ]
    for dist, info, needle in cases:
        with pytest.raises(MasktrlError, match=needle) as exc:
            dist.check_engine_state(info, tmp_path / "checkpoints" / "000002")
        assert "\n" not in str(exc.value) and str(tmp_path) in str(exc.value)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_run_killed_then_resumed_is_bit_identical(reference, stage):
    """ZeRO-2 / ZeRO-3 on 2 CPU processes, rollouts generated on policy: SIGKILL (both processes)
    during step 2's update, then --resume under the same launch. Checkpoint 1 holds DeepSpeed's
    shards (each process's optimizer partition with its fp32 master weights); the resumed run's
    final weights and metrics equal the uninterrupted run's exactly."""
    pytest.importorskip("deepspeed")
    base, cfg, _ = reference
    acc = base / f"zero{stage}_resume.yaml"
    acc.write_text(DS_CPU.format(stage=stage))
    env = _env(TORCH_EXTENSIONS_DIR=str(base / "torch_extensions"))  # DeepSpeed's op, compiled once for the module
    out = base / "out"
    full, crash = f"z{stage}-full", f"z{stage}-crash"
    r = launch(acc, "--config", str(cfg), "--out", str(out), "--run", full, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    r = launch(
        acc, "--config", str(cfg), "--out", str(out), "--run", crash, env={**env, "MASKTRL_CRASH_AT": "update:2"}
    )
    assert r.returncode != 0 and not (out / crash / "summary.json").exists()
    ckpt = out / crash / "checkpoints" / "000001"
    assert len(list((ckpt / "deepspeed").rglob("*optim_states.pt"))) == 2  # one optimizer partition per process
    assert json.loads((ckpt / "trainer_state.json").read_text())["deepspeed"] == {"zero_stage": stage, "processes": 2}
    r = masktrl("train", "--resume", crash, "--out", str(out))  # one process: refused, the run left as it is
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and f"ZeRO-{stage} with 2 processes" in lines[0], r.stderr[-2000:]
    r = launch(acc, "--resume", crash, "--out", str(out), env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    a = load_file(out / full / "checkpoints" / "000002" / "model.safetensors")
    b = load_file(out / crash / "checkpoints" / "000002" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    timing = ("step_time_s", "rollout_time_s", "tokens_per_s")
    strip = lambda rows: [{k: v for k, v in row.items() if k not in timing} for row in rows]  # noqa: E731
    assert strip(metrics(out / full)) == strip(metrics(out / crash))
    r = masktrl("train", "--resume", crash, "--out", str(out))  # complete now: nothing to resume, whatever the launch
    assert r.returncode == 0 and "nothing to do" in r.stdout + r.stderr, r.stderr[-2000:]


FSDP2 = ROOT / "configs" / "accelerate" / "fsdp2.yaml"


@pytest.mark.slow
@pytest.mark.parametrize(
    "sets",
    [[], ["--set", "train.packing=true", "--set", "train.micro_batch_tokens=40"], ["--set", "model.lora.rank=4"]],
    ids=["full", "packed", "lora"],
)
def test_fsdp2_two_cpu_processes_match_one_process(reference, sets):
    """FSDP2 (configs/accelerate/fsdp2.yaml: the policy as one fully_shard unit, gradients and
    optimizer state sharded) on 2 CPU processes (gloo), on the one-process reference's rollouts:
    the same update to the tolerance of ``assert_same_weights`` (measured: every element within
    1e-6, the largest difference 7.1e-7 at lr 1e-3), the checkpoint's optimizer state whole and in
    the one-process format. LoRA: against a one-process LoRA run, on its rollouts."""
    base, cfg, ref = reference
    name = "fsdp2-" + ("-".join(s.split("=")[0].replace(".", "-") for s in sets if s != "--set") or "full")
    weights = "model.safetensors"
    if "model.lora.rank=4" in sets:
        ref = base / "out" / "lora-ref"
        r = masktrl("train", "--config", str(cfg), "--out", str(base / "out"), "--run", ref.name, *sets)
        assert r.returncode == 0, r.stderr[-3000:]
        weights = "adapter_model.safetensors"
    out = str(base / "out")
    r = launch(FSDP2, "--config", str(cfg), "--out", out, "--run", name, "--rollouts-from", str(ref), *sets)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    two = base / "out" / name
    a = load_file(ref / "checkpoints" / "000002" / weights)
    b = load_file(two / "checkpoints" / "000002" / weights)
    assert_same_weights(a, b, lr=train_lr(ref))
    assert any(not torch.equal(a[k], load_file(ref / "checkpoints" / "000001" / weights)[k]) for k in a)  # it trained
    for x, y in zip(metrics(ref), metrics(two), strict=True):
        assert abs(x["loss"] - y["loss"]) < 1e-6 and abs(x["grad_norm"] - y["grad_norm"]) < 1e-5
        shares = y["sequences_per_process"]
        assert len(shares) == 2 and shares[0] == shares[1] > 0
    one_opt = torch.load(ref / "checkpoints" / "000002" / "trainer_state.pt", weights_only=True)["optimizer"]
    two_opt = torch.load(two / "checkpoints" / "000002" / "trainer_state.pt", weights_only=True)["optimizer"]
    assert one_opt["state"].keys() == two_opt["state"].keys()
    for i, entry in one_opt["state"].items():  # whole tensors (no DTensor), the same moments
        assert type(two_opt["state"][i]["exp_avg"]) is torch.Tensor
        assert (entry["exp_avg"] - two_opt["state"][i]["exp_avg"]).abs().max() < 1e-6


@pytest.mark.slow
def test_fsdp2_run_killed_then_resumed_is_bit_identical(reference):
    """FSDP2 on 2 CPU processes, rollouts generated on policy (the engine samples from the
    gathered weights): SIGKILL (both processes) during step 3's update, then --resume under the
    same launch; the full optimizer state of checkpoint 2 is sharded again on resume. The final
    weights and metrics equal the uninterrupted run's exactly."""
    base, cfg, _ = reference
    out = str(base / "out")
    args = ["--config", str(cfg), "--out", out, "--set", "train.steps=3"]
    r = launch(FSDP2, *args, "--run", "f-full3")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    r = launch(FSDP2, *args, "--run", "f-crash3", env=_env(MASKTRL_CRASH_AT="update:3"))
    assert r.returncode != 0 and not (base / "out" / "f-crash3" / "summary.json").exists()
    r = launch(FSDP2, "--resume", "f-crash3", "--out", out)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    strip = lambda rows: [{k: v for k, v in row.items() if k not in TIMING} for row in rows]  # noqa: E731
    full, crash = strip(metrics(base / "out" / "f-full3")), strip(metrics(base / "out" / "f-crash3"))
    differ = [  # (step, metric, uninterrupted, resumed): what tells where a difference starts
        (x["step"], k, x[k], y.get(k)) for x, y in zip(full, crash) for k in x if x[k] != y.get(k)
    ]
    for step in (1, 2, 3):
        a = load_file(base / "out" / "f-full3" / "checkpoints" / f"{step:06d}" / "model.safetensors")
        b = load_file(base / "out" / "f-crash3" / "checkpoints" / f"{step:06d}" / "model.safetensors")
        worst = max((a[k] - b[k]).abs().max().item() for k in a)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (step, worst, differ[:6])
    assert full == crash, differ[:6]


@pytest.mark.parametrize(
    "setting, needle",
    [
        ({"FSDP_VERSION": "1"}, "fsdp_version must be 2"),
        ({"FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP"}, "fsdp_auto_wrap_policy must be NO_WRAP"),
        ({"FSDP_OFFLOAD_PARAMS": "true"}, "fsdp_offload_params must be false"),
    ],
)
def test_unsupported_fsdp_setting_is_one_line(tmp_path, tiny_config, setting, needle):
    """As ``accelerate launch`` hands over an FSDP config's settings; refused before anything is written."""
    env = _env(**{"ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", **setting})
    r = masktrl("train", "--config", str(tiny_config), "--out", str(tmp_path / "out"), "--run", "x", env=env)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], r.stderr[-2000:]
    assert next(iter(setting)) in lines[0] and not (tmp_path / "out" / "x").exists()


@pytest.mark.slow
def test_an_fsdp2_checkpoint_resumes_in_one_process(reference):
    """An FSDP2 checkpoint is masktrl's ordinary one (full weights, the full optimizer state in the
    one-process format): a run killed during step 2's update resumes in a plain process."""
    base, cfg, _ = reference
    out = str(base / "out")
    r = launch(
        FSDP2, "--config", str(cfg), "--out", out, "--set", "train.steps=3", "--run", "f-one",
        env=_env(MASKTRL_CRASH_AT="update:2"),
    )  # fmt: skip
    assert r.returncode != 0 and (base / "out" / "f-one" / "checkpoints" / "000001").is_dir()
    r = masktrl("train", "--resume", "f-one", "--out", out)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [row["step"] for row in metrics(base / "out" / "f-one")] == [1, 2, 3]
    assert (base / "out" / "f-one" / "checkpoints" / "000003" / "model.safetensors").is_file()


def test_a_plain_run_takes_an_accelerator_exactly_when_a_cuda_gpu_is_visible(monkeypatch):
    """Without one, a plain run on a GPU machine trained on the CPU beside an idle GPU (seen on
    the GPU check); on a CPU machine the plain run stays ``Dist()``, bit for bit the old path."""
    from masktrl.recipes import train as train_recipe
    from masktrl.rl import distributed

    for var in ("ACCELERATE_MIXED_PRECISION", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not distributed.accelerated()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert distributed.accelerated()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert distributed.accelerated()
    assert train_recipe.accelerated is distributed.accelerated  # the recipe's one choice


def test_a_command_that_ends_well_closes_its_process_group():
    """masktrl.cli.close_process_group (called when a command succeeds): the launcher's group is
    destroyed, as torch asks (NCCL warns at exit otherwise); without a group it does nothing."""
    import torch.distributed as td

    from masktrl.cli import close_process_group

    if td.is_initialized():
        pytest.skip("a process group is already open in this process")
    close_process_group()  # nothing open: nothing to do
    td.init_process_group("gloo", store=td.HashStore(), rank=0, world_size=1)
    assert td.is_initialized()
    close_process_group()
    assert not td.is_initialized()


@pytest.mark.parametrize(
    "env, stage",
    [
        ({}, None),  # a plain run
        ({"ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}, None),  # a stage without a DeepSpeed launch
        ({"ACCELERATE_USE_DEEPSPEED": "true"}, None),  # DeepSpeed without a stage named
        ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"}, 2),
        (
            {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": " 3 "},
            3,
        ),  # as the launch check accepts it
        ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "x"}, None),
    ],
)
def test_deepspeed_stage_reads_the_launch_as_its_check_accepts_it(monkeypatch, env, stage):
    """One reader of accelerate's ZeRO stage for the FP8-under-ZeRO-3 refusal and the disk projection
    (rl/checks.py): the stage check_launch_settings lets through, stripped."""
    from masktrl.rl.distributed import deepspeed_stage

    for key in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_DEEPSPEED_ZERO_STAGE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert deepspeed_stage() == stage
