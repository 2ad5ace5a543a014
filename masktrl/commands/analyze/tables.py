"""Tables the token studies print beside their main one."""

from __future__ import annotations

from masktrl.commands.analyze import fmt
from masktrl.commands.ui import console


def print_first_order(result: dict) -> None:
    from rich.table import Table

    fo = result["first_order"]
    sa = fo["sign_agree"]
    console.print(
        f"first-order parts of ΔD ({fo['n_tokens']} tokens with D > δ; own term on {fo['n_own']}): sign agreement with the measured ΔD "
        + ", ".join(f"{k} {fmt(v)}" for k, v in sa.items() if v is not None and v == v)
        + f"; momentum outweighs gradient on {fmt(fo['momentum_outweighs_gradient_frac'])}; median |own| / |rest| {fmt(fo['own_over_rest_median'])}",
        highlight=False,
    )
    parts = ["measured", "total", "gradient", "momentum", "decay", "own", "rest"]
    t = Table(title="unsafe keep over every kept D > δ token (pooled): measured, and as each first-order part alone predicts")
    t.add_column("criterion")
    for p in parts:
        t.add_column(p, justify="right")
    for c, row in fo["unsafe_keep"].items():
        t.add_row(c, *[fmt(row.get(p)) for p in parts])
    console.print(t)
