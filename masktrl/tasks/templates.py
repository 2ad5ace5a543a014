"""Prompt templates: from an example's prompt and fields to the exact text the model sees.

A template is a Python format string over the example: ``{prompt}`` is the example's prompt
(the value under ``task.prompt_key``) and ``{any.field}`` any other field of the row, dotted
paths allowed (``{reward_model.style}``); literal braces are written ``{{`` and ``}}``. Named
templates:

* ``raw``       ``{prompt}`` unchanged (the default of ``task.name=dataset``).
* ``base``      ``Problem: ...`` + the ``\\boxed{}`` instruction + ``Solution:`` (the math default).
* ``instruct``  the problem and the instruction, no cue (``chat`` is ``instruct`` in a chat turn).
* ``dapo``      DAPO-Math-17k's own prompt, exactly as that dataset ships it: its "Answer:"
                instruction around the problem (pair it with the ``answer-line`` reward).

With a chat template (``model.chat_template``) the rendered text is the user message, after an
optional system message (``task.system_prompt``), passed through the tokenizer's
``apply_chat_template(..., add_generation_prompt=True)`` with ``task.chat_template_kwargs``
(e.g. ``{enable_thinking: false}`` for Qwen3). Without one, a system prompt is an error: put
the text in the template itself.
"""

from __future__ import annotations

import string
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from masktrl.errors import ConfigError
from masktrl.tasks.fields import get_path
from masktrl.tasks.prompts import INSTRUCTION

DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be "
    "of the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'


def _literal(text: str) -> str:
    return text.replace("{", "{{").replace("}", "}}")


# name -> (format string, strip the prompt first, the reward its instruction asks for)
NAMED_TEMPLATES: dict[str, tuple[str, bool, str | None]] = {
    "raw": ("{prompt}", False, None),
    "base": ("Problem: {prompt}\n\n" + _literal(INSTRUCTION) + "\n\nSolution:", True, "math-verify"),
    "instruct": ("{prompt}\n\n" + _literal(INSTRUCTION), True, "math-verify"),
    "dapo": (_literal(DAPO_PREFIX) + "{prompt}" + _literal(DAPO_SUFFIX), False, "answer-line"),
}
CHAT_ALIAS = "chat"  # the math template of instruct models: ``instruct`` in a chat turn


class _Formatter(string.Formatter):
    """``{a.b.0}`` looks up the dotted path ``a.b.0`` in the fields (not attribute access)."""

    def get_field(self, field_name: str, args, kwargs):
        return get_path(kwargs, field_name), field_name


_FORMATTER = _Formatter()


@dataclass(frozen=True)
class PromptTemplate:
    """How an example becomes prompt text.

    Attributes:
        text: the format string (``{prompt}`` and any other field).
        name: the named template it came from (None for a custom string).
        strip: strip whitespace around the prompt before formatting (``base``, ``instruct``).
        system_prompt: a system message before the user turn (chat template only).
        chat: render through the tokenizer's chat template.
        chat_kwargs: extra keyword arguments of ``apply_chat_template``.
        reward: the reward the template's instruction asks for (``base``: math-verify,
            ``dapo``: answer-line), used when the task names none.
    """

    text: str = "{prompt}"
    name: str | None = "raw"
    strip: bool = False
    system_prompt: str | None = None
    chat: bool = False
    chat_kwargs: dict = field(default_factory=dict)
    reward: str | None = None

    @classmethod
    def resolve(
        cls,
        template: str | None = None,
        *,
        system_prompt: str | None = None,
        chat: bool = False,
        chat_kwargs: Mapping[str, Any] | None = None,
        default: str = "raw",
    ) -> PromptTemplate:
        """A named template (``raw``, ``base``, ``instruct``, ``dapo``; ``chat`` = ``instruct``
        with the chat template) or a format string (anything containing ``{``)."""
        template = default if template is None else template
        if template == CHAT_ALIAS:
            template, chat = "instruct", True
        if "{" in template:
            text, name, strip, reward = template, None, False, None
            _check_format(text)
        elif template in NAMED_TEMPLATES:
            (text, strip, reward), name = NAMED_TEMPLATES[template], template
        else:
            raise ConfigError(
                f"unknown prompt template {template!r}; valid templates: "
                f"{', '.join([*NAMED_TEMPLATES, CHAT_ALIAS])}, "
                "or a format string with {prompt}"
            )
        if system_prompt is not None and not chat:
            raise ConfigError(
                "task.system_prompt needs a chat template (model.chat_template: true); without one, "
                "put the text in task.template"
            )
        if chat_kwargs and not chat:
            raise ConfigError("task.chat_template_kwargs needs a chat template (model.chat_template: true)")
        return cls(text, name, strip, system_prompt, chat, dict(chat_kwargs or {}), reward)

    @property
    def label(self) -> str:
        """How reports name it: ``base``, ``chat`` (instruct in a chat turn), ``dapo+chat``, ``custom``."""
        if self.name == "instruct" and self.chat:
            return CHAT_ALIAS
        return (self.name or "custom") + ("+chat" if self.chat else "")

    def fields(self) -> list[str]:
        """The field names the format string uses (``prompt`` included)."""
        return [f for _, f, _, _ in string.Formatter().parse(self.text) if f]

    def content(self, prompt: str, fields: Mapping[str, Any] | None = None) -> str:
        """The user text: the format string filled in. KeyError names a missing field."""
        values = dict(fields or {})
        values["prompt"] = prompt.strip() if self.strip else prompt
        return _FORMATTER.vformat(self.text, (), values)

    def render(self, prompt: str, fields: Mapping[str, Any] | None = None, tokenizer: Any = None) -> str:
        """The exact prompt text: the content, through the chat template when ``chat``."""
        text = self.content(prompt, fields)
        if not self.chat:
            return text
        self.check(tokenizer)
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt is not None else []
        messages.append({"role": "user", "content": text})
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **self.chat_kwargs)

    def check(self, tokenizer: Any) -> None:
        """ConfigError now if rendering would need a chat template this tokenizer lacks."""
        if not self.chat:
            return
        if tokenizer is None or not hasattr(tokenizer, "apply_chat_template"):
            raise ConfigError(f"prompt template {self.label!r} needs a tokenizer with a chat template")
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                f"prompt template {self.label!r}: this tokenizer has no chat template (a base "
                "model?); "
                "set model.chat_template: false"
            )


def _check_format(text: str) -> None:
    try:
        parsed = list(string.Formatter().parse(text))
    except ValueError as e:
        raise ConfigError(
            f"task.template {text!r} is not a valid format string ({e}); write literal braces as {{{{ }}}}"
        ) from None
    names = [f for _, f, _, _ in parsed if f is not None]
    if any(not n or n.isdigit() for n in names):
        raise ConfigError(f"task.template {text!r}: every {{}} must name a field, e.g. {{prompt}}")
