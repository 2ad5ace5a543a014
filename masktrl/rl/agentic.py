"""The run's engine with multi-turn, tool-using episodes (``task.env``; docs/TASKS.md,
"Environments"): ``with_environment`` wraps the engine, and ``rl.sampling.sample`` asks it for
episodes (``generate_episodes``) instead of single responses. Everything else (weight syncs,
the low-precision copy, the mismatch measurement) reaches the wrapped engine unchanged."""

from __future__ import annotations

from dataclasses import replace

from masktrl.config import TaskConfig
from masktrl.rollout.base import Generation, SamplingSettings
from masktrl.rollout.multiturn import generate_multi_turn
from masktrl.tasks.envs import EnvStats, Episode, env_stop, load_env

DEFAULT_MAX_TURNS = 4
DEFAULT_TIMEOUT_S = 10.0


def env_settings(task_cfg: TaskConfig) -> tuple[type, str, int, float]:
    """(the environment class, the call's stop string, max_turns, the call timeout) of a
    ``task.env`` config; ConfigError when the class does not load or no stop string is known."""
    env_cls = load_env(task_cfg.env)
    stop = env_stop(env_cls, task_cfg.call_stop, task_cfg.env)
    return env_cls, stop, task_cfg.max_turns or DEFAULT_MAX_TURNS, task_cfg.env_timeout_s or DEFAULT_TIMEOUT_S


class EnvEngine:
    """``engine`` running each response as an episode of ``task_cfg.env``."""

    def __init__(self, engine, tokenizer, task_cfg: TaskConfig):
        self.inner, self.tokenizer = engine, tokenizer
        self.env_cls, self.stop, self.max_turns, self.timeout_s = env_settings(task_cfg)
        self.max_total_tokens = task_cfg.max_total_tokens
        self.stats = EnvStats()

    def __getattr__(self, name):  # name, copy, policy, model, batch_size, ...: the wrapped engine's
        return getattr(self.inner, name)

    def sync_weights(self, model) -> None:
        self.inner.sync_weights(model)

    def generate(self, prompts, settings: SamplingSettings, seed: int) -> list[list[Generation]]:
        """Single responses (no environment): what a caller without examples gets."""
        return self.inner.generate(prompts, settings, seed)

    def generate_episodes(
        self, prompts: list[list[int]], examples, settings: SamplingSettings, seed: int
    ) -> list[list[Generation]]:
        """``settings.n`` episodes per prompt; ``examples``: the prompts' ``Example`` s (the
        environment is reset with the row: prompt, answer and the row's fields)."""
        rows = [{**(ex.meta.get("fields") or {}), "prompt": ex.prompt, "answer": ex.answer} for ex in examples]
        max_tokens = self.max_total_tokens or self.max_turns * settings.max_new_tokens
        return generate_multi_turn(
            self.inner,
            self.tokenizer,
            prompts,
            rows,
            replace(settings),
            seed,
            lambda: Episode(self.env_cls, self.stats, self.timeout_s),
            stop=self.stop,
            max_turns=self.max_turns,
            max_tokens=max_tokens,
        )

    def take_stats(self) -> dict:
        """``env_calls``, ``env_errors``, ``env_timeouts``, ``env_truncated`` since the last call (a metrics row's)."""
        return self.stats.take()


def with_environment(engine, tokenizer, task_cfg: TaskConfig):
    """``engine`` itself for a single-turn task, else an ``EnvEngine`` around it."""
    return engine if task_cfg.env is None else EnvEngine(engine, tokenizer, task_cfg)
