"""``masktrl train``."""

from __future__ import annotations

import signal
from pathlib import Path

import typer

from masktrl.commands import train_options
from masktrl.commands.options import DEFAULT_OUT, ConfigOpt, MethodOpt, OutOpt, RunOpt, SeedOpt, SetOpt
from masktrl.commands.ui import console, err_console, kv_table, plain, progress_bar


def train(
    config: ConfigOpt = None,
    method: MethodOpt = None,
    run: RunOpt = None,
    out: OutOpt = DEFAULT_OUT,
    seed: SeedOpt = None,
    set_: SetOpt = None,
    resume: train_options.ResumeOpt = None,
    force: train_options.ForceOpt = False,
    rollouts_from: train_options.RolloutsFromOpt = None,
    dry_run: train_options.DryRunOpt = False,
) -> None:
    """Run RL training (default: the embedded tiny model on synthetic arithmetic, GRPO).

    Artifacts go to OUT/RUN: run.yaml, manifest.json, metrics.jsonl, steps/*/rollouts.parquet,
    checkpoints/*, summary.json. Ctrl-C or SIGTERM finishes the current step, checkpoints it and
    leaves a run that --resume (or the same command again) continues. Re-running the command of
    a failed run continues it, or starts it again in place if its config changed before any
    checkpoint (docs/RELIABILITY.md).
    """
    from masktrl.recipes import preflight
    from masktrl.recipes import train as recipe
    from masktrl.rl.distributed import launch_rank
    from masktrl.rl.signals import Interrupted
    from masktrl.runs.plan import RunRequest, plan_run

    request = RunRequest(
        tuple(config) if config else None, method, run, Path(out), seed, tuple(set_ or ()), resume, force, rollouts_from
    )
    if dry_run:
        print_dry_run(preflight.run(request))
        return
    try:
        plan = plan_run(request, main=launch_rank() == 0)  # only the main process of a launch decides
        with progress_bar() as progress:
            result = recipe.train(plan, progress, on_start=print_start)
    except Interrupted as exc:
        done = getattr(exc, "checkpoints", [])
        where = f"after checkpoint {done[-1]}" if done else "before its first checkpoint"
        err_console.print(
            f"[yellow]interrupted[/] ({signal.Signals(exc.signum).name}): run "
            f"{getattr(exc, 'run', '')} stopped {where}; "
            "`masktrl train --resume` (or the same command) continues it",
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(128 + exc.signum) from None
    if result.is_main:
        if result.note:
            console.print(result.note, highlight=False, markup=False, soft_wrap=True)
        print_summary(result.summary, result.store.root)


def print_start(plan) -> None:
    verb = {"resume": "resuming", "restart": "restarting"}.get(plan.start.mode, "run")
    console.print(
        f"[bold]masktrl train[/] {verb} [cyan]{plain(plan.root.name)}[/] method "
        f"[cyan]{plain(plan.cfg.method_name)}[/] seed {plan.cfg.seed}"
    )
    if plan.start.note and not plan.explicit_resume:
        console.print(plain(plan.start.note), highlight=False)


def print_dry_run(dry) -> None:
    """What ``--dry-run`` found: the resolved config, what would happen to the run folder, the
    checks that passed and the projected disk use. Nothing was written."""
    import yaml

    console.print("[bold]masktrl train --dry-run[/]: every check passed; nothing was written", highlight=False)
    console.print(yaml.safe_dump(dry.cfg.to_dict(), sort_keys=False).rstrip(), highlight=False, markup=False)
    console.print(kv_table("checks", dry.rows))


def print_summary(summary: dict, root: Path) -> None:
    rows = [(key, str(summary[key])) for key in ("method", "seed", "steps", "eval_decoding")]
    rows += [
        ("held-out accuracy before RL", f"{summary['eval_before']:.3f}"),
        ("held-out accuracy after RL", f"{summary['eval_after']:.3f}"),
        ("change", f"{summary['eval_after'] - summary['eval_before']:+.3f}"),
        *(
            [("held-out accuracy, tool forbidden", f"{summary['eval_after_no_tool']:.3f}")]
            if summary.get("eval_after_no_tool") is not None
            else []
        ),
        ("wall time", f"{summary['wall_time_s']:.0f} s"),
    ]
    console.print(kv_table(f"run {plain(summary['run'])}", rows))
    console.print(f"artifacts: {plain(root)}", highlight=False)
