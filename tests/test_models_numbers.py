"""The number tokenizer and the structured initialisation of number-token embeddings."""

import math

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from masktrl.models.numbers import (
    BAND,
    MODULI,
    NUMBER_TOKENS,
    build_number_tokenizer,
    init_number_embeddings,
    number_features,
    number_token_ids,
)
from masktrl.models.tiny import EOS, TinyModelConfig, build_tiny_model


def test_vocabulary_has_one_token_per_integer_and_round_trips(tmp_path):
    tok = build_number_tokenizer()
    assert len(tok) == NUMBER_TOKENS + 4 >= 1000  # pad, eos, unk, "=", 0..1999
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    for text in ["12 40 3 1 =", "0 1999", "7", ""]:
        ids = loaded(text, add_special_tokens=False)["input_ids"]
        assert len(ids) == len(text.split())  # one token per number
        assert loaded.decode(ids) == text
    assert (
        loaded(" 5   17\n", add_special_tokens=False)["input_ids"]
        == loaded("5 17", add_special_tokens=False)["input_ids"]
    )
    eos = loaded.convert_tokens_to_ids(EOS)
    assert loaded.eos_token_id == eos and loaded.pad_token_id is not None
    assert (
        loaded.decode(loaded("3 9", add_special_tokens=False)["input_ids"] + [eos], skip_special_tokens=True) == "3 9"
    )
    unk = loaded.unk_token_id
    assert loaded("2000 07 -1 x", add_special_tokens=False)["input_ids"] == [unk] * 4  # no token outside 0..1999


def test_number_token_ids_map_values():
    tok = build_number_tokenizer(50)
    ids, values = number_token_ids(tok)
    assert values.tolist() == list(range(50))
    assert [tok.convert_ids_to_tokens(i) for i in ids[:3].tolist()] == ["0", "1", "2"]


def test_number_features_by_hand():
    values = torch.arange(2000)
    f = number_features(values, 2000)
    n_residue = 2 * len(MODULI) - 1  # no sin column for m = 2
    assert f.shape == (2000, n_residue + 2000 // BAND + 8)
    assert f.abs().max() <= 1.0 + 1e-12
    # residue columns depend only on x mod m: x and x + m share them
    for col, m in [(0, 2), (1, 3), (3, 4), (n_residue - 2, 9)]:
        assert torch.allclose(f[:-m, col], f[m:, col])
    assert f[7, 1] == math.cos(2 * math.pi * 7 / 3)
    bands = f[:, n_residue : n_residue + 20]
    assert torch.equal(bands.argmax(1), values // BAND) and torch.equal(bands.sum(1), torch.ones(2000, dtype=f.dtype))
    # the (cos, sin) pair of modulus m = 5 (columns 5, 6) tells residue classes apart
    pair = f[:, 5:7]
    same = torch.cdist(pair, pair) < 1e-6  # [2000, 2000]; other classes are >= 1.17 apart
    assert torch.equal(same, (values[:, None] - values[None, :]) % 5 == 0)


def test_init_writes_features_into_both_embeddings_and_leaves_the_rest():
    tok = build_number_tokenizer()
    model = build_tiny_model(
        tok, TinyModelConfig(hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64), seed=0
    )
    before_in = model.get_input_embeddings().weight.clone()
    before_out = model.get_output_embeddings().weight.clone()
    n_feat = init_number_embeddings(model, tok)
    ids, values = number_token_ids(tok)
    feats = number_features(values, NUMBER_TOKENS).float()
    for w, before in (
        (model.get_input_embeddings().weight, before_in),
        (model.get_output_embeddings().weight, before_out),
    ):
        assert torch.equal(w[ids, :n_feat], feats)
        assert torch.equal(w[ids, n_feat:], before[ids, n_feat:])  # other columns untouched
        assert torch.equal(w[:4], before[:4])  # specials and "=" untouched


def test_structured_model_saves_and_loads_identically(tmp_path):
    tok = build_number_tokenizer()
    model = build_tiny_model(
        tok, TinyModelConfig(hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64), seed=0
    )
    init_number_embeddings(model, tok)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    x = torch.tensor([[10, 500, 7, 5, 3]])
    torch.testing.assert_close(model(x).logits, loaded(x).logits, rtol=0, atol=0)
    assert loaded.config.vocab_size == 2004
