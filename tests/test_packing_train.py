"""The packed forward and the token-budget micro-batches inside the training step
(``train.packing``, ``train.micro_batch_tokens``): same update, runs, errors."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import masktrl.methods  # registers the methods
from masktrl.config import load_config
from masktrl.methods.registry import get_method
from masktrl.rl import update
from masktrl.rl.update import Learner, UpdateSettings, make_optimizer, policy_update
from tests.conftest import TIMING, masktrl, write_tiny_config
from tests.test_packing import make_samples


@pytest.fixture(scope="module")
def model(float64_tiny_model):
    return float64_tiny_model


def _update(model, samples, name, **settings):
    m = copy.deepcopy(model)
    cfg = load_config(None, ["train.lr=1e-2"])
    opt, sched = make_optimizer(m, cfg.train)
    s = UpdateSettings(
        minibatches=2,
        grad_accum=settings.pop("grad_accum", 1),
        grad_clip=1e9,
        logprob_chunk=7,
        temperature=0.9,
        horizon=20,
        method=get_method(name).bind(),
        **settings,
    )
    stats = policy_update(Learner(m, opt, sched), samples, s, step=1)
    return m, stats


@pytest.mark.parametrize("name", ["grpo", "sis", "gspo"])
def test_packed_budgeted_update_equals_the_padded_one(model, name):
    samples = make_samples(model.config.vocab_size, seed=7, groups=4, per_group=4)
    ref, ref_stats = _update(model, samples, name)
    for settings in ({"packing": True}, {"packing": True, "micro_batch_tokens": 40}, {"micro_batch_tokens": 25}):
        got, stats = _update(model, samples, name, **settings)
        for (k, a), b in zip(ref.named_parameters(), got.parameters()):
            torch.testing.assert_close(b, a, atol=1e-10, rtol=1e-8, msg=f"{settings} {k}")
        assert stats["loss"] == pytest.approx(ref_stats["loss"], abs=1e-10)


def test_a_huge_budget_is_bit_identical_to_one_micro_batch(model):
    samples = make_samples(model.config.vocab_size, seed=8)
    ref, _ = _update(model, samples, "grpo")
    got, _ = _update(model, samples, "grpo", micro_batch_tokens=10**9)
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), got.parameters()))


def test_oversized_sequences_warn_once(model, capsys, monkeypatch):
    monkeypatch.setattr(update, "_WARNED_BUDGETS", set())
    samples = make_samples(model.config.vocab_size, seed=9, lengths=(3, 30))
    _update(model, samples, "grpo", packing=True, micro_batch_tokens=20)
    _update(model, samples, "grpo", packing=True, micro_batch_tokens=20)
    err = [line for line in capsys.readouterr().err.splitlines() if "micro_batch_tokens" in line]
    assert len(err) == 1 and err[0].startswith("warning: train.micro_batch_tokens=20:") and "trained alone" in err[0]


def test_micro_batches_balance_across_processes():
    class TwoRanks:
        rank, world = 0, 2

        def gather_objects(self, x):
            return [x, x + 2]  # the other process needs two more micro-batches

    samples = make_samples(20, seed=10, groups=4, per_group=4)
    out = update._micro_batches(
        samples,
        TwoRanks(),
        UpdateSettings(1, 1, 1.0, 8, 1.0, 20, micro_batch_tokens=10**6, method=get_method("grpo").bind()),
    )
    assert len(out) == 3 and sorted(i for b in out for i in b) == list(range(0, 16, 2))


def test_packed_run_trains_and_records(tmp_path, warm_out):
    cfg = write_tiny_config(tmp_path / "c.yaml", {"train": {"packing": True, "micro_batch_tokens": 60}})
    r = masktrl("train", "--config", cfg, "--out", warm_out, "--run", f"packed-{tmp_path.name}")
    assert r.returncode == 0, r.stderr
    rows = [
        json.loads(line) for line in (warm_out / f"packed-{tmp_path.name}" / "metrics.jsonl").read_text().splitlines()
    ]
    assert len(rows) == 2 and all(row["loss"] == row["loss"] for row in rows)


def test_default_run_is_unchanged_by_a_budget_that_packs_nothing(tmp_path, warm_out):
    """train.micro_batch_tokens large enough for the whole minibatch = one micro-batch in the
    samples' order, as train.grad_accum=1: the run is bit-identical."""
    runs = {}
    for name, overlay in (("plain", {}), ("budget", {"train": {"micro_batch_tokens": 10**6}})):
        cfg = write_tiny_config(tmp_path / f"{name}.yaml", overlay)
        r = masktrl("train", "--config", cfg, "--out", warm_out, "--run", f"{name}-{tmp_path.name}")
        assert r.returncode == 0, r.stderr
        rows = [
            json.loads(line)
            for line in (warm_out / f"{name}-{tmp_path.name}" / "metrics.jsonl").read_text().splitlines()
        ]
        runs[name] = [{k: v for k, v in row.items() if k not in TIMING and not k.endswith("_s")} for row in rows]
    assert runs["plain"] == runs["budget"]


@pytest.mark.parametrize("value", ["0", "-5", "2.5"])
def test_bad_budget_is_one_line(cli_error, tmp_path, value):
    line = cli_error("train", "--out", tmp_path / "out", "--set", f"train.micro_batch_tokens={value}")
    assert "train.micro_batch_tokens" in line
    assert not (tmp_path / "out").exists()


def test_budget_and_grad_accum_conflict(cli_error, tmp_path):
    line = cli_error(
        "train", "--out", tmp_path / "out", "--set", "train.micro_batch_tokens=100", "--set", "train.grad_accum=2"
    )
    assert "set one of them" in line and not (tmp_path / "out").exists()


def test_packing_an_architecture_that_cannot_mask_segments(cli_error, tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from masktrl.models.tiny import build_char_tokenizer

    tok = build_char_tokenizer("0123456789+=")
    config = Qwen3Config(
        vocab_size=len(tok),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        use_sliding_window=True,
        sliding_window=4,
        max_window_layers=1,
        layer_types=["full_attention", "sliding_attention"],
    )
    folder = tmp_path / "slide"
    Qwen3ForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    line = cli_error("train", "--out", tmp_path / "out", "--set", f"model.path={folder}", "--set", "train.packing=true")
    assert line.startswith("error: train.packing:") and "sliding_attention" in line
    assert not (tmp_path / "out").exists()
