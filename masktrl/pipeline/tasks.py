"""From the task section of a config to a Task object."""

from __future__ import annotations

from masktrl.config import Config

HELDOUT_SEED = 1234  # the held-out split is the same for every run, whatever its seed


def make_task(cfg: Config):
    from masktrl.tasks import get_task

    t = cfg.task
    if t.name == "arithmetic":
        return get_task(
            "arithmetic", ops=t.ops, digits=t.digits, answer_format=t.answer_format, n_test=t.n_test, seed=HELDOUT_SEED
        )
    return get_task(t.name, data_file=t.data, n_test=t.n_test)
