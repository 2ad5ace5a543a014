"""Replicates of a token study: independent rollout batches (run x step), each replayed.

A study pools the rollout batches of several steps (``--steps 600,650,700`` or ``600:700:50``)
of several runs (``--run`` repeated, or a folder of runs such as a sweep's). Each batch is one
independent replicate: its own rollouts, checkpoint and optimizer state. Partition seeds
(``--partitions``) replay a batch several times with other minibatch partitions; they are
pooled into their batch unless the replicate unit is ``partition``.

``plan`` checks everything before any replay (so a bad request writes nothing): the runs share
one task, every step is in range, and every step has its stored rollouts, the checkpoint its
update starts from (S-1, or ``--policy-step``) and, for the exact values, the checkpoint of the
behaviour policy that sampled it (S-1-``rollout.staleness``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from masktrl.errors import ArtifactError, MasktrlError
from masktrl.runs.store import WARMSTART_KEY, RunStore, checkpoint_key, rollout_key

REPLICATE_UNITS = ("batch", "partition")
MAX_STEPS = 100_000
"""The most steps one --steps lists (a range beyond it is a typo, and was expanded in memory), and
the most --partitions (replays of each batch)."""


@dataclass(frozen=True)
class BatchRef:
    """One rollout batch to replay."""

    root: Path
    run: str
    step: int  # S: the rollout batch
    policy_step: int  # P: the checkpoint the update starts from
    behaviour_step: int  # B: the checkpoint that sampled the batch


def parse_steps(spec: str | None) -> list[int] | None:
    """``600,650,700``, ``600:700:50`` (inclusive: 600, 650, 700), ``600:700`` (every step) or a
    mix (``5,10:20:5``) -> sorted distinct steps; None -> None (each run's latest)."""
    if spec is None or not str(spec).strip():
        return None
    steps: set[int] = set()
    for part in str(spec).split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?::(\d+)(?::(\d+))?)?", part)
        if not m:
            raise MasktrlError(f"--steps: {part!r} is not a step, a list (600,650) or a range (600:700:50)")
        a = int(m.group(1))
        b = int(m.group(2)) if m.group(2) is not None else a
        stride = int(m.group(3)) if m.group(3) is not None else 1
        if stride < 1 or b < a:
            raise MasktrlError(f"--steps: range {part!r} must be start:end[:stride] with end >= start and stride >= 1")
        if len(steps) + (b - a) // stride + 1 > MAX_STEPS:  # counted before a range is expanded
            raise MasktrlError(f"--steps {str(spec).strip()[:60]}: more than {MAX_STEPS} steps (each one is replayed)")
        steps.update(range(a, b + 1, stride))
    return sorted(steps)


def run_roots(runs: list[str], out: Path | None) -> list[Path]:
    """Run folders from run paths, run names under ``out`` and folders of runs."""
    from masktrl.analysis.io import expand_runs

    return expand_runs(runs, out)


