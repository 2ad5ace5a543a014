"""The table of ``analyze compare`` (and of a sweep's end): methods over seeds, the tests, the interactions."""

from __future__ import annotations

from rich.markup import escape

from masktrl.commands.analyze import fmt, pm
from masktrl.commands.analyze.tables import collapsed, interaction_line
from masktrl.commands.ui import console


def print_compare(table: dict) -> None:
    from rich.table import Table

    paired = table["test"] == "paired"  # the interval that goes with the test: paired over shared seeds, else Welch
    # each interval beside its own centre: over other seed sets the paired mean difference is not
    # the difference of means
    ci_name, d_key, lo_key, hi_key = (
        ("paired", "diff_paired", "diff_ci_paired_low", "diff_ci_paired_high")
        if paired
        else ("Welch", "diff_vs_baseline", "diff_ci_low", "diff_ci_high")
    )
    if paired:
        t = Table(
            title=f"{table['metric']} ({table.get('metric_kind', '')}): mean ± std over seeds, bootstrap "
            "95% CI; vs "
            f"{escape(table['baseline'])} ({table.get('baseline_handle', '')}) over "
            "the shared seeds: difference \\[paired 95% CI], "
            "paired t p, exact sign-flip p, Holm p of the larger, paired MDD at 80% "
            "power and alpha/m (post hoc), "
            f"TOST p at ±{fmt(table.get('margin'))} where no difference is found; "
            f"unit: {table.get('p_unit', 'run')}"
        )
        cols = (
            "#",
            "method",
            "n",
            "final",
            "95% CI",
            "diff [95% CI]",
            "t p",
            "sign-flip p",
            "Holm p",
            "MDD 80%",
            "TOST p",
            "verdict",
            "best of evals (biased)",
            "collapsed",
        )
    else:
        t = Table(
            title=f"{table['metric']} ({table.get('metric_kind', '')}): mean ± std over seeds, bootstrap "
            "95% CI; vs "
            f"{escape(table['baseline'])} ({table.get('baseline_handle', '')}): "
            f"difference \\[{ci_name} 95% CI], {table['test']} p, "
            "Holm p, smallest difference detectable at 80% power; unit: "
            f"{table.get('p_unit', 'run')}"
        )
        cols = (
            "#",
            "method",
            "n",
            "final",
            "95% CI",
            "diff [95% CI]",
            "p",
            "Holm p",
            "MDD 80%",
            "best of evals (biased)",
            "collapsed",
        )
    for col in cols:
        t.add_column(col, justify="right" if col not in ("method", "verdict") else "left")
    for row in table["methods"]:
        s, b = row["final"], row["best"]
        base = row["is_baseline"]
        diff = "base" if base else f"{fmt(s.get(d_key))} [{fmt(s.get(lo_key))}, {fmt(s.get(hi_key))}]"
        cell = lambda key: "" if base else fmt(s.get(key))  # noqa: E731, B023  (called in this iteration only)
        tests = (
            [
                cell("p_paired_t"),
                cell("p_sign_flip"),
                cell("p_holm"),
                cell("mdd_paired"),
                cell("tost_p"),
                "" if base else s.get("verdict", ""),
            ]
            if paired
            else [cell("p"), cell("p_holm"), cell("mdd_80")]
        )
        t.add_row(
            row.get("handle", ""),
            escape(row["label"]),
            str(s["n"]),
            pm(s["mean"], s["std"]),
            f"[{fmt(s['ci_low'])}, {fmt(s['ci_high'])}]",
            diff,
            *tests,
            pm(b["mean"], b["std"]),
            collapsed(row.get("collapse")),
        )
    console.print(t)
    if paired:
        console.print(f"decides: {table.get('decision_rule', '')}; {table.get('mdd_note', '')}", highlight=False)
    if table.get("interaction"):
        console.print(interaction_line(table["interaction"]), highlight=False)
    if table.get("collapse_definition"):
        console.print(table["collapse_definition"], highlight=False)
    for w in table["warnings"]:
        console.print(f"[yellow]warning:[/] {escape(w)}", highlight=False)
    for s in table["skipped"]:
        console.print(f"[yellow]skipped incomplete run[/] {escape(s)}", highlight=False)
