"""Live tracking (``train.report_to``): every metrics row also goes to accelerate's trackers.

``metrics.jsonl`` stays the source of truth; a tracker is a live view of it. The trackers are
accelerate's own classes (``accelerate.tracking``): TensorBoard event files under
``<run>/tensorboard/``, and Weights & Biases, trackio and MLflow configured as those libraries
read their environment (``WANDB_MODE=offline``, ``WANDB_PROJECT``, ``MLFLOW_TRACKING_URI``, ...;
project / experiment ``masktrl`` unless set there, the run's folder name as the run name).

Only the main process logs. Each row is logged at its ``step`` with its numeric values (lists
such as ``sequences_per_process`` and missing values are left out). A resumed run logs the
redone steps again (TensorBoard shows the later value; the rows are identical anyway).

The packages are optional: ``check_available`` (called before the run folder is created) turns
a missing one into one ``ConfigError`` line. A tracker that fails while logging is dropped with
one warning line: a multi-day run does not stop because a dashboard is unreachable.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from pathlib import Path

from masktrl.errors import ConfigError, MasktrlError

PACKAGES = {
    "tensorboard": ("tensorboard", "tensorboardX"),
    "wandb": ("wandb",),
    "trackio": ("trackio",),
    "mlflow": ("mlflow",),
}
"""tracker -> the package it needs (import names; any one of them): accelerate's TensorBoard
tracker writes through torch.utils.tensorboard (needs tensorboard) or else tensorboardX."""
PROJECT = "masktrl"


def check_available(report_to: tuple[str, ...]) -> None:
    """Raise ``ConfigError`` (one line) if a requested tracker's package is not installed."""
    for name in report_to:
        if not any(importlib.util.find_spec(m) is not None for m in PACKAGES[name]):
            package = PACKAGES[name][0]
            raise ConfigError(
                f"train.report_to={name}: the {package} package is not installed (pip install "
                f"{package}; "
                "pip install 'masktrl[track]' installs tensorboard)"
            )


class Trackers:
    """The run's trackers (none: every method is a no-op)."""

    def __init__(self, report_to: tuple[str, ...], run_dir: Path, run_name: str, config: dict | None = None):
        self.trackers = []
        for name in report_to:
            tracker = _make(name, Path(run_dir), run_name)
            try:
                tracker.start()
                if config is not None:
                    tracker.store_init_configuration(hparams(config))
            except Exception as exc:  # (any library error: one line)
                raise MasktrlError(f"train.report_to={name}: the tracker did not start ({_first_line(exc)})") from None
            self.trackers.append(tracker)

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.trackers]

    def log(self, row: dict, step: int | None = None) -> None:
        """Log a metrics row's numbers at ``step`` (default: ``row['step']``)."""
        if not self.trackers:
            return
        step = row["step"] if step is None else step
        values = numeric(row)
        for tracker in list(self.trackers):
            try:
                tracker.log(values, step=step)
            except Exception as exc:  # any library error: one line
                self.trackers.remove(tracker)
                print(
                    f"warning: tracker {tracker.name} failed ({_first_line(exc)}); it is dropped, "
                    "metrics.jsonl continues",
                    file=sys.stderr,
                )

    def close(self) -> None:
        for tracker in self.trackers:
            try:
                tracker.finish()
            except Exception as exc:  # any library error: one line
                print(f"warning: tracker {tracker.name} did not close cleanly ({_first_line(exc)})", file=sys.stderr)
        self.trackers = []


def open_trackers(
    report_to: tuple[str, ...], run_dir: Path, run_name: str, config: dict | None, is_main: bool
) -> Trackers:
    """The trackers of the main process; the other processes get an empty set."""
    return Trackers(report_to if is_main else (), run_dir, run_name, config)


def numeric(row: dict) -> dict:
    """The int/float values of ``row`` (not bools, lists, strings or None), ``step`` left out."""
    return {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


def hparams(config: dict) -> dict:
    """A nested config as flat ``section.key`` scalars (lists and None as text) for the trackers' config view."""
    from masktrl.config import flatten

    out = {}
    for k, v in flatten(config).items():
        if isinstance(v, float) and not math.isfinite(v):
            v = str(v)
        out[k] = v if isinstance(v, (bool, int, float, str)) else str(v)
    return out


def _make(name: str, run_dir: Path, run_name: str):
    from accelerate import tracking

    if name == "tensorboard":  # events under <run>/tensorboard/
        return tracking.TensorBoardTracker("tensorboard", run_dir)
    if name == "wandb":
        return tracking.WandBTracker(os.environ.get("WANDB_PROJECT", PROJECT), name=run_name)
    if name == "trackio":
        return tracking.TrackioTracker(os.environ.get("TRACKIO_PROJECT", PROJECT), name=run_name)
    if name == "mlflow":
        return tracking.MLflowTracker(experiment_name=PROJECT, run_name=run_name)
    raise ConfigError(f"train.report_to: unknown tracker {name!r}")


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
