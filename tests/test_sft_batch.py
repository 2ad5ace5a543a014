"""The warm start's batch (rl/warmstart.py ``_sft_batch``) tokenises every string of a batch in one
tokenizer call: the same tensors as one call per string, for every preset's task (plain,
weighted and multi-turn targets)."""

import random
from pathlib import Path

import pytest
import torch

from masktrl.config import load_config
from masktrl.models.tiny import tiny_tokenizer
from masktrl.rl.warmstart import _sft_batch
from masktrl.tasks import make_task

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


class PerString:
    """The tokenizer, answering a list of strings with one call per string."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, text, **kwargs):
        if isinstance(text, list):
            return {"input_ids": [self.tokenizer(t, **kwargs)["input_ids"] for t in text]}
        return self.tokenizer(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


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
        got, want = _sft_batch(tok, task, examples), _sft_batch(PerString(tok), task, examples)
        for g, w in zip(got, want, strict=True):
            assert (g is None and w is None) or (g.dtype == w.dtype and torch.equal(g, w))
    if "answer_weight" in " ".join(sets):
        assert got[3] is not None  # the weighted case is exercised
