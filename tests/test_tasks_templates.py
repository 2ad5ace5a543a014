"""Prompt templates: named ones match the math prompts, format strings take any (dotted) field,
a system prompt and chat-template keyword arguments go through the tokenizer's chat template."""

import pytest

from masktrl.errors import ConfigError
from masktrl.tasks import get_task
from masktrl.tasks.prompts import encode_prompt, render_prompt, wraps_chat
from masktrl.tasks.templates import DAPO_PREFIX, DAPO_SUFFIX, PromptTemplate
from tests.datasets_helpers import datasets_cache, write_jsonl  # noqa: F401
from tests.test_tasks_prompts import FakeChatTokenizer

CHAT = (
    "{% for m in messages %}[{{ m['role'][0] }}]{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}[a]{% endif %}"
)


def char_tokenizer_with_chat_template():
    from masktrl.models.tiny import build_char_tokenizer

    tok = build_char_tokenizer("[]sSuQ:1+=a")
    tok.chat_template = CHAT
    return tok


@pytest.mark.parametrize("name", ["base", "instruct", "raw"])
def test_named_templates_are_the_math_prompts(name):
    problem = "  What is 2+2?\n"
    assert PromptTemplate.resolve(name).render(problem) == render_prompt(problem, name)
    chat = PromptTemplate.resolve("chat")
    assert chat.render(problem, tokenizer=FakeChatTokenizer()) == render_prompt(
        problem, "chat", tokenizer=FakeChatTokenizer()
    )
    assert chat.label == "chat" and PromptTemplate.resolve("dapo", chat=True).label == "dapo+chat"


def test_format_strings_take_dotted_fields_and_literal_braces():
    t = PromptTemplate.resolve("{source.name} asks {{sic}}: {prompt} [{tags.0}]")
    assert t.render("x?", {"source": {"name": "Ann"}, "tags": ["hard"]}) == "Ann asks {sic}: x? [hard]"
    assert PromptTemplate.resolve("dapo").render("Find x.") == DAPO_PREFIX + "Find x." + DAPO_SUFFIX
    with pytest.raises(KeyError):
        t.render("x?", {"source": {}})
    for bad, match in [
        ("{prompt", "not a valid format string"),
        ("{} {prompt}", "must name a field"),
        ("fancy", "valid templates: raw, base, instruct, dapo, chat"),
    ]:
        with pytest.raises(ConfigError, match=match):
            PromptTemplate.resolve(bad)


def test_system_prompt_and_chat_kwargs_need_a_chat_template():
    with pytest.raises(ConfigError, match="task.system_prompt needs a chat template"):
        PromptTemplate.resolve("raw", system_prompt="Be brief.")
    with pytest.raises(ConfigError, match="chat_template_kwargs needs a chat template"):
        PromptTemplate.resolve("raw", chat_kwargs={"enable_thinking": False})
    t = PromptTemplate.resolve("raw", system_prompt="Be brief.", chat=True, chat_kwargs={"enable_thinking": False})
    assert t.render("2+2?", tokenizer=FakeChatTokenizer()) == (
        "<|system|>Be brief.<|end|><|user|>2+2?<|end|><|assistant|><think></think>"
    )
    no_template = FakeChatTokenizer()
    no_template.chat_template = None
    with pytest.raises(ConfigError, match="no chat template"):
        t.check(no_template)


def test_template_with_system_prompt_gives_exactly_these_token_ids(tmp_path, datasets_cache):
    tok = char_tokenizer_with_chat_template()
    data = write_jsonl(tmp_path / "d.jsonl", [{"q": "1+1=", "a": "2"}, {"q": "11+1=", "a": "12"}])
    with get_task(
        "dataset",
        source=str(data),
        prompt_key="q",
        answer_key="a",
        n_test=1,
        template="Q:{prompt}",
        system_prompt="S",
        chat=True,
        tokenizer=tok,
        reward="exact-match",
        seed=0,
    ) as task:
        (ex,) = [
            e for e in task.test_examples() + task.train_examples(1, __import__("random").Random(0)) if e.answer == "2"
        ]
        assert ex.prompt == "[s]S[u]Q:1+1=[a]"
        # ids: <pad> <eos> <unk>, then the sorted alphabet + 1 : = Q S [ ] a s u
        ids = [9, 12, 10, 8, 9, 13, 10, 7, 5, 4, 3, 4, 6, 9, 11, 10]
        assert tok(ex.prompt, add_special_tokens=False)["input_ids"] == ids
        # what training and eval feed the model: already rendered, so never wrapped a second time
        assert encode_prompt(tok, ex.prompt, wraps_chat(task, chat_template=True)) == ids
