"""``masktrl train``."""

from __future__ import annotations

import contextlib
import signal
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from masktrl.config import load_config
from masktrl.commands.ui import console, err_console, kv_table, progress_bar
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
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Run every check, print the resolved config and the projected disk use, write nothing.")
    ] = False,
) -> None:
    """Run RL training (default: the embedded tiny model on synthetic arithmetic, GRPO).

    Artifacts go to OUT/RUN: run.yaml, manifest.json, metrics.jsonl, steps/*/rollouts.parquet,
    checkpoints/*, summary.json. Ctrl-C or SIGTERM finishes the current step, checkpoints it and
    leaves a run that --resume (or the same command again) continues. Re-running the command of
    a failed run continues it, or starts it again in place if its config changed before any
    checkpoint (docs/RELIABILITY.md).
    """
    from masktrl.rl import checks
    from masktrl.runs.plan import Start, plan_start
    from masktrl.rl.distributed import launch_rank
    from masktrl.runs.store import RunStore, check_run_name, is_run_folder, resolve_run
    from masktrl.rl.signals import Interrupted
    from masktrl.recipes.train import train as run_training

    main = launch_rank() == 0  # under accelerate launch the main process decides and writes; the others follow
    if resume:
        root = resolve_run(resume, out)
        plan = Start(root, "resume")
    else:
        cfg = load_config(config, set_ or [], method=method, seed=seed)
        name = check_run_name(run) if run is not None else f"{cfg.method_name}-{time.strftime('%Y%m%d-%H%M%S')}"
        root = Path(out) / name
        plan = plan_start(root, cfg) if main else Start(root, "new")
    if rollouts_from and not Path(rollouts_from).exists() and is_run_folder(Path(out) / rollouts_from):
        rollouts_from = str(Path(out) / rollouts_from)  # a run given by name
    store, changed = RunStore(root), []
    if plan.mode == "resume":
        store.check_resumable()
        cfg, changed = _resume_config(store, config, set_, method, seed, force) if resume else (cfg, [])
    checked = checks.check(cfg, rollouts_from=rollouts_from, out=Path(out))  # everything that needs no write
    try:
        if dry_run:
            from masktrl.recipes import preflight

            print_dry_run(cfg, preflight.run(cfg, plan, checked))
            return
        with store.writing() if main and plan.mode != "new" else contextlib.nullcontext():  # one writer from here on
            if main and plan.mode != "new":  # again, under the lock: another process may have moved the run on
                if not resume:
                    plan = plan_start(root, cfg)
                if plan.mode == "resume":
                    store.check_resumable()
                    store.resume_step(checked.vocab_size)  # every artifact the resumed run reads, before --force records the config
            verb = {"resume": "resuming", "restart": "restarting"}.get(plan.mode, "run")
            console.print(f"[bold]masktrl train[/] {verb} [cyan]{root.name}[/] method [cyan]{cfg.method_name}[/] seed {cfg.seed}")
            if plan.note and not resume:
                console.print(plan.note, highlight=False)
            with progress_bar() as progress:
                result = run_training(cfg, store, progress, resume=plan.mode == "resume", restart=plan.mode == "restart",
                                      rollouts_from=rollouts_from, checked=checked, forced_changes=changed)
    except Interrupted as exc:
        done = store.checkpoints() if store.exists() else []
        where = f"after checkpoint {done[-1]}" if done else "before its first checkpoint"
        err_console.print(f"[yellow]interrupted[/] ({signal.Signals(exc.signum).name}): run {root.name} stopped {where}; "
                          "`masktrl train --resume` (or the same command) continues it", highlight=False, soft_wrap=True)
        raise typer.Exit(128 + exc.signum) from None
    finally:
        checked.task.close()
    if result.is_main:
        print_summary(result.summary, store.root)


def _resume_config(store, config, set_, method, seed, force: bool):
    """(run.yaml, or the given config/overrides if they agree with it or --force; the keys that differ)."""
    from masktrl.config import diff_configs

    saved_path = store.root / "run.yaml"
    saved = store.config()
    if not config and not set_ and method is None and seed is None:
        return saved, []
    cfg = load_config(config or [saved_path], set_ or [], method=method, seed=seed)
    changed = diff_configs(saved, cfg)
    if changed and not force:
        raise MasktrlError(f"config differs from {saved_path} in {', '.join(changed)}; pass --force to resume with it anyway")
    return cfg, changed


def print_dry_run(cfg, rows) -> None:
    """What ``--dry-run`` found: the resolved config, what would happen to the run folder, the
    checks that passed and the projected disk use. Nothing was written."""
    import yaml

    console.print("[bold]masktrl train --dry-run[/]: every check passed; nothing was written", highlight=False)
    console.print(yaml.safe_dump(cfg.to_dict(), sort_keys=False).rstrip(), highlight=False, markup=False)
    console.print(kv_table("checks", rows))


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