def plan(
    roots: list[Path],
    steps: list[int] | None,
    policy_step: int | None = None,
    exact: bool = True,
    no_exact: bool = True,
) -> list[BatchRef]:
    """The batches to replay, after checking every artifact they need (``MasktrlError`` otherwise).
    ``no_exact``: whether the command has ``--no-exact`` to suggest (``estimators`` has not)."""
    skip = " (use --no-exact)" if no_exact else ""
    from masktrl.analysis.io import default_replay_step, task_difference
    from masktrl.analysis.step_replay import behaviour_step

    if policy_step is not None and (len(roots) > 1 or (steps is not None and len(steps) != 1)):
        raise MasktrlError("--policy-step needs one run and one step (it is an absolute checkpoint)")
    stores = [RunStore(r) for r in roots]
    cfgs = [s.config() for s in stores]
    for store, cfg in zip(stores[1:], cfgs[1:]):
        diff = task_difference(cfgs[0], cfg)
        if diff is not None:
            raise MasktrlError(
                f"runs of different tasks cannot be pooled: {stores[0].name} has {diff[0]}, {store.name} has {diff[1]}"
            )
    refs: list[BatchRef] = []
    batches: dict[tuple, tuple[str, int]] = {}  # each stored batch's sha256 -> (run, step): pooled once
    for store, cfg in zip(stores, cfgs):
        run_steps = steps if steps is not None else [default_replay_step(store.root)]
        bad = [s for s in run_steps if not 1 <= s <= cfg.train.steps]
        if bad:
            raise MasktrlError(
                f"--steps: step {bad[0]} is out of range for run {store.name} (train.steps = "
                f"{cfg.train.steps}: steps 1..{cfg.train.steps})"
            )
        stored = set(store.rollout_steps())
        policies = set(store.policy_steps())
        if exact:
            _check_behaviour_known(store, skip)
            if cfg.rollout.top_p < 1.0:
                raise MasktrlError(
                    f"run {store.name} sampled with rollout.top_p = {cfg.rollout.top_p}: its "
                    "behaviour distribution is "
                    f"truncated, and the exact values need the full one{skip}"
                )
        for s in run_steps:
            if s not in stored:
                have = sorted(stored)
                span = f"{have[0]}..{have[-1]}" if have else "none"
                raise ArtifactError(f"run {store.name} has no stored rollouts for step {s} (stored steps: {span})")
            p = s - 1 if policy_step is None else policy_step
            if p < 0:
                raise MasktrlError(f"--policy-step must be >= 0, got {p}")
            b = behaviour_step(cfg, s)
            if p not in policies:
                raise ArtifactError(
                    f"run {store.name}, step {s}: the update starts from checkpoint {p}, which is "
                    "not stored "
                    f"(checkpoints: {_span(policies)}; train with "
                    "train.checkpoint_every=1 around the steps studied)"
                )
            if exact and b not in policies:
                good = replayable_steps(cfg, stored, policies, policy_step)
                hint = (
                    f"steps with both checkpoints: {_span(set(good))}"
                    if good
                    else "no stored step has both checkpoints"
                )
                raise ArtifactError(
                    f"run {store.name}, step {s}: the exact values need the behaviour policy, "
                    f"checkpoint {b} "
                    "(step - 1 - rollout.staleness), which is not stored "
                    f"(checkpoints: {_span(policies)}); "
                    f"{hint}{' (or --no-exact)' if no_exact else ''}"
                )
            digest = (  # the run's config, the batch and the checkpoint its update starts from
                _stage_digest(store, "config"),
                _stage_digest(store, rollout_key(s)),
                _stage_digest(store, checkpoint_key(p) if p else WARMSTART_KEY),
            )
            if all(digest) and digest in batches:  # a copied run folder: one replicate pooled twice
                twin, twin_step = batches[digest]
                raise MasktrlError(
                    f"run {store.name}, step {s} is the same replicate as run {twin}, step "
                    f"{twin_step} (its config, rollout batch and checkpoint {p} have the same sha256: "
                    "a copied run folder, or a rerun); give one of them"
                )
            batches[digest] = (store.name, s)
            refs.append(BatchRef(store.root, store.name, s, p, b))
    return refs


def _stage_digest(store: RunStore, key: str) -> tuple[str, ...]:
    """The sha256 of a stage's files as its manifest records them (the warm start's: its info's
    files); empty when it records none."""
    stage = store.stage(key) or {}
    return tuple(sorted((stage.get("files") or (stage.get("info") or {}).get("files") or {}).values()))


