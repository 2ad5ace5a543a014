"""What a ``--model`` argument names: a run folder or a run's name under ``--out`` (one of its
checkpoints, or step 0: its starting policy), a checkpoint folder inside a run, a model folder,
or a hub id."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from masktrl.config import Config
from masktrl.errors import ArtifactError, ConfigError, MasktrlError
from masktrl.runs.store import RunStore, is_path_like, is_run_folder


@dataclass
class ModelRef:
    """The weights to evaluate and, when they belong to a run, the run and step."""

    label: str  # what --model said
    weights: str  # a folder with config.json, or a hub id
    store: RunStore | None = None
    cfg: Config | None = None
    step: int | None = None  # 0 = the run's starting policy (warm start)


def model_path(model: str) -> Path:
    """``--model`` as a path; an empty or blank one (an unset shell variable) is refused, not read
    as the current folder."""
    if not str(model).strip():
        raise ConfigError("--model is empty; give a run (a name under --out, or a folder), a model folder or a hub id")
    return Path(model)


def resolve_model(model: str, step: int | None, out: Path | None = None) -> ModelRef:
    """A run folder or a run's name under ``out`` (its checkpoint at ``step``, default the latest
    complete one; step 0 is the warm-start policy), a checkpoint folder inside a run, a model
    folder, or a hub id."""
    p = model_path(model)
    if not is_path_like(model):  # a name: a run under --out only (a run elsewhere is given as a path)
        if out is not None and is_run_folder(Path(out) / model):
            p = Path(out) / model
        elif is_run_folder(p):
            raise ConfigError(
                f"--model {model}: no run {model} under {out}; a run elsewhere is given as a path (./{model})"
            )
    if p.parent.name == "checkpoints" and is_run_folder(p.parent.parent) and p.name.isdigit():
        if step is not None and step != int(p.name):
            raise ConfigError(f"--step {step} contradicts the checkpoint folder {model} (step {int(p.name)})")
        return resolve_model(str(p.parent.parent), int(p.name))
    if not is_run_folder(p):
        if step is not None:
            raise ConfigError(f"--step needs a run folder; {model} is not one (no run.yaml)")
        if p.exists() and not (p / "config.json").is_file():
            raise MasktrlError(f"{model}: neither a run folder (run.yaml) nor a model folder (config.json)")
        return ModelRef(label=model, weights=model)
    store = RunStore(p)
    if not store.exists():
        raise ArtifactError(f"{p / 'manifest.json'}: missing; is {model} a masktrl run?")
    if step is None:
        if not store.checkpoints():
            raise ConfigError(f"run {model} has no complete checkpoint yet; pass --step 0 for its starting policy")
        step = store.checkpoints()[-1]
    return ModelRef(label=model, weights=store.policy_path(step), store=store, cfg=store.config(), step=step)


def run_containing(path: Path) -> Path | None:
    """The run folder ``path`` is or lies in (as written, or once its symbolic links are resolved),
    else None: an analysis's ``--output`` that names a run folder itself would write into it."""
    path = Path(path)
    for candidate in (Path(os.path.normpath(path)), Path(os.path.abspath(path)), path.resolve()):
        for parent in (candidate, *candidate.parents):
            if is_run_folder(parent):
                return parent if str(parent) != "." else Path(os.getcwd())
    return None


def cache_containing(path: Path) -> Path | None:
    """The warm-start cache entry (``<out>/.cache/warmstart/<entry>``) ``path`` is or lies in, else None."""
    path = Path(path)
    for candidate in (Path(os.path.abspath(path)), path.resolve()):
        for parent in (candidate, *candidate.parents):
            if parent.parent.name == "warmstart" and parent.parent.parent.name == ".cache":
                return parent
    return None


def refuse_output_file(path: Path, what: str, *, replace: bool) -> None:
    """A file a command is about to write (rollout's parquet, eval's report), checked before any
    generation: refused when it is a folder (``--force`` cannot replace a folder with a file), or
    when it exists and ``replace`` (``--force``) is false."""
    if path.is_dir():
        raise MasktrlError(f"--output {path} is a folder; give the path of the {what} to write")
    if path.exists() and not replace:
        raise MasktrlError(f"{path} already exists; pass --force to replace it (nothing was changed)")


def refuse_inside_run(path: Path, flag: str = "--output", *, analysis_ok: bool = False) -> None:
    """ConfigError when ``path`` lies inside a run folder: a run's files are written by its own
    commands only and recorded with their hashes; a file put there by another would replace one
    of them, or be one no stage records. ``analysis_ok``: a run's ``analysis/`` folder, where the
    analyses write by default, is allowed."""
    entry = cache_containing(path)
    if entry is not None:
        raise ConfigError(
            f"{flag} {path} lies inside the warm-start cache entry {entry}; its files are masktrl's own (a file "
            "added there makes the next run build the entry again, deleting it): choose a path outside it"
        )
    run = run_containing(path)
    if run is None:
        return
    if analysis_ok:
        for candidate in (Path(os.path.abspath(path)), Path(path).resolve()):
            for root in (Path(os.path.abspath(run)), Path(run).resolve()):
                if candidate.is_relative_to(root / "analysis"):
                    return
    where = "is" if Path(os.path.abspath(path)) == Path(os.path.abspath(run)) else "lies inside"
    raise ConfigError(
        f"{flag} {path} {where} the run folder {run}; a run's files are written only by its own "
        "commands "
        f"(nothing was changed): choose a path outside it" + (" (or its analysis/ folder)" if analysis_ok else "")
    )
