"""What ``rollout.mismatch: auto`` saves per step where it reuses a forward the update runs anyway.

The lab preset (configs/lab.yaml: 64 prompts x 8, 8 minibatches) at ``rollout.staleness: 0`` with
``method.correction.mode: decoupled``: the update computes log pi_old of the whole batch before its
first step, at the weights that sampled it, so ``auto`` takes ``mismatch/*`` from that forward
(``UpdateLogp.old``, masktrl/rl/mismatch.py), where ``always`` runs the separate no-gradient
forward after sampling and ``off`` measures nothing. The three sides run in turn, in a fresh
order each repeat, each a short ``masktrl train`` in this process; the figure is the median over
repeats of the per-step CPU time ratio (``time.process_time`` around each RL step, steps 2..n;
a busy machine inflates wall time, not CPU time) of each side to ``auto`` in the same repeat. The
``mismatch/*`` of ``auto`` and ``always`` are compared too (same tokens; float32 rounding).

At the lab's own settings (``rollout.staleness: 2``) no update forward runs at the sampling
weights, so ``auto`` keeps the separate forward there (docs/ROLLOUTS.md).

    python benchmarks/mismatch_reuse.py --json benchmarks/results/mismatch_reuse.json
    python benchmarks/mismatch_reuse.py --reps 2 --steps 4     # a quick look
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import count, machine, median, parser, print_table, quiet, run_masktrl, write_json

SIDES = ("auto", "always", "off")
LAB = Path(__file__).resolve().parents[1] / "configs" / "lab.yaml"


def lab_config(mode: str, steps: int, threads: int):
    from masktrl.config import load_config

    return load_config(
        LAB,
        [
            f"train.steps={steps}",
            f"train.threads={threads}",
            "train.eval_every=0",
            "train.checkpoint_every=1000",
            "rollout.staleness=0",
            "method.correction.mode=decoupled",
            f"rollout.mismatch={mode}",
        ],
    )


def one_rep(order: list[str], steps: int, threads: int) -> dict:
    out = {}
    for side in order:
        r = run_masktrl(lab_config(side, steps, threads))
        out[side] = {"cpu_step_s": median(r["cpu_times"][1:]), "wall_step_s": median(r["step_times"][1:])}
        out[side]["mismatch"] = {k: v for k, v in r["metrics"][-1].items() if k.startswith("mismatch/")}
    return out


def main(argv=None) -> dict:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--reps", type=count, default=3)
    p.add_argument("--steps", type=count, default=6)
    args = p.parse_args(argv)
    quiet()
    run_masktrl(lab_config("off", 2, args.threads))  # the warm start, cached before anything is timed
    rng = random.Random(0)
    reps, t0 = [], time.time()
    for _ in range(args.reps):
        order = list(SIDES)
        rng.shuffle(order)
        reps.append(one_rep(order, args.steps, args.threads))
    ratio = {s: median([r[s]["cpu_step_s"] / r["auto"]["cpu_step_s"] for r in reps]) for s in SIDES}
    wall = {s: median([r[s]["wall_step_s"] / r["auto"]["wall_step_s"] for r in reps]) for s in SIDES}
    a, b = reps[-1]["auto"]["mismatch"], reps[-1]["always"]["mismatch"]
    gap = max((abs(a[k] - b[k]) / max(abs(b[k]), 1e-12) for k in b if isinstance(b[k], float)), default=None)
    rows = [[s, median([r[s]["cpu_step_s"] for r in reps]) * 1e3, ratio[s], wall[s]] for s in SIDES]
    print_table(
        "lab shape, staleness 0, decoupled: per-step CPU time",
        ["side", "CPU ms/step", "CPU / auto", "wall / auto"],
        rows,
    )
    result = {
        "command": " ".join(["python", "benchmarks/mismatch_reuse.py", *(argv if argv is not None else sys.argv[1:])]),
        "machine": machine(),
        "elapsed_s": time.time() - t0,
        "settings": {"reps": args.reps, "steps": args.steps, "threads": args.threads, "config": "configs/lab.yaml"},
        "cpu_ratio_to_auto": ratio,
        "wall_ratio_to_auto": wall,
        "saving_cpu_frac": 1 - 1 / ratio["always"],  # of the always step's CPU time
        "mismatch_max_rel_gap_auto_vs_always": gap,
        "same_mismatch_keys": sorted(a) == sorted(b),
        "reps": reps,
    }
    print(f"auto saves {result['saving_cpu_frac']:.1%} of a step's CPU time against always; max rel gap {gap}")
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