def prepare(
    runs: list[Path],
    steps: list[int] | None,
    *,
    delta: float,
    update: str,
    partitions: int,
    policy_step: int | None,
    minibatches: int | None,
    exact: bool,
    optimizer=None,
    own_tokens: int | None = None,
    no_exact: bool = True,
) -> list[BatchRef]:
    """Check a study's options and artifacts (``MasktrlError`` before any replay), then ``plan``.
    ``optimizer``: a ``first_order.ReplayOptimizer`` (checked when it was built)."""
    from masktrl.analysis.step_replay import update_choice

    if own_tokens is not None and own_tokens < 0:
        raise MasktrlError(f"--own-tokens must be >= 0, got {own_tokens}")
    if partitions < 1:
        raise MasktrlError(f"--partitions must be >= 1, got {partitions}")
    if partitions > MAX_STEPS:  # a typo: it replayed each batch for hours before a word
        raise MasktrlError(f"--partitions {partitions}: more than {MAX_STEPS} replays of each batch")
    if not delta >= 0:
        raise MasktrlError(f"--delta must be >= 0, got {delta}")
    if minibatches is not None and minibatches < 1:
        raise MasktrlError(f"--minibatches must be >= 1, got {minibatches}")
    for r in runs:
        update_choice(update, RunStore(r).config())  # an unknown --update-method
    return plan(runs, steps, policy_step, exact, no_exact)


def replayable_steps(cfg, stored: set[int], policies: set[int], policy_step: int | None = None) -> list[int]:
    """The stored steps whose update checkpoint (S-1, or ``policy_step``) and behaviour
    checkpoint (S-1-staleness) both exist: the steps a study with exact values can replay."""
    from masktrl.analysis.step_replay import behaviour_step

    return sorted(
        s
        for s in stored
        if (s - 1 if policy_step is None else policy_step) in policies and behaviour_step(cfg, s) in policies
    )


def _check_behaviour_known(store: RunStore, skip: str = " (use --no-exact)") -> None:
    summary = store.summary() or {}
    if summary.get("rollouts_from"):
        raise MasktrlError(
            f"run {store.name} trained on rollouts from {summary['rollouts_from']}: its behaviour "
            "policy is "
            "not one of its checkpoints, so the exact values cannot be "
            f"computed{skip}"
        )


def _span(steps: set[int]) -> str:
    s = sorted(steps)
    if not s:
        return "none"
    if len(s) <= 8:
        return ", ".join(map(str, s))
    return f"{', '.join(map(str, s[:4]))}, ..., {', '.join(map(str, s[-3:]))} ({len(s)} in all)"


