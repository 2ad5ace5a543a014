"""Runs as the analyses see them (``RunInfo``, grouped by seed), and their results written as
JSON + PNG atomically.

Run folders are read through the run store (``runs/store.py``): every missing or
unreadable artifact raises ``ArtifactError`` (one line, exit code 2 on the CLI).
"""

from __future__ import annotations

import io
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from masktrl.config import Config, flatten
from masktrl.errors import ArtifactError, MasktrlError
from masktrl.io import atomic_write_bytes, atomic_write_json
from masktrl.runs.store import RunStore, is_run_folder, resolve_run

ANALYSIS_DIR = "analysis"


@dataclass
class RunInfo:
    """One run folder with its resolved config, metrics and (if complete) summary."""

    root: Path
    cfg: Config
    metrics: list[dict] = field(default_factory=list)
    summary: dict | None = None
    status: str | None = None  # RunStore.status(): running | interrupted | failed | complete | unknown

    @property
    def name(self) -> str:
        return self.root.name

    @property
    def complete(self) -> bool:
        return self.summary is not None and self.status == "complete"

    @property
    def store(self) -> RunStore:
        return RunStore(self.root)


def load_run(run: str | Path, out: Path | None = None) -> RunInfo:
    store = RunStore(resolve_run(run, out))
    return RunInfo(store.root, store.config(), store.read_metrics(), store.summary(), store.status())


def expand_runs(paths: list[Path | str], out: Path | None = None) -> list[Path]:
    """Run folders from run paths/names and folders of runs (their children with run.yaml)."""
    found: list[Path] = []
    for p in paths:
        path = Path(p)
        if not is_run_folder(path) and path.is_dir():
            children = sorted(c for c in path.iterdir() if is_run_folder(c))
            if children:
                found.extend(children)
                continue
        found.append(resolve_run(p, out))
    if not found:
        raise MasktrlError("no runs given")
    seen, unique = set(), []
    for f in found:
        if f.resolve() not in seen:
            seen.add(f.resolve())
            unique.append(f)
    return unique


# --------------------------------------------------------------------------- steps and checkpoints


def default_replay_step(root: Path) -> int:
    """The latest step S with stored rollouts whose generating checkpoint S-1 exists."""
    store = RunStore(root)
    policies = set(store.policy_steps())
    candidates = [s for s in store.rollout_steps() if s - 1 in policies]
    if not candidates:
        raise ArtifactError(
            f"{root}: no step S with both rollouts S and checkpoint S-1 (run longer or checkpoint more often)"
        )
    return candidates[-1]


# --------------------------------------------------------------------------- grouping seeds


def config_key(cfg: Config) -> str:
    """The config with the seed removed and every method parameter resolved (``dppo`` and
    ``dppo:divergence=topk-kl``, its default, are one config): runs with the same key differ
    only in seed."""
    d = cfg.to_dict()
    d.pop("seed", None)
    d["method"] = cfg.resolved_method()
    return json.dumps(d, sort_keys=True, default=str)


def task_difference(a: Config, b: Config) -> tuple[str, str] | None:
    """Where two configs' tasks differ: the first ``task.*`` key they do not share, as
    (``task.k=<a's value>``, ``task.k=<b's value>``); None when they share one task."""
    first, other = flatten(a.to_dict().get("task", {})), flatten(b.to_dict().get("task", {}))
    diff = sorted(k for k in set(first) | set(other) if first.get(k) != other.get(k))
    if not diff:
        return None
    k = diff[0]
    return f"task.{k}={first.get(k)}", f"task.{k}={other.get(k)}"


def strip_seed(name: str) -> str:
    return re.sub(r"[-_.]?(seed|s)\d+([-_.]retry\d+)?$", "", name)


def group_runs(runs: list[RunInfo]) -> list[tuple[str, list[RunInfo]]]:
    """Runs grouped by config-minus-seed, in first-seen order, with readable unique labels.

    The label is the method name; groups that share it are told apart by the fewest config keys
    that separate them (``distinguishing_keys``: method parameters first, then other keys),
    shown as ``method[key=value,...]`` (a method key without its ``method.`` prefix). The group that
    leaves every shown key unset (plain ``grpo`` beside ``grpo`` with a ``method.correction``) is
    labelled by the method name alone, so ``--baseline grpo`` finds it.
    """
    groups: dict[str, list[RunInfo]] = {}
    for r in runs:
        groups.setdefault(config_key(r.cfg), []).append(r)
    by_method: dict[str, list[str]] = {}
    for key, members in groups.items():
        by_method.setdefault(members[0].cfg.method_name, []).append(key)
    labels: dict[str, str] = {}
    for method, keys in by_method.items():
        if len(keys) == 1:
            labels[keys[0]] = method
            continue
        flat = {k: flatten(json.loads(k)) for k in keys}
        shown = distinguishing_keys([flat[k] for k in keys])
        for k in keys:
            if all(flat[k].get(f) is None for f in shown):
                labels[k] = method  # the plain method: it leaves unset every key the others set
                continue
            parts = [f"{f.split('.', 1)[1] if f.startswith('method.') else f}={flat[k].get(f)}" for f in shown]
            labels[k] = f"{method}[{','.join(parts)}]"
    return [(labels[k], sorted(m, key=lambda r: r.cfg.seed)) for k, m in groups.items()]


