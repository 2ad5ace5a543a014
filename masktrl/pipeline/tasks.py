"""From the task section of a config to a Task object, and from a prompt to token ids.

Prompt text is rendered once. Math tasks render it with their template (``base``, or
``chat`` through the tokenizer's chat template when ``model.chat_template`` is set), so
``Example.prompt`` is exactly the text the model sees and ``encode_prompt`` only tokenizes
it. The synthetic arithmetic task has no template: with ``model.chat_template`` its raw
prompt is wrapped by ``encode_prompt`` (unchanged behaviour).
"""

from __future__ import annotations


from masktrl.config import Config
from masktrl.models.loading import load_tokenizer

HELDOUT_SEED = 1234  # the held-out split is the same for every run, whatever its seed
_PROBE = "\x00masktrl-probe\x00"  # a message content no real prompt contains


def make_task(cfg: Config, tokenizer=None):
    """The task of ``cfg.task``. Math tasks with ``model.chat_template`` need the policy's
    tokenizer: pass it, or it is loaded from ``model.path`` (local files / cache only)."""
    from masktrl.tasks.base import get_task
    import masktrl.tasks.arithmetic  # noqa: F401  (registers the task)
    import masktrl.tasks.math_data  # noqa: F401  (registers the math tasks)

    t = cfg.task
    if t.name == "arithmetic":
        return get_task(
            "arithmetic", ops=t.ops, digits=t.digits, answer_format=t.answer_format, n_test=t.n_test, seed=HELDOUT_SEED
        )
    template = "chat" if cfg.model.chat_template else "base"
    if template == "chat" and tokenizer is None:
        tokenizer = load_tokenizer(cfg.model.path)
    return get_task(t.name, data_file=t.data, n_test=t.n_test, template=template, tokenizer=tokenizer)


def encode_prompt(tokenizer, prompt: str, chat_template: bool) -> list[int]:
    """Token ids of a prompt: raw text for base models, the chat template for instruct models.

    A prompt the task already rendered with this tokenizer's chat template (MathTask with
    template ``chat``) is tokenized as it is, never wrapped twice.
    """
    if chat_template and not is_chat_rendered(tokenizer, prompt):
        # rendered as text, then tokenized like any prompt: apply_chat_template(tokenize=True)
        # returns a BatchEncoding, not ids, in transformers 5
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
    return tokenizer(prompt, add_special_tokens=False)["input_ids"]


def is_chat_rendered(tokenizer, prompt: str) -> bool:
    """Whether ``prompt`` is a user turn rendered with ``tokenizer``'s chat template (the text
    before and after the message content match the template's)."""
    if not getattr(tokenizer, "chat_template", None):
        return False
    text = tokenizer.apply_chat_template([{"role": "user", "content": _PROBE}], tokenize=False, add_generation_prompt=True)
    head, sep, tail = text.partition(_PROBE)
    return bool(sep) and len(prompt) > len(head) + len(tail) and prompt.startswith(head) and prompt.endswith(tail)
