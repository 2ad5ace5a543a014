"""The data behind docs/RESULTS.md's tables: one small JSON per grid cell, and the tables from them.

    python scripts/results_cells.py write outputs/mismatch/fp8 outputs/mismatch/bfloat16 --out docs/results/cells
    python scripts/results_cells.py tables --cells docs/results/cells                 # print the tables
    python scripts/results_cells.py tables --cells docs/results/cells --check docs/RESULTS.md
    python scripts/results_cells.py tables --cells docs/results/cells --write docs/RESULTS.md
    python scripts/results_cells.py same docs/results/cells/agentic/stale2/grpo.json RERUN/stale2/grpo.json

``write``: for every sweep folder (one behaviour source, e.g. ``fp8``), the complete runs grouped
as ``analyze compare`` groups them (config minus seed); each group is a **cell** written to
``<out>/<source>/<label>.json``, and any other JSON there is removed (the folder is the sweep's). A
cell holds the resolved method and the flattened config (without the seed), and per seed: the run,
held-out accuracy before and after, avg@k of each ``masktrl eval`` report at the final checkpoint,
the mismatch at step 1 and over the last 50 steps, the blocked fraction, the SIS acceptance, the
mean per-response sum of abs log r, the turns per episode (multi-turn), the final entropy, the
collapse record, and the machine (CPU model, threads, commit) from summary.json.
Nothing time-dependent is stored, so rerunning a cell on the same machine rewrites its JSON byte
for byte.

``tables``: one markdown table per source from the cells, with the paired design of
docs/ANALYSIS.md (``analyze compare --test paired``): per cell against the source's baseline
(``grpo``), the mean paired difference over the shared seeds with its paired 95% interval, the
paired t p and the exact sign-flip p (the larger decides), Holm across the source, the paired MDD
at alpha / m (post hoc), the collapse count and the machines. ``--check FILE`` compares every
``<!-- cells:SOURCE -->`` ... ``<!-- /cells:SOURCE -->`` block of FILE with what this prints
(exit 1 naming the blocks that differ); ``--write FILE`` replaces them.

``same A B``: whether a rerun's cell equals the committed one: every value equal (floats exactly),
the commit each run was made at aside (a rerun is made at a later commit); exit 1 naming the
first values that differ.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

import numpy as np

from masktrl.analysis import compare as cmp
from masktrl.analysis.collapse import run_collapse
from masktrl.analysis.io import expand_runs, group_runs, load_run
from masktrl.config import flatten
from masktrl.errors import MasktrlError
from masktrl.stats import paired_mdd, paired_tests, sign_flip_p, tost_paired

TAIL = 50  # steps averaged for the "end" of a run, as scripts/mismatch_table.py
SCORE = "eval_after"  # the score without an eval report: the run's held-out accuracy (one answer per prompt)


def _mean(metrics: list[dict], key: str, tail: int | None = None) -> float | None:
    vals = [float(m[key]) for m in metrics if isinstance(m.get(key), (int, float)) and math.isfinite(m[key])]
    vals = vals[-tail:] if tail else vals
    return float(np.mean(vals)) if vals else None


def _first(metrics: list[dict], key: str) -> float | None:
    return next((float(m[key]) for m in metrics if isinstance(m.get(key), (int, float))), None)


def eval_reports(run) -> dict:
    """avg@k of every ``masktrl eval`` report at the run's final checkpoint: {bench: {avg_at_k, k, n_problems}}."""
    out = {}
    try:
        step = cmp.final_step(run)
    except MasktrlError:
        return out
    for key, entry in sorted(run.store.manifest.get("stages", {}).items()):
        if key.startswith("eval/") and entry.get("status") == "done" and key.endswith(f"/{step:06d}"):
            bench = key.split("/")[1]
            rep = cmp.eval_report(run, bench, step)
            out[bench] = {"avg_at_k": float(rep["avg_at_k"]), "k": rep.get("k"), "n_problems": rep.get("n_problems")}
    return out


