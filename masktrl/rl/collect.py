"""One step's rollout batch: prompts -> rollout (the engine samples G responses per prompt) ->
reward (the task's scorer, then the method's shaping) -> group advantages.

With dynamic sampling (DAPO) groups whose rewards are all equal carry no signal: they are
dropped and more prompts are drawn (up to ``MAX_REFILLS`` attempts) to refill the batch. Under
several processes each generates and scores every world-th prompt's group (with its own
sampling seed), then the groups are gathered in prompt order, so every process holds the same
batch.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from masktrl.config import Config, RolloutConfig
from masktrl.methods import group_advantages
from masktrl.rl.distributed import Dist
from masktrl.rollout.base import Sample, SamplingSettings
from masktrl.seeding import stream_seed
from masktrl.tasks import encode_prompt

MAX_REFILLS = 4  # dynamic sampling: rollout attempts per step before training on what was kept


@dataclass(frozen=True)
class CollectSettings:
    """What collecting a batch reads from the config."""

    sampling: SamplingSettings
    prompts_per_step: int
    seed: int  # the run's seed: prompts and sampling are drawn from streams named by it
    chat_template: bool

    @classmethod
    def from_config(cls, cfg: Config) -> "CollectSettings":
        return cls(sampling_settings(cfg.rollout), cfg.rollout.prompts_per_step, cfg.seed, cfg.model.chat_template)


def sampling_settings(rollout_cfg: RolloutConfig) -> SamplingSettings:
    r = rollout_cfg
    return SamplingSettings(r.n, r.max_new_tokens, r.temperature, r.top_p, r.logprobs_k)


def collect_rollouts(engine, tokenizer, task, method, params, settings: CollectSettings, step: int,
                     dist: Dist | None = None) -> tuple[list[Sample], dict]:
    """``prompts_per_step`` groups with rewards and advantages (samples numbered by group), and
    the step's rollout statistics."""
    dist = dist or Dist()
    want, max_len = settings.prompts_per_step, settings.sampling.max_new_tokens
    dynamic = method.dynamic_sampling(params)
    kept, generated = [], []
    errors_before = getattr(task, "reward_errors", 0)
    for attempt in range(MAX_REFILLS if dynamic else 1):
        rng = random.Random(stream_seed(settings.seed, "prompts", step, attempt))
        examples = task.train_examples(want, rng)[dist.rank :: dist.world]
        seed = stream_seed(settings.seed, "rollout", step, attempt, *dist.stream_key)
        groups = generate_groups(engine, tokenizer, examples, settings.sampling, seed, settings.chat_template) if examples else []
        score_groups(task, examples, groups)  # reward: the task's score, then the method's shaping
        for group in groups:
            method.shape_rewards(params, group, max_len)
        set_advantages(groups, method, params)  # within each group, where it was generated
        groups = _interleave(dist.gather_objects(groups))
        generated.extend(groups)
        kept.extend(g for g in groups if not (dynamic and _uniform(g)))
        if len(kept) >= want:
            break
    kept = kept[:want]
    for g, group in enumerate(kept):
        for s in group:
            s.group = g
    # completions the reward failed on (scored 0), summed over the processes: same number of attempts on each
    reward_errors = sum(dist.gather_objects(getattr(task, "reward_errors", 0) - errors_before))
    return [s for g in kept for s in g], {**rollout_stats(generated, len(kept)), "reward_errors": reward_errors}


def generate_groups(engine, tokenizer, examples, settings: SamplingSettings, seed: int, chat_template=False) -> list[list[Sample]]:
    """``settings.n`` samples per example, one list per example (a GRPO group), not yet scored."""
    prompt_ids = [encode_prompt(tokenizer, ex.prompt, chat_template) for ex in examples]
    gens = engine.generate(prompt_ids, settings, seed)
    return [
        [
            Sample(ex.id, ex.prompt, ex.answer, ids, g, gen, text=tokenizer.decode(gen.response_ids, skip_special_tokens=True))
            for gen in outs
        ]
        for g, (ex, ids, outs) in enumerate(zip(examples, prompt_ids, gens))
    ]


def score_groups(task, examples, groups: list[list[Sample]]) -> None:
    """Each sample's reward (and ``extra["score"]``) is the task's score of its text; one batched
    call (math grading runs in a pool)."""
    flat = [s for group in groups for s in group]
    if not flat:
        return
    scores = task.score_many([examples[s.group] for s in flat], [s.text for s in flat])
    for s, score in zip(flat, scores):
        s.reward = score
        s.extra["score"] = score


def set_advantages(groups: list[list[Sample]], method=None, params=None) -> None:
    """Each sample's advantage from the rewards of its group (samples carry their group's id):
    ``method.advantages`` (with the method's ``adv_norm``), or GRPO's group normalisation
    (``methods.group_advantages``) without a method."""
    flat = [s for group in groups for s in group]
    if not flat:
        return
    rewards, ids = [s.reward for s in flat], [s.group for s in flat]
    adv = method.advantages(params, rewards, ids) if method else group_advantages(rewards, ids)  # [B]
    for s, a in zip(flat, adv.tolist()):
        s.advantage = a


def rollout_stats(groups: list[list[Sample]], kept: int) -> dict:
    """A step's rollout statistics (a metrics row's first columns)."""
    samples = [s for g in groups for s in g]
    return {
        "reward_mean": sum(s.extra.get("score", s.reward) for s in samples) / len(samples),
        "response_len_mean": sum(len(s.gen.response_ids) for s in samples) / len(samples),
        "tokens": sum(len(s.gen.response_ids) for s in samples),
        "groups_kept": kept,
        "groups_generated": len(groups),
    }


def _uniform(group: list[Sample]) -> bool:
    return len({s.reward for s in group}) == 1


def _interleave(per_rank: list[list]) -> list:
    """Rank r holds items r, r + W, r + 2W, ...: put them back in one list in that order."""
    return [x[j] for j in range(max(map(len, per_rank))) for x in per_rank if j < len(x)]
