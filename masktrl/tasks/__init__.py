"""Tasks: what the model is asked, and how an answer is scored.

``make_task(cfg.task, cfg.model)`` builds a run's task from its config;
``get_task("arithmetic", digits=3)``, ``get_task("residues", distinct=True)`` (the lab task) or ``get_task("math",
test="aime24", test_file=...)``
returns an object following the :class:`Task` protocol; ``get_task("dataset", source=...,
reward="my_rewards.py:score")`` is any dataset with any reward (see docs/TASKS.md). Rewards are
registered with :func:`register_reward`, tasks with :func:`register_task`; ``encode_prompt``
turns a prompt into the token ids the model sees. Importing this package is cheap:
math-verify is imported only inside grading worker processes.
"""

from masktrl.tasks import arithmetic as _arithmetic  # noqa: F401  (registers "arithmetic")
from masktrl.tasks import longtail as _longtail  # noqa: F401  (registers "longtail", the long-response benchmark task)
from masktrl.tasks import math_data as _math_data  # noqa: F401  (registers "math" and the benchmarks)
from masktrl.tasks import residues as _residues  # noqa: F401  (registers "residues", the lab task)
from masktrl.tasks.base import Example, Task, get_task, register_task, task_names
from masktrl.tasks.dataset import DatasetTask
from masktrl.tasks.factory import make_eval_task, make_task
from masktrl.tasks.prompts import encode_prompt
from masktrl.tasks.rewards import make_reward, register_reward, reward_names
from masktrl.tasks.templates import PromptTemplate

__all__ = [
    "DatasetTask",
    "Example",
    "PromptTemplate",
    "Task",
    "encode_prompt",
    "get_task",
    "make_eval_task",
    "make_reward",
    "make_task",
    "register_reward",
    "register_task",
    "reward_names",
    "task_names",
]
