"""Replaying a stored training step: a checkpoint, the rollouts it trains on, and its updates.

``load_replay`` loads checkpoint P (weights + optimizer + scheduler; P = 0 is the warm-start
policy with a fresh optimizer, as the train loop starts) and the rollout batch of step S.
``replay_step`` then runs the minibatch updates of ``rl.update.policy_update`` with the
run's method, parameters and optimizer, calling hooks before and after each update, so an
analysis can look at exactly what the method saw. With P = S-1, the run's seed and the run's
number of minibatches, the replay reproduces the stored checkpoint S (tested).

Which optimizer runs it is a ``first_order.ReplayOptimizer`` (the run's own by default; plain
SGD or fresh AdamW at a chosen learning rate; the Adam state cleared before every minibatch).
Which update is replayed is an ``UpdateChoice``: the run's own method (what training did), a
named method with its defaults, or ``unmasked``: importance-weighted policy gradient with no
trust-region mask (see ``update_choice``). The behaviour policy that sampled step S is the
checkpoint ``behaviour_step(cfg, S)`` = S-1-``rollout.staleness`` (0 = the starting policy).

The modules used here (``runs.store``, ``rl.train_state``, ``rl.policy``, ``rl.update``) are the
public API the analyses may use: the import contract in pyproject.toml keeps them off the others.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from masktrl.config import Config, resolve_method_spec
from masktrl.errors import ArtifactError, MasktrlError
from masktrl.method_spec import is_rule_file
from masktrl.methods import BoundMethod, get_method, make_params, method_names
from masktrl.models.loading import load_model_and_tokenizer, load_trainable_policy
from masktrl.models.lora import LoraSettings
from masktrl.models.lowprec import apply_training_quantization
from masktrl.rl import update
from masktrl.rl.policy import PolicyOutputs, lm_head_weight, policy_token_batch, response_hidden
from masktrl.rl.reference import FrozenReference, Reference, micro_batch_size, penalise_kl, reference_logprobs
from masktrl.rl.schedule import sampled_at
from masktrl.rl.train_state import load_optimizer_state
from masktrl.rollout.base import Sample
from masktrl.runs.store import RunStore

UNMASKED = "unmasked"
RUN_METHOD = "run"


@dataclass(frozen=True)
class UpdateChoice:
    """The update a replay runs: ``name`` as asked (``unmasked``, ``run`` or a method name), the
    registered ``method`` that runs and its ``params``."""

    name: str
    method: str
    params: object

    def describe(self) -> dict:
        params = {
            k: ("inf" if isinstance(v, float) and math.isinf(v) else v)
            for k, v in dataclasses.asdict(self.params).items()
        }
        return {"name": self.name, "method": self.method, "params": params, "masks": self.name != UNMASKED}


def update_choice(name: str, cfg: Config) -> UpdateChoice:
    """``unmasked``: importance-weighted PG with no trust-region mask, l = -A sg(r) log pi_k
    (dppo with delta = inf: the mask is never on), aggregated as the run's method aggregates;
    every token with A != 0 gets the gradient coefficient -A r (docs/ANALYSIS.md says why).
    ``run``: the run's method and parameters. A method name: that method, with the run's
    parameters if it is the run's method, else its defaults."""
    run_params = cfg.method.params
    if name == UNMASKED:
        params = make_params("dppo", delta_pos=math.inf, delta_neg=math.inf, loss_agg=run_params.agg_mode)
        return UpdateChoice(UNMASKED, "dppo", params)
    if name == RUN_METHOD or name == cfg.method_name or name == cfg.method.rule:
        return UpdateChoice(name, cfg.method.rule, run_params)
    if is_rule_file(name):  # a rule of the user's own (path/to/rules.py:name), at its defaults
        return UpdateChoice(name, name, resolve_method_spec(name).params)
    if name not in method_names():
        raise MasktrlError(
            f"unknown --update-method {name!r}: choose {UNMASKED}, {RUN_METHOD} or a method "
            f"({', '.join(method_names())})"
        )
    return UpdateChoice(name, name, make_params(name))


def check_rule_files(root: Path, cfg: Config, choice: UpdateChoice) -> None:
    """ArtifactError when a rule file the replay runs (the run's own rule, when it replays it; the
    run's correction from a file, always) is not the content the run recorded: the replay ran the
    edited file and recorded it as the run's update."""
    for key, f in cfg.method.files.items():
        if f.changed and (key != "method.sha256" or choice.method == cfg.method.rule):
            raise ArtifactError(f"{root}: {f.change()}; the replay would not be the run's update: restore it")


