"""The search for a regime where the field's standard GRPO fails (issue #40, docs/RESULTS.md §1).

verl's default GRPO (``configs/methods/verl-grpo.yaml``: eps 0.2/0.2, dual clip 3, token-mean, pi_old
recomputed, mu not read) is run on the lab under one production regime at a time, in the order below
(cheapest first), 3 seeds each. A probe **fails** when, in at least 2 of its 3 seeds, the run collapsed
(``analysis/collapse.py``) or ended below its starting held-out accuracy (``eval_after < eval_before``).
Only then is its control run: the same regime with the one factor named in ``control`` removed. The
search stops at the first probe that fails while its control does not; if none does, the table of
every probe is the finding.

    python scripts/probe_regimes.py run --out outputs/probes            # resumable: run it again
    python scripts/probe_regimes.py run --out outputs/probes --only fp8-e2e
    python scripts/probe_regimes.py table --cells docs/results/cells     # the probe table (markdown)
    python scripts/probe_regimes.py list                                 # the plan, no runs

``run`` calls ``masktrl sweep`` (complete runs are skipped, interrupted ones resume) and writes each
finished probe's cell JSON with ``scripts/results_cells.py write`` under ``docs/results/cells/<name>/``:
commit that file as soon as it is written, so a new machine loses only the probe that was running.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SEEDS = "0,1,2"
METHOD = ["--config", "methods/verl-grpo"]  # after the lab presets: the method overlay wins

# name: (extra presets, --set overrides of the regime, --set overrides of the control: the one factor removed)
PROBES: dict[str, tuple[list[str], list[str], list[str]]] = {
    "fp8-e2e": (
        [],
        ["rollout.quantization=fp8-full", "train.quantization=fp8-full"],
        ["rollout.quantization=null", "train.quantization=null"],
    ),
    "async-geometric": (
        [],
        ["rollout.staleness={dist: geometric, max: 4, p: 0.5}", "rollout.partial=0.5", "rollout.quantization=fp8-full"],
        ["rollout.staleness=0", "rollout.partial=null", "rollout.quantization=fp8-full"],
    ),
    "top-p": (  # the kept set must fit the recorded top-20 list: top-k 20 on both sides, top-p the factor
        [],
        ["rollout.top_k=20", "rollout.top_p=0.9", "rollout.quantization=fp8-full"],
        ["rollout.top_k=20", "rollout.top_p=1.0", "rollout.quantization=fp8-full"],
    ),
    "moe-fp8": (
        ["--config", "lab-moe"],
        ["rollout.quantization=fp8-full"],
        ["rollout.quantization=fp8-full", "model.routing_replay=rollout"],
    ),
    "deep-fp8": (["--config", "lab-deep"], [], ["rollout.quantization=null"]),  # the preset is the regime (fp8-act)
    "long-fp8": (["--config", "lab-long"], ["rollout.quantization=fp8-full"], ["rollout.quantization=null"]),
}


def sweep_command(name: str, sets: list[str], out: Path) -> list[str]:
    presets, _, _ = PROBES[name]
    command = [sys.executable, "-m", "masktrl.cli", "sweep", "--config", "lab", *presets, *METHOD, "--methods", "grpo"]
    command += ["--seeds", SEEDS, "--out", str(out)]
    for item in sets:
        command += ["--set", item]
    return command


def failed(cell: dict) -> int:
    """How many seeds of the cell collapsed or ended below their start."""
    n = 0
    for run in cell["runs"]:
        collapsed = bool((run.get("collapse") or {}).get("collapsed"))
        below = (
            run["eval_after"] is not None and run["eval_before"] is not None and run["eval_after"] < run["eval_before"]
        )
        n += collapsed or below
    return n


def run_probe(name: str, sets: list[str], out: Path, cells: Path) -> dict:
    folder = out / name
    subprocess.run(sweep_command(name, sets, folder), check=True, cwd=ROOT)
    written = subprocess.run(
        [sys.executable, "scripts/results_cells.py", "write", str(folder), "--out", str(cells)],
        check=True,
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    print(written.stdout, end="")
    (path,) = sorted((cells / name).glob("*.json"))  # one cell: grpo under one config
    return json.loads(path.read_text())


def run(args: argparse.Namespace) -> int:
    names = [args.only] if args.only else list(PROBES)
    for name in names:
        _, regime, control = PROBES[name]
        cell = run_probe(name, regime, args.out, args.cells)
        bad = failed(cell)
        print(f"{name}: {bad} of {len(cell['runs'])} seeds collapsed or ended below their start")
        if bad < 2:
            continue
        ctrl = run_probe(f"{name}-control", control, args.out, args.cells)
        if failed(ctrl) < 2:
            print(f"{name}: fails while its control does not: the search stops here")
            return 0
    print("no probe fails while its control holds" if not args.only else "")
    return 0


def probe_table(cells: Path) -> str:
    """The probe table (markdown) from the committed cells: one row per seed of every probe run so far."""
    lines = [
        "| probe | regime | seed | held-out before → after | collapsed | below start |",
        "|---|---|---|---|---|---|",
    ]
    for name in [n for p in PROBES for n in (p, f"{p}-control")]:
        sets = PROBES[name.removesuffix("-control")][2 if name.endswith("-control") else 1]
        for path in sorted((cells / name).glob("*.json")):
            for r in json.loads(path.read_text())["runs"]:
                collapsed = bool((r.get("collapse") or {}).get("collapsed"))
                lines.append(
                    f"| {name} | {', '.join(sets) or 'the preset'} | {r['seed']} | {r['eval_before']:.3f} → "
                    f"{r['eval_after']:.3f} | {'yes' if collapsed else 'no'} | "
                    f"{'yes' if r['eval_after'] < r['eval_before'] else 'no'} |"
                )
    if len(lines) == 2:
        lines.append("| (no probe has finished yet) | | | | | |")
    return "\n".join(lines) + "\n"


def table(args: argparse.Namespace) -> int:
    print(probe_table(args.cells), end="")
    return 0


def list_plan(args: argparse.Namespace) -> int:
    for name, (_, regime, control) in PROBES.items():
        print(" ".join(sweep_command(name, regime, args.out / name)[2:]))
        print(f"  control ({name}-control): --set " + " --set ".join(control))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    for cmd in ("run", "table", "list"):
        p = sub.add_parser(cmd)
        p.add_argument("--out", type=Path, default=Path("outputs/probes"))
        p.add_argument("--cells", type=Path, default=ROOT / "docs/results/cells")
        p.add_argument("--only", choices=list(PROBES))
    args = parser.parse_args(argv)
    return {"run": run, "table": table, "list": list_plan}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
