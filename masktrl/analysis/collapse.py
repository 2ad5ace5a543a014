"""Collapse of a run's training reward: the reward falls below a fraction of its starting value
and stays there (docs/ANALYSIS.md, "analyze compare").

From the run's metrics rows, the per-step training reward ``reward_mean`` (the mean task score
of the step's rollouts, before any shaping), in step order:

* start = the mean reward of the first ``START_STEPS`` steps;
* smoothed reward s_t = the trailing moving average over the last ``WINDOW`` steps up to and
  including step t (over the steps so far for the first ``WINDOW - 1`` steps);
* the run collapsed iff there is a step t with s_u < ``FRACTION`` × start for every step u ≥ t
  and at least ``MIN_STEPS`` steps from t to the end (t and the last step included).

The earliest such t is reported as the collapse step. A run with fewer than ``START_STEPS +
MIN_STEPS`` steps of reward is too short to judge: ``collapsed`` is None and it counts in no
rate. A run whose starting reward is 0 cannot collapse (no reward is below 0).
"""

from __future__ import annotations

import math

import numpy as np

REWARD = "reward_mean"
START_STEPS = 10  # steps averaged for the starting value
WINDOW = 10  # steps of the trailing moving average
FRACTION = 0.5  # collapsed below FRACTION x start ...
MIN_STEPS = 20  # ... for at least this many steps, through the end of the run


def rewards_of(metrics: list[dict], key: str = REWARD) -> tuple[list[int], list[float]]:
    """(steps, rewards) of the rows that log a finite ``key``, one per step (the last row of a
    step wins), in step order."""
    by_step: dict[int, float] = {}
    for row in metrics:
        value = row.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            by_step[int(row["step"])] = float(value)
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def smoothed(rewards: list[float], window: int = WINDOW) -> np.ndarray:
    """[n] the trailing moving average: s_t = mean(r[max(0, t - window + 1) .. t])."""
    r = np.asarray(rewards, dtype=np.float64)
    c = np.concatenate([[0.0], np.cumsum(r)])
    t = np.arange(r.size)
    lo = np.maximum(0, t - window + 1)
    return (c[t + 1] - c[lo]) / (t + 1 - lo)


def collapse(rewards: list[float], steps: list[int] | None = None) -> dict:
    """``collapsed`` (True / False, None when too short), ``start``, ``threshold``, the collapse
    ``step`` (None if none) and ``final_smoothed`` of one run's per-step rewards."""
    steps = list(range(1, len(rewards) + 1)) if steps is None else list(steps)
    n = len(rewards)
    out = {"collapsed": None, "start": None, "threshold": None, "step": None, "final_smoothed": None, "steps": n}
    if n < START_STEPS + MIN_STEPS:
        return out
    start = float(np.mean(rewards[:START_STEPS]))
    s = smoothed(rewards)
    below = s < FRACTION * start  # [n]
    # the earliest t from which every s_u (u >= t) is below: the start of the final run of True
    t = n
    while t > 0 and below[t - 1]:
        t -= 1
    collapsed = t < n and n - t >= MIN_STEPS
    out.update(
        collapsed=bool(collapsed),
        start=start,
        threshold=FRACTION * start,
        step=steps[t] if collapsed else None,
        final_smoothed=float(s[-1]),
    )
    return out


def run_collapse(metrics: list[dict]) -> dict:
    """:func:`collapse` of a run's metrics rows."""
    steps, rewards = rewards_of(metrics)
    return collapse(rewards, steps)


def collapse_rate(results: list[dict]) -> dict:
    """count / total over the runs that could be judged, and how many were too short."""
    judged = [r for r in results if r["collapsed"] is not None]
    count = sum(bool(r["collapsed"]) for r in judged)
    return {
        "count": count,
        "total": len(judged),
        "rate": count / len(judged) if judged else float("nan"),
        "too_short": len(results) - len(judged),
    }


DEFINITION = (
    f"collapsed: the {WINDOW}-step trailing mean of {REWARD} stays below {FRACTION:g} x the mean of "
    "the first "
    f"{START_STEPS} steps from some step t to the end, with at least {MIN_STEPS} steps "
    "from t on; runs with fewer "
    f"than {START_STEPS + MIN_STEPS} steps are not judged"
)
