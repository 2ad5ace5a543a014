"""The embedded model and tokenizer: exact text round-trip, save/load through Auto classes."""

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from masktrl.models.tiny import EOS, TinyModelConfig, build_char_tokenizer, build_tiny_model

ALPHABET = "0123456789+-*= \n\\boxed{}"


def test_char_tokenizer_round_trips_exactly(tmp_path):
    tok = build_char_tokenizer(ALPHABET)
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    for text in ["123+456=", "  12 +  3 =\n\\boxed{15}", "", "9*9=81", " 7 "]:
        ids = loaded(text, add_special_tokens=False)["input_ids"]
        assert len(ids) == len(text)  # one token per character, spaces included
        assert loaded.decode(ids) == text
    eos = loaded.convert_tokens_to_ids(EOS)
    assert loaded.eos_token_id == eos
    assert loaded.decode(loaded("42", add_special_tokens=False)["input_ids"] + [eos], skip_special_tokens=True) == "42"


def test_tiny_model_saves_and_loads_identically(tmp_path):
    tok = build_char_tokenizer(ALPHABET)
    model = build_tiny_model(tok, TinyModelConfig(), seed=3)
    assert model.config.model_type == "qwen3"
    assert not model.config.tie_word_embeddings
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    x = torch.tensor([[3, 4, 5, 6]])
    torch.testing.assert_close(model(x).logits, loaded(x).logits, rtol=0, atol=0)
    # the seed decides the init
    other = build_tiny_model(tok, TinyModelConfig(), seed=4)
    assert not torch.equal(other.lm_head.weight, model.lm_head.weight)
