"""Group-normalised advantages as a step's batch gets them, and the per-purpose random streams, by hand."""

import math
import os
import subprocess
import sys

from masktrl.methods import get_method, make_params
from masktrl.rl.collect import set_advantages
from masktrl.rollout.base import Generation, Sample
from masktrl.seeding import stream_seed


def _group(rewards):
    gen = Generation([1], [-0.5], [[1]], [[-0.5]], True)
    return [Sample("e", "p", "a", [0], 0, gen, reward=r) for r in rewards]


def test_group_advantages_by_hand():
    g = _group([1.0, 0.0, 0.0, 1.0])
    set_advantages([g])
    std = math.sqrt(((0.5**2) * 4) / 3)  # unbiased std of [1, 0, 0, 1]
    want = [0.5 / (std + 1e-6), -0.5 / (std + 1e-6), -0.5 / (std + 1e-6), 0.5 / (std + 1e-6)]
    assert all(abs(s.advantage - w) < 1e-12 for s, w in zip(g, want))


def test_equal_rewards_give_zero_advantage():
    g = _group([1.0, 1.0, 1.0])
    set_advantages([g])
    assert [s.advantage for s in g] == [0.0, 0.0, 0.0]


KNOWN_STREAMS = {  # resume, replays and the processes of a launch all rely on these exact values
    (0, "rollout", 3, 0): 3339349149211750549,
    (0, "rollout", 4, 0): 2965434345700390563,
    (1, "rollout", 3, 0): 6211495403011991807,
    (0, "sis", 3, 0): 264868131719246759,
}


def test_streams_are_fixed_values_in_every_process():
    assert {key: stream_seed(*key) for key in KNOWN_STREAMS} == KNOWN_STREAMS
    code = f"from masktrl.seeding import stream_seed; print([stream_seed(*k) for k in {list(KNOWN_STREAMS)!r}])"
    for hash_seed in ("0", "4242"):  # str hashing is salted per process unless fixed: the streams must not depend on it
        r = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONHASHSEED": hash_seed},
        )
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == str(list(KNOWN_STREAMS.values()))


def test_streams_are_distinct_63_bit_seeds():
    assert len(set(KNOWN_STREAMS.values())) == 4 and all(0 <= s < 2**63 for s in KNOWN_STREAMS.values())


def test_the_method_chooses_the_normalisation():
    g = _group([1.0, 0.0, 0.0, 1.0])
    set_advantages([g], get_method("grpo").bind(make_params("grpo", adv_norm="none")))  # Dr. GRPO: centred only
    assert [s.advantage for s in g] == [0.5, -0.5, -0.5, 0.5]
    h = _group([1.0, 0.0, 0.0, 1.0])
    set_advantages([h], get_method("grpo").bind())
    assert [s.advantage for s in h] == [s.advantage for s in _by_default([1.0, 0.0, 0.0, 1.0])]


def _by_default(rewards):
    g = _group(rewards)
    set_advantages([g])
    return g


# --------------------------------------------------------------------------- dynamic sampling


class _Tokenizer:
    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [1]}

    def decode(self, ids, skip_special_tokens=True):
        return str(ids[0])


class _Engine:
    """Sample j of every group answers "j"."""

    def generate(self, prompt_ids, settings, seed):
        return [[Generation([j], [-0.5], [[j]], [[-0.5]], True) for j in range(settings.n)] for _ in prompt_ids]


class _Task:
    """Prompts numbered in draw order; prompt i carries a signal (sample 0 right, the others
    wrong) if ``signal(i)``, else every sample is right (equal rewards: no signal)."""

    def __init__(self, signal):
        self.signal, self.drawn = signal, 0

    def train_examples(self, n, rng):
        from masktrl.tasks.base import Example

        out = [Example(f"p{self.drawn + i}", "q", "0") for i in range(n)]
        self.drawn += n
        return out

    def score_many(self, examples, completions):
        return [1.0 if not self.signal(int(e.id[1:])) else float(c == "0") for e, c in zip(examples, completions)]


def _collect(task, method="dapo", prompts=4):
    from masktrl.rl.collect import CollectSettings, collect_rollouts
    from masktrl.rollout.base import SamplingSettings

    settings = CollectSettings(SamplingSettings(3, 4, 1.0, 1.0, 1), prompts, 0, False)
    return collect_rollouts(_Engine(), _Tokenizer(), task, get_method(method).bind(), settings, step=1)


def test_dynamic_sampling_refills_the_batch_with_groups_that_carry_a_signal():
    task = _Task(signal=lambda i: i % 2 == 1)  # half the prompts of every draw carry a signal
    samples, stats = _collect(task)
    assert task.drawn == 8 and (stats["groups_generated"], stats["groups_kept"]) == (8, 4)  # one refill
    assert sorted({s.example_id for s in samples}) == ["p1", "p3", "p5", "p7"]
    assert [s.group for s in samples] == [g for g in range(4) for _ in range(3)]  # renumbered 0..3
    for g in range(4):
        assert [s.reward for s in samples if s.group == g] == [1.0, 0.0, 0.0]
    assert stats["reward_mean"] == (4 * 3 + 4 * 1) / 24  # over every generated response, dropped groups too


def test_dynamic_sampling_stops_after_max_refills_and_trains_on_what_it_kept():
    from masktrl.rl.collect import MAX_REFILLS

    task = _Task(signal=lambda i: i == 5)
    samples, stats = _collect(task)
    assert task.drawn == 4 * MAX_REFILLS and (stats["groups_generated"], stats["groups_kept"]) == (4 * MAX_REFILLS, 1)
    assert {s.example_id for s in samples} == {"p5"} and {s.group for s in samples} == {0}


def test_no_group_kept_gives_an_empty_batch():
    from masktrl.rl.collect import MAX_REFILLS

    samples, stats = _collect(_Task(signal=lambda i: False))
    assert samples == [] and stats["groups_kept"] == 0 and stats["groups_generated"] == 4 * MAX_REFILLS
    assert stats["reward_mean"] == 1.0 and stats["tokens"] == 4 * MAX_REFILLS * 3


def test_without_dynamic_sampling_uniform_groups_are_kept():
    samples, stats = _collect(_Task(signal=lambda i: False), method="grpo")
    assert len(samples) == 12 and (stats["groups_generated"], stats["groups_kept"]) == (4, 4)
    assert all(s.advantage == 0.0 for s in samples)