def replay_all(
    refs: list[BatchRef],
    *,
    update: str,
    partitions: int,
    minibatches: int | None,
    exact: bool,
    ks: tuple[int, ...] = (),
    unit: str = "batch",
    progress=None,
    optimizer=None,
    decompose_delta: float | None = None,
    own_tokens: int = 0,
    recut_ks: tuple[int, ...] = (),
) -> tuple[dict[str, np.ndarray], list[dict]]:
    """Replay every batch ``partitions`` times; returns the token table of all of them (columns
    of ``token_replay.record_tokens`` plus run, step, partition, replicate) and one info row
    per batch (run, step, policy_step, behaviour_step, method, minibatches, n_tokens, ...)."""
    from masktrl.analysis.step_replay import load_behaviour, load_replay
    from masktrl.analysis.token_replay import record_tokens
    from masktrl.rl.policy import lm_head_weight

    if unit not in REPLICATE_UNITS:
        raise MasktrlError(f"--replicate must be one of {', '.join(REPLICATE_UNITS)}, got {unit!r}")
    tables: list[dict[str, np.ndarray]] = []
    info: list[dict] = []
    bar = progress.add_task("replays", total=len(refs) * partitions, info="") if progress else None
    replicate = 0
    for bi, ref in enumerate(refs):
        replay = load_replay(ref.root, ref.step, ref.policy_step, update, optimizer)
        m = study_minibatches(replay.cfg.train.minibatches, minibatches, ref.policy_step - ref.behaviour_step)
        if m > len(replay.samples):  # parts of ceil(N / M) = 1 sequence: N updates, recorded as M
            raise MasktrlError(
                f"--minibatches {m}: run {ref.run}, step {ref.step} has {len(replay.samples)} sequences, fewer "
                f"than the minibatches (each needs one); give --minibatches {len(replay.samples)} or fewer"
            )
        if m == 1 and partitions > 1 and not replay.method.needs_u:
            raise MasktrlError(
                f"--partitions {partitions}: run {ref.run}, step {ref.step} is replayed as one minibatch and "
                f"the update ({update}) draws no random numbers, so every partition is the same update "
                "(copies, not replicates); give --partitions 1, or --minibatches 2 or more"
            )
        behaviour = load_behaviour(replay, ref.behaviour_step) if exact else None
        row = {
            "batch": bi,
            "run": ref.run,
            "step": ref.step,
            "policy_step": ref.policy_step,
            "behaviour_step": ref.behaviour_step,
            "staleness": ref.policy_step - ref.behaviour_step,
            "method": replay.cfg.method_name,
            "seed": replay.cfg.seed,
            "minibatches": m,
            "minibatches_run": replay.cfg.train.minibatches,
            "n_tokens": replay.n_tokens,
            "stored_k": max((len(row) for s in replay.samples for row in s.gen.topk_ids), default=0),
            "vocab_size": int(lm_head_weight(replay.model).shape[0]),
            "update": replay.update.describe(),
            "replay_optimizer": replay.replay_optimizer.describe(replay.lr_used),
        }
        for j in range(partitions):
            cols = record_tokens(
                replay,
                replay.cfg.seed + j,
                m,
                behaviour=behaviour,
                ks=ks,
                decompose_delta=decompose_delta,
                own_tokens=own_tokens,
                recut_ks=recut_ks,
            )
            n = len(cols["sample"])
            if exact:
                mass = cols.pop("mu_list_mass_diff")
                row["mu_recompute_max_list_mass_diff"] = max(
                    row.get("mu_recompute_max_list_mass_diff", 0.0), float(np.nanmax(mass)) if mass.size else 0.0
                )
                mu = cols.pop("mu_logp_recomputed")
                stored = np.array([x for s in replay.samples for x in s.gen.logp])
                ok = np.isfinite(stored)
                row.setdefault("mu_recompute_max_abs_logp_diff", 0.0)
                if ok.any():
                    row["mu_recompute_max_abs_logp_diff"] = max(
                        row["mu_recompute_max_abs_logp_diff"], float(np.max(np.abs(mu[ok] - stored[ok])))
                    )
            cols = {
                "run": np.array([ref.run] * n, dtype=object),
                "step": np.full(n, ref.step, dtype=np.int64),
                "batch": np.full(n, bi, dtype=np.int64),
                "partition": np.full(n, j, dtype=np.int64),
                "replicate": np.full(n, replicate, dtype=np.int64),
                **cols,
            }
            tables.append(cols)
            if unit == "partition":
                replicate += 1
            if progress:
                progress.update(bar, advance=1, info=f"{ref.run} step {ref.step}")
        if unit == "batch":
            replicate += 1
        info.append(row)
        del replay, behaviour
    keys = list(tables[0])
    table = {k: np.concatenate([t[k] for t in tables]) for k in keys}
    return table, info


STUDY_MINIBATCHES = 4  # used when the run trained on whole batches (M = 1, see study_minibatches)


def study_minibatches(run_minibatches: int, requested: int | None, lag: int = 0) -> int:
    """The study's M: as requested, else the run's; STUDY_MINIBATCHES for a one-minibatch run
    whose update starts from the behaviour policy (``lag`` = P - B = 0).

    With M = 1 and pi = mu at the start every token is trained on-policy (D ~ 0): no token is
    outside the trust region, and every partition gives the same update. Stale rollouts (lag > 0)
    are off-policy from the first update, so the run's M stands.
    """
    if requested is not None:
        if requested < 1:
            raise MasktrlError(f"--minibatches must be >= 1, got {requested}")
        return requested
    return run_minibatches if run_minibatches > 1 or lag > 0 else STUDY_MINIBATCHES