def run_record(run) -> dict:
    m, s = run.metrics, run.summary or {}
    return {
        "seed": run.cfg.seed,
        "run": run.name,
        "steps": s.get("steps"),
        "eval_before": s.get("eval_before"),
        "eval_after": s.get("eval_after"),
        "eval": eval_reports(run),
        "mismatch": {
            "logp_abs_step1": _first(m, "mismatch/logp_abs_mean"),
            "logp_abs_end": _mean(m, "mismatch/logp_abs_mean", TAIL),
            "kl_k3_end": _mean(m, "mismatch/kl_k3", TAIL),
        },
        "mask_frac": _mean(m, "mask_frac"),
        "sis_accept_rate": _mean(m, "sis_accept_rate"),
        "log_r_dev": _mean(m, "log_r_dev"),  # mean over steps of the per-response sum |log r|
        "turns_end": _mean(m, "turns_per_episode", TAIL),  # multi-turn runs only
        "entropy_end": _mean(m, "entropy", TAIL),
        "collapse": run_collapse(m),
        "machine": s.get("machine", {}),
    }


def slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9.=+-]+", "_", label).strip("_") or "cell"


def cells(folder: Path) -> list[dict]:
    """The cells of one sweep folder (complete runs only; the others are counted in ``incomplete``)."""
    runs = [load_run(p) for p in expand_runs([folder])]
    complete = [r for r in runs if r.complete]
    if not complete:
        raise MasktrlError(f"{folder}: no complete run")
    out = []
    for label, members in group_runs(complete):
        cfg = flatten(members[0].cfg.to_dict())
        cfg.pop("seed", None)
        out.append(
            {
                "cell": f"{folder.name}/{label}",
                "source": folder.name,
                "label": label,
                "method": members[0].cfg.resolved_method(),
                "config": cfg,
                "runs": sorted((run_record(r) for r in members), key=lambda r: r["seed"]),
                "incomplete": sum(
                    1 for r in runs if not r.complete and r.cfg.seed is not None and cmp_key(r) == cmp_key(members[0])
                ),
            }
        )
    return out


def cmp_key(run) -> str:
    from masktrl.analysis.io import config_key

    return config_key(run.cfg)


def write_cells(folders: list[Path], out: Path) -> tuple[list[Path], list[Path]]:
    """Write every folder's cells; returns (written, removed). A source's folder under ``out`` then
    holds exactly the cells its sweep folder gives: a file of the source that was not written (a
    cell whose label changed when another cell joined the sweep, e.g. ``grpo_dual_clip=3`` becoming
    ``grpo_correction.hi=None_dual_clip=3``) is removed, so no run stands in two cells."""
    paths, removed = [], []
    for folder in folders:
        made = []
        for cell in cells(folder):
            path = out / cell["source"] / f"{slug(cell['label'])}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(cell, indent=1, sort_keys=True, default=str) + "\n")
            made.append(path)
        for stale in sorted({q for p in made for q in p.parent.glob("*.json")} - set(made)):
            stale.unlink()
            removed.append(stale)
        paths += made
    return paths, removed


# --------------------------------------------------------------------------- tables


def read_cells(root: Path) -> dict[str, list[dict]]:
    """{source: [cell, ...]} from ``<root>/<source>/*.json``, in file-name order."""
    out: dict[str, list[dict]] = {}
    for path in sorted(root.glob("*/*.json")):
        cell = json.loads(path.read_text())
        out.setdefault(cell["source"], []).append(cell)
    return out


def machine_of(run: dict) -> str:
    """A run's machine as the tables name it: its CPU model and ``train.threads``."""
    m = run.get("machine") or {}
    return f"{m.get('cpu_model', '?')} x{m.get('threads', '?')}"


