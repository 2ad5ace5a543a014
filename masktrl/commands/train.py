"""``masktrl train``."""

from __future__ import annotations

import time
from pathlib import Path

from masktrl.commands.ui import console, kv_table, progress_bar
from masktrl.errors import MasktrlError
from masktrl.options import DEFAULT_OUT, ConfigOpt, MethodOpt, OutOpt, RunOpt, SeedOpt, SetOpt


def train(
    config: ConfigOpt = None,
    method: MethodOpt = None,
    run: RunOpt = None,
    out: OutOpt = DEFAULT_OUT,
    seed: SeedOpt = None,
    set_: SetOpt = None,
) -> None:
    """Run RL training (default: the embedded tiny model on synthetic arithmetic, GRPO).

    Artifacts go to OUT/RUN: run.yaml, manifest.json, metrics.jsonl, steps/*/rollouts.parquet,
    checkpoints/*, summary.json.
    """
    from masktrl.config import load_config
    from masktrl.pipeline import train as train_stage
    from masktrl.pipeline.store import RunStore

    cfg = load_config(config, set_ or [], method=method, seed=seed)
    name = run or f"{cfg.method_name}-{time.strftime('%Y%m%d-%H%M%S')}"
    store = RunStore(Path(out) / name)
    if store.root.exists() and any(store.root.iterdir()):
        raise MasktrlError(f"run folder {store.root} already exists: choose another --run (nothing was changed)")
    console.print(f"[bold]masktrl train[/] run [cyan]{name}[/] method [cyan]{cfg.method_name}[/] seed {cfg.seed}")
    with progress_bar() as progress:
        result = train_stage.run(cfg, store, progress)
    print_summary(result.summary, store.root)


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
