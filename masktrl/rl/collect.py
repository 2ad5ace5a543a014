"""One step's rollout batch: prompts -> rollout (the engine samples G responses per prompt) ->
reward (the task's scorer, then the method's shaping) -> group advantages.

This module is the one place a sample gets its reward (``score_groups``, ``shape_rewards``),
its advantage (``set_advantages``) and its group number (``numbered``); the engines create
samples, everything after reads them. (A reference KL in the reward changes rewards and
advantages once more, just before the update: ``rl/reference.py``'s ``penalise_kl``.)

With dynamic sampling (DAPO) groups whose rewards are all equal carry no signal: they are
dropped and more prompts are drawn (up to ``MAX_REFILLS`` attempts) to refill the batch. Under
several processes each generates and scores every world-th prompt's group (with its own
sampling seed), then the groups are gathered in prompt order, so every process holds the same
batch.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import NamedTuple

from masktrl.config import Config, RolloutConfig
from masktrl.errors import MasktrlError
from masktrl.methods import BoundMethod, group_advantages
from masktrl.rl.distributed import Dist
from masktrl.rl.reference import response_lengths
from masktrl.rl.sampling import grade, sample
from masktrl.rollout.base import ENVIRONMENT, Sample, SamplingSettings
from masktrl.seeding import stream_seed
from masktrl.tasks.rewards import check_reward_errors

MAX_REFILLS = 4  # dynamic sampling: rollout attempts per step before training on what was kept


class Batch(NamedTuple):
    """A step's samples (with rewards and advantages, numbered by group) and their statistics."""

    samples: list[Sample]
    stats: dict


@dataclass(frozen=True)
class CollectSettings:
    """What collecting a batch reads from the config."""

    sampling: SamplingSettings
    prompts_per_step: int
    seed: int  # the run's seed: prompts and sampling are drawn from streams named by it
    chat_template: bool

    @classmethod
    def from_config(cls, cfg: Config) -> CollectSettings:
        return cls(sampling_settings(cfg.rollout), cfg.rollout.prompts_per_step, cfg.seed, cfg.model.chat_template)


def sampling_settings(rollout_cfg: RolloutConfig) -> SamplingSettings:
    r = rollout_cfg
    return SamplingSettings(r.n, r.max_new_tokens, r.temperature, r.top_p, r.logprobs_k, top_k=r.top_k)


def collect_rollouts(
    engine, tokenizer, task, method: BoundMethod, settings: CollectSettings, step: int, dist: Dist | None = None
) -> Batch:
    """``prompts_per_step`` groups with rewards and advantages (samples numbered by group), and
    the step's rollout statistics; ``method``: the run's method bound to its params (reward
    shaping, dynamic sampling, advantages)."""
    dist = dist or Dist()
    want, max_len = settings.prompts_per_step, settings.sampling.max_new_tokens
    dynamic = method.dynamic_sampling
    kept, generated = [], []
    errors_before = getattr(task, "reward_errors", 0)
    if hasattr(engine, "take_stats"):  # task.env: the step's counts start here (a held-out eval's are not the step's)
        engine.take_stats()
    for attempt in range(MAX_REFILLS if dynamic else 1):
        rng = random.Random(stream_seed(settings.seed, "prompts", step, attempt))
        examples = task.train_examples(want, rng)[dist.rank :: dist.world]
        seed = stream_seed(settings.seed, "rollout", step, attempt, *dist.stream_key)
        groups = (
            generate_groups(engine, tokenizer, examples, settings.sampling, seed, settings.chat_template)
            if examples
            else []
        )
        score_groups(task, examples, groups)  # reward: the task's score, then the method's shaping
        shape_rewards(groups, method, max_len)
        set_advantages(groups, method)  # within each group, where it was generated
        groups = _interleave(dist.gather_objects(groups))
        generated.extend(groups)
        kept.extend(g for g in groups if not (dynamic and _uniform(g)))
        if len(kept) >= want:
            break
    kept = kept[:want]
    # completions the reward failed on (scored 0), summed over the processes: same number of attempts on each
    reward_errors = sum(dist.gather_objects(getattr(task, "reward_errors", 0) - errors_before))
    stats = {**rollout_stats(generated, len(kept)), "reward_errors": reward_errors}
    if hasattr(engine, "take_stats"):  # task.env: the environment's calls and failures (rl/agentic.py)
        stats.update(engine.take_stats())
    return Batch(numbered(kept), stats)


