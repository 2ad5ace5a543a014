"""docs/RESULTS.md §3: the lab with minibatches of whole groups against minibatches of single
samples (grpo, fast-packed's settings, seeds 0-5), from its committed cells.

    python scripts/results_cells.py write outputs/minibatch-groups/samples outputs/minibatch-groups/groups \
        --out docs/results/cells/minibatch-groups
    python scripts/minibatch_groups.py              # print the table
    python scripts/results_pages.py --write         # put it in docs/RESULTS.md §3

Seed 0 of both arms again at ``train.threads=2`` (``CELLS_THREADS2``) gets the same outcome table.

``drift_table`` is descriptive, not part of the pre-registered design: what the two arms' runs
recorded along the way (the cells' ``log_r_dev``, ``mask_frac`` and ``entropy_end``), whole
groups minus single samples per seed with the paired 95% interval and no test.

The comparison is the one §3 states before the runs: whole groups minus single samples (m = 1)
on the held-out accuracy after RL (``eval_after``), paired by seed, with the rule of
docs/RESULTS.md (the larger of the paired t p and the exact sign-flip p), the paired MDD and
TOST at ±0.05. An arm is told by its cell's ``train.minibatch_groups``, not by its folder's name.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import results_cells  # noqa: E402  (a sibling script)
from results_cells import f3, md_row, mean_of, signed  # noqa: E402

CELLS = Path("docs/results/cells/minibatch-groups")
CELLS_THREADS2 = Path("docs/results/cells/minibatch-groups-threads2")  # seed 0 of both arms at train.threads=2
ARMS = {"single samples": False, "whole groups": True}  # arm -> its train.minibatch_groups; baseline first
MARGIN = 0.05  # TOST margin, held-out accuracy
HEAD = "arm | n | held-out before | held-out after mean ± sd | held-out after per seed | collapsed | machine"
COMPARISON_HEAD = (
    "comparison | n | Δ held-out after [paired 95% CI] | t p | sign-flip p | Holm p | paired MDD at α/m | "
    "TOST ±0.05 p | per seed Δ"
)


def read(root: Path) -> dict[str, dict]:
    """{arm: cell} from ``<root>/*/*.json``: grpo cells of the lab told apart by
    ``train.minibatch_groups``; any other cell, or a second cell of an arm, is an error."""

    def arm_of(cell: dict) -> str | None:
        groups = cell["config"].get("train.minibatch_groups", False)
        if cell["method"]["name"] != "grpo":
            return None
        return next((a for a, on in ARMS.items() if on is groups), None)

    return results_cells.read_arms(sorted(root.glob("*/*.json")), arm_of, "not one of §3's two grpo arms")


def after(cell: dict) -> dict[int, float]:
    """The held-out accuracy after RL per seed."""
    return {r["seed"]: float(r["eval_after"]) for r in cell["runs"]}


def outcome_table(root: Path) -> str:
    data = read(root)
    head = HEAD.split(" | ")
    lines = [md_row(head), md_row(["---"] * len(head))]
    for arm in ARMS:
        if arm not in data:
            continue
        runs, scores = data[arm]["runs"], after(data[arm])
        v = list(scores.values())
        sd = f" ± {np.std(v, ddof=1):.3f}" if len(v) > 1 else ""
        machines = sorted({f"{r['machine'].get('cpu_model', '?')} x{r['machine'].get('threads', '?')}" for r in runs})
        lines.append(
            md_row(
                [
                    arm,
                    str(len(runs)),
                    mean_of(runs, lambda r: r["eval_before"]),
                    f"{f3(float(np.mean(v)))}{sd}",
                    ", ".join(f"{s}: {f3(x)}" for s, x in sorted(scores.items())),
                    f"{sum(1 for r in runs if (r.get('collapse') or {}).get('collapsed'))}/{len(runs)}",
                    "; ".join(machines),
                ]
            )
        )
    if len(lines) == 2:
        lines.append("| (no cell has finished yet) |" + " |" * (len(head) - 1))
    return "\n".join(lines) + "\n"


def comparison_rows(data: dict[str, dict]) -> list[dict]:
    """Whole groups minus single samples over the seeds both arms have."""
    base, other = list(ARMS)
    if base not in data or other not in data:
        return []
    a, b = after(data[base]), after(data[other])
    seeds = sorted(set(a) & set(b))
    rows = [{"arm": other, "seeds": seeds, "d": [b[s] - a[s] for s in seeds]}]
    return [r | t for r, t in zip(rows, results_cells.paired_family([r["d"] for r in rows], MARGIN))]


def comparison_table(root: Path) -> str:
    def label(r: dict) -> list[str]:
        return [f"{r['arm']} − {list(ARMS)[0]}"]

    return results_cells.family_markdown(comparison_rows(read(root)), COMPARISON_HEAD, label, complete=1)


DRIFT = {  # cell key -> what it is (docs/METHODS.md's metrics), in the table's order
    "log_r_dev": "log_r_dev: a response's summed abs(log pi − log mu) at its update, mean over steps",
    "mask_frac": "mask_frac: share of response tokens whose gradient the clip removes, mean over steps",
    "entropy_end": "entropy: the policy's mean token entropy, last 50 steps",
}
DRIFT_HEAD = "recorded in the run | single samples | whole groups | Δ [paired 95% CI] | seeds with Δ > 0 | per seed Δ"


def drift_table(root: Path) -> str:
    """Descriptive: each ``DRIFT`` key's mean per arm and whole groups minus single samples per
    seed (the seeds both arms have), with the paired 95% interval; no test, no declaration."""
    from masktrl.analysis.compare import paired_diff_ci

    data = read(root)
    head = DRIFT_HEAD.split(" | ")
    lines = [md_row(head), md_row(["---"] * len(head))]
    base, other = list(ARMS)
    if base not in data or other not in data:
        return "\n".join([*lines, "| (no comparison has both cells yet) |" + " |" * (len(head) - 1)]) + "\n"
    for key, label in DRIFT.items():
        a, b = ({r["seed"]: r.get(key) for r in data[arm]["runs"]} for arm in (base, other))
        seeds = sorted(s for s in set(a) & set(b) if isinstance(a[s], (int, float)) and isinstance(b[s], (int, float)))
        d = [b[s] - a[s] for s in seeds]
        mean = signed(float(np.mean(d))) if d else "—"
        if len(d) >= 2:
            lo, hi = paired_diff_ci(d, [0.0] * len(d))
            mean = f"{mean} [{signed(lo)}, {signed(hi)}]"
        lines.append(
            md_row(
                [
                    label,
                    mean_of(data[base]["runs"], lambda r, key=key: r.get(key)),
                    mean_of(data[other]["runs"], lambda r, key=key: r.get(key)),
                    mean,
                    f"{sum(x > 0 for x in d)}/{len(d)}",
                    ", ".join(f"{s}: {signed(x)}" for s, x in zip(seeds, d)),
                ]
            )
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    root = ROOT / CELLS
    print(outcome_table(root))
    print(comparison_table(root))
    print(drift_table(root), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
