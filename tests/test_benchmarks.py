"""The benchmark scripts still run and still time what they claim to (no timing is asserted)."""

import importlib
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
TINY = [
    "--set",
    "model.hidden_size=32",
    "--set",
    "model.num_layers=1",
    "--set",
    "model.num_heads=2",
    "--set",
    "model.num_kv_heads=1",
    "--set",
    "model.intermediate_size=64",
    "--set",
    "warmstart.steps=5",
    "--set",
    "rollout.prompts_per_step=4",
    "--set",
    "rollout.n=3",
    "--set",
    "rollout.max_new_tokens=3",
    "--set",
    "task.n_test=8",
]


@pytest.fixture
def common(tmp_path, monkeypatch):
    monkeypatch.setenv("MASKTRL_BENCH_OUT", str(tmp_path))
    monkeypatch.syspath_prepend(str(BENCH))
    for name in ("common", "profile_step"):
        sys.modules.pop(name, None)
    return importlib.import_module("common")


def test_phase_timer_counts_exclusive_time_and_restores(common, monkeypatch):
    import types

    clock = [0.0]  # a fake perf_counter: each call below takes a known time

    def tick(seconds):
        clock[0] += seconds

    monkeypatch.setattr(common, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    mod = types.SimpleNamespace(inner=lambda: tick(1.0), outer=None)
    mod.outer = lambda: (mod.inner(), tick(0.5), mod.inner())
    original_inner = mod.inner
    timer = common.PhaseTimer()
    timer.wrap(mod, "inner", "in")
    timer.wrap(mod, "outer", "out")
    mod.outer()
    assert timer.take() == {"in": 2.0, "out": 0.5}  # the outer phase keeps only its own time
    timer.restore()
    assert mod.inner is original_inner and timer.take() == {}
    timer.wrap(mod, "inner", "in")
    timer.wrap(mod, "outer", "out", absorb=True)
    mod.outer()
    assert timer.take() == {"out": 2.5}  # absorb: the nested calls count as the outer phase


def test_every_masktrl_stage_is_found(common):
    """A renamed function would silently drop out of profile_step's table."""
    timer = common.PhaseTimer()
    common.wrap_masktrl_phases(timer)
    timer.restore()
    assert timer.missing == []


def test_profile_step_runs_and_shares_add_up(common, tmp_path):
    profile_step = importlib.import_module("profile_step")
    out = tmp_path / "p.json"
    profile_step.main([*TINY, "--steps", "3", "--full-run-steps", "20", "--json", str(out)])
    r = json.loads(out.read_text())
    assert r["steps_counted"] == 2
    assert abs(sum(r["shares"].values()) - 1.0) < 1e-6
    assert 0.0 < r["io_share"] < 1.0
    assert r["phases_ms"]["rollout: transformers generate"] > 0 and r["phases_ms"]["backward"] > 0
