"""Lab runs per CPU-hour: whole `masktrl train` runs of the lab presets, this tree against an earlier commit's.

What a user of the CPU lab buys with a machine is runs: a comparison wants 5-10 seeds per cell,
and every cell is a whole run (warm start, RL steps, held-out evaluations). This benchmark times
exactly that: `masktrl train` of a preset, in a fresh folder (so the warm start is built, not read
from a cache), one thread (``--threads``), in its own process, and reports the process tree's CPU time (user +
sys, `getrusage(RUSAGE_CHILDREN)`: what a machine shared with other jobs inflates least) and its
inverse, runs per CPU-hour. Each preset runs with this tree's code and with the baseline tree's (by
default commit 19f900d, the code issue #39 starts from, extracted with ``git archive``), with the
same command and the same number of steps, the trees alternating round by round; the ratio is
this tree's runs per CPU-hour over the baseline's.

Variants of this tree (``--variants``): ``default`` is the preset as it is; ``fast`` adds
``rollout.decode=fused`` and ``rollout.draw=inverse_cdf`` (the same distribution, other samples for
a seed: docs/ROLLOUTS.md) and ``rollout.mismatch=off`` (no extra forward for the mismatch metric);
``fast-packed`` adds ``train.packing=true`` to those (the padding-free forward, equal to the padded
one up to float32 rounding; on request); ``fast-grouped`` adds ``train.minibatch_groups=true`` to
``fast-packed`` (minibatches of whole prompt groups: another run, docs/CLUSTER.md; on request);
``fast-parts4`` adds ``train.minibatch_groups=4`` to ``fast-packed`` instead (minibatches of parts
of 4 samples of a group: another run; on request). The held-out accuracy before and after RL of
every run is recorded beside its time, so the JSON shows whether a variant's run is the baseline's
run (equal numbers) or another one. So are the run's phases by its own clocks (``run_phases``: the
warm start, the rollouts, the updates, the rest) and, per phase, the ratio to the baseline had that
phase cost nothing (``if_free``): how far making one part faster can take the ratio.

    python benchmarks/runs_per_cpu_hour.py --json benchmarks/results/runs_per_cpu_hour.json
    python benchmarks/runs_per_cpu_hour.py --presets lab --steps 20 --rounds 1     # a quick look

The presets: ``lab``, ``long`` (48-64-token answers) and ``agentic`` by default; ``moe``, ``deep``,
``long200`` (200-240-token answers), ``scratch`` (a 200-integer scratchpad before the answer) and
``credit`` (200 numbers, each graded) on request. A preset the baseline tree does not have (the
agentic, deep, long200, scratch and credit labs at 19f900d) is timed on this tree only.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import die, finish, median, parser
from gen_vs_base import BASE_COMMIT, extract

ROOT = Path(__file__).resolve().parents[1]
PRESETS = {  # name -> the --config files, relative to the tree
    "lab": ["configs/lab.yaml"],
    "long": ["configs/lab.yaml", "configs/lab-long.yaml"],
    "agentic": ["configs/agentic.yaml"],
    "moe": ["configs/lab.yaml", "configs/lab-moe.yaml"],
    "deep": ["configs/lab.yaml", "configs/lab-deep.yaml"],
    "scratch": ["configs/lab.yaml", "configs/lab-scratch.yaml"],
    "long200": ["configs/lab.yaml", "configs/lab-long200.yaml"],
    "credit": ["configs/lab.yaml", "configs/lab-credit.yaml"],
}
DEFAULT_PRESETS = "lab,long,agentic"
DEFAULT_VARIANTS = "default,fast"  # fast-packed, fast-grouped and fast-parts4 on request (--variants)
VARIANTS = {  # name -> --set overrides on this tree
    "default": [],
    "fast": ["rollout.decode=fused", "rollout.draw=inverse_cdf", "rollout.mismatch=off"],
    "fast-packed": ["rollout.decode=fused", "rollout.draw=inverse_cdf", "rollout.mismatch=off", "train.packing=true"],
    "fast-grouped": [
        "rollout.decode=fused",
        "rollout.draw=inverse_cdf",
        "rollout.mismatch=off",
        "train.packing=true",
        "train.minibatch_groups=true",
    ],
    "fast-parts4": [
        "rollout.decode=fused",
        "rollout.draw=inverse_cdf",
        "rollout.mismatch=off",
        "train.packing=true",
        "train.minibatch_groups=4",
    ],
}


def children_cpu_s() -> float:
    """User + system CPU seconds of every child process this process has waited for so far."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def train_command(preset: str, out: Path, sets: list[str], steps: int | None, threads: int = 1) -> list[str]:
    command = [sys.executable, "-m", "masktrl.cli", "train"]
    for path in PRESETS[preset]:
        command += ["--config", path]
    command += ["--out", str(out), "--run", "run", "--set", f"train.threads={threads}"]
    for item in sets + ([f"train.steps={steps}"] if steps else []):
        command += ["--set", item]
    return command