def behaviour_step(cfg: Config, step: int) -> int:
    """The checkpoint whose policy sampled step ``step``'s batch: step-1-age (``rollout.staleness``,
    its drawn age when a distribution), 0 (the starting policy) for the first batches."""
    return sampled_at(cfg.rollout.staleness, cfg.seed, step) - 1  # max(0, S-1-age); rl/schedule.py


@dataclass
class Replay:
    root: Path
    cfg: Config
    method: BoundMethod  # the replayed update's method, its params and the run's correction
    samples: list[Sample]
    step: int  # S: the rollout batch
    policy_step: int  # P: the checkpoint the update starts from
    model: torch.nn.Module
    tokenizer: object
    optimizer: torch.optim.Optimizer
    scheduler: object
    update: UpdateChoice | None = None
    reference: Reference | None = None  # the run's starting policy, when the replayed update has a reference KL
    replay_optimizer: object = None  # first_order.ReplayOptimizer
    lr_used: float | None = None
    _saved: tuple | None = None

    @property
    def offsets(self) -> list[int]:
        """Start of each sample's tokens in the flattened [N] batch (sample order)."""
        out, n = [], 0
        for s in self.samples:
            out.append(n)
            n += len(s.gen.response_ids)
        return out

    @property
    def n_tokens(self) -> int:
        return sum(len(s.gen.response_ids) for s in self.samples)

    def save_state(self) -> None:
        self._saved = (
            copy.deepcopy(self.model.state_dict()),
            copy.deepcopy(self.optimizer.state_dict()),
            copy.deepcopy(self.scheduler.state_dict()),
        )

    def restore(self) -> None:
        """Back to checkpoint P (weights, optimizer moments, scheduler position)."""
        weights, opt, sched = self._saved
        self.model.load_state_dict(weights)
        self.optimizer.load_state_dict(copy.deepcopy(opt))  # load_state_dict may alias tensors
        self.scheduler.load_state_dict(copy.deepcopy(sched))


def load_replay(
    root: Path, step: int, policy_step: int | None = None, update_name: str = RUN_METHOD, optimizer=None
) -> Replay:
    """Checkpoint ``policy_step`` (default step-1) with its optimizer, and the rollouts of ``step``;
    the update is ``update_choice(update_name)`` (default: the run's own method); ``optimizer``: a
    ``first_order.ReplayOptimizer`` (default: the run's own, with its moments and schedule)."""
    from masktrl.analysis.first_order import ReplayOptimizer, build_optimizer

    choice_opt = optimizer or ReplayOptimizer()
    store = RunStore(root)
    cfg = store.config()
    choice = update_choice(update_name, cfg)
    check_rule_files(root, cfg, choice)
    policy_step = step - 1 if policy_step is None else policy_step
    if policy_step < 0:
        raise ArtifactError(f"policy step must be >= 0, got {policy_step}")
    samples, _ = store.read_rollouts(step)
    if not samples:
        raise ArtifactError(f"{store.rollout_path(step)}: empty rollout batch")
    path = store.policy_path(policy_step)
    torch.set_num_threads(cfg.train.threads)
    lora = LoraSettings.from_config(cfg.model.lora) if cfg.model.lora.rank is not None else None
    model, tokenizer = load_trainable_policy(path, cfg.model.dtype, lora, seed=cfg.seed)  # LoRA: the adapters, unmerged
    apply_training_quantization(
        model, cfg.train.quantization, cfg.train.quantization_backend
    )  # FP8 training: the run's forward
    model.eval()
    optimizer, scheduler = update.make_optimizer(model, cfg.train)
    if policy_step > 0:
        load_optimizer_state(Path(path), optimizer, scheduler)
    optimizer, scheduler, lr_used = build_optimizer(model, cfg.train, choice_opt, optimizer, scheduler)
    method = (
        cfg.method.method
        if choice.method == cfg.method.rule
        else resolve_method_spec(choice.method).method
        if is_rule_file(choice.method)
        else get_method(choice.method)
    ).bind(choice.params, cfg.method.correction)
    reference = None
    if method.needs_reference:  # the starting policy, as the run's (docs/METHODS.md §13.7)
        start, _ = load_model_and_tokenizer(store.policy_path(0), cfg.model.dtype)
        apply_training_quantization(
            start, cfg.train.quantization, cfg.train.quantization_backend
        )  # the run's reference was its FP8 copy
        reference = FrozenReference(start, cfg.rollout.temperature, cfg.train.logprob_chunk)
        if choice.params.kl_in_reward:  # the stored batch holds the unpenalised rewards and advantages
            micro = micro_batch_size(len(samples), cfg.train.minibatches, cfg.train.grad_accum)
            penalise_kl(samples, reference_logprobs(reference, samples, micro), method)
    replay = Replay(
        Path(root),
        cfg,
        method,
        samples,
        step,
        policy_step,
        model,
        tokenizer,
        optimizer,
        scheduler,
        choice,
        reference,
        choice_opt,
        lr_used,
    )
    replay.save_state()
    return replay


