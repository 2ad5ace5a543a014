"""rollout.staleness as a seeded distribution of batch ages under a cap (rl/schedule.py): the
integer form unchanged, the distributions' draws, determinism, resume, metrics and bad input."""

import json
from collections import Counter

import pytest

from masktrl.config import load_config
from masktrl.errors import ConfigError
from masktrl.rl.schedule import batch_age, drawn_age, sample_now, sampled_at, staleness_cap, staleness_spec
from tests.conftest import TIMING, masktrl, write_tiny_config


def old_sample_ahead(s: int, step: int, last: int) -> list[int]:
    """The integer form as recipes/train.py sampled before distributions existed."""
    return list(range(step + 1, min(step + s, last) + 1))


@pytest.mark.parametrize("s", [0, 1, 2, 5])
def test_integer_form_samples_what_it_always_did(s):
    last = 12
    seen = set()
    for step in range(1, last + 1):
        later = [
            t for t in old_sample_ahead(s, step, last) if t not in seen
        ]  # the run samples what is neither held nor stored
        assert [t for t in sample_now(s, 0, step, last) if t not in seen] == later
        seen.update(later)
        seen.add(step)
        assert batch_age(s, 0, step) == min(s, step - 1) and staleness_cap(s) == s
    assert staleness_spec(3) == staleness_spec({"dist": "fixed", "max": 3, "min": 3})


@pytest.mark.parametrize(
    "spec",
    [
        {"dist": "uniform", "max": 4},
        {"dist": "geometric", "max": 4, "p": 0.4},
        {"dist": "uniform", "min": 1, "max": 3},
        {"dist": "fixed", "max": 2},
    ],
)
def test_every_batch_is_sampled_once_before_its_step_by_the_age_drawn(spec):
    last = 300
    when = {}
    for step in range(1, last + 1):
        when.setdefault(step, step)  # not sampled ahead: collected at its own step (age 0 or the first steps)
        for t in sample_now(spec, 7, step, last):
            assert t not in when
            when[t] = step
    for t in range(1, last + 1):
        assert when[t] == sampled_at(spec, 7, t) and 0 <= t - when[t] <= spec["max"]
        assert t - when[t] == batch_age(spec, 7, t) == min(drawn_age(spec, 7, t), t - 1)
        assert spec.get("min", 0) <= drawn_age(spec, 7, t) <= spec["max"]
    assert [drawn_age(spec, 7, t) for t in range(1, 50)] == [
        drawn_age(spec, 7, t) for t in range(1, 50)
    ]  # a pure function
    assert [drawn_age(spec, 8, t) for t in range(1, 50)] != [drawn_age(spec, 7, t) for t in range(1, 50)] or spec[
        "dist"
    ] == "fixed"


def test_distributions_have_their_shape():
    n = 20000
    uni = Counter(drawn_age({"dist": "uniform", "max": 4}, 0, t) for t in range(n))
    assert set(uni) == {0, 1, 2, 3, 4} and all(abs(c / n - 0.2) < 0.015 for c in uni.values())
    p = 0.5
    geo = Counter(drawn_age({"dist": "geometric", "max": 4, "p": p}, 0, t) for t in range(n))
    expect = {a: p * (1 - p) ** a for a in range(4)} | {4: (1 - p) ** 4}  # the cut puts the tail's mass on the cap
    assert all(abs(geo[a] / n - expect[a]) < 0.015 for a in range(5))


@pytest.mark.parametrize(
    "value, needle",
    [
        ({"dist": "poisson", "max": 2}, "rollout.staleness.dist"),
        ({"dist": "uniform", "min": 3, "max": 2}, "below the minimum age"),
        ({"dist": "uniform"}, "needs dist"),
        ({"dist": "geometric", "max": 2, "p": 0}, "rollout.staleness.p"),
        ({"dist": "uniform", "max": 2, "lag": 1}, "unknown key"),
        (-1, "rollout.staleness"),
    ],
)
def test_bad_schedules_are_config_errors(tmp_path, value, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(write_tiny_config(tmp_path / "c.yaml", {"rollout": {"staleness": value}}))


def test_bad_schedule_on_the_command_line_exit_2_nothing_written(tmp_path, tiny_config):
    r = masktrl(
        "train",
        "--config",
        tiny_config,
        "--set",
        "rollout.staleness={dist: geometric, min: 3, max: 1}",
        "--out",
        tmp_path / "out",
        cwd=tmp_path,
    )
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "below the minimum age" in lines[0], r.stderr
    assert not (tmp_path / "out").exists()


def _rows(run):
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


@pytest.mark.slow
def test_geometric_run_records_ages_reruns_and_resumes_bit_identically(tmp_path, warm_out):
    spec = {"dist": "geometric", "max": 2, "p": 0.5}
    cfg = write_tiny_config(tmp_path / "c.yaml", {"rollout": {"staleness": spec}, "train": {"steps": 5}})
    for run in ("a", "b"):
        r = masktrl("train", "--config", cfg, "--out", warm_out, "--run", f"geo-{run}", cwd=tmp_path)
        assert r.returncode == 0, r.stderr
    a, b = _rows(warm_out / "geo-a"), _rows(warm_out / "geo-b")
    assert a == b  # same seed, same machine, same threads: the same run
    assert [row["rollout_age"] for row in a] == [batch_age(spec, 0, t) for t in range(1, 6)]
    r = masktrl(
        "train",
        "--config",
        cfg,
        "--out",
        warm_out,
        "--run",
        "geo-c",
        cwd=tmp_path,
        env={"MASKTRL_CRASH_AT": "update:4"},
    )
    assert r.returncode != 0
    r = masktrl("train", "--config", cfg, "--out", warm_out, "--resume", "geo-c", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert _rows(warm_out / "geo-c") == a
    assert (warm_out / "geo-c" / "checkpoints" / "000005" / "model.safetensors").read_bytes() == (
        warm_out / "geo-a" / "checkpoints" / "000005" / "model.safetensors"
    ).read_bytes()


def test_dynamics_counts_and_plots_the_ages(tmp_path):
    from types import SimpleNamespace

    from masktrl.analysis import plots
    from masktrl.analysis.dynamics import AGE, age_counts, metric_list

    runs = [
        SimpleNamespace(
            metrics=[{"step": 1, "rollout_age": 0}, {"step": 2, "rollout_age": 1}, {"step": 3, "rollout_age": 1}]
        ),
        SimpleNamespace(metrics=[{"step": 1, "rollout_age": 0}, {"step": 2, "rollout_age": 2}]),
    ]
    assert age_counts(runs) == {"0": 2, "1": 2, "2": 1}
    assert AGE in metric_list(runs) and AGE not in metric_list([SimpleNamespace(metrics=[{"step": 1}])])
    fig = plots.age_histogram([{"label": "grpo", "runs": ["a", "b"], "ages": age_counts(runs)}])
    heights = [p.get_height() for p in fig.axes[0].patches]
    assert heights == pytest.approx([0.4, 0.4, 0.2])


def test_dry_run_line():
    from masktrl.rl.checks import staleness_line

    assert staleness_line({"dist": "uniform", "max": 3}).startswith("uniform batch ages 0..3, drawn per step")
    assert "p = 0.25" in staleness_line({"dist": "geometric", "max": 4, "p": 0.25})
