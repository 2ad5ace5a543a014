"""Shared fixtures and helpers: the one tiny config of the suite (tests state only what they
change, as an overlay), one way to run the real ``masktrl`` entry point in a subprocess, one
way to invoke the CLI in-process (and its error boundary), a warm start trained once per
session, and a set of tiny finished runs the analyses read."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

# rich fixes a console's width when the console is made, from COLUMNS: whichever test first imports
# masktrl's consoles (inside cli()'s CliRunner, COLUMNS=200, or outside it, 80) set it for all the
# later ones, so a test reading a wrapped line passed or failed by the order the files ran in
os.environ["COLUMNS"] = "200"

from masktrl.config import merge_config

TINY = {  # every end-to-end run of the suite starts from this: a few seconds on a CPU
    "seed": 0,
    "method": {"name": "grpo"},
    "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 64},
    "task": {"name": "arithmetic", "digits": 1, "n_test": 16},
    "warmstart": {"steps": 40, "batch_size": 16},
    "rollout": {"prompts_per_step": 6, "n": 4, "max_new_tokens": 4, "logprobs_k": 5},
    "train": {"steps": 2, "checkpoint_every": 1, "lr": 1.0e-3},
}
TIMING = ("step_time_s", "rollout_time_s", "tokens_per_s")  # metrics that differ between identical runs


def tiny_yaml(overlay: dict | None = None) -> str:
    """The tiny config with ``overlay`` merged on top (as ``--config tiny --config overlay`` would)."""
    return yaml.safe_dump(merge_config(TINY, overlay or {}), sort_keys=False)


def write_tiny_config(path: Path, overlay: dict | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tiny_yaml(overlay))
    return path


@pytest.fixture
def tiny_config(tmp_path) -> Path:
    return write_tiny_config(tmp_path / "tiny_test.yaml")


@pytest.fixture(scope="module")
def float64_tiny_model():
    """A 2-layer tiny model in float64 (hidden 32, 4 heads, 2 KV heads, MLP 64; the characters
    0-9, + and =; seed 0): the update tests' exact reference model."""
    from masktrl.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer("0123456789+=")
    return build_tiny_model(
        tok, TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64), seed=0
    ).double()


@pytest.fixture(scope="session")
def warm_out(tmp_path_factory) -> Path:
    """An outputs folder whose warm-start cache already holds the tiny config's warm start (seed
    0): runs under it (any method, any train.* or rollout.* setting) skip the warm start."""
    from masktrl.config import load_config
    from masktrl.rl.warmstart import prepare_policy
    from masktrl.tasks import make_task

    out = tmp_path_factory.mktemp("warm") / "out"
    cfg = load_config(write_tiny_config(out.parent / "tiny.yaml"))
    prepare_policy(cfg, make_task(cfg.task, cfg.model), out)
    return out


ANALYSED = {  # a longer warm start and off-policy minibatches: the analyses need something to find
    "warmstart": {"steps": 150},
    "rollout": {"prompts_per_step": 8},
    "train": {"steps": 3, "lr": 3.0e-3, "minibatches": 2, "eval_every": 2},
}


@pytest.fixture(scope="session")
def analysis_runs(tmp_path_factory):
    """A folder of finished runs: grpo x seeds 0, 1, 2 and sis x seeds 0, 1 (3 steps each, 2
    minibatches, every checkpoint kept, K = 5 lists over a 17-token vocabulary). Tests that
    write into a run's analysis/ folder must not assume it is empty."""
    from masktrl.recipes import sweep

    base = tmp_path_factory.mktemp("analysis")
    config = write_tiny_config(base / "tiny.yaml", ANALYSED)
    out = base / "out"
    sweep.run(sweep.plan(out, ["grpo"], [0, 1, 2], config))
    sweep.run(sweep.plan(out, ["sis"], [0, 1], config))
    return out


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A complete 2-step run of the tiny config, one per test module: ``(config, out, root)``
    (copy it with ``copy_run`` before changing it)."""
    base = tmp_path_factory.mktemp("finished")
    config = write_tiny_config(base / "tiny.yaml")
    cli("train", "--config", config, "--out", base / "out", "--run", "r")
    return config, base / "out", base / "out" / "r"


def snapshot(root) -> dict:
    """Every file under ``root`` and its bytes: equal before and after means nothing changed."""
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}


def copy_run(finished, tmp_path):
    """A copy of a module fixture's finished run ``(config, out, root)`` under ``tmp_path/out``,
    to change without touching the shared one."""
    config, out, root = finished
    shutil.copytree(out, tmp_path / "out")
    return config, tmp_path / "out", tmp_path / "out" / root.name


def masktrl_env(extra: dict | None = None) -> dict:
    """The environment for a child ``masktrl``: no debug / fault-injection / launcher variables
    leak in from the test's own environment; a wide terminal for rich."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("MASKTRL_", "ACCELERATE_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    }
    env["COLUMNS"] = "200"
    env.update(extra or {})
    return env


def masktrl(*args, env: dict | None = None, cwd=None, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run the real entry point (``python -m masktrl.cli``) in a fresh process."""
    return subprocess.run(
        [sys.executable, "-m", "masktrl.cli", *map(str, args)],
        capture_output=True,
        text=True,
        env=masktrl_env(env),
        cwd=cwd,
        timeout=timeout,
    )


def cli(*args, ok: bool = True):
    """Invoke the typer app in-process (CliRunner); with ``ok`` assert it succeeded."""
    from typer.testing import CliRunner

    from masktrl.cli import app

    result = CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})
    if ok:
        assert result.exit_code == 0, (result.output, result.exception)
    return result


@pytest.fixture
def cli_error(monkeypatch, capsys):
    """``cli_error(arg, ...)`` runs ``masktrl arg ...`` through the CLI's error boundary, checks it
    ended with exit code 2 and exactly one stderr line (no traceback), and returns that line."""
    from masktrl import cli as entry

    def run(*args) -> str:
        monkeypatch.setattr(sys, "argv", ["masktrl", *map(str, args)])
        with pytest.raises(SystemExit) as exc:
            entry.main()
        assert exc.value.code == 2
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and "Traceback" not in err, err
        return lines[0]

    return run
