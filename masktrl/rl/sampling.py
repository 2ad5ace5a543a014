"""The one sample-and-grade core: prompts encoded (with the chat template when asked), the
engine samples ``settings.n`` responses each, the responses decoded (``sample``), and the task
grades them in one batched call (``grade``). Training (``rl/collect.py``), the held-out and
benchmark evals (``rl/evaluation.py``) and ``masktrl rollout`` all go through it."""

from __future__ import annotations

from masktrl.rollout.base import Generation, RolloutEngine, SamplingSettings
from masktrl.tasks import Example, Task, encode_prompt


def sample(
    engine: RolloutEngine,
    tokenizer,
    examples: list[Example],
    settings: SamplingSettings,
    seed: int,
    chat_template: bool = False,
) -> tuple[list[list[int]], list[list[Generation]], list[list[str]]]:
    """(prompt ids [P], generations [P][n], decoded responses [P][n]) for the P ``examples``."""
    prompt_ids = [encode_prompt(tokenizer, ex.prompt, chat_template) for ex in examples]
    if hasattr(engine, "generate_episodes"):  # task.env: multi-turn episodes (rl/agentic.py)
        gens = engine.generate_episodes(prompt_ids, examples, settings, seed)
    else:
        gens = engine.generate(prompt_ids, settings, seed)
    texts = [[tokenizer.decode(g.response_ids, skip_special_tokens=True) for g in group] for group in gens]
    return prompt_ids, gens, texts


def grade(task: Task, examples: list[Example], texts: list[list[str]]) -> list[list[float]]:
    """The task's score of every response [P][n]: one ``task.score_many`` call (math grading runs in a pool)."""
    flat_ex = [ex for ex, group in zip(examples, texts) for _ in group]
    flat = task.score_many(flat_ex, [t for group in texts for t in group]) if flat_ex else []
    out, i = [], 0
    for group in texts:
        out.append(list(flat[i : i + len(group)]))
        i += len(group)
    return out
