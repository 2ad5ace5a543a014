"""Lab runs per CPU-hour: whole `masktrl train` runs of the lab presets, this tree against an earlier commit's.

What a user of the CPU lab buys with a machine is runs: a comparison wants 5-10 seeds per cell,
and every cell is a whole run (warm start, RL steps, held-out evaluations). This benchmark times
exactly that: `masktrl train` of a preset, in a fresh folder (so the warm start is built, not read
from a cache), one thread (``--threads``), in its own process, and reports the process tree's CPU time (user +
sys, from ``wait4``: what a machine shared with other jobs inflates least) and its inverse, runs
per CPU-hour. Each preset runs with this tree's code and with the baseline tree's (by default
commit 19f900d, the code issue #39 starts from, extracted with ``git archive``), with the same
command and the same number of steps, the trees alternating round by round; the ratio is this
tree's runs per CPU-hour over the baseline's. A machine whose speed changes during the benchmark
(a shared virtual machine's can) moves that ratio from round to round; ``--pairs`` starts the base
and each variant together instead, one per core, so the two runs of a pair meet the same machine,
and takes the median of the pairs' own ratios. Two lab runs side by side on a 2-core machine is how
docs/RESULTS.md's sweeps ran, so a pair's CPU times include what two runs at once cost each
other (shared caches and memory bandwidth). The shorter run of a pair spends all of its time beside
the other, the longer one its last part alone; where two runs at once slow each other, a pair's
ratio therefore understates how much faster the shorter run is.

Variants of this tree (``--variants``): ``default`` is the preset as it is; ``fast`` adds
``rollout.decode=fused`` and ``rollout.draw=inverse_cdf`` (the same distribution, other samples for
a seed: docs/ROLLOUTS.md) and ``rollout.mismatch=off`` (no extra forward for the mismatch metric);
``fast-packed`` adds ``train.packing=true`` to those (the padding-free forward, equal to the padded
one up to float32 rounding; on request); ``fast-grouped`` adds ``train.minibatch_groups=true`` to
``fast-packed`` (minibatches of whole prompt groups: another run, docs/CLUSTER.md; on request);
``fast-parts4`` adds ``train.minibatch_groups=4`` to ``fast-packed`` instead (minibatches of parts
of 4 samples of a group: another run; on request); ``fast-fused`` adds ``train.adamw=fused`` to
``fast-packed`` (torch's fused AdamW kernel: the same update up to float32 rounding, another run of
the same distribution; on request). The held-out accuracy before and after RL of
every run is recorded beside its time, so the JSON shows whether a variant's run is the baseline's
run (equal numbers) or another one. So are the run's phases by its own clocks (``run_phases``: the
warm start, the rollouts, the updates, the rest) and, per phase, the ratio to the baseline had that
phase cost nothing (``if_free``): how far making one part faster can take the ratio.

    python benchmarks/runs_per_cpu_hour.py --json benchmarks/results/runs_per_cpu_hour.json
    python benchmarks/runs_per_cpu_hour.py --presets lab --steps 20 --rounds 1     # a quick look
    python benchmarks/runs_per_cpu_hour.py --presets lab --variants fast-packed --pairs --rounds 3  # side by side

The presets: ``lab``, ``long`` (48-64-token answers) and ``agentic`` by default; ``moe``, ``deep``,
``long200`` (200-240-token answers), ``scratch`` (a 200-integer scratchpad before the answer) and
``credit`` (200 numbers, each graded) on request. A preset the baseline tree does not have (the
agentic, deep, long200, scratch and credit labs at 19f900d) is timed on this tree only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import count, die, finish, median, parser
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
DEFAULT_VARIANTS = "default,fast"  # fast-packed, fast-grouped, fast-parts4 and fast-fused on request (--variants)
FAST = ["rollout.decode=fused", "rollout.draw=inverse_cdf", "rollout.mismatch=off"]
FAST_PACKED = [*FAST, "train.packing=true"]
VARIANTS = {  # name -> --set overrides on this tree
    "default": [],
    "fast": FAST,
    "fast-packed": FAST_PACKED,
    "fast-grouped": [*FAST_PACKED, "train.minibatch_groups=true"],
    "fast-parts4": [*FAST_PACKED, "train.minibatch_groups=4"],
    "fast-fused": [*FAST_PACKED, "train.adamw=fused"],
}


def train_command(preset: str, out: Path, sets: list[str], steps: int | None, threads: int = 1) -> list[str]:
    command = [sys.executable, "-m", "masktrl.cli", "train"]
    for path in PRESETS[preset]:
        command += ["--config", path]
    command += ["--out", str(out), "--run", "run", "--set", f"train.threads={threads}"]
    for item in sets + ([f"train.steps={steps}"] if steps else []):
        command += ["--set", item]
    return command


@dataclass
class Started:
    """A run in progress: its process, its ``--out``, its stderr file, its tree and preset, and when
    it started."""

    proc: subprocess.Popen
    out: Path
    stderr: Path
    tree: Path
    preset: str
    wall0: float


def start_run(tree: Path, preset: str, sets: list[str], steps: int | None, scratch: Path, threads: int = 1) -> Started:
    """``preset`` with ``tree``'s code started in a fresh ``--out`` (its output to files, so a run
    beside another never blocks on a pipe)."""
    out = Path(tempfile.mkdtemp(dir=scratch))
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    stderr = out.with_suffix(".stderr")
    with open(out.with_suffix(".stdout"), "w") as so, open(stderr, "w") as se:
        proc = subprocess.Popen(
            train_command(preset, out, sets, steps, threads), cwd=tree, env=env, stdout=so, stderr=se
        )
    return Started(proc, out, stderr, tree, preset, time.perf_counter())


def finish_runs(runs: list[Started]) -> list[dict]:
    """Wait for every run of ``runs`` (each one's end noted as it comes) and return their records:
    each run's own process tree's CPU seconds (user + sys, ``wait4``: this child and the processes it
    waited for, not a run beside it), its wall seconds, its held-out accuracy before and after RL and
    its phases. A failed run: one line and exit 2, the others stopped."""
    ended: dict[int, tuple[float, float]] = {}  # index -> (CPU s, wall s)
    try:
        while len(ended) < len(runs):
            for i, run in enumerate(runs):
                if i in ended:
                    continue
                pid, status, usage = os.wait4(run.proc.pid, os.WNOHANG)
                if pid == 0:
                    continue
                run.proc.returncode = os.waitstatus_to_exitcode(status)
                ended[i] = (usage.ru_utime + usage.ru_stime, time.perf_counter() - run.wall0)
                if run.proc.returncode != 0:
                    last = (run.stderr.read_text(errors="replace").strip().splitlines() or ["(no output)"])[-1]
                    die(f"error: the {run.preset} run with {run.tree}'s code exited {run.proc.returncode}: {last}")
            if len(ended) < len(runs):
                time.sleep(0.05)
    finally:  # a failed run (or an interrupt): none of the others is left running
        for run in runs:
            if run.proc.returncode is None:
                run.proc.kill()
                run.proc.wait()
    records = []
    for i, run in enumerate(runs):
        cpu, wall = ended[i]
        summary = json.loads((run.out / "run" / "summary.json").read_text())
        records.append(
            {
                "cpu_s": cpu,
                "wall_s": wall,
                "eval_before": summary.get("eval_before"),
                "eval_after": summary.get("eval_after"),
                "steps": summary.get("steps"),
                "phases_s": run_phases(run.out / "run", summary, wall),
            }
        )
    return records


def time_run(tree: Path, preset: str, sets: list[str], steps: int | None, scratch: Path, threads: int = 1) -> dict:
    """One whole run of ``preset`` with ``tree``'s code in a fresh ``--out``, alone: ``finish_runs``'
    record of it."""
    return finish_runs([start_run(tree, preset, sets, steps, scratch, threads)])[0]


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
    """``args.rounds`` rounds of every (name, tree, overrides) in ``runs`` on ``preset``; one row per
    name with its median CPU time and its ratio to the base's. One run at a time, the order reversed
    every other round; or, with ``args.pairs`` and a base, the base and each variant in turn started
    together (one per core), so both meet the same machine, and the ratio is the median over the
    rounds of each pair's own ratio."""
    pairs = args.pairs and runs[0][0] == "base"
    per: dict[str, list[dict]] = {name: [] for name, _, _ in runs}

    def done(name: str, record: dict) -> None:
        per[name].append(record)
        print(
            f"  {preset:8s} {name:20s} {record['cpu_s']:8.1f} CPU-s  {record['wall_s']:8.1f} s wall"
            f"  held-out {record['eval_before']} -> {record['eval_after']}",
            flush=True,
        )

    for r in range(args.rounds):
        if pairs:
            base = runs[0]
            for name, tree, sets in runs[1:]:
                started = [
                    start_run(t, preset, s, args.steps, scratch, args.threads) for _, t, s in (base, (name, tree, sets))
                ]
                first, second = finish_runs(started)
                second["paired_base_cpu_s"] = first["cpu_s"]
                done("base", first)
                done(name, second)
            continue
        for name, tree, sets in runs if r % 2 == 0 else list(reversed(runs)):
            done(name, time_run(tree, preset, sets, args.steps, scratch, args.threads))
    cpu = {name: median([x["cpu_s"] for x in v]) for name, v in per.items()}

    def ratio(name: str, v: list[dict]) -> float | None:
        if "base" not in cpu:
            return None
        if pairs and name != "base":
            return median([x["paired_base_cpu_s"] / x["cpu_s"] for x in v])
        return cpu["base"] / cpu[name]

    return [
        {
            "preset": preset,
            "variant": name,
            "cpu_s": cpu[name],
            "runs_per_cpu_hour": 3600 / cpu[name],
            "ratio_vs_base": ratio(name, v),
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
    p.add_argument("--steps", type=count, default=None, help="RL steps of every run (default: the preset's)")
    p.add_argument("--rounds", type=count, default=1, help="rounds of alternating trees")
    p.add_argument(
        "--pairs",
        action="store_true",
        help="start the base and each variant together, one per core (a preset the base has)",
    )
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
        pairs=args.pairs,
        variants={v: VARIANTS[v] for v in variants},
        rows=rows,
    )


if __name__ == "__main__":
    main()
