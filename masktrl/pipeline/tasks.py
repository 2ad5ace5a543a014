"""From the task section of a config to a Task object."""

from __future__ import annotations

from masktrl.config import Config

HELDOUT_SEED = 1234  # the held-out split is the same for every run, whatever its seed


def make_task(cfg: Config):
    from masktrl.tasks.base import get_task
    import masktrl.tasks.arithmetic  # noqa: F401  (registers the task)

    t = cfg.task
    if t.name == "arithmetic":
        return get_task(
            "arithmetic", ops=t.ops, digits=t.digits, answer_format=t.answer_format, n_test=t.n_test, seed=HELDOUT_SEED
        )
    return get_task(t.name, data_file=t.data, n_test=t.n_test)


def encode_prompt(tokenizer, prompt: str, chat_template: bool) -> list[int]:
    """Token ids of a prompt: raw text for base models, the chat template for instruct models."""
    if chat_template:
        return list(
            tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
        )
    return tokenizer(prompt, add_special_tokens=False)["input_ids"]