def check_one_run_per_seed(groups: list[tuple[str, list[RunInfo]]], *, runs: str = "complete runs") -> None:
    """``MasktrlError`` naming two ``runs`` of one config with the same seed (a copied run folder,
    or a rerun): the run is the unit of a comparison and of a band over seeds, and a seed counted
    twice narrows every interval with no new evidence."""
    for label, members in groups:
        seen: dict[int, RunInfo] = {}
        for r in members:
            if r.cfg.seed in seen:
                raise MasktrlError(
                    f"{seen[r.cfg.seed].root} and {r.root} are two {runs} of {label} with seed "
                    f"{r.cfg.seed} (the same config: a copy or a rerun); the run is the unit of the "
                    "comparison: give one of them"
                )
            seen[r.cfg.seed] = r


def distinguishing_keys(configs: list[dict]) -> list[str]:
    """The fewest keys (greedy) whose values tell the flat ``configs`` apart: at each round the
    differing key that separates the most groups, the rule (``method.name``: a rule from a file
    registered under a shipped rule's name) before method parameters before other keys, then the
    key that fewer configs leave unset (None or "none": a set value tells more, so
    ``correction.mode=decoupled`` is shown rather than ``correction.kind`` None vs none), then by
    name. Keys no two configs differ in are never shown."""
    differing = sorted(
        {f for c in configs for f in c if len({json.dumps(o.get(f), default=str) for o in configs}) > 1},
        key=lambda f: (not f.startswith("method."), f),
    )
    chosen: list[str] = []

    def n_distinct(keys):
        return len({tuple(json.dumps(c.get(f), default=str) for f in keys) for c in configs})

    def n_unset(f):
        return sum(c.get(f) in (None, "none") for c in configs)

    while differing and n_distinct(chosen) < len(configs):
        best = max(
            differing,
            key=lambda f: (
                n_distinct(chosen + [f]),
                f == "method.name",  # another rule under a shipped rule's name: the rule, not a parameter it differs in
                f.startswith("method."),
                -n_unset(f),
                -differing.index(f),
            ),
        )
        if n_distinct(chosen + [best]) == n_distinct(chosen):
            break
        chosen.append(best)
        differing.remove(best)
    return sorted(chosen, key=lambda f: (not f.startswith("method."), f))


# --------------------------------------------------------------------------- outputs


def analysis_dir(root: Path) -> Path:
    """``<run>/analysis``, where an analysis of one run writes; a run folder that is a symbolic
    link is refused (``runs.locks.refuse_symlink``): its files would land outside ``--out``."""
    from masktrl.runs.locks import refuse_symlink

    refuse_symlink(root)
    return Path(root) / ANALYSIS_DIR


def multi_run_dir(runs: list[Path], out: Path | None) -> Path:
    """Where a multi-run analysis writes: ``out``, else the first run's parent ``analysis/``."""
    return Path(out) if out is not None else Path(runs[0]).parent / ANALYSIS_DIR


def write_json(path: Path, obj) -> Path:
    atomic_write_json(path, _finite(obj))
    return path


def write_table(path: Path, columns: dict) -> Path:
    """Columns of equal length (numpy arrays; strings as object arrays) as one parquet file,
    written atomically (zstd)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({k: pa.array(v.tolist() if v.dtype == object else v) for k, v in columns.items()})
    buf = pa.BufferOutputStream()
    pq.write_table(table, buf, compression="zstd")
    atomic_write_bytes(path, buf.getvalue().to_pybytes())
    return path


def read_table(path: Path) -> dict:
    """A parquet file written by ``write_table`` as {column: numpy array}."""
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    return {
        name: np.asarray(col.to_numpy(zero_copy_only=False)) for name, col in zip(table.column_names, table.columns)
    }


class _Figures:
    """``masktrl.analysis.plots``, imported at its first use (``figures``)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)

    def __getattr__(self, name: str):
        from masktrl.caches import settle_matplotlib

        settle_matplotlib(self.folder)
        from masktrl.analysis import plots

        return getattr(plots, name)


def figures(folder: Path) -> _Figures:
    """The plotting functions for figures drawn into ``folder``: matplotlib is imported at the
    first one, after the analysis wrote its JSON there, with its cache where
    ``caches.settle_matplotlib`` puts it (never the current folder or /tmp)."""
    return _Figures(folder)


def save_figure(fig, path: Path) -> Path:
    """Render a ``matplotlib.figure.Figure`` to PNG in memory (Agg) and write it atomically."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    atomic_write_bytes(path, buf.getvalue())
    return path


def _finite(obj):
    """JSON-safe copy: NaN and +-inf become None (strict JSON has no NaN)."""
    if isinstance(obj, float):
        return obj if obj == obj and obj not in (float("inf"), float("-inf")) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    if hasattr(obj, "item") and not isinstance(obj, (str, bytes)):
        return _finite(obj.item())
    return obj
