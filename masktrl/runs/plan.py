"""What a run does with its folder, decided before anything is written; ``runs/session.py``
carries the decision out under the run's lock.

* ``plan_run`` (``masktrl train``) and ``plan_config`` (the Python API, a sweep's run): a new
  run, a resume, or a restart in place of a failed or interrupted run (``plan_start``).
  Re-running the command of a run that failed or was interrupted continues it (same config: as
  ``--resume`` would) or, when the config changed and no checkpoint was completed yet, starts it
  again in the same folder; nothing has to be deleted by hand.
* ``sweep_fate`` (``masktrl sweep``): the fate of one run of a grid among its folders
  ``<name>``, ``<name>-retry<i>``: ``complete`` (skipped), ``resume`` (an incomplete run of the
  same config, continued in place), ``retry`` (an incomplete run that cannot resume is left as
  it is and the run starts again in a fresh ``-retry<i>`` folder) or ``new``.
* ``stale_batch_keys``: the ``--resume --force`` changes that make the stored batches after
  the checkpoint stale."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from masktrl.config import Config, diff_configs, load_config
from masktrl.errors import ArtifactError, MasktrlError
from masktrl.io import disk_problem, sha256_file
from masktrl.runs import locks
from masktrl.runs.store import RunStore, check_run_name, is_fresh_folder, is_path_like, is_run_folder, resolve_run


@dataclass
class Start:
    """What a train command does with its run folder: ``new``, ``resume`` (``--resume``, or the
    same command re-run after a failure or an interruption) or ``restart`` (re-run with a
    changed config, before any checkpoint: the folder is reused from scratch)."""

    root: Path
    mode: str
    note: str = ""


@dataclass(frozen=True)
class RunRequest:
    """What ``masktrl train`` was asked for, before anything is resolved."""

    config: tuple[Path, ...] | None = None  # --config files, composed in order (None: configs/tiny.yaml)
    method: str | None = None
    run: str | None = None  # --run (default: <method>-<timestamp>)
    out: Path = Path("outputs")
    seed: int | None = None
    overrides: tuple[str, ...] = ()  # --set KEY=VALUE
    resume: str | None = None  # --resume RUN: a name under out, or a folder
    force: bool = False  # with resume: accept a config that differs from run.yaml
    rollouts_from: str | None = None  # a run (folder, or name under out) or a rollout file


@dataclass(frozen=True)
class Plan:
    """A request resolved: the run folder and what to do with it, the config to train with,
    ``--rollouts-from`` as a path, and the keys ``--resume --force`` changes."""

    start: Start
    cfg: Config
    rollouts_from: str | None = None
    forced_changes: list[str] = field(default_factory=list)
    explicit_resume: bool = False  # --resume (else the folder's state decided)

    @property
    def root(self) -> Path:
        return self.start.root


def plan_run(request: RunRequest, *, main: bool = True) -> Plan:
    """Resolve ``request`` without writing anything: the folder (``--resume``'s run, or
    ``--out/--run``), the config (run.yaml on ``--resume``, unless other settings agree with it
    or ``--force``), and what to do with the folder (``plan_start``; only the main process of a
    launch decides, the others follow it)."""
    r = request
    if r.resume and r.run is not None:  # --run was ignored: the run continued was --resume's
        raise MasktrlError(
            f"--run {r.run} conflicts with --resume {r.resume} (--run names a new run, --resume the run "
            "to continue): drop one"
        )
    if r.resume:
        start = Start(resolve_run(r.resume, r.out), "resume")
    else:
        cfg = load_config(r.config, list(r.overrides), method=r.method, seed=r.seed)
        name = check_run_name(r.run) if r.run is not None else f"{cfg.method_name}-{time.strftime('%Y%m%d-%H%M%S')}"
        root = Path(r.out) / name
        start = plan_start(root, cfg) if main else Start(root, "new")
    rollouts_from = r.rollouts_from
    if rollouts_from and not is_path_like(rollouts_from):  # a run given by name: under --out only
        if is_run_folder(Path(r.out) / rollouts_from):
            rollouts_from = str(Path(r.out) / rollouts_from)
        elif is_run_folder(Path(rollouts_from)):
            raise MasktrlError(
                f"--rollouts-from {rollouts_from}: no run {rollouts_from} under {r.out}; "
                f"a run or file elsewhere is given as a path (./{rollouts_from})"
            )
    changed: list[str] = []
    if start.mode == "resume":
        store = RunStore(start.root)
        store.check_resumable()
        if r.resume:
            cfg, changed = _resume_config(store, r)
        rollouts_from = _resume_rollouts_from(store, rollouts_from, force=r.force)
        if not r.force:
            _check_task_files(store, cfg)
    return Plan(start, cfg, rollouts_from, changed, explicit_resume=bool(r.resume))


def source_digest(source: str | None) -> str | None:
    """The sha256 of a ``--rollouts-from`` file (None for a run folder, whose batches its own
    manifest hashes, or a path that is no file)."""
    if not source or not os.path.isfile(source):
        return None
    try:
        return sha256_file(Path(source))
    except OSError:  # unreadable: reading it as the source says so in its own line
        return None


TASK_FILES = {"task.data": "prompts", "task.source": "data", "task.reward": "reward", "task.env": "environment"}
"""The task keys that may name a local file, and what the run's remaining steps would get from
another content of it."""


def task_file_digests(cfg: Config) -> dict[str, str]:
    """The sha256 of each local file the run's task reads by path (``TASK_FILES``: a data file, a
    ``path/to/file.py:name`` reward or environment), by key; recorded as the run starts
    (``task_files`` in its manifest) and checked on ``--resume``. A hub id, a module or a folder
    of data files is not hashed."""
    out = {}
    for key in TASK_FILES:
        spec = getattr(cfg.task, key.split(".")[1])
        if isinstance(spec, str):
            where = spec.strip().rpartition(":")[0] if key in ("task.reward", "task.env") else spec
            digest = source_digest(where)
            if digest is not None:
                out[key] = digest
    return out


def _check_task_files(store: RunStore, cfg: Config) -> None:
    """MasktrlError when a task file the run recorded holds other content now (a reward edited,
    a data file replaced): its remaining steps would train on it without a word."""
    recorded = store.manifest.get("task_files")
    if not isinstance(recorded, dict):
        return  # a run recorded before task files were
    for key, now in task_file_digests(cfg).items():
        was = recorded.get(key)
        if isinstance(was, str) and was != now:
            raise _changed_since(
                store, f"{key} {getattr(cfg.task, key.split('.')[1])}", was, now, f"another {TASK_FILES[key]}"
            )


def _changed_since(store: RunStore, what: str, was: str, now: str, instead: str) -> MasktrlError:
    return MasktrlError(
        f"{store.root}: {what} changed since this run started on it (sha256 {was[:12]}, now {now[:12]}); its "
        f"remaining steps would train on {instead}: restore the file, add --force to train them on it as it "
        "is now, or start another --run (nothing was changed)"
    )


def _resume_rollouts_from(store: RunStore, given: str | None, *, force: bool = False) -> str | None:
    """The rollout source a resumed run trains on: the one it recorded when it started (as
    ``--resume`` takes the run's config), ``given`` for a run that recorded none (written before
    runs recorded it); another source than the recorded one is refused, not mixed into the run,
    unless ``--force`` (as for a changed config: a source that moved, or another on purpose; the
    run then records the new one)."""
    manifest = store.manifest
    if "rollouts_from" not in manifest:
        return given
    recorded = manifest["rollouts_from"]
    if given is None or (recorded is not None and os.path.abspath(given) == recorded):
        digest = manifest.get("rollouts_from_sha256")
        if force or not isinstance(digest, str):
            return recorded
        now = source_digest(recorded)
        if now is None or now == digest:
            return recorded
        raise _changed_since(store, f"--rollouts-from {recorded}", digest, now, "other rollouts")
    if force:
        return given
    was = f"--rollouts-from {recorded}" if recorded else "its own rollouts (no --rollouts-from)"
    raise MasktrlError(
        f"{store.root}: this run trains on {was}; --rollouts-from {given} would mix another source "
        "into it: resume it without --rollouts-from, add --force to train its remaining steps on this "
        "source (one that moved, say), or start another --run (nothing was changed)"
    )


def _resume_config(store: RunStore, r: RunRequest) -> tuple[Config, list[str]]:
    """(run.yaml, or the given config/overrides if they agree with it or --force; the keys that differ)."""
    saved_path = store.root / "run.yaml"
    saved = store.config()
    edited = {
        key: f for key, f in saved.method.files.items() if f.changed
    }  # rule files whose content is not the one recorded
    if not r.config and not r.overrides and r.method is None and r.seed is None and not edited:
        return saved, []
    cfg = load_config(r.config or [saved_path], list(r.overrides), method=r.method, seed=r.seed)
    changed = diff_configs(saved, cfg)
    if changed and not r.force:
        keys = ", ".join(f"{k} ({edited[k].change()})" if k in edited else k for k in changed)
        raise MasktrlError(f"config differs from {saved_path} in {keys}; pass --force to resume with it anyway")
    return cfg, changed


def check_steps_cover(cfg: Config, root: Path, step: int) -> None:
    """MasktrlError when ``cfg.train.steps`` is below ``step``, the checkpoint a resume continues
    from: ``--resume --force --set train.steps=N`` extends a run, it cannot shorten one (the
    steps already trained, their checkpoint and metrics would be described by a summary and a
    run.yaml of fewer steps)."""
    if step > cfg.train.steps:
        raise MasktrlError(
            f"{root}: train.steps={cfg.train.steps} is below the {step} steps this run has trained "
            f"(checkpoint {step}); a run cannot be shortened: evaluate an earlier checkpoint with "
            "masktrl eval --step, or choose another --run (nothing was changed)"
        )


def plan_start(root: Path, cfg: Config, *, resume: bool = False) -> Start:
    """What to do with ``root`` for a run of ``cfg``; MasktrlError when it must be left alone."""
    root = Path(root)
    if resume:
        return Start(root, "resume", "continuing from its last checkpoint")
    _check_folder_for_writing(root)
    if is_fresh_folder(root):
        return Start(root, "new")
    if not is_run_folder(root) or not (root / "manifest.json").is_file():
        raise MasktrlError(
            f"run folder {root} already exists: choose another --run, or --resume it (nothing was changed)"
        )
    store = RunStore(root)
    status = store.status()
    if status not in ("failed", "interrupted"):
        what = {
            "complete": "a complete run",
            "running": f"a run that is training right now (pid {locks.holder(root)})",
        }.get(status, f"a run (status {status})")
        raise MasktrlError(
            f"run folder {root} already exists and holds {what}: choose another --run, or --resume "
            "it (nothing was changed)"
        )
    changed = diff_configs(store.config(), cfg)
    reason = store.manifest.get("reason")
    why = f"{status}" + (f": {reason}" if reason else "")
    if not changed:
        return Start(root, "resume", f"the run {why}; continuing it from its last checkpoint (same config)")
    if store.checkpoints():
        raise MasktrlError(
            f"run folder {root} holds a {status} run with checkpoints and a different config "
            f"({', '.join(changed[:4])}): "
            "--resume it (--force to take the new config), or choose another --run (nothing was "
            "changed)"
        )
    return Start(
        root,
        "restart",
        f"the run {why}; no checkpoint yet and the config changed ({', '.join(changed[:4])}): "
        "starting it again in place",
    )


def plan_config(cfg: Config, root: Path, *, resume: bool = False) -> Plan:
    """A run of ``cfg`` in ``root`` (the Python API, a sweep's run): a new run, or what
    ``plan_start`` decides for a folder that holds one; ``resume``: continue the run there (its
    own config: a sweep checked it)."""
    root = Path(root)
    return Plan(plan_start(root, cfg, resume=resume), cfg)


NOT_IN_BATCHES = (
    "rollout.store",
    "rollout.batch_size",
    "rollout.gpu_memory_utilization",
    "rollout.enforce_eager",
    "rollout.sleep_mode",
    "task.reward_workers",
    "task.max_reward_error_frac",
)
"""Keys of the sections below that change how a batch is made, not what it holds."""
IN_BATCHES = ("train.quantization", "train.quantization_backend")
"""Keys outside those sections that change what a batch holds (FP8 training: the model's own forward)."""


def stale_batch_keys(changed: list[str]) -> list[str]:
    """The keys among ``changed`` (dotted) that change what a stored rollout batch holds: the
    seed, the model, the task and its reward, the method (reward shaping, advantages), the
    sampling (``rollout.*``, but how the engine is run; ``train.quantization``: an engine that
    samples from the model itself samples with its FP8 forward)."""
    return [
        k
        for k in changed
        if (k in ("seed", *IN_BATCHES) or k.startswith(("model.", "task.", "method.", "rollout.")))
        and k not in NOT_IN_BATCHES
    ]


@dataclass
class Fate:
    """What a sweep does with one run of its grid."""

    root: Path  # the folder that holds (or will hold) the complete run
    state: str  # "complete" (skip) | "new" | "resume" (incomplete, resumable) | "retry" (fresh folder)
    incomplete: list[Path] = field(default_factory=list)  # the run's incomplete folders
    writer: int | None = None  # busy_ok: the pid holding the run's lock (-1: not known), if a process trains it now


def sweep_fate(out: Path, name: str, cfg: Config, *, busy_ok: bool = False) -> Fate:
    """The fate of run ``name`` of ``cfg`` among its folders under ``out`` (``<name>``,
    ``<name>-retry<i>``; module doc). A complete run of another config stops the sweep; so does
    a run that a process is training right now (it holds the run's lock), unless ``busy_ok``
    (the slurm launcher: its job may be that process): then it is a resume with ``writer`` set."""
    attempts = [Path(out) / name] + sorted(Path(out).glob(f"{name}-retry*"), key=_retry_index)
    for root in attempts:
        _check_recorded_whole(root)
    states = {root: folder_state(root) for root in attempts}
    complete = [r for r in attempts if states[r] == "complete"]
    incomplete = [r for r in attempts if states[r] == "incomplete"]
    for root in complete:
        _check_same_config(root, cfg)
    if complete:
        return Fate(complete[-1], "complete", incomplete)
    if incomplete and _resumable(incomplete[-1], cfg, busy_ok):
        return Fate(incomplete[-1], "resume", incomplete, locks.holder(incomplete[-1]))
    if incomplete:
        return Fate(Path(out) / f"{name}-retry{_next_retry(attempts)}", "retry", incomplete)
    return Fate(Path(out) / name, "new")


def _check_recorded_whole(root: Path) -> None:
    """A run its manifest records complete reads back whole (its summary and metrics, which the
    sweep's compare reads), or one line before anything runs: with its summary deleted it was
    planned as an interrupted run to resume, which train then refused as complete; with its
    summary or metrics edited the sweep trained every other run and stopped at the compare."""
    if is_fresh_folder(root):
        return
    store = RunStore(root, writable=False)
    if not store.exists() or store.manifest.get("status") != "complete":
        return
    try:
        store.summary()
        store.read_metrics()
    except ArtifactError as exc:
        raise MasktrlError(
            f"{exc} (a damaged run: the sweep changed nothing; restore the file, or use another --out)"
        ) from None


def folder_state(root: Path) -> str:
    """'missing' | 'complete' | 'incomplete' for a run folder."""
    if is_fresh_folder(root):
        return "missing"
    if RunStore(root).is_complete():
        return "complete"
    return "incomplete"


def _check_same_config(root: Path, cfg: Config) -> None:
    diff = diff_configs(RunStore(root).config(), cfg)
    if diff:
        raise MasktrlError(
            f"{root} holds a run with a different config ({', '.join(diff[:4])}); use another --out "
            "(nothing was changed)"
        )


def _resumable(root: Path, cfg: Config, busy_ok: bool = False) -> bool:
    """An interrupted run of this config that a resume accepts. Raises if the run is alive (a
    process holds its lock) unless ``busy_ok``: two sweeps must not write into the same run."""
    store = RunStore(root)
    try:
        store.check_resumable()
    except MasktrlError:
        return False
    pid = locks.holder(root)  # a process holds the run's lock (runs/locks.py)
    if (pid is not None or store.status() == "running") and not busy_ok:
        who = f"pid {pid}" if pid and pid > 0 else "a process"
        raise MasktrlError(f"{root} is being trained right now ({who}); wait for it or stop it first")
    _check_same_config(root, cfg)
    return True


def _retry_index(path: Path) -> int:
    tail = path.name.rsplit("-retry", 1)[-1]
    return int(tail) if tail.isdigit() else 0


def _next_retry(attempts: list[Path]) -> int:
    return 1 + max([_retry_index(p) for p in attempts if "-retry" in p.name] + [0])


def _check_folder_for_writing(root: Path) -> None:
    """The run folder can be created: nothing that is not a folder on the way, and the nearest
    existing folder is writable."""
    for parent in [root, *root.parents]:
        if parent.exists():
            if not parent.is_dir():
                raise MasktrlError(f"{parent}: not a folder (a file is in the way of the run folder {root})")
            problem = disk_problem(parent, min_free=64 << 10)
            if problem is not None:
                raise MasktrlError(f"{parent}: {problem.strerror} (cannot write the run folder {root})")
            if not os.access(parent, os.W_OK | os.X_OK):
                raise MasktrlError(f"{parent}: permission denied (cannot write the run folder {root})")
            return