def read_arms(paths, arm_of, no_arm: str) -> dict[str, dict]:
    """{arm: cell} of a designed comparison's cells at ``paths`` (RESULTS §1's, §3's and §4's
    scripts); ``arm_of(cell)`` names a cell's arm, None for none. A file that is not a cell, a cell
    of no arm (``no_arm`` says which arms there are), a second cell of an arm, or runs of more than
    one machine (CPU model and thread count: a seed's warm start, hence the pairing by seed,
    depends on both) stops with one line."""
    out: dict[str, dict] = {}
    for path in paths:
        try:
            cell = json.loads(path.read_text())
            arm = arm_of(cell)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise SystemExit(f"error: {path}: not a cell of results_cells.py ({e})") from None
        if arm is None:
            raise SystemExit(f"error: {path}: {no_arm}")
        if arm in out:
            raise SystemExit(f"error: {path}: a second cell of {arm}")
        out[arm] = cell
    one_machine(out.values(), ", ".join(sorted({str(Path(p).parent) for p in paths})))
    return out


def one_machine(cells, where: str) -> None:
    """Stop with one line naming ``where`` if the runs of ``cells`` come from more than one machine
    (CPU model and thread count: a seed's warm start, hence the pairing by seed, depends on both)."""
    machines = sorted({machine_of(r) for cell in cells for r in cell["runs"]})
    if len(machines) > 1:
        raise SystemExit(f"error: {where}: runs of {len(machines)} machines do not pair by seed: {', '.join(machines)}")


def score_of(cells_: list[dict]) -> tuple[str, str]:
    """(key, name) of the score: avg@k of the eval benchmark every run has (``task`` first), else eval_after."""
    benches = None
    for c in cells_:
        for r in c["runs"]:
            benches = set(r["eval"]) if benches is None else benches & set(r["eval"])
    if benches:
        bench = "task" if "task" in benches else sorted(benches)[0]
        return bench, f"avg@k ({bench})"
    return SCORE, "held-out accuracy (one answer)"


def value(run: dict, key: str) -> float:
    return float(run["eval"][key]["avg_at_k"]) if key != SCORE else float(run[SCORE])


def f3(x) -> str:
    return "—" if x is None or not math.isfinite(x) else f"{x:.3f}"


def signed(x) -> str:
    return "—" if x is None or not math.isfinite(x) else f"{x:+.3f}"


def md_row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def mean_of(runs: list[dict], get, fmt: str = "{:.3f}") -> str:
    """The mean over runs of ``get(run)`` where recorded, else —."""
    vals = [v for v in map(get, runs) if isinstance(v, (int, float)) and math.isfinite(v)]
    return fmt.format(float(np.mean(vals))) if vals else "—"


