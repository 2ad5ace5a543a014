"""Held-out accuracy of a policy on its training task (eval_before / eval_after)."""

from __future__ import annotations

from dataclasses import replace

from masktrl.pipeline.tasks import encode_prompt
from masktrl.rollout.base import SamplingSettings


def heldout_accuracy(engine, tokenizer, task, examples, settings: SamplingSettings, greedy: bool, chat_template=False, seed=0) -> float:
    """Fraction of ``examples`` answered correctly with one completion each (greedy or sampled)."""
    one = replace(settings, n=1, greedy=greedy)
    prompts = [encode_prompt(tokenizer, ex.prompt, chat_template) for ex in examples]
    gens = engine.generate(prompts, one, seed)
    texts = [tokenizer.decode(gen.response_ids, skip_special_tokens=True) for (gen,) in gens]
    scores = task.score_many(examples, texts)
    return sum(x > 0 for x in scores) / max(1, len(examples))
