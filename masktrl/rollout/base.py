"""The rollout engine contract and the records every engine returns.

Engines (transformers ``generate`` on CPU, vLLM on GPU) take token-id prompts and return,
for every generated token, the sampled id, its behaviour log-probability and the
behaviour's top-K ids and log-probabilities of the distribution actually sampled from
(temperature applied, see ``SamplingSettings``). Both engines return identical records,
so the trainer, the store and the analyses never know which engine ran.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from masktrl.config import check_temperature
from masktrl.errors import ConfigError


@dataclass(frozen=True)
class SamplingSettings:
    n: int = 8  # samples per prompt (the GRPO group size G)
    max_new_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0  # 1.0 = no nucleus truncation: recorded logprobs are the full softmax(z/T)
    logprobs_k: int = 20  # K of the recorded behaviour top-K lists
    greedy: bool = False  # argmax decoding (evaluation); temperature and top_p are then ignored
    top_k: int = 0  # 0 = no top-k truncation; k: sample among the k most likely tokens (before top_p)
    # multi-turn tool calls: a turn ends at the first of these strings. vLLM stops there; the hf
    # engine samples the turn's token budget and the caller cuts (rollout/multiturn.stop_cut)
    stop: tuple[str, ...] = ()

    @property
    def truncated(self) -> bool:
        """Whether sampling keeps a subset of the vocabulary (top_p < 1 or top_k > 0): the
        engines then record each token's kept set (``Generation.kept``)."""
        return not self.greedy and (self.top_p < 1.0 or self.top_k > 0)

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_p)  # the engines' last guard: the commands check their flags first


def check_sampling(temperature: float, top_p: float, names: tuple[str, str] = ("temperature", "top_p")) -> None:
    """ConfigError (naming ``names``) unless ``temperature`` is a finite number >= MIN_TEMPERATURE
    and ``top_p`` lies in (0, 1]: an infinite temperature samples uniformly and records nothing an
    engine can reproduce, a NaN one samples nothing, a vanishing one samples NaN."""
    t_name, p_name = names
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise ConfigError(f"{t_name} must be a finite number > 0, got {temperature}")
    check_temperature(t_name, temperature)
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ConfigError(f"{p_name} must be in (0, 1], got {top_p}")


@dataclass
class Generation:
    """One sampled response. Lists are aligned: position t is the t-th generated token."""

    response_ids: list[int]
    logp: list[float]  # log mu(k_t) under the sampling distribution
    topk_ids: list[list[int]]  # [T][K] behaviour top-K ids, descending mu
    topk_logp: list[list[float]]  # [T][K] log mu at topk_ids
    finished: bool  # ended with EOS (False: cut at max_new_tokens)
    kept: list[int] | None = (
        None  # [T] truncated sampling: the kept set is the first kept[t] top-K entries; None: the whole vocabulary
    )
    # Multi-turn rollouts (docs/ROLLOUTS.md, "Multi-turn rollouts"): None for a single-turn response
    # (every token the policy's, turn 0). ``source[t]`` is POLICY (sampled from mu) or ENVIRONMENT
    # (a tool's reply, appended as tokens: no behaviour log-probability, logp[t] = -inf, and no
    # top-K list, its row all padding); ``turn[t]`` the turn the token belongs to (0, 1, ...).
    source: list[int] | None = None
    turn: list[int] | None = None
    # [P+T][L*k] routing replay (model.routing_replay): the engine's top-k experts of every prompt
    # and response position in each MoE layer; None when not recorded
    routing: list[list[int]] | None = None
    # [T] partial rollouts (rollout.partial): the policy version of each token, the optimizer step
    # of the policy that sampled it (0: the starting policy); logp[t] is that policy's. None: not
    # recorded (runs without rollout.partial)
    version: list[int] | None = None


POLICY, ENVIRONMENT = 0, 1  # Generation.source values


def policy_tokens(gen: Generation) -> list[bool]:
    """[T] True at the tokens the policy sampled, False at environment tokens (a tool's reply).

    The one place the source is read: training makes every environment token invalid
    (``rl.policy.behaviour_logp``: behaviour log-probability -inf), so no rule, correction,
    aggregate, statistic or study counts it, and the batch statistics leave it out."""
    if gen.source is None:
        return [True] * len(gen.response_ids)
    return [s == POLICY for s in gen.source]


@dataclass
class Sample:
    """A generation together with the prompt it answers and its reward."""

    example_id: str
    prompt: str
    answer: str
    prompt_ids: list[int]
    group: int  # index of the prompt within its batch; samples of one group share it
    gen: Generation
    text: str = ""
    reward: float = 0.0
    advantage: float = 0.0
    extra: dict = field(default_factory=dict)


_NUMPY_TYPES = {torch.float32: np.float32, torch.float64: np.float64, torch.long: np.int64}


def list_tensor(values: list, dtype: torch.dtype, device=None) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)`` for a list of Python numbers or of
    equal-length lists of them (the records' lists), converted through NumPy, which is about
    three times faster for the long lists of a rollout batch: the same values, each number
    rounded to ``dtype`` once (tests/test_list_tensor.py). Other dtypes go to ``torch.tensor``."""
    np_type = _NUMPY_TYPES.get(dtype)
    if np_type is None:
        return torch.tensor(values, dtype=dtype, device=device)
    with np.errstate(over="ignore"):  # a float past float32's range is inf, as torch makes it, without a warning
        out = torch.from_numpy(np.array(values, dtype=np_type))
    return out if device is None else out.to(device)


def behaviour_lists(samples: list[Sample]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The policy's response tokens of ``samples`` in order (environment tokens left out), as
    tensors: sampled ids [N], behaviour top-K ids [N, K] (padded with -1) and their log mu
    [N, K] float64 (padded with -inf); K is the longest list."""
    gens = [s.gen for s in samples]
    own = [policy_tokens(g) for g in gens]
    ids = [row for g, m in zip(gens, own) for row, p in zip(g.topk_ids, m) if p]
    lps = [row for g, m in zip(gens, own) for row, p in zip(g.topk_logp, m) if p]
    k = max((len(row) for g in gens for row in g.topk_ids), default=0)
    if any(len(row) != k for row in ids):  # ragged lists: padded (as one length they convert as they are)
        ids = [list(row) + [-1] * (k - len(row)) for row in ids]
        lps = [list(row) + [float("-inf")] * (k - len(row)) for row in lps]
    sampled = list_tensor([t for g, m in zip(gens, own) for t, p in zip(g.response_ids, m) if p], torch.long)  # [N]
    n = len(ids)
    return sampled, list_tensor(ids, torch.long).reshape(n, k), list_tensor(lps, torch.float64).reshape(n, k)


def kept_sizes(samples: list[Sample], device=None) -> torch.Tensor | None:
    """[N] the kept-set size of every response token of ``samples`` (in order), or None when none
    of them was sampled with truncation (``Generation.kept``); a row sampled without truncation
    among truncated ones gets 0 (its whole vocabulary: nothing to renormalise)."""
    if all(s.gen.kept is None for s in samples):
        return None
    return torch.tensor(
        [k for s in samples for k in (s.gen.kept if s.gen.kept is not None else [0] * len(s.gen.response_ids))],
        dtype=torch.long,
        device=device,
    )


class RolloutEngine(Protocol):
    """What training and evaluation need from a generation backend."""

    name: str

    def generate(self, prompts: list[list[int]], settings: SamplingSettings, seed: int) -> list[list[Generation]]:
        """``settings.n`` generations for each prompt, in prompt order."""
        ...

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Make the engine sample from ``model``'s current weights."""
        ...
