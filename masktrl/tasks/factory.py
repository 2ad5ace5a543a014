"""From the task section of a config to a Task object."""

from __future__ import annotations

from masktrl.config import ModelConfig, TaskConfig
from masktrl.tasks.base import Task, get_task

HELDOUT_SEED = 1234  # the held-out split is the same for every run, whatever its seed


def make_task(task_cfg: TaskConfig, model_cfg: ModelConfig, tokenizer=None) -> Task:
    """The task of ``task_cfg``. Math tasks render their prompts with the ``base`` template, or
    with the policy's chat template when ``model_cfg.chat_template`` is set: pass the policy's
    tokenizer, or it is loaded from ``model_cfg.path`` (local files / cache only)."""
    import masktrl.tasks.arithmetic  # noqa: F401  (registers the task)
    import masktrl.tasks.math_data  # noqa: F401  (registers the math tasks)

    t = task_cfg
    if t.name == "arithmetic":
        return get_task(
            "arithmetic", ops=t.ops, digits=t.digits, answer_format=t.answer_format, n_test=t.n_test, seed=HELDOUT_SEED
        )
    template = "chat" if model_cfg.chat_template else "base"
    if template == "chat" and tokenizer is None:
        from masktrl.models.loading import load_tokenizer  # here: importing masktrl.tasks stays free of torch

        tokenizer = load_tokenizer(model_cfg.path)
    return get_task(t.name, data_file=t.data, n_test=t.n_test, template=template, tokenizer=tokenizer)
