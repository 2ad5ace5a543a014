"""``masktrl sweep``."""

from __future__ import annotations

from pathlib import Path

from masktrl.commands import sweep_options
from masktrl.commands.options import DEFAULT_OUT, ConfigOpt, OutOpt, SetOpt
from masktrl.commands.ui import console, plain, progress_bar


def sweep(
    methods: sweep_options.MethodsOpt = "grpo,dppo,pdm,sis",
    seeds: sweep_options.SeedsOpt = "3",
    config: ConfigOpt = None,
    out: OutOpt = DEFAULT_OUT,
    set_: SetOpt = None,
    baseline: sweep_options.BaselineOpt = None,
    launcher: sweep_options.LauncherOpt = "local",
    print_commands: sweep_options.PrintCommandsOpt = False,
    slurm_opts: sweep_options.SlurmOptsOpt = None,
    accelerate_config: sweep_options.AccelerateConfigOpt = None,
    no_submit: sweep_options.NoSubmitOpt = False,
    resubmit: sweep_options.ResubmitOpt = False,
) -> None:
    """Train every method x seed (runs <method>-seed<k> under OUT, one after another), then print the compare table.

    Resumable: complete runs are skipped, interrupted ones resume from their last checkpoint, one that cannot resume
    starts again as <method>-seed<k>-retry<i> (nothing stored is deleted).
    With --launcher slurm each run still to do becomes one sbatch job (scripts in OUT/.sweep/slurm/); run the same
    command again later: finished runs are skipped, runs whose job is still queued or running are left alone, the rest
    are submitted again, and the compare table is printed once every run is complete.
    """
    from masktrl.analysis import compare as cmp
    from masktrl.analysis.io import load_run, multi_run_dir
    from masktrl.commands.analyze import print_compare
    from masktrl.recipes import sweep as stage
    from masktrl.rl.tracking import check_available as check_trackers

    stage.check_launcher(launcher, accelerate_config, print_commands)
    method_list = stage.parse_methods(methods)
    seed_list = stage.parse_seeds(seeds)
    stage.check_flags(method_list, set_ or [], baseline, launcher, no_submit=no_submit, resubmit=resubmit)
    items = stage.plan(
        Path(out), method_list, seed_list, config, set_ or [], busy_ok=print_commands or launcher == "slurm"
    )
    for item in items:  # every run's trackers are importable, before anything starts
        check_trackers(item.cfg.train.report_to)
    if print_commands or launcher == "slurm":
        launch_runs(
            items,
            Path(out),
            config,
            set_ or [],
            accelerate_config,
            print_only=print_commands,
            options=slurm_opts or [],
            submit=not no_submit,
            resubmit=resubmit,
        )
        if print_commands or not all(i.state == "complete" for i in items):
            return
    todo = sum(i.state != "complete" for i in items)
    console.print(
        f"[bold]masktrl sweep[/] {len(method_list)} methods x {len(seed_list)} seeds: "
        f"{len(items) - todo} complete, {todo} to run, under {plain(out)}"
    )
    stage.run(items, progress_bar, lambda event, item: print_event(event, item, items))
    roots = [i.root for i in items]
    base = baseline or ("grpo" if "grpo" in method_list else method_list[0])
    # a swept spec (grpo:correction.kind=icepop) is found by one of its runs' folders: compare's
    # labels are method names with the keys that tell groups apart, not the spec
    base = next((str(i.root) for i in items if i.method == base), base)
    table = cmp.compare([load_run(r) for r in roots], base)
    paths = cmp.save(table, multi_run_dir(roots, None))
    print_compare(table)
    console.print("wrote " + ", ".join(plain(p) for p in paths), highlight=False)


def print_event(event: str, item, items) -> None:
    n = items.index(item) + 1
    for root in item.incomplete:
        if not (item.state == "resume" and root == item.root):
            console.print(f"[yellow]incomplete run[/] {plain(root)} (cannot resume; left as it is)", highlight=False)
    if event == "skip":
        console.print(f"[{n}/{len(items)}] skip [cyan]{plain(item.root.name)}[/] (complete)", highlight=False)
        return
    note = {"resume": " (resuming an interrupted run)", "retry": " (fresh restart of an incomplete run)"}.get(
        item.state, ""
    )
    console.print(f"[{n}/{len(items)}] train [cyan]{plain(item.root.name)}[/]{note}", highlight=False)


def launch_runs(
    items,
    out: Path,
    config,
    overrides: list[str],
    accelerate_config,
    *,
    print_only: bool,
    options: list[str],
    submit: bool,
    resubmit: bool,
) -> None:
    """--print-commands (print each run's command) or --launcher slurm (one sbatch job per run)."""
    from masktrl.recipes import slurm

    how = slurm.SlurmOptions(tuple(options), submit=submit, resubmit=resubmit)
    for line in slurm.launch(items, out, config, overrides, accelerate_config, print_only=print_only, slurm=how):
        console.print(line, highlight=False, markup=False, soft_wrap=True)
