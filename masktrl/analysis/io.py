"""Reading run folders for the analyses, and writing their results (JSON + PNG) atomically.

A run folder ``<out>/<run>/`` holds run.yaml, manifest.json, metrics.jsonl, summary.json,
steps/<step>/rollouts.parquet and checkpoints/<step>/ (see ``pipeline/store.py``). Every
missing or unreadable artifact raises ``ArtifactError`` (one line, exit code 2 on the CLI).
"""

from __future__ import annotations

import io
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from masktrl.config import Config, from_dict, flatten
from masktrl.errors import ArtifactError, ConfigError, MasktrlError
from masktrl.io import atomic_write_bytes, atomic_write_json
from masktrl.pipeline.store import RunStore

ANALYSIS_DIR = "analysis"


@dataclass
class RunInfo:
    """One run folder with its resolved config, metrics and (if complete) summary."""

    root: Path
    cfg: Config
    metrics: list[dict] = field(default_factory=list)
    summary: dict | None = None
    status: str | None = None  # manifest status: running | complete | None

    @property
    def name(self) -> str:
        return self.root.name

    @property
    def complete(self) -> bool:
        return self.summary is not None and self.status == "complete"

    @property
    def store(self) -> RunStore:
        return RunStore(self.root)


def resolve_run(run: str | Path, out: Path | None = None) -> Path:
    """A run folder from a path, or from a name under ``out``; ArtifactError if neither exists."""
    candidates = [Path(run)]
    if out is not None:
        candidates.append(Path(out) / str(run))
    for path in candidates:
        if (path / "run.yaml").is_file():
            return path
    for path in candidates:
        if path.is_dir():
            raise ArtifactError(f"{path}: not a masktrl run folder (no run.yaml)")
    where = f" (looked in . and {out})" if out is not None else ""
    raise ArtifactError(f"unknown run {run}: no such folder{where}")


