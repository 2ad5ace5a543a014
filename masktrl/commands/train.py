"""``masktrl train``."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from masktrl.config import load_config
from masktrl.commands.ui import console, kv_table, progress_bar
from masktrl.errors import MasktrlError
from masktrl.commands.options import DEFAULT_OUT, ConfigOpt, MethodOpt, OutOpt, RunOpt, SeedOpt, SetOpt


def train(
    config: ConfigOpt = None,
    method: MethodOpt = None,
    run: RunOpt = None,
    out: OutOpt = DEFAULT_OUT,
    seed: SeedOpt = None,
    set_: SetOpt = None,
    resume: Annotated[
        Optional[str], typer.Option("--resume", metavar="RUN", help="Continue RUN (a name under --out, or a folder) from its last checkpoint.", show_default=False)
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="With --resume: accept a config that differs from run.yaml.")] = False,
    rollouts_from: Annotated[
        Optional[str],
        typer.Option("--rollouts-from", metavar="RUN|FILE", help="Train on stored rollouts: a run (folder, or name under --out) or a parquet file from `masktrl rollout`.", show_default=False),
    ] = None,
) -> None:
    """Run RL training (default: the embedded tiny model on synthetic arithmetic, GRPO).

    Artifacts go to OUT/RUN: run.yaml, manifest.json, metrics.jsonl, steps/*/rollouts.parquet,
    checkpoints/*, summary.json. Ctrl-C finishes the current step, checkpoints it and leaves a
    run that --resume continues.
    """
    from masktrl.pipeline.train import train as run_training
    from masktrl.pipeline.distributed import launch_rank
    from masktrl.pipeline.runstore import RunStore, is_run_folder, resolve_run

    if resume:
        store = RunStore(resolve_run(resume, out))
        store.check_resumable()
        store.resume_step()  # every artifact the resumed run reads is checked before anything is written (--force records the config)
        cfg = _resume_config(store, config, set_, method, seed, force)
        name = store.name
    else:
        cfg = load_config(config, set_ or [], method=method, seed=seed)
        name = run or f"{cfg.method_name}-{time.strftime('%Y%m%d-%H%M%S')}"
        store = RunStore(Path(out) / name)
        if store.root.exists() and any(store.root.iterdir()) and launch_rank() == 0:  # other ranks: the main one creates it
            raise MasktrlError(f"run folder {store.root} already exists: choose another --run, or --resume it (nothing was changed)")
    if rollouts_from and not Path(rollouts_from).exists() and is_run_folder(Path(out) / rollouts_from):
        rollouts_from = str(Path(out) / rollouts_from)  # a run given by name
    verb = "resuming" if resume else "run"
    console.print(f"[bold]masktrl train[/] {verb} [cyan]{name}[/] method [cyan]{cfg.method_name}[/] seed {cfg.seed}")
    with progress_bar() as progress:
        result = run_training(cfg, store, progress, resume=bool(resume), rollouts_from=rollouts_from)
    if result.is_main:
        print_summary(result.summary, store.root)


def _resume_config(store, config, set_, method, seed, force: bool):
    """run.yaml, or the given config/overrides if they agree with it (or --force)."""
    from masktrl.config import diff_configs
    from masktrl.pipeline.distributed import launch_rank

    saved_path = store.root / "run.yaml"
    saved = store.config()
    if not config and not set_ and method is None and seed is None:
        return saved
    cfg = load_config(config or [saved_path], set_ or [], method=method, seed=seed)
    changed = diff_configs(saved, cfg)
    if changed and not force:
        raise MasktrlError(f"config differs from {saved_path} in {', '.join(changed)}; pass --force to resume with it anyway")
    if changed and launch_rank() == 0:
        store.record_config(cfg, forced_changes=changed)
    return cfg


def print_summary(summary: dict, root: Path) -> None:
    rows = [(key, str(summary[key])) for key in ("method", "seed", "steps", "eval_decoding")]
    rows += [
        ("held-out accuracy before RL", f"{summary['eval_before']:.3f}"),
        ("held-out accuracy after RL", f"{summary['eval_after']:.3f}"),
        ("change", f"{summary['eval_after'] - summary['eval_before']:+.3f}"),
        ("wall time", f"{summary['wall_time_s']:.0f} s"),
    ]
    console.print(kv_table(f"run {summary['run']}", rows))
    console.print(f"artifacts: {root}")
