"""docs/RESULTS.md §2: the agentic-lab comparison (grpo, dapo, gspo with and without SIS, pdm;
staleness 2 and fp8; seeds 0-2), from its committed cells.

    python scripts/results_cells.py write outputs/agentic/stale2 outputs/agentic/fp8 --out docs/results/cells/agentic
    python scripts/agentic_grid.py                  # print both tables
    python scripts/results_pages.py --write         # put them in docs/RESULTS.md §2

The family is the one §2 states before the runs: in each regime sis(base X) − X for X in
grpo, dapo, gspo, and pdm − grpo (m = 8). Each row: the mean paired difference over the shared
seeds with its paired 95% t interval, the paired t p, the exact sign-flip p, the larger of the
two Holm-adjusted across the 8, the paired MDD at α/m (post hoc) and TOST at ±0.05. The outcome
table is descriptive: per regime and method, held-out accuracy before and after RL, collapses,
the engine's first-step mismatch, the mean per-response Σ|log r| (how off-policy the update
is), SIS acceptance and turns per episode at the end.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import results_cells  # noqa: E402  (a sibling script)
from results_cells import f3, md_row, mean_of, signed  # noqa: E402

CELLS = Path("docs/results/cells/agentic")
REGIMES = {"stale2": "staleness 2", "fp8": "fp8 rollouts"}
METHODS = ["grpo", "dapo", "gspo", "sis", "sis:base=dapo", "sis:base=gspo", "pdm"]  # §2's order
FAMILY = [("sis", "grpo"), ("sis:base=dapo", "dapo"), ("sis:base=gspo", "gspo"), ("pdm", "grpo")]
MARGIN = 0.05  # TOST margin, held-out accuracy
FAMILY_HEAD = (
    "regime | comparison | n | Δ held-out after RL [paired 95% CI] | t p | sign-flip p | Holm p | "
    "paired MDD at α/m | TOST ±0.05 p | per seed Δ"
)
PRESET_HEAD = "train.threads | seed | held-out before RL | after RL | change | CPU"
OUTCOME_HEAD = (
    "regime | method | n | held-out before | after RL mean ± sd | per seed after | collapsed | "
    "mean abs Δ log p engine vs policy, step 1 | per-response Σ abs log r | SIS acceptance | "
    "turns per episode (last 50 steps) | machine"
)


def method_name(cell: dict) -> str:
    """The cell's method as §2 names it: ``sis`` (base grpo) or ``sis:base=X``, else the name."""
    m = cell["method"]
    base = m.get("base")
    return f"sis:base={base}" if m["name"] == "sis" and base not in (None, "grpo") else m["name"]


def read(root: Path) -> dict[str, dict[str, dict]]:
    """{regime: {method: cell}} from ``<root>/<regime>/*.json``."""
    out: dict[str, dict[str, dict]] = {}
    for regime in REGIMES:
        for path in sorted((root / regime).glob("*.json")):
            cell = json.loads(path.read_text())
            name = method_name(cell)
            if name in out.get(regime, {}):  # e.g. a cell written under an older label: remove the stale file
                raise SystemExit(f"error: {path}: a second cell of {name} in {regime}")
            out.setdefault(regime, {})[name] = cell
    return out


def after(cell: dict) -> dict[int, float]:
    return {r["seed"]: float(r["eval_after"]) for r in cell["runs"]}


def family_rows(data: dict[str, dict[str, dict]]) -> list[dict]:
    """Every comparison of the family whose two cells exist, with its tests (Holm over those present)."""
    rows = []
    for regime in REGIMES:
        cells = data.get(regime, {})
        for a, b in FAMILY:
            if a not in cells or b not in cells:
                continue
            va, vb = after(cells[a]), after(cells[b])
            seeds = sorted(set(va) & set(vb))
            rows.append({"regime": regime, "a": a, "b": b, "seeds": seeds, "d": [va[s] - vb[s] for s in seeds]})
    tests = results_cells.paired_family([r["d"] for r in rows], MARGIN)
    return [r | t for r, t in zip(rows, tests)]


def family_table(root: Path) -> str:
    def label(r: dict) -> list[str]:
        return [REGIMES[r["regime"]], f"{r['a']} − {r['b']}"]

    return results_cells.family_markdown(family_rows(read(root)), FAMILY_HEAD, label, complete=8)


def outcome_table(root: Path) -> str:
    data = read(root)
    head = OUTCOME_HEAD.split(" | ")
    lines = [md_row(head), md_row(["---"] * len(head))]
    for regime in REGIMES:
        for name in METHODS:
            cell = data.get(regime, {}).get(name)
            if cell is None:
                continue
            runs = cell["runs"]
            v = [float(r["eval_after"]) for r in runs]
            sd = f" ± {np.std(v, ddof=1):.3f}" if len(v) > 1 else ""
            acc = [r.get("sis_accept_rate") for r in runs if r.get("sis_accept_rate") is not None]
            turns = [r.get("turns_end") for r in runs if r.get("turns_end") is not None]
            machines = sorted(
                {f"{r['machine'].get('cpu_model', '?')} x{r['machine'].get('threads', '?')}" for r in runs}
            )
            lines.append(
                md_row(
                    [
                        REGIMES[regime],
                        name,
                        str(len(runs)),
                        f3(float(np.mean([r["eval_before"] for r in runs]))),
                        f"{f3(float(np.mean(v)))}{sd}",
                        ", ".join(f"{r['seed']}: {f3(r['eval_after'])}" for r in runs),
                        f"{sum(1 for r in runs if (r.get('collapse') or {}).get('collapsed'))}/{len(runs)}",
                        mean_of(runs, lambda r: (r.get("mismatch") or {}).get("logp_abs_step1"), "{:.4f}"),
                        mean_of(runs, lambda r: r.get("log_r_dev")),
                        f3(float(np.mean(acc))) if acc else "—",
                        f3(float(np.mean(turns))) if turns else "—",
                        "; ".join(machines),
                    ]
                )
            )
    if len(lines) == 2:
        lines.append("| (no cell has finished yet) |" + " |" * (len(head) - 1))
    return "\n".join(lines) + "\n"


def preset_table(root: Path) -> str:
    """docs/LAB.md's table of the agentic preset itself (GRPO) over seeds and ``train.threads``:
    the cells of ``<root>/preset-t1`` and ``<root>/preset-t2``."""
    lines = [md_row(PRESET_HEAD.split(" | ")), md_row(["---"] * len(PRESET_HEAD.split(" | ")))]
    for threads in (1, 2):
        for path in sorted((root / f"preset-t{threads}").glob("*.json")):
            runs = json.loads(path.read_text())["runs"]
            for r in runs:
                lines.append(
                    md_row(
                        [
                            str(threads),
                            str(r["seed"]),
                            f3(r["eval_before"]),
                            f3(r["eval_after"]),
                            signed(r["eval_after"] - r["eval_before"]),
                            f"{r['machine'].get('cpu_model', '?')}",
                        ]
                    )
                )
            gains = [r["eval_after"] - r["eval_before"] for r in runs]
            lines.append(md_row([str(threads), "mean", "", "", f"**{signed(float(np.mean(gains)))}**", ""]))
    if len(lines) == 2:
        lines.append("| (no run has finished yet) |" + " |" * 5)
    return "\n".join(lines) + "\n"


def main() -> int:
    root = ROOT / CELLS
    print(preset_table(root))
    print(outcome_table(root))
    print(family_table(root), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