@dataclass
class Behaviour:
    """The behaviour policy of a replayed batch over the whole vocabulary: the final hidden
    state predicting each token ([N, H], sample order) and its lm_head ([V, H]).
    ``rl.policy.full_logprobs(hidden[rows], weight, T)`` is log mu of those tokens."""

    step: int
    hidden: torch.Tensor
    weight: torch.Tensor


@torch.no_grad()
def load_behaviour(replay: Replay, step: int | None = None) -> Behaviour:
    """The policy that sampled the batch (checkpoint ``behaviour_step``, or ``step``), on the
    batch's tokens. Call it before any update when the behaviour is the replay's own start
    (staleness 0): then the replay's model at checkpoint P is used."""
    step = behaviour_step(replay.cfg, replay.step) if step is None else step
    versions = sorted({v for x in replay.samples for v in (x.gen.version or [])})
    if len(versions) > 1:  # one checkpoint's lm_head and hidden states cannot give two policies' log mu
        raise MasktrlError(
            f"step {replay.step}'s batch was sampled by policies {versions[0]}..{versions[-1]} "
            "(rollout.partial: a weight sync landed mid-generation); the exact behaviour over the "
            "vocabulary needs one policy per batch: study a step whose batch has one version"
        )
    if step == replay.policy_step:
        return Behaviour(
            step, response_hidden(replay.model, replay.samples), lm_head_weight(replay.model).detach().clone()
        )
    model, _ = load_model_and_tokenizer(RunStore(replay.root).policy_path(step), replay.cfg.model.dtype)
    model.eval()
    return Behaviour(step, response_hidden(model, replay.samples), lm_head_weight(model).detach().clone())


def sis_uniforms(seed: int, step: int, mb: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """The uniforms SIS draws for minibatch ``mb`` of ``step`` (as in ``policy_update``)."""
    return update.sis_uniforms(seed, step, mb, n).to(dtype)


def token_index(replay: Replay, idx: list[int]) -> torch.Tensor:
    """[n] global token indices (into the flattened batch) of the samples ``idx``, in that order."""
    offs = replay.offsets
    return torch.tensor(
        [offs[i] + t for i in idx for t in range(len(replay.samples[i].gen.response_ids))], dtype=torch.long
    )


@torch.no_grad()
def policy_outputs(replay: Replay, idx: list[int]) -> PolicyOutputs:
    """The current policy on samples ``idx`` (no gradient)."""
    return policy_token_batch(
        replay.model, [replay.samples[i] for i in idx], replay.cfg.rollout.temperature, replay.cfg.train.logprob_chunk
    )


Hook = Callable[..., None]


def replay_step(
    replay: Replay, seed: int, minibatches: int, before: Hook | None = None, after: Hook | None = None
) -> None:
    """Run the step's minibatch updates from the current state with ``policy_update`` itself.

    ``before(mb, idx, out, losses, u)`` sees each minibatch's policy outputs and token losses
    just before its backward; ``after(mb, idx)`` runs just after its optimizer step. The seed
    chooses the minibatch partition (``stream_seed(seed, "order", S)``; ``"group-order"`` for a run
    with ``train.minibatch_groups``) and the SIS uniforms
    (``stream_seed(seed, "sis", S, mb)``); nothing else in an update is random.
    """
    settings = replace(
        update.UpdateSettings.from_config(replay.cfg), minibatches=minibatches, method=replay.method, seed=seed
    )
    if replay.replay_optimizer is not None and replay.replay_optimizer.reset_moments:
        inner, seen = before, set()

        def before(mb, idx, out, losses, u):  # fresh Adam state for every minibatch update
            if mb not in seen:
                seen.add(mb)
                replay.optimizer.state.clear()
            if inner is not None:
                inner(mb, idx, out, losses, u)

    update.policy_update(
        update.Learner(replay.model, replay.optimizer, replay.scheduler),
        replay.samples,
        settings,
        replay.step,
        hooks=update.Hooks(before, after),
        reference=replay.reference,
    )
