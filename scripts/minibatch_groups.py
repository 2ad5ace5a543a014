"""docs/RESULTS.md §3: the lab with minibatches of whole groups against minibatches of single
samples (grpo, fast-packed's settings, seeds 0-5), from its committed cells; §4: the same with
parts of g samples of each group (g = 2, 4) between them, as a dose of prompts per update.

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

§4 (``dose_table``, ``trend_table``, ``steps_table``) reads its own cells (``CELLS_PARTS``): g = 1
(the default split), 2, 4 and 8 (whole groups), all from one machine and thread count (a seed's
warm start depends on both, so cells of two machines do not pair: ``results_cells.read_arms``
refuses them, for §3 as for §4). Its one comparison, stated before its runs: per seed the least-squares slope
of ``eval_after`` on log2 g over the four arms, the mean slope tested with the same rule, TOST at
±0.0167 per doubling. The rest is descriptive (each g minus g = 1, and the slope
of ``log_r_dev``), with paired 95% intervals and no test.

    python scripts/results_cells.py write outputs/minibatch-groups/parts1 outputs/minibatch-groups/parts2 \
        outputs/minibatch-groups/parts4 outputs/minibatch-groups/parts8 --out docs/results/cells/minibatch-groups-parts

§5 (``CELLS_SIZE``) runs §3's two arms again on §4's machine with 8 new seeds (6-13): its one
comparison is §3's (``outcome_table`` and ``comparison_table`` read its folder as they read
§3's), and ``size_table`` puts it beside §4's seeds 0-5 of g = 1 and 8 and both pooled,
descriptively (cells of two machines, or a seed in both folders, stop with one line).

    python scripts/results_cells.py write outputs/minibatch-groups-size/samples outputs/minibatch-groups-size/groups \
        --out docs/results/cells/minibatch-groups-size

§6 (``CELLS_WHERE``) runs g = 4 on §5's seeds and reads it beside §5's two arms (``read_where``):
``where_outcomes`` the three arms, ``where_table`` its two comparisons (whole groups − g = 4,
g = 4 − single samples; m = 2, Holm, TOST at ±0.05), ``where_pooled_table`` the same differences
over §4's seeds 0-5, §6's and both, descriptively.

    python scripts/results_cells.py write outputs/minibatch-groups-where/parts4 \
        --out docs/results/cells/minibatch-groups-where
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import results_cells  # noqa: E402  (a sibling script)
from results_cells import f3, machine_of, md_row, mean_of, signed  # noqa: E402

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


def per_seed(cell: dict, key: str) -> dict[int, float]:
    """{seed: the run's ``key``} where it is recorded as a finite number."""
    return {
        r["seed"]: float(r[key]) for r in cell["runs"] if isinstance(r.get(key), (int, float)) and np.isfinite(r[key])
    }


def paired(base: dict[int, float], other: dict[int, float]) -> tuple[list[int], list[float]]:
    """(seeds both have, other minus base per seed)."""
    seeds = sorted(set(base) & set(other))
    return seeds, [other[s] - base[s] for s in seeds]


def outcome_table(root: Path) -> str:
    data = read(root)
    head = HEAD.split(" | ")
    lines = [md_row(head), md_row(["---"] * len(head))]
    for arm in ARMS:
        if arm not in data:
            continue
        runs, scores = data[arm]["runs"], per_seed(data[arm], "eval_after")
        v = list(scores.values())
        sd = f" ± {np.std(v, ddof=1):.3f}" if len(v) > 1 else ""
        machines = sorted({machine_of(r) for r in runs})
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
    seeds, d = paired(per_seed(data[base], "eval_after"), per_seed(data[other], "eval_after"))
    rows = [{"arm": other, "seeds": seeds, "d": d}]
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
    data = read(root)
    head = DRIFT_HEAD.split(" | ")
    lines = [md_row(head), md_row(["---"] * len(head))]
    base, other = list(ARMS)
    if base not in data or other not in data:
        return "\n".join([*lines, "| (no comparison has both cells yet) |" + " |" * (len(head) - 1)]) + "\n"
    for key, label in DRIFT.items():
        seeds, d = paired(per_seed(data[base], key), per_seed(data[other], key))
        lines.append(
            md_row(
                [
                    label,
                    mean_of(data[base]["runs"], lambda r, key=key: r.get(key)),
                    mean_of(data[other]["runs"], lambda r, key=key: r.get(key)),
                    with_interval(d),
                    f"{sum(x > 0 for x in d)}/{len(d)}",
                    by_seed(seeds, d),
                ]
            )
        )
    return "\n".join(lines) + "\n"


def with_interval(d: list[float]) -> str:
    """The mean of paired differences with its paired 95% interval (the mean alone for one, — for none)."""
    from masktrl.analysis.compare import paired_diff_ci

    mean = signed(float(np.mean(d))) if d else "—"
    if len(d) < 2:
        return mean
    lo, hi = paired_diff_ci(d, [0.0] * len(d))
    return f"{mean} [{signed(lo)}, {signed(hi)}]"


def by_seed(seeds: list[int], d: list[float]) -> str:
    return ", ".join(f"{s}: {signed(x)}" for s, x in zip(seeds, d))


# §4: prompts per update as a dose, g = 1, 2, 4, 8, all four arms run on one machine.
CELLS_PARTS = Path("docs/results/cells/minibatch-groups-parts")
CELLS_PARTS_THREADS2 = Path("docs/results/cells/minibatch-groups-parts-threads2")  # seed 0 of every g at 2 threads
DOSE = (1, 2, 4, 8)  # g: samples of a group that stay together in a minibatch
DOSE_LABEL = {1: "1 (single samples)", 2: "2", 4: "4", 8: "8 (whole groups)"}
TREND_MARGIN = MARGIN / 3  # TOST margin per doubling of g: ±0.05 over the three doublings
LAB_GROUPS, LAB_N, LAB_MINIBATCHES = 64, 8, 8  # configs/lab.yaml: prompts per step, samples each, minibatches
TREND_HEAD = (
    "comparison | n | slope per doubling of g [95% CI] | t p | sign-flip p | Holm p | MDD at α/m | "
    "TOST ±0.0167 p | per seed slope"
)
DOSE_HEAD = (
    "g | prompts per minibatch (expected) | n | held-out after mean ± sd | held-out after per seed | "
    "log_r_dev mean | collapsed | machine"
)
STEPS_HEAD = "recorded in the run | Δ [paired 95% CI] | seeds with Δ < 0 | per seed Δ"


def g_of(value) -> int:
    """A cell's ``train.minibatch_groups`` as the number of a group's samples kept together: false
    (the default split, and cells from before the key) is 1, true (whole groups) the lab's 8."""
    if value is True:
        return LAB_N
    if value is False or value is None:
        return 1
    return int(value)


def prompts_per_minibatch(
    g: int, groups: int = LAB_GROUPS, n: int = LAB_N, minibatches: int = LAB_MINIBATCHES
) -> float:
    """The expected number of distinct prompts in a minibatch when each of ``groups`` groups of
    ``n`` samples is cut into parts of g (g divides n) and the parts are dealt at random into
    ``minibatches`` minibatches of equal size: a prompt is absent when none of its n/g parts is
    among the minibatch's k of the P parts."""
    from math import comb

    parts, per_prompt = groups * n // g, n // g
    k = parts // minibatches
    return groups * (1 - comb(parts - per_prompt, k) / comb(parts, k))


def read_dose(root: Path) -> dict[int, dict]:
    """{g: cell} from §4's cells in ``<root>/*/*.json``. Any other cell, a second cell of a g, or
    runs of more than one machine (CPU model and thread count: a seed's warm start, hence its
    pairs, depends on both) stop with one line."""

    def arm_of(cell: dict) -> int | None:
        g = g_of(cell["config"].get("train.minibatch_groups", False))
        return g if cell["method"]["name"] == "grpo" and g in DOSE else None

    return results_cells.read_arms(sorted(root.glob("*/*.json")), arm_of, "not one of §4's grpo arms (g = 1, 2, 4, 8)")


def slopes(data: dict[int, dict], key: str) -> tuple[list[int], list[float]]:
    """(seeds, per-seed least-squares slopes of ``key`` on log2 g) over the seeds every g has."""
    values = {g: per_seed(data[g], key) for g in DOSE if g in data}
    if len(values) < len(DOSE):
        return [], []
    seeds = sorted(set.intersection(*(set(v) for v in values.values())))
    x = np.log2(DOSE)
    return seeds, [float(np.polyfit(x, [values[g][s] for g in DOSE], 1)[0]) for s in seeds]


def dose_table(root: Path) -> str:
    return dose_lines(read_dose(root), DOSE)


def dose_lines(data: dict[int, dict], gs) -> str:
    """The outcome table of the arms ``gs`` of ``data`` ({g: cell}) that have a cell."""
    head = DOSE_HEAD.split(" | ")
    lines = [md_row(head), md_row(["---"] * len(head))]
    for g in gs:
        if g not in data:
            continue
        runs, scores = data[g]["runs"], per_seed(data[g], "eval_after")
        v = list(scores.values())
        sd = f" ± {np.std(v, ddof=1):.3f}" if len(v) > 1 else ""
        lines.append(
            md_row(
                [
                    DOSE_LABEL[g],
                    f"{prompts_per_minibatch(g):.1f}",
                    str(len(runs)),
                    f"{f3(float(np.mean(v)))}{sd}" if v else "—",
                    ", ".join(f"{s}: {f3(x)}" for s, x in sorted(scores.items())),
                    mean_of(runs, lambda r: r.get("log_r_dev")),
                    f"{sum(1 for r in runs if (r.get('collapse') or {}).get('collapsed'))}/{len(runs)}",
                    "; ".join(sorted({machine_of(r) for r in runs})),
                ]
            )
        )
    return "\n".join(lines) + "\n"


def trend_rows(data: dict[int, dict]) -> list[dict]:
    """§4's one comparison: the per-seed slope of the held-out accuracy after RL on log2 g."""
    seeds, d = slopes(data, "eval_after")
    if not seeds:
        return []
    [row] = results_cells.paired_family([d], TREND_MARGIN)
    return [row | {"seeds": seeds}]


def trend_table(root: Path) -> str:
    def label(r: dict) -> list[str]:
        return ["held-out after on log2 g (g = 1, 2, 4, 8)"]

    return results_cells.family_markdown(trend_rows(read_dose(root)), TREND_HEAD, label, complete=1)


def steps_table(root: Path) -> str:
    """Descriptive: each g minus single samples per seed, and the per-seed slope of ``log_r_dev``
    on log2 g, with paired 95% intervals; no test, no declaration."""
    data = read_dose(root)
    head = STEPS_HEAD.split(" | ")
    lines = [md_row(head), md_row(["---"] * len(head))]
    rows = []
    if 1 in data:
        base = per_seed(data[1], "eval_after")
        for g in DOSE[1:]:
            if g in data:
                rows.append((f"held-out after, g = {g} − g = 1", *paired(base, per_seed(data[g], "eval_after"))))
    seeds, d = slopes(data, "log_r_dev")
    if seeds:
        rows.append(("log_r_dev: slope per doubling of g", seeds, d))
    for label, seeds, d in rows:
        lines.append(md_row([label, with_interval(d), f"{sum(x < 0 for x in d)}/{len(d)}", by_seed(seeds, d)]))
    if not rows:
        lines.append("| (no comparison has both cells yet) |" + " |" * (len(head) - 1))
    return "\n".join(lines) + "\n"


# §5: the size of the cost of whole groups, 8 new seeds (6-13) of §3's two arms on §4's machine.
CELLS_SIZE = Path("docs/results/cells/minibatch-groups-size")
CELLS_SIZE_THREADS2 = Path("docs/results/cells/minibatch-groups-size-threads2")  # seed 6 of both arms at 2 threads
SIZE_HEAD = "seeds | n | Δ held-out after [paired 95% CI] | seeds with Δ < 0 | paired SD | per seed Δ"


def size_rows(root: Path) -> list[tuple[str, list[int], list[float]]]:
    """(label, seeds, whole groups minus single samples) for §4's seeds (its g = 1 and g = 8 cells,
    in the sibling folder ``CELLS_PARTS.name``), §5's new seeds (``root``) and both together.
    The cells of both folders must come from one machine, and a seed may be in one folder only."""
    parts, size = read_dose(root.parent / CELLS_PARTS.name), read(root)
    halves = [
        ("§4's g = 1 and g = 8", parts.get(1), parts.get(LAB_N)),
        ("§5", size.get("single samples"), size.get("whole groups")),
    ]
    results_cells.one_machine([*parts.values(), *size.values()], f"{root.parent / CELLS_PARTS.name}, {root}")
    rows = []
    for label, single, whole in halves:
        a, b = (per_seed(c, "eval_after") if c else {} for c in (single, whole))
        rows.append((label, *paired(a, b)))
    return pool(root, rows, "§4's and §5's cells")


def pool(root: Path, halves: list, names: str) -> list[tuple[str, list[int], list[float]]]:
    """The two ``halves`` ((label, seeds, differences) each) that have seeds, then both together
    ("both") when both have; a seed in both halves (``names`` says whose) stops with one line."""
    (_, s0, d0), (_, s1, d1) = halves
    if set(s0) & set(s1):
        raise SystemExit(f"error: {root}: seeds {sorted(set(s0) & set(s1))} are in both {names}")
    rows = [h for h in halves if h[1]]
    if s0 and s1:
        rows.append(("both", s0 + s1, d0 + d1))
    return rows


def pooled_columns(label: str, seeds: list[int], d: list[float]) -> list[str]:
    """A pooled row's columns: the label with its seeds (a range where they are one), n, the mean
    difference with its paired 95% interval, how many are below 0, the paired SD, per seed."""
    span = f"{seeds[0]}–{seeds[-1]}" if seeds == list(range(seeds[0], seeds[-1] + 1)) else ", ".join(map(str, seeds))
    sd = f"{np.std(d, ddof=1):.3f}" if len(d) > 1 else "—"
    return [
        f"{label}: {span}",
        str(len(d)),
        with_interval(d),
        f"{sum(x < 0 for x in d)}/{len(d)}",
        sd,
        by_seed(seeds, d),
    ]


def size_table(root: Path) -> str:
    """§5, descriptive beside its comparison: whole groups minus single samples over §4's seeds,
    §5's and both, each with its paired 95% interval and the paired SD; no test."""
    head = SIZE_HEAD.split(" | ")
    lines = [md_row(head), md_row(["---"] * len(head))]
    lines += [md_row(pooled_columns(*row)) for row in size_rows(root)]
    if len(lines) == 2:
        lines.append("| (no seed has both arms yet) |" + " |" * (len(head) - 1))
    return "\n".join(lines) + "\n"


# §6: where the cost of whole groups arises: parts of 4 samples on §5's seeds (6-13), against §5's arms.
CELLS_WHERE = Path("docs/results/cells/minibatch-groups-where")
WHERE = (1, 4, 8)  # §6's arms: §5's single samples and whole groups, and its own g = 4
WHERE_COMPARISONS = ((8, 4), (4, 1))  # (g, minus g): C1 whole groups − g = 4, C2 g = 4 − single samples
WHERE_NAME = {1: "single samples", 4: "g = 4", 8: "whole groups"}
POOLED_HEAD = "comparison | seeds | n | Δ held-out after [paired 95% CI] | seeds with Δ < 0 | paired SD | per seed Δ"


def read_where(root: Path) -> dict[int, dict]:
    """{g: cell} of §6: its g = 4 cell (``root``; any other cell there stops with one line) and
    §5's single samples (g = 1) and whole groups (g = 8) in the sibling folder ``CELLS_SIZE.name``,
    all from one machine."""
    own = read_dose(root)
    if set(own) - {4}:
        raise SystemExit(f"error: {root}: §6's own cells are of g = 4 only, not g = {sorted(set(own) - {4})}")
    size = read(root.parent / CELLS_SIZE.name)
    data = {**own, **{g_of(ARMS[arm]): cell for arm, cell in size.items()}}
    results_cells.one_machine(data.values(), f"{root.parent / CELLS_SIZE.name}, {root}")
    return data


def where_differences(data: dict[int, dict]) -> list[tuple[str, list[int], list[float]]]:
    """(label, seeds, differences) of C1 and C2 over the seeds both of its arms have, in order; a
    comparison whose arm has no cell yet has none."""
    rows = []
    for g, minus in WHERE_COMPARISONS:
        label = f"{WHERE_NAME[g]} − {WHERE_NAME[minus]}"
        if g in data and minus in data:
            rows.append((label, *paired(per_seed(data[minus], "eval_after"), per_seed(data[g], "eval_after"))))
        else:
            rows.append((label, [], []))
    return rows


def where_outcomes(root: Path) -> str:
    """§6's arms (g = 1, 4, 8) on its seeds, as §4's outcome table."""
    return dose_lines(read_where(root), WHERE)


def where_table(root: Path) -> str:
    """§6's two comparisons (m = 2, Holm) on the held-out accuracy after RL, paired by seed."""
    diffs = where_differences(read_where(root))
    tested = results_cells.paired_family([d for _, _, d in diffs], MARGIN)
    rows = [r | {"label": label, "seeds": seeds} for (label, seeds, _), r in zip(diffs, tested) if seeds]

    def label(r: dict) -> list[str]:
        return [r["label"]]

    return results_cells.family_markdown(rows, COMPARISON_HEAD, label, complete=len(WHERE_COMPARISONS))


def where_pooled_table(root: Path) -> str:
    """§6, descriptive: C1 and C2 over §4's seeds (its g = 1, 4 and 8 cells, ``CELLS_PARTS.name``),
    §6's and both, each with its paired 95% interval and SD; no test. The two folders' runs must
    come from one machine, and a seed may be in one of them only."""
    parts, where = read_dose(root.parent / CELLS_PARTS.name), read_where(root)
    results_cells.one_machine([*parts.values(), *where.values()], f"{root.parent / CELLS_PARTS.name}, {root}")
    head = POOLED_HEAD.split(" | ")
    lines = [md_row(head), md_row(["---"] * len(head))]
    for (label, s0, d0), (_, s1, d1) in zip(where_differences(parts), where_differences(where)):
        halves = [("§4", s0, d0), ("§6", s1, d1)]
        lines += [md_row([label, *pooled_columns(*row)]) for row in pool(root, halves, "§4's and §6's cells")]
    if len(lines) == 2:
        lines.append("| (no comparison has both cells yet) |" + " |" * (len(head) - 1))
    return "\n".join(lines) + "\n"


def main() -> int:
    root = ROOT / CELLS
    print(outcome_table(root))
    print(comparison_table(root))
    print(drift_table(root))
    dose = ROOT / CELLS_PARTS
    print(dose_table(dose))
    print(trend_table(dose))
    print(steps_table(dose))
    size = ROOT / CELLS_SIZE
    print(outcome_table(size))
    print(comparison_table(size))
    print(size_table(size))
    where = ROOT / CELLS_WHERE
    print(where_outcomes(where))
    print(where_table(where))
    print(where_pooled_table(where), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
