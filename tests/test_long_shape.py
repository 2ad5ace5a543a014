"""The long-response benchmark task, the long shape's length processor and the roofline's FLOP count."""

import importlib
import math
import random
import sys
from pathlib import Path

import pytest
import torch

from masktrl.config import load_config
from masktrl.errors import ConfigError
from masktrl.tasks import make_task
from masktrl.tasks.longtail import LongTailTask, expected_completion, target_length

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def test_longtail_shapes_and_scoring():
    task = make_task(load_config(None, ["task.name=longtail", "task.n_test=8"]).task, load_config(None, []).model)
    ex = task.train_examples(3000, random.Random(0))
    lengths = [target_length(e.prompt) for e in ex]
    prompts = [len(e.prompt) for e in ex]
    assert min(prompts) >= 64 and max(prompts) <= 256
    assert min(lengths) == 32 and max(lengths) == 512  # clipped at both ends
    assert 110 < sorted(lengths)[len(lengths) // 2] < 150  # median ~128
    assert sorted(lengths)[int(0.9 * len(lengths))] > 2 * 128  # heavy tail: p90 > 2 x median
    e = ex[0]
    assert len(e.answer) == target_length(e.prompt) - 1 and e.answer == expected_completion(e.prompt)
    assert task.score(e, e.answer) == 1.0 and task.score(e, e.answer[:-1]) == 0.0 and task.score(e, None) == 0.0
    test_ids = {x.prompt for x in task.test_examples()}
    assert len(test_ids) == 8 and not test_ids & {x.prompt for x in ex}
    assert set("".join(x.prompt for x in ex[:50])) <= set(task.alphabet())
    assert [x.id for x in task.test_examples()] == [x.id for x in LongTailTask(n_test=8).test_examples()]  # stable ids


@pytest.mark.parametrize("bad", [{"prompt_min": 2}, {"response_max": 1}, {"length_sigma": -1}, {"length_median": 0}])
def test_longtail_bad_options(bad):
    with pytest.raises(ConfigError, match="longtail"):
        LongTailTask(**bad)


@pytest.fixture
def bench(tmp_path, monkeypatch):
    monkeypatch.setenv("MASKTRL_BENCH_OUT", str(tmp_path))
    monkeypatch.syspath_prepend(str(BENCH))
    for name in ("common", "long_shape", "roofline"):
        sys.modules.pop(name, None)
    return importlib.import_module("long_shape"), importlib.import_module("roofline")


@pytest.mark.parametrize("drop_finished", [False, True])
def test_target_length_processor_makes_every_response_its_length(bench, monkeypatch, drop_finished):
    long_shape, _ = bench
    from masktrl.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model
    from masktrl.rollout.base import SamplingSettings
    from masktrl.rollout.hf import HFEngine
    from masktrl.tasks.longtail import ALPHABET

    tok = build_char_tokenizer(ALPHABET)
    model = build_tiny_model(
        tok, TinyModelConfig(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32), 0
    ).eval()
    prompts = ["abcdefgh|8=", "xyz|6=", "qwertyuiopasdf|12="]
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    monkeypatch.setattr(long_shape, "MAX_NEW_TOKENS", 20)
    row_length = long_shape.row_length
    monkeypatch.setattr(long_shape, "row_length", lambda L, a, b: row_length(L, a, b, low=3, high=20))
    with long_shape.follow_target_lengths(tok):
        gens = HFEngine(model, tok, drop_finished=drop_finished).generate(
            ids, SamplingSettings(n=4, max_new_tokens=20, logprobs_k=3), seed=0
        )
    lengths = []
    for p, group in zip(prompts, gens):
        for g in group:
            want = row_length(target_length(p), g.response_ids[0], g.response_ids[1], low=3, high=20)
            assert len(g.response_ids) == want and g.finished
            assert g.response_ids[-1] == tok.eos_token_id and tok.eos_token_id not in g.response_ids[:-1]
            lengths.append(len(g.response_ids))
    assert len(set(lengths)) > 3  # ragged, also within groups
    plain = HFEngine(model, tok).generate(ids, SamplingSettings(n=4, max_new_tokens=20, logprobs_k=3), seed=0)
    assert (
        any(g.response_ids[-1] != tok.eos_token_id or len(g.response_ids) < 3 for grp in plain for g in grp)
        or [len(g.response_ids) for grp in plain for g in grp] != lengths
    )  # restored


def test_roofline_flops_by_hand(bench):
    _, roofline = bench
    from masktrl.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer("ab")
    model = build_tiny_model(
        tok, TinyModelConfig(hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=16), 0
    )
    total, n, head = roofline.param_counts(model)
    v, h = model.config.vocab_size, 8
    assert head == v * h and total - n == 2 * v * h
    per_layer = 8 * 8 + 2 * 8 * 4 + 8 * 8 + 3 * 8 * 16 + 2 * 8 + 2 * 4  # q, k+v, o, mlp, 2 norms, q/k norms
    assert n == 2 * per_layer + 8  # + the final norm
    dims = {"hidden_size": 8, "num_heads": 2}
    # two sequences of 3 and 1 tokens, 2 response tokens: 6N per token, 6VH per response token,
    # attention 2 layers x d_q 8 x (6 + 1 causal pairs) x 2 matmuls x 2 FLOP x 3 (fwd + bwd)
    want = 6 * n * 4 + 6 * v * h * 2 + 2 * 8 * 7 * 2 * 2 * 3
    assert math.isclose(roofline.train_flops(model, dims, [3, 1], 2), want)
    spread = [bench[0].row_length(128, a, b) for a in range(41) for b in range(41)]
    assert min(spread) == 32 and 100 < sorted(spread)[len(spread) // 2] < 160 and max(spread) > 300
    assert (
        roofline.matmul_peak(torch.device("cpu"), 64, reps=1) > 0
        and roofline.bandwidth(torch.device("cpu"), 1, reps=1) > 0
    )


def test_roofline_generation_rows_count_the_finished_rows_and_bound_by_hand(bench):
    """The generation table's variants on ragged responses: ``generate`` spends row-steps on
    rows that have ended, ``rollout.drop_finished`` none; the bandwidth bound is the bytes the
    responses need, by hand."""
    from types import SimpleNamespace

    from masktrl.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model
    from masktrl.rollout.base import Generation, Sample

    _, roofline = bench
    tok = build_char_tokenizer("0123456789+=")
    model = build_tiny_model(tok, TinyModelConfig(hidden_size=64, intermediate_size=128), seed=2).eval()
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id] *= 2.0  # some responses end after a few tokens
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in ("12+3=", "345+67=")]
    samples = [
        Sample("x", "", "", p, g, Generation([], [], [], [], True)) for g, p in enumerate(prompts) for _ in range(4)
    ]
    cfg = SimpleNamespace(rollout=SimpleNamespace(max_new_tokens=12))
    rows = roofline.measure_generation("tiny", model, tok, samples, cfg, torch.device("cpu"), bw=1e9, peak=1e10, reps=2)
    gen, drop, fused = rows[:3]
    assert (gen["variant"], drop["variant"]) == ("generate", "drop_finished") and gen["rows"] == 8
    assert gen["row_steps_wasted"] > 0.1 and drop["row_steps_wasted"] == 0.0
    assert fused["variant"] == "fused" and fused["batches"] == gen["batches"]  # bit-identical samples
    assert fused["row_steps_wasted"] == gen["row_steps_wasted"]
    lengths = gen["batches"][0]["lengths"]
    c = model.config
    kv_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4
    total = sum(p.numel() for p in model.parameters())
    positions = sum(len(prompts[i // 4]) * L + L * (L - 1) // 2 for i, L in enumerate(lengths))
    bw_time, _ = roofline.generation_bounds(model, prompts, 4, lengths, 1e9, 1e10)
    assert math.isclose(bw_time, (max(lengths) * total * 4 + positions * kv_token) / 1e9)
