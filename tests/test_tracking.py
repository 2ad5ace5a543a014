"""train.report_to: metrics rows reach accelerate's trackers; TensorBoard event files are
written offline and read back; a missing package or unknown tracker is one line."""

import pytest

from masktrl.config import load_config
from masktrl.errors import ConfigError
from masktrl.rl import tracking


def read_scalars(logdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_events_hold_every_row_at_its_step(tmp_path):
    pytest.importorskip("tensorboard")
    rows = [
        {
            "step": 1,
            "reward_mean": 0.25,
            "mask_frac": 0.5,
            "tokens": 96,
            "sequences_per_process": [12, 12],
            "clip_frac": None,
            "ok": True,
        },
        {"step": 2, "reward_mean": 0.75, "mask_frac": 0.125, "tokens": 80, "eval/heldout/accuracy": 0.5},
    ]
    cfg = load_config(None, ["train.report_to=tensorboard"])
    t = tracking.Trackers(cfg.train.report_to, tmp_path, "run-a", cfg.to_dict())
    assert t.names == ["tensorboard"]
    for row in rows:
        t.log(row)
    t.log({"step": 7, "eval/heldout/accuracy": 0.625}, step=0)  # explicit step wins
    t.close()
    scalars = read_scalars(tmp_path / "tensorboard")
    assert scalars["reward_mean"] == [(1, 0.25), (2, 0.75)]
    assert scalars["mask_frac"] == [(1, 0.5), (2, 0.125)]
    assert scalars["tokens"] == [(1, 96.0), (2, 80.0)]
    assert scalars["eval/heldout/accuracy"] == [(2, 0.5), (0, 0.625)]
    assert not {"sequences_per_process", "clip_frac", "ok", "step"} & set(scalars)


def test_no_tracker_and_other_processes_log_nothing(tmp_path):
    t = tracking.open_trackers(("tensorboard",), tmp_path, "r", None, is_main=False)
    t.log({"step": 1, "x": 1.0})
    t.close()
    assert t.names == [] and not any(tmp_path.iterdir())


def test_missing_package_is_one_config_error(monkeypatch):
    real = tracking.importlib.util.find_spec
    monkeypatch.setattr(
        tracking.importlib.util, "find_spec", lambda name: None if name in ("wandb", "mlflow") else real(name)
    )
    with pytest.raises(
        ConfigError, match=r"^train.report_to=wandb: the wandb package is not installed \(pip install wandb"
    ):
        tracking.check_available(("wandb",))
    tracking.check_available(())  # nothing requested, nothing checked


def test_unknown_tracker_is_rejected_at_config_load():
    with pytest.raises(
        ConfigError, match="train.report_to must be one of tensorboard, wandb, trackio, mlflow, none; got 'tensorbored'"
    ):
        load_config(None, ["train.report_to=tensorbored"])
    assert load_config(None, ["train.report_to=none"]).train.report_to == ()
    assert load_config(None, ["train.report_to=tensorboard,mlflow"]).train.report_to == ("tensorboard", "mlflow")


def test_a_tracker_failing_mid_run_is_dropped_with_one_warning(tmp_path, capsys):
    class Broken:
        name = "broken"

        def log(self, values, step=None):
            raise OSError("disk full\nmore")

        def finish(self):
            pass

    t = tracking.Trackers((), tmp_path, "r")
    t.trackers.append(Broken())
    t.log({"step": 1, "x": 1.0})
    t.log({"step": 2, "x": 2.0})
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["warning: tracker broken failed (disk full); it is dropped, metrics.jsonl continues"]
