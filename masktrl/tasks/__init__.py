"""Tasks: what the model is asked, and how an answer is scored.

``make_task(cfg.task, cfg.model)`` builds a run's task from its config;
``get_task("arithmetic", digits=3)`` or ``get_task("math", test="aime24", test_file=...)``
returns an object following the :class:`Task` protocol; ``encode_prompt`` turns a prompt into
the token ids the model sees. Importing this package is cheap:
math-verify is imported only inside grading worker processes.
"""
from masktrl.tasks.base import Example, Task, get_task, register_task, task_names
from masktrl.tasks import arithmetic as _arithmetic  # noqa: F401  (registers "arithmetic")
from masktrl.tasks import math_data as _math_data  # noqa: F401  (registers "math")
from masktrl.tasks.factory import make_task
from masktrl.tasks.prompts import encode_prompt

__all__ = ["Example", "Task", "encode_prompt", "get_task", "make_task", "register_task", "task_names"]
