import pytest

from masktrl.errors import ConfigError
from masktrl.tasks.prompts import INSTRUCTION, TEMPLATES, render_prompt


class FakeChatTokenizer:
    chat_template = "{% for m in messages %}...{% endfor %}"

    def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=False, **kw):
        assert tokenize is False and add_generation_prompt is True
        body = "".join(f"<|{m['role']}|>{m['content']}<|end|>" for m in messages)
        return body + "<|assistant|>" + ("<think></think>" if kw.get("enable_thinking") is False else "")


def test_base_template():
    p = render_prompt("  What is 2+2?\n", "base")
    assert p == f"Problem: What is 2+2?\n\n{INSTRUCTION}\n\nSolution:"
    assert "\\boxed{}" in p


def test_chat_template_uses_tokenizer():
    p = render_prompt("What is 2+2?", "chat", tokenizer=FakeChatTokenizer(), enable_thinking=False)
    assert p == f"<|user|>What is 2+2?\n\n{INSTRUCTION}<|end|><|assistant|><think></think>"


def test_raw_and_errors():
    assert render_prompt("as is\n", "raw") == "as is\n"
    assert render_prompt(" q ", "instruct") == f"q\n\n{INSTRUCTION}"
    assert set(TEMPLATES) == {"base", "chat", "instruct", "raw"}
    with pytest.raises(ConfigError, match="valid templates: base, chat, instruct, raw"):
        render_prompt("x", "fancy")
    with pytest.raises(ConfigError, match="needs a tokenizer"):
        render_prompt("x", "chat")
    no_template = FakeChatTokenizer()
    no_template.chat_template = None
    with pytest.raises(ConfigError, match="no chat template"):
        render_prompt("x", "chat", tokenizer=no_template)
