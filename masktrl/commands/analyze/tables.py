"""Tables the token studies print beside their main one."""

from __future__ import annotations

from masktrl.commands.analyze import fmt
from masktrl.commands.ui import console


def p_text(result: dict) -> str:
    if result.get("p_unit") == "run":
        return f"run-blocked sign flip over {len(result['runs'])} runs (the run is the unit)"
    return (
        f"paired {result['test']} over the {result['n_replicates']} replicates of one run (unit: "
        f"{result.get('p_unit', 'batch')})"
    )


def print_first_order(result: dict) -> None:
    from rich.table import Table

    fo = result["first_order"]
    sa = fo["sign_agree"]
    console.print(
        f"first-order parts of ΔD ({fo['n_tokens']} tokens with D > δ; own term on "
        f"{fo['n_own']}): sign agreement with the measured ΔD "
        + ", ".join(f"{k} {fmt(v)}" for k, v in sa.items() if v is not None and v == v)
        + f"; momentum outweighs gradient on {fmt(fo['momentum_outweighs_gradient_frac'])}; median "
        f"|own| / |rest| {fmt(fo['own_over_rest_median'])}",
        highlight=False,
    )
    parts = ["measured", "total", "gradient", "momentum", "decay", "own", "rest"]
    t = Table(
        title="unsafe keep over every kept D > δ token (pooled): measured, and as each first-order part alone predicts"
    )
    t.add_column("criterion")
    for p in parts:
        t.add_column(p, justify="right")
    for c, row in fo["unsafe_keep"].items():
        t.add_row(c, *[fmt(row.get(p)) for p in parts])
    console.print(t)


def print_k_sweep(result: dict) -> None:
    from rich.table import Table

    t = Table(
        title="the study at other list sizes K (lists re-cut): unsafe keep over every kept D_K > δ token, "
        "mean over replicates; "
        "ratio vs Ḋ on their disagreement sets, with p (its unit)"
    )
    for col in ("K", "D_K > δ /rep", "ratio", "Ḋ_agg", "Ḋ_uniform", "ratio vs Ḋ_agg", "ratio vs Ḋ_uniform"):
        t.add_column(col, justify="right")
    for k, b in result["k_sweep"].items():
        o = b["over_delta"]
        pa, pu = b["pairs"]["ratio_vs_ddot_agg"], b["pairs"]["ratio_vs_ddot_uniform"]
        t.add_row(
            k,
            f"{b['n_over_delta_mean']:.0f}",
            fmt(o["ratio"]["unsafe_keep_mean"]),
            fmt(o["ddot_agg"]["unsafe_keep_mean"]),
            fmt(o["ddot_uniform"]["unsafe_keep_mean"]),
            f"{fmt(pa['ratio'])} vs {fmt(pa['ddot_agg'])} (p {fmt(pa['p'], 2)}, {pa['p_unit']})",
            f"{fmt(pu['ratio'])} vs {fmt(pu['ddot_uniform'])} (p {fmt(pu['p'], 2)}, {pu['p_unit']})",
        )
    console.print(t)


def interaction_line(i: dict) -> str:
    """One line: the two effects, their difference, its t p (and sign-flip p when paired) and TOST p."""
    kind = "paired t" if i["paired"] else "Welch t"
    line = (
        f"interaction {i['spec']}: effects {fmt(i['effects'][0])} and {fmt(i['effects'][1])}, "
        f"difference {fmt(i['interaction'])}, "
        f"{kind} p {fmt(i['p'])}"
    )
    if i["paired"]:
        line += f", sign-flip p {fmt(i.get('p_sign_flip'))}"
    tost = i.get("tost")
    line += (
        f", TOST p at ±{fmt(tost['margin'])} {fmt(tost['p'])} "
        f"({'the effect does not depend on the source' if tost['p'] < 0.05 else 'inconclusive'})"
        if tost
        else "; no --margin, so no claim that the effect does not depend on the source"
    )
    return line


def collapsed(c: dict | None) -> str:
    return "" if not c else f"{c['count']}/{c['total']}" + (f" (+{c['too_short']} short)" if c["too_short"] else "")
