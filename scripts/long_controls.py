"""docs/RESULTS.md §1: the long lab's missing controls (bypass grpo against bypass + dual clip 3,
dppo with top-K KL and decoupled IcePop; the long lab at fp8-full; seeds 0-6), from its committed cells.

    python scripts/results_cells.py write outputs/long-controls/long-fp8 --out docs/results/cells/long-controls
    python scripts/long_controls.py                 # print both tables
    python scripts/results_pages.py --write         # put them in docs/RESULTS.md §1

Seed 0 of the four arms again at ``train.threads=2`` (``CELLS_THREADS2``) gets the same outcome table.

The family is the one §1 states before the runs: each of the three controls minus masktrl's
bypass grpo (m = 3), on avg@8 of the held-out set at the final checkpoint (``masktrl eval task
--k 8 --temperature 0.75``). Each row: the mean paired difference over the shared seeds with its
paired 95% t interval, the paired t p, the exact sign-flip p, the larger of the two (the one that
decides) Holm-adjusted across the 3, the paired MDD at α/m (post hoc) and TOST at ±0.05. A cell is
told by its resolved method, not by its label (a sweep's labels depend on which cells it holds).
The outcome table is descriptive: held-out accuracy before and after RL (one answer per prompt),
avg@8, how many runs end below their start, collapses, the masked fraction, the per-response sum
of |log r| (the ratio each rule uses: π/μ in bypass and for dppo, π/π_old for decoupled IcePop;
means over the run) and the engine's first-step mismatch.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import results_cells  # noqa: E402  (a sibling script)
from results_cells import f3, md_row, mean_of  # noqa: E402

CELLS = Path("docs/results/cells/long-controls/long-fp8")
CELLS_THREADS2 = Path("docs/results/cells/long-controls/long-fp8-threads2")  # seed 0 at train.threads=2
BENCH = "task"  # the eval report whose avg@k is the primary metric
MARGIN = 0.05  # TOST margin, avg@8
BASELINE = "grpo (bypass)"


def _grpo(m: dict, dual_clip, kind: str, mode: str) -> bool:
    """grpo with this dual clip and correction; no ``correction`` in the method is bypass with none
    (the clip against μ, the engine's log-probs)."""
    c = m.get("correction") or {"kind": "none", "mode": "bypass"}
    return m["name"] == "grpo" and m.get("dual_clip") == dual_clip and (c["kind"], c["mode"]) == (kind, mode)


ARMS = {  # §1's name -> whether a cell's resolved method is that arm; baseline first
    BASELINE: lambda m: _grpo(m, None, "none", "bypass"),
    "grpo + dual_clip=3": lambda m: _grpo(m, 3, "none", "bypass"),
    "dppo (top-K KL)": lambda m: m["name"] == "dppo" and m.get("divergence") == "topk-kl",
    "decoupled IcePop": lambda m: _grpo(m, None, "icepop", "decoupled"),
}
OUTCOME_HEAD = (
    "method | n | held-out before | held-out after | avg@8 mean ± sd | avg@8 per seed | ended below start | "
    "collapsed | masked fraction | per-response Σ abs log r | mean abs Δ log p engine vs policy, step 1 | machine"
)
FAMILY_HEAD = (
    "comparison | n | Δ avg@8 [paired 95% CI] | t p | sign-flip p | Holm p | paired MDD at α/m | "
    "TOST ±0.05 p | per seed Δ"
)


def read(root: Path) -> dict[str, dict]:
    """{arm: cell} from ``<root>/*.json``; a cell that is no arm, or a second cell of one, is an error."""

    def arm_of(cell: dict) -> str | None:
        return next((a for a, match in ARMS.items() if match(cell["method"])), None)

    return results_cells.read_arms(sorted(root.glob("*.json")), arm_of, "its method is none of §1's four arms")


def avg_at_k(cell: dict) -> dict[int, float]:
    """avg@k per seed, for the runs that have the eval report (the others are not scored yet)."""
    return {r["seed"]: float(r["eval"][BENCH]["avg_at_k"]) for r in cell["runs"] if BENCH in r["eval"]}


def outcome_table(root: Path) -> str:
    data = read(root)
    head = OUTCOME_HEAD.split(" | ")
    lines = [md_row(head), md_row(["---"] * len(head))]
    for arm in ARMS:
        cell = data.get(arm)
        if cell is None:
            continue
        runs, scores = cell["runs"], avg_at_k(cell)
        v = list(scores.values())
        sd = f" ± {np.std(v, ddof=1):.3f}" if len(v) > 1 else ""
        below = sum(1 for r in runs if r["eval_after"] < r["eval_before"])
        machines = sorted({f"{r['machine'].get('cpu_model', '?')} x{r['machine'].get('threads', '?')}" for r in runs})
        lines.append(
            md_row(
                [
                    arm,
                    str(len(runs)) + (f" ({len(v)} scored)" if len(v) != len(runs) else ""),
                    mean_of(runs, lambda r: r["eval_before"]),
                    mean_of(runs, lambda r: r["eval_after"]),
                    f"{f3(float(np.mean(v)))}{sd}" if v else "—",
                    ", ".join(f"{s}: {f3(x)}" for s, x in sorted(scores.items())),
                    f"{below}/{len(runs)}",
                    f"{sum(1 for r in runs if (r.get('collapse') or {}).get('collapsed'))}/{len(runs)}",
                    mean_of(runs, lambda r: r.get("mask_frac")),
                    mean_of(runs, lambda r: r.get("log_r_dev")),
                    mean_of(runs, lambda r: (r.get("mismatch") or {}).get("logp_abs_step1"), "{:.4f}"),
                    "; ".join(machines),
                ]
            )
        )
    if len(lines) == 2:
        lines.append("| (no cell has finished yet) |" + " |" * (len(head) - 1))
    return "\n".join(lines) + "\n"


def family_rows(data: dict[str, dict]) -> list[dict]:
    """Each control minus the baseline over the seeds both have scored (Holm over those present)."""
    if BASELINE not in data:
        return []
    base = avg_at_k(data[BASELINE])
    rows = []
    for arm in list(ARMS)[1:]:
        if arm not in data:
            continue
        va = avg_at_k(data[arm])
        seeds = sorted(set(va) & set(base))
        rows.append({"arm": arm, "seeds": seeds, "d": [va[s] - base[s] for s in seeds]})
    tests = results_cells.paired_family([r["d"] for r in rows], MARGIN)
    return [r | t for r, t in zip(rows, tests)]


def family_table(root: Path) -> str:
    def label(r: dict) -> list[str]:
        return [f"{r['arm']} − {BASELINE}"]

    return results_cells.family_markdown(family_rows(read(root)), FAMILY_HEAD, label, complete=3)


def main() -> int:
    root = ROOT / CELLS
    print(outcome_table(root))
    print(family_table(root), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
