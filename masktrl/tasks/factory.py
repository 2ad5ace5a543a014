"""From the task section of a config to a Task object."""

from __future__ import annotations

import dataclasses

from masktrl.config import ModelConfig, TaskConfig
from masktrl.errors import ConfigError
from masktrl.tasks.base import Task, get_task, task_parameters

HELDOUT_SEED = 1234  # the held-out split is the same for every run, whatever its seed


def make_task(task_cfg: TaskConfig, model_cfg: ModelConfig, tokenizer=None) -> Task:
    """The task of ``task_cfg``.

    * ``arithmetic``: the synthetic task (no template; ``encode_prompt`` wraps it in the chat
      template when ``model_cfg.chat_template`` is set).
    * ``residues``: the lab's synthetic task (docs/LAB.md), its options from ``task.options``.
    * ``dataset`` and the math presets: prompts rendered once, with the task's template, through
      the policy's chat template when ``model_cfg.chat_template`` is set; the policy's tokenizer
      (pass it, or it is loaded from ``model_cfg.path``, local files / cache only) renders chat
      prompts and counts ``task.max_prompt_tokens`` (the tiny model's character tokenizer: one
      token per character).
    * a task added with ``register_task``: its factory gets the ``task.*`` keys it names as
      parameters (and ``tokenizer`` / ``chat`` if it asks for them) and ``task.options``.

    Everything is checked here (data, keys, template, reward), before a run writes anything.
    """
    import masktrl.tasks.arithmetic  # (registers the task)
    import masktrl.tasks.kb  # (registers the agentic lab's task)
    import masktrl.tasks.longtail  # (registers the long-response benchmark task)
    import masktrl.tasks.math_data  # (registers the math tasks)
    import masktrl.tasks.residues  # noqa: F401  (registers the lab task)
    from masktrl.tasks.math_data import BENCHMARKS

    t = task_cfg
    if t.env is not None:  # multi-turn: the class loads, has the protocol and a stop string (tasks/envs.py)
        from masktrl.tasks.envs import env_stop, load_env

        env_stop(load_env(t.env), t.call_stop, t.env)
    if t.options and (t.name in ("arithmetic", "dataset") or t.name in BENCHMARKS):
        raise ConfigError(
            f"task.options: the {t.name} task takes no options there; its keys are task.* (masktrl config keys)"
        )
    if t.name == "arithmetic":
        return get_task(
            "arithmetic", ops=t.ops, digits=t.digits, answer_format=t.answer_format, n_test=t.n_test, seed=HELDOUT_SEED
        )
    if t.name == "residues":
        fixed = sorted({"n_test", "seed"} & set(t.options))
        if fixed:
            raise ConfigError(
                f"task.options.{fixed[0]}: the held-out split is task.n_test problems drawn with a fixed seed"
            )
        return get_task("residues", **t.options, n_test=t.n_test, seed=HELDOUT_SEED)
    if t.name == "dataset" or t.name in BENCHMARKS:
        return get_task(t.name, **_dataset_options(t, model_cfg, tokenizer))
    params = task_parameters(t.name)  # ConfigError for an unknown name
    extra = {"tokenizer": tokenizer, "chat": model_cfg.chat_template}
    kwargs = {
        f.name: getattr(t, f.name)
        for f in dataclasses.fields(t)
        if f.name in params and f.name not in ("name", "options")
    }
    return get_task(t.name, **kwargs, **{k: v for k, v in extra.items() if k in params}, **t.options)


def make_eval_task(task_cfg: TaskConfig, model_cfg: ModelConfig, tokenizer=None, *, whole_split: bool = False) -> Task:
    """The task of ``masktrl eval`` / ``masktrl rollout``: its ``test_examples`` are what is
    evaluated. A math preset: every problem. A dataset: its held-out split as in training
    (``task.test_split``, else the seeded ``n_test`` sample of ``task.split``), or with
    ``whole_split`` every row of ``task.split``. Any other task: its own held-out split."""
    import masktrl.tasks.math_data  # noqa: F401  (registers the math tasks)
    from masktrl.tasks.math_data import BENCHMARKS

    t = task_cfg
    if t.name in BENCHMARKS or (t.name == "dataset" and whole_split):
        options = _dataset_options(t, model_cfg, tokenizer)
        options["n_test"] = None  # everything held out
        if t.name == "dataset":
            options["test_split"] = None
        return get_task(t.name, **options)
    return make_task(t, model_cfg, tokenizer)


def _dataset_options(t: TaskConfig, model_cfg: ModelConfig, tokenizer) -> dict:
    from masktrl.tasks.dataset import task_options

    tiny = model_cfg.path == "tiny"
    if tokenizer is None and not tiny and (model_cfg.chat_template or t.max_prompt_tokens is not None):
        from masktrl.models.loading import load_tokenizer  # here: importing masktrl.tasks stays free of torch

        tokenizer = load_tokenizer(model_cfg.path)
    count_tokens = len if tiny and tokenizer is None else None  # the tiny model's tokenizer: one token per character
    return task_options(t, chat=model_cfg.chat_template, tokenizer=tokenizer, count_tokens=count_tokens)
