"""The warm start's batch (rl/warmstart.py ``_sft_batch``) tokenises every string of a batch in one
tokenizer call: the same tensors as one call per string, for every preset's task (plain,
weighted and multi-turn targets)."""

import random
from pathlib import Path

import pytest
import torch

from masktrl.config import load_config
from masktrl.models.tiny import tiny_tokenizer
from masktrl.rl.warmstart import _sft_batch, target_segments
from masktrl.tasks import make_task

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def per_string_batch(tokenizer, task, examples):
    """The batch as built before: one tokenizer call per prompt and per target segment."""

    def encode(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    rows, label_rows, weight_rows = [], [], []
    for ex in examples:
        p, t, labels, weights = encode(ex.prompt), [], [], []
        for text, trained in target_segments(task, ex):
            ids = encode(text)
            t += ids
            labels += ids if trained else [-100] * len(ids)
            weights += [float(trained)] * len(ids)
        rows.append(p + t + [tokenizer.eos_token_id])
        label_rows.append([-100] * len(p) + labels + [tokenizer.eos_token_id])
        weight_rows.append([0.0] * len(p) + weights + [1.0])
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    attention = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    labels = torch.tensor([r + [-100] * (width - len(r)) for r in label_rows])
    weighted = any(w not in (0.0, 1.0) for row in weight_rows for w in row)
    weights = torch.tensor([r + [0.0] * (width - len(r)) for r in weight_rows]) if weighted else None
    return input_ids, attention, labels, weights


@pytest.mark.parametrize(
    "configs, sets",
    [
        (["tiny.yaml"], []),  # arithmetic, character tokenizer
        (["lab.yaml"], []),  # residues, number tokenizer
        (["lab.yaml", "lab-scratch.yaml"], []),  # residues with a scratchpad
        (["lab.yaml"], ["task.options.scratch_min=4", "task.options.scratch_max=6", "task.options.answer_weight=5"]),
        (["agentic.yaml"], []),  # multi-turn: calls, tool replies (not trained on), answer
    ],
)
def test_one_tokenizer_call_gives_the_per_string_batch(configs, sets):
    cfg = load_config([str(CONFIGS / c) for c in configs], sets)
    task = make_task(cfg.task, cfg.model)
    tok = tiny_tokenizer(cfg.model.tokenizer, task.alphabet())
    for seed, size in ((0, 1), (1, 7), (2, 64)):
        examples = task.train_examples(size, random.Random(seed))
        got, want = _sft_batch(tok, task, examples), per_string_batch(tok, task, examples)
        for g, w in zip(got, want, strict=True):
            assert (g is None and w is None) or (g.dtype == w.dtype and torch.equal(g, w))
    if "answer_weight" in " ".join(sets):
        assert got[3] is not None  # the weighted case is exercised
