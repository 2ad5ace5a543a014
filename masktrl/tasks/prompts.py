"""Prompt templates for math problems, selectable by name.

* ``base``: for base (non-chat) checkpoints: the problem, the instruction to reason step
  by step and box the final answer, then an answer cue the model continues from.
* ``chat``: the same instruction as a user turn, rendered with the tokenizer's own chat
  template (``apply_chat_template(..., add_generation_prompt=True)``).
* ``instruct``: the problem and the instruction with no cue: the user-message content,
  for callers that apply a chat template themselves.
* ``raw``: the problem text unchanged (for data whose prompts are already complete).
"""
from __future__ import annotations

from typing import Any, Callable

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
            "prompt template 'chat': this tokenizer has no chat template (a base model?); "
            "use template 'base'"
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
