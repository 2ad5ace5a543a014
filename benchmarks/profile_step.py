"""Where one masktrl RL step spends its time, on the tiny default (configs/tiny.yaml).

Runs the real training loop (``masktrl.recipes.train.train``) for ``--steps`` steps and times
each stage by wrapping the functions that implement it (benchmarks/common.py, PhaseTimer):
rollout (transformers generate, logprob/top-K extraction, decode + scoring + advantages),
log-probability recomputation (policy forward, token_logprobs at the sampled and top-K ids,
entropy, batch assembly), loss, backward, optimizer (clip + AdamW + scheduler + zero_grad),
diagnostics, and artifact I/O (rollout parquet, manifest, metrics line). Checkpoints are
timed where they happen and amortised over ``train.checkpoint_every`` steps.

The first step (allocator and cache warm-up) is left out of the shares.

    python benchmarks/profile_step.py                       # tiny default, grpo
    python benchmarks/profile_step.py --method dapo --json outputs/bench/profile.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    PhaseTimer,
    bench_config,
    count,
    group_phases,
    machine,
    median,
    parser,
    print_table,
    quiet,
    run_masktrl,
    warm_model,
    wrap_masktrl_phases,
    write_json,
)

IO_GOAL = 0.05


def main(argv=None) -> dict:
    p = parser(__doc__.split("\n")[0])
    p.add_argument("--steps", type=count, default=40, help="RL steps of the profiled run (the first is not counted)")
    p.add_argument("--method", default=None, help="method name (default: the preset's)")
    p.add_argument(
        "--full-run-steps",
        type=int,
        default=800,
        help="run length for the manifest-growth probe (the preset's train.steps)",
    )
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override, repeatable")
    args = p.parse_args(argv)
    quiet()

    # Checkpoint every 10 steps so several are timed (the first, cold one includes one-time
    # imports), then amortise the median over the preset's own checkpoint_every.
    every = bench_config(*args.set).train.checkpoint_every
    overrides = [*args.set, f"train.steps={args.steps}", f"train.threads={args.threads}", "train.checkpoint_every=10"]
    if args.method:
        overrides.append(f"method.name={args.method}")
    cfg = bench_config(*overrides)
    warm_model(cfg)  # build (or find) the cached warm start before anything is timed

    timer = PhaseTimer()
    per_step: list[dict] = []
    wrap_masktrl_phases(timer)
    try:
        run = run_masktrl(cfg, on_start=timer.take, on_step=lambda: per_step.append(timer.take()))
    finally:
        timer.restore()
    if timer.missing:
        print(f"warning: not timed (renamed?): {', '.join(timer.missing)}", file=sys.stderr)

    result = summarise(run["step_times"], per_step, every)
    result["io_probe"] = io_probe(cfg.train.steps, args.full_run_steps)
    result.update(
        config={"preset": "configs/tiny.yaml", "overrides": overrides, "method": cfg.method_name},
        io_goal=IO_GOAL,
        io_goal_met=result["io_share"] <= IO_GOAL,
        tokens_per_step=median([r.get("tokens") for r in run["metrics"][1:]]),
        machine=machine(),
    )
    report(result)
    write_json(args.json, result)
    return result


def summarise(step_times: list[float], per_step: list[dict], checkpoint_every: int) -> dict:
    """Shares of the step time per phase, first step excluded, checkpoints amortised."""
    steps = list(zip(step_times, per_step))[1:]
    ckpt = [ph.get("io: checkpoint", 0.0) for _, ph in steps if ph.get("io: checkpoint")]
    ckpt_s = median(ckpt) if ckpt else 0.0
    amortised = ckpt_s / checkpoint_every
    n = len(steps)
    phase_sum: dict[str, float] = {}
    for _, ph in steps:
        for k, v in ph.items():
            if k != "io: checkpoint":
                phase_sum[k] = phase_sum.get(k, 0.0) + v
    phase_sum["io: checkpoint (amortised)"] = amortised * n
    total = sum(t - ph.get("io: checkpoint", 0.0) for t, ph in steps) + amortised * n
    groups = group_phases(phase_sum, total)
    return {
        "steps_counted": n,
        "step_ms_mean": 1000 * total / n,
        "step_ms_median_without_checkpoint": 1000 * median([t - ph.get("io: checkpoint", 0.0) for t, ph in steps]),
        "checkpoint_ms": 1000 * ckpt_s,
        "checkpoint_every": checkpoint_every,
        "phases_ms": {k: 1000 * v / n for k, v in sorted(phase_sum.items())},
        "shares": {k: v / total for k, v in groups.items()},
        "phase_shares": {k: v / total for k, v in sorted(phase_sum.items())},
        "io_share": groups["io"] / total,
    }


def io_probe(steps_now: int, steps_full: int, reps: int = 7) -> dict:
    """What the run store's writes cost on this disk, and how the manifest's cost grows.

    ``mark_done`` re-reads the whole manifest, adds a stage and rewrites it atomically (fsync
    of the file and of its folder); a run records about two stages per step, so its manifest
    grows with the step count. Times one ``mark_done`` on manifests as large as after
    ``steps_now`` and after ``steps_full`` steps, and one fsynced 100-byte atomic write.
    """
    import shutil
    import tempfile
    import time

    from common import BENCH_TMP
    from masktrl.io import atomic_write_bytes
    from masktrl.runs.store import RunStore

    BENCH_TMP.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="io-", dir=BENCH_TMP))
    out = {}
    try:
        payload = root / "steps" / "rollouts.parquet"
        atomic_write_bytes(payload, b"x" * 60_000)  # about one tiny-default rollout file
        for steps in (steps_now, steps_full):
            store = RunStore(root / f"run{steps}")
            store.root.mkdir(parents=True)
            fake = {
                "status": "done",
                "time": 0.0,
                "config_hash": "",
                "files": {"steps/000001/rollouts.parquet": "0" * 64},
            }
            store.manifest["stages"].update(
                {f"step/{i:06d}/{kind}": dict(fake) for i in range(1, steps + 1) for kind in ("rollout", "train")}
            )
            store.write_manifest()
            times = []
            for i in range(reps):
                shutil.copy(payload, store.root / "rollouts.parquet")
                t0 = time.perf_counter()
                store.mark_done(f"probe/{i}", [store.root / "rollouts.parquet"])
                times.append(time.perf_counter() - t0)
            out[f"mark_done_ms_at_step_{steps}"] = 1000 * median(times)
            out[f"manifest_kb_at_step_{steps}"] = (store.root / "manifest.json").stat().st_size / 1024
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            atomic_write_bytes(root / "small.txt", b"x" * 100)
            times.append(time.perf_counter() - t0)
        out["atomic_write_100B_ms"] = 1000 * median(times)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


def report(r: dict) -> None:
    rows = [
        [k, r["phases_ms"][k], 100 * r["phase_shares"][k]]
        for k in sorted(r["phases_ms"], key=lambda k: -r["phases_ms"][k])
    ]
    print_table(
        f"masktrl step on the tiny default ({r['config']['method']}): {r['step_ms_mean']:.0f} "
        "ms/step, "
        f"{r['steps_counted']} steps",
        ["phase", "ms/step", "% of step"],
        rows,
    )
    grows = [[g, 100 * s] for g, s in r["shares"].items()]
    print_table("shares by stage", ["stage", "% of step"], grows)
    verdict = "met" if r["io_goal_met"] else "MISSED"
    print(
        f"io_share = {r['io_share']:.3f} (goal <= {r['io_goal']}: {verdict}); checkpoint "
        f"{r['checkpoint_ms']:.0f} ms "
        f"every {r['checkpoint_every']} steps"
    )
    probe = r["io_probe"]
    print("store write costs on this disk: " + ", ".join(f"{k} = {v:.1f}" for k, v in probe.items()))


if __name__ == "__main__":
    main()
