"""Prompts are rendered once: a MathTask's chat-rendered prompt is tokenized as it is (never
wrapped twice), synthetic prompts are still wrapped by encode_prompt, and `masktrl eval`
feeds the engine exactly the template's text."""

import json
import string

import pytest

import masktrl.recipes.eval as ev
from masktrl.config import load_config
from masktrl.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model
from masktrl.rollout.base import Generation
from masktrl.tasks import make_task
from masktrl.tasks.base import Example
from masktrl.tasks.math_data import MathTask
from masktrl.tasks.prompts import encode_prompt, instruct_prompt, is_chat_rendered

CHAT = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture
def chat_tokenizer():
    tok = build_char_tokenizer(string.printable)
    tok.chat_template = CHAT
    return tok


def test_chat_rendered_prompt_is_not_wrapped_twice(chat_tokenizer):
    tok = chat_tokenizer
    task = MathTask([Example("a/1", "What is 1+1?", "2", {"problem": "What is 1+1?"})], template="chat", tokenizer=tok)
    prompt = task.test_examples()[0].prompt
    assert prompt == f"<|user|>{instruct_prompt('What is 1+1?')}\n<|assistant|>" and is_chat_rendered(tok, prompt)
    once = tok.apply_chat_template(
        [{"role": "user", "content": instruct_prompt("What is 1+1?")}], add_generation_prompt=True, tokenize=True
    )
    once = once["input_ids"] if hasattr(once, "keys") else once  # a BatchEncoding in transformers 5
    assert encode_prompt(tok, prompt, True) == list(once) == encode_prompt(tok, prompt, False)
    # the arithmetic path is unchanged: a raw prompt is wrapped when chat_template is on
    assert tok.decode(encode_prompt(tok, "1+2=", True)) == "<|user|>1+2=\n<|assistant|>"
    assert tok.decode(encode_prompt(tok, "1+2=", False)) == "1+2="


def test_make_task_renders_math_prompts_with_the_policy_chat_template(chat_tokenizer, tmp_path):
    data = tmp_path / "mini.jsonl"
    data.write_text('{"problem": "1+1", "answer": "2"}\n')
    cfg = load_config(None, [f"task.data={data}", "task.name=gsm8k", "model.chat_template=true"])
    with make_task(cfg.task, cfg.model, tokenizer=chat_tokenizer) as task:
        assert task.test_examples()[0].prompt.startswith("<|user|>1+1")
    cfg = load_config(None, [f"task.data={data}", "task.name=gsm8k"])
    with make_task(cfg.task, cfg.model) as task:
        assert task.test_examples()[0].prompt.startswith("Problem: 1+1")


def test_eval_with_chat_template_sends_the_rendered_text_once(chat_tokenizer, tmp_path, monkeypatch):
    model_dir = tmp_path / "chat-model"
    model = build_tiny_model(chat_tokenizer, TinyModelConfig(32, 1, 2, 1, 64, max_positions=256), seed=0)
    model.save_pretrained(model_dir)
    chat_tokenizer.save_pretrained(model_dir)
    data = tmp_path / "mini.jsonl"
    data.write_text('{"problem": "1+1", "answer": "2"}\n')
    seen = []

    def fake_generate(self, prompts, settings, seed):
        seen.extend(self.tokenizer.decode(p) for p in prompts)
        resp = self.tokenizer("\\boxed{2}", add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        return [
            [Generation(resp, [0.0] * len(resp), [[t] for t in resp], [[0.0]] * len(resp), True)] * settings.n
            for _ in prompts
        ]

    monkeypatch.setattr("masktrl.rollout.hf.HFEngine.generate", fake_generate)
    result = ev.run("gsm8k", str(model_dir), None, ev.EvalOptions(k=2, data=str(data), template="chat"))
    assert seen == [f"<|user|>{instruct_prompt('1+1')}\n<|assistant|>"]
    report = json.loads(result.path.read_text())
    assert report["avg_at_k"] == 1.0 and report["generation"]["template"] == "chat"
