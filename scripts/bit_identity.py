"""Is this tree behaviour-preserving against an older commit? Trains the same three short runs with both
and compares them: the default run, the lab's GRPO seed 0, and a default run SIGKILLed at its 5th update
and resumed. Every metric (timing fields aside) and the final weights must be equal bit for bit; a
metric only one side logs is listed, not failed (a column added or removed on purpose).

    git worktree add /tmp/base 19f900d
    python scripts/bit_identity.py --base /tmp/base --out /tmp/bit_identity      # exit 1 on a difference

Same machine and thread count only (``train.threads=1`` here): GEMMs differ across CPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

HERE = Path(__file__).resolve().parent.parent
RUNS = {
    "default": ["--set", "train.steps=10"],
    "lab": ["--config", "lab", "--set", "train.steps=6"],
    "resumed": ["--set", "train.steps=10"],
}
TIMING = ("time", "wall", "elapsed", "sec", "timestamp", "cpu", "rss", "per_s")


def train(tree: Path, out: Path, run: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    base = [sys.executable, "-m", "masktrl.cli", "train", "--out", str(out), "--set", "train.threads=1"]
    if run == "resumed":
        killed = subprocess.run(
            [*base, "--run", run, *RUNS[run]], cwd=tree, env={**env, "MASKTRL_CRASH_AT": "update:5"}
        )
        assert killed.returncode == -9, f"{tree}: the run was not killed at update 5 ({killed.returncode})"
        subprocess.run([*base, "--resume", run], cwd=tree, env=env, check=True, capture_output=True)
    else:
        subprocess.run([*base, "--run", run, *RUNS[run]], cwd=tree, env=env, check=True, capture_output=True)


def rows(root: Path) -> list[dict]:
    return [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]


def weights(root: Path) -> dict:
    return load_file(sorted((root / "checkpoints").iterdir())[-1] / "model.safetensors")


def compare(a: Path, b: Path) -> tuple[list[str], set[str]]:
    """(differences, keys only one side logs)."""
    ra, rb = rows(a), rows(b)
    diffs = [] if len(ra) == len(rb) else [f"{len(ra)} vs {len(rb)} metric rows"]
    one_side: set[str] = set()
    for x, y in zip(ra, rb):
        for k in (set(x) | set(y)) - {k for k in set(x) | set(y) if any(t in k.lower() for t in TIMING)}:
            if k not in x or k not in y:
                one_side.add(k)
            elif x[k] != y[k]:
                diffs.append(f"step {x.get('step')}: {k} {x[k]!r} vs {y[k]!r}")
    wa, wb = weights(a), weights(b)
    if wa.keys() != wb.keys() or not all(torch.equal(wa[k], wb[k]) for k in wa):
        diffs.append("final weights differ")
    return diffs, one_side


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, required=True, help="a checkout of the older commit")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    failed = False
    for run in RUNS:
        for side, tree in (("base", args.base.resolve()), ("tree", HERE)):
            train(tree, args.out / side, run)
        diffs, one_side = compare(args.out / "base" / run, args.out / "tree" / run)
        failed |= bool(diffs)
        print(f"{run}: {'bit-identical' if not diffs else 'DIFFERS'}; logged by one side only: {sorted(one_side)}")
        for d in diffs[:10]:
            print("  " + d)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