def generate_groups(
    engine, tokenizer, examples, settings: SamplingSettings, seed: int, chat_template=False
) -> list[list[Sample]]:
    """``settings.n`` samples per example, one list per example (a GRPO group), not yet scored."""
    prompt_ids, gens, texts = sample(engine, tokenizer, examples, settings, seed, chat_template)
    return [
        [Sample(ex.id, ex.prompt, ex.answer, ids, g, gen, text=text) for gen, text in zip(outs, group_texts)]
        for g, (ex, ids, outs, group_texts) in enumerate(zip(examples, prompt_ids, gens, texts))
    ]


def score_groups(task, examples, groups: list[list[Sample]]) -> None:
    """Each sample's reward (and ``extra["score"]``) is the task's score of its text (``grade``:
    one batched call)."""
    scores = grade(task, examples, [[s.text for s in group] for group in groups])
    for group, group_scores in zip(groups, scores):
        for s, score in zip(group, group_scores):
            s.reward = score
            s.extra["score"] = score


def shape_rewards(groups: list[list[Sample]], method: BoundMethod, max_len: int) -> None:
    """The method's reward shaping (DAPO's overlong penalty: ``method.reward_delta``) added to
    each sample's reward; nothing for methods without it."""
    buffer, _ = method.overlong
    if buffer <= 0:
        return
    for group in groups:
        for s in group:
            s.reward = s.reward + method.reward_delta(len(s.gen.response_ids), max_len)


def numbered(groups: list[list[Sample]]) -> list[Sample]:
    """The samples of ``groups`` in order, each carrying its group's index in the batch."""
    for g, group in enumerate(groups):
        for s in group:
            s.group = g
    return [s for group in groups for s in group]


def set_advantages(groups: list[list[Sample]], method: BoundMethod | None = None) -> None:
    """Each sample's advantage from the rewards of its group (samples carry their group's id):
    ``method.advantages`` (with the method's ``adv_norm``), or GRPO's group normalisation
    (``methods.group_advantages``) without a method."""
    flat = [s for group in groups for s in group]
    if not flat:
        return
    rewards, ids = [s.reward for s in flat], [s.group for s in flat]
    lengths = response_lengths(flat)  # the batch weights of reinforce++ (docs/METHODS.md §13.4)
    try:
        adv = method.advantages(rewards, ids, lengths) if method else group_advantages(rewards, ids)  # [B]
    except ValueError as exc:  # advantages no float can hold (rewards ~1e308 apart): the step stops, nothing stored
        raise MasktrlError(str(exc)) from None
    for s, a in zip(flat, adv.tolist()):
        s.advantage = a


def reward_failures(task, batch: Batch, step: int, n: int, max_frac: float) -> str | None:
    """``tasks.rewards.check_reward_errors`` on a collected batch: None, a warning line (more than
    10% of the step's completions failed their reward), or ConfigError past ``max_frac``
    (``task.max_reward_error_frac``), before the batch is stored."""
    scored = batch.stats["groups_generated"] * n
    last = getattr(getattr(task, "reward", None), "last_error", None)
    return check_reward_errors(step, batch.stats.get("reward_errors", 0), scored, max_frac, last)


def rollout_stats(groups: list[list[Sample]], kept: int) -> dict:
    """A step's rollout statistics (a metrics row's first columns)."""
    samples = [s for g in groups for s in g]
    return {
        "reward_mean": sum(s.extra.get("score", s.reward) for s in samples) / len(samples),
        "response_len_mean": sum(len(s.gen.response_ids) for s in samples) / len(samples),
        "tokens": sum(len(s.gen.response_ids) for s in samples),
        "groups_kept": kept,
        "groups_generated": len(groups),
        **episode_stats([s.gen for s in samples]),
    }


def episode_stats(gens) -> dict:
    """Multi-turn batches (``task.env``): ``turns_per_episode`` (policy turns, mean),
    ``calls_per_episode`` (tool calls answered, mean) and ``tool_call_rate`` (the fraction of
    episodes with one); nothing for single-turn ones (their metrics rows are unchanged)."""
    multi = [g for g in gens if g.source is not None]
    if not multi:
        return {}
    calls = [len({t for t, s in zip(g.turn, g.source) if s == ENVIRONMENT}) for g in multi]
    turns = [len(set(g.turn)) for g in multi]  # every turn starts with the policy's tokens
    return {
        "turns_per_episode": sum(turns) / len(multi),
        "calls_per_episode": sum(calls) / len(multi),
        "tool_call_rate": sum(c > 0 for c in calls) / len(multi),
    }


def _uniform(group: list[Sample]) -> bool:
    return len({s.reward for s in group}) == 1


def _interleave(per_rank: list[list]) -> list:
    """Rank r holds items r, r + W, r + 2W, ...: put them back in one list in that order."""
    return [x[j] for j in range(max(map(len, per_rank))) for x in per_rank if j < len(x)]