def time_run(tree: Path, preset: str, sets: list[str], steps: int | None, scratch: Path, threads: int = 1) -> dict:
    """One whole run of ``preset`` with ``tree``'s code in a fresh ``--out``: its CPU and wall seconds
    and its held-out accuracy before and after RL."""
    out = Path(tempfile.mkdtemp(dir=scratch))
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    cpu0, wall0 = children_cpu_s(), time.perf_counter()
    done = subprocess.run(
        train_command(preset, out, sets, steps, threads), cwd=tree, env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        die(f"error: the {preset} run with {tree}'s code exited {done.returncode}: {last}")
    cpu, wall = children_cpu_s() - cpu0, time.perf_counter() - wall0
    summary = json.loads((out / "run" / "summary.json").read_text())
    return {
        "cpu_s": cpu,
        "wall_s": wall,
        "eval_before": summary.get("eval_before"),
        "eval_after": summary.get("eval_after"),
        "steps": summary.get("steps"),
        "phases_s": run_phases(out / "run", summary, wall),
    }


PHASES = ("warm start", "rollouts", "updates", "the rest")


def run_phases(run_dir: Path, summary: dict, wall_s: float) -> dict[str, float]:
    """Wall seconds of a run's phases by the run's own clocks (both trees record them alike): the warm
    start (summary.json's ``warmstart.time_s``), the rollouts (the steps' ``rollout_time_s``: generation,
    rewards, advantages, storing the batch), the updates (``step_time_s`` minus ``rollout_time_s``: the
    policy update and handing the weights to the engine), and the rest of the process's ``wall_s``
    (start-up and imports, the held-out evaluations, the lab statistics, checkpoints, metrics)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if isinstance(r.get("step_time_s"), (int, float))]
    rollouts = sum(float(r["rollout_time_s"]) for r in steps)
    updates = sum(float(r["step_time_s"]) for r in steps) - rollouts
    warm = float((summary.get("warmstart") or {}).get("time_s") or 0.0)
    return dict(zip(PHASES, (warm, rollouts, updates, wall_s - warm - rollouts - updates)))


def if_free(base_cpu: float, runs: list[dict]) -> dict[str, float]:
    """Per phase, the ratio to the base's CPU time had that phase cost nothing: the phase's share of
    the run's wall time (median over the rounds) taken off the run's median CPU time. One thread on
    a quiet machine: wall and CPU time agree (the JSON keeps both)."""
    cpu = median([r["cpu_s"] for r in runs])
    shares = {p: median([r["phases_s"][p] / r["wall_s"] for r in runs]) for p in PHASES}
    return {p: base_cpu / (cpu * (1 - share)) for p, share in shares.items()}


def time_preset(preset: str, runs: list[tuple[str, Path, list[str]]], args, scratch: Path) -> list[dict]:
    """``args.rounds`` rounds of every (name, tree, overrides) in ``runs`` on ``preset``, the order
    reversed every other round; one row per name with its median CPU time and its ratio to the base's."""
    per: dict[str, list[dict]] = {name: [] for name, _, _ in runs}
    for r in range(args.rounds):
        for name, tree, sets in runs if r % 2 == 0 else list(reversed(runs)):
            per[name].append(time_run(tree, preset, sets, args.steps, scratch, args.threads))
            last = per[name][-1]
            print(
                f"  {preset:8s} {name:20s} {last['cpu_s']:8.1f} CPU-s  {last['wall_s']:8.1f} s wall"
                f"  held-out {last['eval_before']} -> {last['eval_after']}",
                flush=True,
            )
    cpu = {name: median([x["cpu_s"] for x in v]) for name, v in per.items()}
    return [
        {
            "preset": preset,
            "variant": name,
            "cpu_s": cpu[name],
            "runs_per_cpu_hour": 3600 / cpu[name],
            "ratio_vs_base": cpu["base"] / cpu[name] if "base" in cpu else None,
            "ratio_if_free": if_free(cpu["base"], v) if "base" in cpu and "phases_s" in v[0] else None,
            "runs": v,
        }
        for name, v in per.items()
    ]


def main(argv=None) -> dict:
    p = parser(__doc__.split("\n")[0])
    p.add_argument("--base", default=None, help=f"a checkout of the baseline code (default: commit {BASE_COMMIT})")
    p.add_argument("--presets", default=DEFAULT_PRESETS, help="comma-separated, of: " + ", ".join(PRESETS))
    p.add_argument(
        "--variants", default=DEFAULT_VARIANTS, help="this tree's, comma-separated, of: " + ", ".join(VARIANTS)
    )
    p.add_argument("--steps", type=int, default=None, help="RL steps of every run (default: the preset's)")
    p.add_argument("--rounds", type=int, default=1, help="rounds of alternating trees")
    args = p.parse_args(argv)
    presets = [x.strip() for x in args.presets.split(",") if x.strip()]
    variants = [x.strip() for x in args.variants.split(",") if x.strip()]
    for name in presets:
        if name not in PRESETS:
            die(f"error: unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    for name in variants:
        if name not in VARIANTS:
            die(f"error: unknown variant {name!r}; choose from {', '.join(VARIANTS)}")
    load_start = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.base:
            base = Path(args.base)
            if not base.is_dir():
                die(f"error: --base {base}: not a folder (a checkout of the baseline code)")
        else:
            base = Path(tmp) / "base"
            base.mkdir()
            extract(BASE_COMMIT, base)
        scratch = Path(tmp) / "runs"
        scratch.mkdir()
        for preset in presets:
            runs = [(f"this tree: {v}", ROOT, VARIANTS[v]) for v in variants]
            if all((base / path).is_file() for path in PRESETS[preset]):
                runs.insert(0, ("base", base, []))
            rows += time_preset(preset, runs, args, scratch)
    steps = f"{args.steps} steps" if args.steps else "the presets' steps"
    print(
        f"\nruns per CPU-hour ({steps}, train.threads {args.threads}, median of {args.rounds})"
        f" vs {args.base or BASE_COMMIT}"
    )
    for row in rows:
        ratio = "" if row["ratio_vs_base"] is None else f"  x{row['ratio_vs_base']:.2f}"
        print(f"  {row['preset']:8s} {row['variant']:20s} {row['runs_per_cpu_hour']:7.2f}{ratio}")
    return finish(
        "runs_per_cpu_hour.py",
        argv,
        load_start,
        args.json,
        base=args.base or BASE_COMMIT,
        threads=args.threads,
        steps=args.steps,
        rounds=args.rounds,
        variants={v: VARIANTS[v] for v in variants},
        rows=rows,
    )


if __name__ == "__main__":
    main()
