"""``masktrl sweep``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from masktrl.commands.ui import console, progress_bar
from masktrl.commands.options import DEFAULT_OUT, ConfigOpt, OutOpt, SetOpt


def sweep(
    methods: Annotated[str, typer.Option("--methods", metavar="LIST", help="Comma-separated methods (parameters via --set method.X=...).")] = "grpo,dppo,pdm,sis",
    seeds: Annotated[str, typer.Option("--seeds", metavar="N|LIST", help="A count (3: seeds 0,1,2) or a list (0,4,7).")] = "3",
    config: ConfigOpt = None,
    out: OutOpt = DEFAULT_OUT,
    set_: SetOpt = None,
    baseline: Annotated[
        Optional[str], typer.Option("--baseline", metavar="METHOD", help="Method the compare table tests against (default: grpo if swept, else the first).", show_default=False)
    ] = None,
) -> None:
    """Train every method x seed (runs <method>-seed<k> under OUT, one after another), then print the compare table.

    Resumable: complete runs are skipped, interrupted ones resume from their last checkpoint, one that cannot resume starts again as <method>-seed<k>-retry<i> (nothing stored is deleted).
    """
    from masktrl.analysis import compare as cmp
    from masktrl.analysis.io import load_run, multi_run_dir
    from masktrl.commands.analyze import print_compare
    from masktrl.pipeline import sweep as stage

    method_list = stage.parse_methods(methods)
    seed_list = stage.parse_seeds(seeds)
    items = stage.plan(Path(out), method_list, seed_list, config, set_ or [])
    todo = sum(i.state != "complete" for i in items)
    console.print(f"[bold]masktrl sweep[/] {len(method_list)} methods x {len(seed_list)} seeds: {len(items) - todo} complete, {todo} to run, under {out}")
    for n, item in enumerate(items, 1):
        for root in item.incomplete:
            if not (item.state == "resume" and root == item.root):
                console.print(f"[yellow]incomplete run[/] {root} (cannot resume; left as it is)", highlight=False)
        if item.state == "complete":
            console.print(f"[{n}/{len(items)}] skip [cyan]{item.root.name}[/] (complete)", highlight=False)
            continue
        note = {"resume": " (resuming an interrupted run)", "retry": " (fresh restart of an incomplete run)"}.get(item.state, "")
        console.print(f"[{n}/{len(items)}] train [cyan]{item.root.name}[/]{note}", highlight=False)
        with progress_bar() as progress:
            stage.run_one(item, progress)
    roots = [i.root for i in items]
    base = baseline or ("grpo" if "grpo" in method_list else method_list[0])
    table = cmp.compare([load_run(r) for r in roots], base)
    paths = cmp.save(table, multi_run_dir(roots, None))
    print_compare(table)
    console.print("wrote " + ", ".join(str(p) for p in paths), highlight=False)
