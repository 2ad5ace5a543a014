"""Prompt templates for math problems, selectable by name.

* ``base``: for base (non-chat) checkpoints: the problem, the instruction to reason step
  by step and box the final answer, then an answer cue the model continues from.
* ``chat``: the same instruction as a user turn, rendered with the tokenizer's own chat
  template (``apply_chat_template(..., add_generation_prompt=True)``).
* ``instruct``: the problem and the instruction with no cue: the user-message content,
  for callers that apply a chat template themselves.
* ``raw``: the problem text unchanged (for data whose prompts are already complete).

Prompt text is rendered once: ``Example.prompt`` is exactly the text the model sees, and
``encode_prompt`` only tokenizes it. The synthetic arithmetic task has no template: with
``model.chat_template`` its raw prompt is wrapped by ``encode_prompt``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from masktrl.errors import ConfigError

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
BASE_TEMPLATE = "Problem: {problem}\n\n" + INSTRUCTION + "\n\nSolution:"


def base_prompt(problem: str, tokenizer: Any = None, **_: Any) -> str:
    """``Problem: ...`` + instruction + ``Solution:`` cue; the model continues after the colon."""
    return BASE_TEMPLATE.replace("{problem}", problem.strip())


def chat_prompt(problem: str, tokenizer: Any = None, **chat_kwargs: Any) -> str:
    """The problem and instruction as one user message, through the tokenizer's chat template.

    Extra keyword arguments go to ``apply_chat_template`` (e.g. ``enable_thinking=False``
    for Qwen3 templates).
    """
    if tokenizer is None or not hasattr(tokenizer, "apply_chat_template"):
        raise ConfigError("prompt template 'chat' needs a tokenizer with a chat template")
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            "prompt template 'chat': this tokenizer has no chat template (a base model?); use template 'base'"
        )
    messages = [{"role": "user", "content": instruct_prompt(problem)}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **chat_kwargs)


def instruct_prompt(problem: str, tokenizer: Any = None, **_: Any) -> str:
    """Problem + instruction, no cue: the content of a user turn (chat template applied elsewhere)."""
    return f"{problem.strip()}\n\n{INSTRUCTION}"


def raw_prompt(problem: str, tokenizer: Any = None, **_: Any) -> str:
    """The problem text exactly as stored."""
    return problem


TEMPLATES: dict[str, Callable[..., str]] = {
    "base": base_prompt,
    "chat": chat_prompt,
    "instruct": instruct_prompt,
    "raw": raw_prompt,
}


def get_template(name: str) -> Callable[..., str]:
    """The template function called ``name``; ConfigError lists the valid names."""
    if name not in TEMPLATES:
        raise ConfigError(f"unknown prompt template {name!r}; valid templates: {', '.join(TEMPLATES)}")
    return TEMPLATES[name]


def render_prompt(problem: str, template: str = "base", tokenizer: Any = None, **chat_kwargs: Any) -> str:
    """Render ``problem`` with the template called ``template``."""
    return get_template(template)(problem, tokenizer=tokenizer, **chat_kwargs)


# --------------------------------------------------------------------------- encoding

_PROBE = "\x00masktrl-probe\x00"  # a message content no real prompt contains


def wraps_chat(task, chat_template: bool) -> bool:
    """Whether ``encode_prompt`` must wrap ``task``'s prompts in the chat template: only when the
    task does not render its own (a task with ``renders_prompts``, e.g. the dataset task, already
    applied the chat template, system prompt included)."""
    return bool(chat_template) and not getattr(task, "renders_prompts", False)


def encode_prompt(tokenizer, prompt: str, chat_template: bool) -> list[int]:
    """Token ids of a prompt: raw text for base models, the chat template for instruct models.

    A prompt the task already rendered with this tokenizer's chat template (MathTask with
    template ``chat``) is tokenized as it is, never wrapped twice.
    """
    if chat_template and not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            "model.chat_template is true, but this tokenizer has no chat template (a base model?); "
            "set model.chat_template=false"
        )
    if chat_template and not is_chat_rendered(tokenizer, prompt):
        # rendered as text, then tokenized like any prompt: apply_chat_template(tokenize=True)
        # returns a BatchEncoding, not ids, in transformers 5
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
    return tokenizer(prompt, add_special_tokens=False)["input_ids"]


def is_chat_rendered(tokenizer, prompt: str) -> bool:
    """Whether ``prompt`` is a user turn rendered with ``tokenizer``'s chat template (the text
    before and after the message content match the template's)."""
    if not getattr(tokenizer, "chat_template", None):
        return False
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": _PROBE}], tokenize=False, add_generation_prompt=True
    )
    head, sep, tail = text.partition(_PROBE)
    return bool(sep) and len(prompt) > len(head) + len(tail) and prompt.startswith(head) and prompt.endswith(tail)