def table(source: str, cells_: list[dict], baseline: str = "grpo") -> str:
    key, name = score_of(cells_)
    base = next((c for c in cells_ if c["label"] == baseline), cells_[0])
    bvals = {r["seed"]: value(r, key) for r in base["runs"]}
    rows = []
    for c in cells_:
        vals = {r["seed"]: value(r, key) for r in c["runs"]}
        row = {"cell": c, "vals": vals}
        if c is not base:
            shared = sorted(set(vals) & set(bvals))
            d = [vals[s] - bvals[s] for s in shared]
            t_p = paired_tests(d, [0.0] * len(d))["p_ttest"] if len(d) >= 2 else float("nan")
            flip = sign_flip_p(d) if d else float("nan")
            lo, hi = cmp.paired_diff_ci(d, [0.0] * len(d))
            row.update(d=d, t_p=t_p, flip=flip, p=max(t_p, flip) if len(d) >= 2 else float("nan"), lo=lo, hi=hi)
        rows.append(row)
    tested = [r for r in rows if "p" in r]
    m = max(1, sum(1 for r in tested if math.isfinite(r["p"])))
    for r, adj in zip(tested, cmp.holm([r["p"] for r in tested])):
        r["holm"], r["mdd"] = adj, paired_mdd(r["d"], alpha=0.05 / m)
    head = [
        "cell",
        "n",
        f"{name} mean ± sd",
        f"Δ vs {base['label']} [paired 95% CI]",
        "t p",
        "sign-flip p",
        "Holm p",
        "paired MDD (post hoc)",
        "collapsed",
        "per seed",
        "machine",
    ]
    lines = [f"<!-- cells:{source} -->", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        c, v = r["cell"], list(r["vals"].values())
        sd = f" ± {np.std(v, ddof=1):.3f}" if len(v) > 1 else ""
        collapsed = sum(1 for x in c["runs"] if x["collapse"].get("collapsed"))
        judged = sum(1 for x in c["runs"] if not x["collapse"].get("too_short"))
        machines = sorted(
            {f"{x['machine'].get('cpu_model', '?')} x{x['machine'].get('threads', '?')}" for x in c["runs"]}
        )
        cells = (
            ["base", "", "", "", ""]
            if "p" not in r
            else [
                f"{signed(float(np.mean(r['d'])) if r['d'] else float('nan'))} [{signed(r['lo'])}, {signed(r['hi'])}]",
                f3(r["t_p"]),
                f3(r["flip"]),
                f3(r["holm"]),
                f3(r["mdd"]),
            ]
        )
        lines.append(
            "| "
            + " | ".join(
                [
                    c["label"],
                    str(len(v)),
                    f"{f3(float(np.mean(v)))}{sd}",
                    *cells,
                    f"{collapsed}/{judged}",
                    ", ".join(f"{s}: {f3(x)}" for s, x in sorted(r["vals"].items())),
                    "; ".join(machines),
                ]
            )
            + " |"
        )
    lines.append(f"<!-- /cells:{source} -->")
    return "\n".join(lines)


def paired_family(diffs: list[list[float]], margin: float) -> list[dict]:
    """The tests of a family of paired comparisons, one list of per-seed differences each.

    Every comparison with at least 2 differences gets the paired t p, the exact sign-flip p, the
    larger of the two (``p``, the one that decides), the paired 95% interval and TOST at ``margin``;
    Holm runs over those tested (m of them) and the paired MDD is taken at alpha / m (post hoc).
    Returns one dict per input, in order; a comparison with fewer than 2 differences gets none.
    """
    rows = []
    for d in diffs:
        row: dict = {"d": list(d), "n": len(d)}
        if len(d) >= 2:
            t_p = paired_tests(d, [0.0] * len(d))["p_ttest"]
            row |= {"t_p": t_p, "flip": sign_flip_p(d), "ci": cmp.paired_diff_ci(d, [0.0] * len(d))}
            row |= {"p": max(t_p, row["flip"]), "tost": tost_paired(d, margin)["p"]}
        rows.append(row)
    tested = [r for r in rows if "p" in r]
    for r, adj in zip(tested, cmp.holm([r["p"] for r in tested])):
        r["holm"], r["mdd"], r["m"] = adj, paired_mdd(r["d"], alpha=0.05 / len(tested)), len(tested)
    return rows


def family_columns(row: dict) -> list[str]:
    """A ``paired_family`` row's columns: Δ [paired 95% CI], t p, sign-flip p, Holm p, paired
    MDD, TOST p and the per-seed differences (``row["seeds"]`` beside ``row["d"]``)."""
    mean = float(np.mean(row["d"])) if row["d"] else float("nan")
    return [
        f"{signed(mean)} [{signed(row['ci'][0])}, {signed(row['ci'][1])}]" if "ci" in row else signed(mean),
        *(f3(row.get(k)) for k in ("t_p", "flip", "holm", "mdd", "tost")),
        ", ".join(f"{s}: {signed(x)}" for s, x in zip(row["seeds"], row["d"])),
    ]


def family_footer(rows: list[dict], columns: int, complete: int) -> list[str]:
    """The lines after a family's rows: a placeholder row when there is none, and Holm's m."""
    lines = [] if rows else ["| (no comparison has both cells yet) |" + " |" * (columns - 1)]
    m = next((r["m"] for r in rows if "m" in r), 0)
    return [*lines, "", f"Holm over the m = {m} comparisons present ({complete} when the grid is complete)."]


def family_markdown(rows: list[dict], head: str, label, complete: int) -> str:
    """A family's table: the header ``head`` (columns joined by " | "), one row per ``paired_family``
    row (``label(row)``'s first columns, n, then ``family_columns``) and ``family_footer``."""
    names = head.split(" | ")
    lines = [md_row(names), md_row(["---"] * len(names))]
    lines += [md_row([*label(r), str(r["n"]), *family_columns(r)]) for r in rows]
    lines += family_footer(rows, len(names), complete)
    return "\n".join(lines) + "\n"


def tables(root: Path) -> dict[str, str]:
    return {source: table(source, cs) for source, cs in read_cells(root).items()}


BLOCK = re.compile(r"<!-- cells:(?P<src>[^ ]+) -->.*?<!-- /cells:(?P=src) -->", re.S)


def check(doc: Path, made: dict[str, str]) -> list[str]:
    """The sources whose block in ``doc`` differs from ``made`` (or that ``made`` lacks)."""
    return [m["src"] for m in BLOCK.finditer(doc.read_text()) if made.get(m["src"]) != m.group(0)]


def rewrite(doc: Path, made: dict[str, str]) -> None:
    doc.write_text(BLOCK.sub(lambda m: made.get(m["src"], m.group(0)), doc.read_text()))


def differences(a, b, where: str = "") -> list[str]:
    """Where two cells differ (paths into the JSON), ``machine.commit`` left out."""
    if isinstance(a, dict) and isinstance(b, dict):
        keys = sorted(set(a) | set(b))
        out = []
        for k in keys:
            if k == "commit" and where.endswith(".machine"):
                continue
            if k not in a or k not in b:
                out.append(f"{where}.{k}: only in {'the first' if k in a else 'the second'}")
            else:
                out += differences(a[k], b[k], f"{where}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{where}: {len(a)} against {len(b)} items"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    return [] if a == b and type(a) is type(b) else [f"{where}: {a!r} against {b!r}"]


def same(a: Path, b: Path) -> int:
    try:
        cells_ = [json.loads(p.read_text()) for p in (a, b)]
    except (OSError, ValueError) as e:
        print(f"error: cannot read a cell: {e}", file=sys.stderr)
        return 2
    diff = differences(*cells_)
    if diff:
        print(f"{a} and {b} differ in {len(diff)} value(s): " + "; ".join(diff[:5]), file=sys.stderr)
        return 1
    print(f"{a} and {b}: every value equal (the commits aside)")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write", help="one JSON per cell from sweep folders")
    w.add_argument("folders", nargs="+", type=Path)
    w.add_argument("--out", type=Path, default=Path("docs/results/cells"))
    t = sub.add_parser("tables", help="the markdown tables from the cells")
    t.add_argument("--cells", type=Path, default=Path("docs/results/cells"))
    t.add_argument(
        "--check", type=Path, default=None, help="compare FILE's <!-- cells:SOURCE --> blocks with the tables"
    )
    t.add_argument(
        "--write", type=Path, default=None, help="replace FILE's <!-- cells:SOURCE --> blocks with the tables"
    )
    c = sub.add_parser("same", help="whether a rerun cell equals the committed one (the commits aside)")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "same":
            return same(args.a, args.b)
        if args.cmd == "write":
            written, removed = write_cells(args.folders, args.out)
            for p in written:
                print(p)
            for p in removed:
                print(f"removed {p} (no longer a cell of its sweep folder)")
            return 0
        made = tables(args.cells)
    except MasktrlError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.check:
        bad = check(args.check, made)
        if bad:
            print(
                f"{args.check}: the tables of {', '.join(bad)} differ from the cells (rerun with --write)",
                file=sys.stderr,
            )
            return 1
        return 0
    if args.write:
        rewrite(args.write, made)
        return 0
    print("\n\n".join(made.values()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