def load_config_of(root: Path) -> Config:
    path = Path(root) / "run.yaml"
    try:
        raw = yaml.safe_load(path.read_text())
        return from_dict(raw or {})
    except (OSError, yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{path}: unreadable run config ({str(exc).splitlines()[0]})") from None
    except ConfigError as exc:
        raise ArtifactError(f"{path}: invalid run config ({exc})") from None


def load_run(run: str | Path, out: Path | None = None) -> RunInfo:
    root = resolve_run(run, out)
    cfg = load_config_of(root)
    store = RunStore(root)
    summary = None
    if (root / "summary.json").is_file():
        try:
            summary = json.loads((root / "summary.json").read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ArtifactError(f"{root / 'summary.json'}: unreadable (corrupted)") from None
    status = store.manifest.get("status") if store.exists() else None
    return RunInfo(root, cfg, store.read_metrics(), summary, status)


def expand_runs(paths: list[Path | str], out: Path | None = None) -> list[Path]:
    """Run folders from run paths/names and folders of runs (their children with run.yaml)."""
    found: list[Path] = []
    for p in paths:
        path = Path(p)
        if not (path / "run.yaml").is_file() and path.is_dir():
            children = sorted(c for c in path.iterdir() if (c / "run.yaml").is_file())
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


def rollout_steps(root: Path) -> list[int]:
    steps_dir = Path(root) / "steps"
    if not steps_dir.is_dir():
        return []
    return sorted(int(p.name) for p in steps_dir.iterdir() if p.name.isdigit() and (p / "rollouts.parquet").is_file())


def checkpoint_steps(root: Path) -> list[int]:
    """Saved checkpoints (step numbers); 0 (the warm-start policy) is always included when known."""
    ck = Path(root) / "checkpoints"
    steps = sorted(int(p.name) for p in ck.iterdir() if p.name.isdigit() and (p / "config.json").is_file()) if ck.is_dir() else []
    ws = warmstart_path(root)
    if ws is not None and (not Path(ws).exists() or (Path(ws) / "config.json").is_file()):
        steps = [0] + steps  # a hub id, or a local folder that is still there
    return steps


def warmstart_path(root: Path) -> str | None:
    """Where the RL start policy lives (the manifest's warm-start info), or None if unknown."""
    store = RunStore(root)
    if not store.exists():
        return None
    stage = store.stage("warmstart") or {}
    info = stage.get("info") or {}
    path = info.get("path") or info.get("source")
    if path is None or path == "tiny":
        return None
    return str(path)


def checkpoint_path(root: Path, step: int) -> str:
    """The weights after ``step`` updates; step 0 is the warm-start policy from the manifest."""
    if step == 0:
        path = warmstart_path(root)
        if path is None:
            raise ArtifactError(f"{root}: the manifest records no warm-start policy (checkpoint 0)")
        if Path(path).exists() and not (Path(path) / "config.json").is_file():
            raise ArtifactError(f"{path}: warm-start policy is missing (was the .cache folder removed?)")
        return path
    path = Path(root) / "checkpoints" / f"{step:06d}"
    if not (path / "config.json").is_file():
        have = ", ".join(str(s) for s in checkpoint_steps(root)) or "none"
        raise ArtifactError(f"{root}: no checkpoint {step} (checkpoints: {have})")
    return str(path)


def rollout_path(root: Path, step: int) -> Path:
    path = Path(root) / "steps" / f"{step:06d}" / "rollouts.parquet"
    if not path.is_file():
        have = rollout_steps(root)
        span = f"{have[0]}..{have[-1]}" if have else "none"
        raise ArtifactError(f"{root}: no rollouts for step {step} (stored steps: {span})")
    return path


def default_replay_step(root: Path) -> int:
    """The latest step S with stored rollouts whose generating checkpoint S-1 exists."""
    ckpts = set(checkpoint_steps(root))
    candidates = [s for s in rollout_steps(root) if s - 1 in ckpts]
    if not candidates:
        raise ArtifactError(f"{root}: no step S with both rollouts S and checkpoint S-1 (run longer or checkpoint more often)")
    return candidates[-1]


# --------------------------------------------------------------------------- grouping seeds


def config_key(cfg: Config) -> str:
    """The config with the seed removed: runs with the same key differ only in seed."""
    d = cfg.to_dict()
    d.pop("seed", None)
    return json.dumps(d, sort_keys=True, default=str)


def strip_seed(name: str) -> str:
    return re.sub(r"[-_.]?(seed|s)\d+([-_.]retry\d+)?$", "", name)


def group_runs(runs: list[RunInfo]) -> list[tuple[str, list[RunInfo]]]:
    """Runs grouped by config-minus-seed, in first-seen order, with readable unique labels.

    The label is the method name; groups that share it are told apart by the method
    parameters, then the other config keys, in which they differ.
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
        differing = sorted({f for k in keys for f in flat[k] if len({json.dumps(flat[o].get(f)) for o in keys}) > 1})
        method_keys = [f for f in differing if f.startswith("method.")]
        shown = method_keys or differing
        for k in keys:
            parts = [f"{f.split('.', 1)[1] if f.startswith('method.') else f}={flat[k].get(f)}" for f in shown]
            labels[k] = f"{method}[{','.join(parts)}]"
    return [(labels[k], sorted(m, key=lambda r: r.cfg.seed)) for k, m in groups.items()]




# --------------------------------------------------------------------------- outputs


def analysis_dir(root: Path) -> Path:
    return Path(root) / ANALYSIS_DIR


def multi_run_dir(runs: list[Path], out: Path | None) -> Path:
    """Where a multi-run analysis writes: ``out``, else the first run's parent ``analysis/``."""
    return Path(out) if out is not None else Path(runs[0]).parent / ANALYSIS_DIR


def write_json(path: Path, obj) -> Path:
    atomic_write_json(path, _finite(obj))
    return path


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
