"""The tables ``analyze disagreement`` prints: where two direction rules disagree, which kept tokens grew."""

from __future__ import annotations

from masktrl.commands.analyze import fmt, optimizer_text, pm, steps_text
from masktrl.commands.ui import console


def print_disagreement(result: dict) -> None:
    from rich.table import Table

    from masktrl.analysis.disagreement import SCOPES
    from masktrl.commands.analyze.tables import p_text

    b = result["batches"]
    stale = sorted({x["staleness"] for x in b})
    console.print(
        f"{len(result['runs'])} run(s) ({', '.join(sorted(set(result['methods'].values())))}), "
        "steps "
        f"{steps_text(result['steps'])}: {result['n_batches']} batches x {result['partitions']} "
        "partition(s) = "
        f"{result['n_replicates']} replicates ({result['replicate_unit']}); update "
        f"{result['update']['name']} "
        f"({result['update']['method']}), {optimizer_text(result)}, M = "
        f"{'/'.join(map(str, result['minibatches']))}, staleness {'/'.join(map(str, stale))}, "
        f"δ = {result['delta']:g}; {result['n_over_delta_mean']:.1f} tokens with D > δ per "
        "replicate",
        highlight=False,
    )
    table = Table(
        title="unsafe keep = P(ΔD > 0 | kept disagreement token): mean ± SE over replicates; contracted = "
        "pooled "
        f"P(ΔD < 0); p on unsafe keep: {p_text(result)}"
    )
    table.add_column("pair")
    table.add_column("criterion")
    table.add_column("disagree\ntotal (/rep)", justify="right")
    for scope in SCOPES:
        table.add_column(f"{scope}\nunsafe keep", justify="right")
        table.add_column("contracted", justify="right")
        table.add_column("kept", justify="right")
        table.add_column("p", justify="right")
    for name, block in result["pairs"].items():
        for i, c in enumerate(block["criteria"]):
            cells = [
                name if i == 0 else "",
                c,
                f"{block['n_disagree_total']} ({block['n_disagree_mean']:.1f})" if i == 0 else "",
            ]
            for scope in SCOPES:
                x = block[scope][c]
                p = block[scope]["paired"]["p"]
                cells += [
                    pm(x["unsafe_keep_mean"], x["unsafe_keep_se"]),
                    fmt(x["contract_frac_pooled"]),
                    str(x["n_kept_total"]),
                    (fmt(p) if i == 0 else ""),
                ]
            table.add_row(*cells, end_section=i == len(block["criteria"]) - 1)
    console.print(table)
    over = Table(
        title=f"every token with D > δ a rule keeps ({result['n_over_delta_total']} tokens with D > δ): "
        "unsafe keep, mean ± SE over replicates"
    )
    over.add_column("criterion")
    for scope in SCOPES:
        over.add_column(f"{scope}\nunsafe keep", justify="right")
        over.add_column("kept", justify="right")
    for c in result["over_delta"][SCOPES[0]]:
        cells = []
        for scope in SCOPES:
            x = result["over_delta"][scope][c]
            cells += [pm(x["unsafe_keep_mean"], x["unsafe_keep_se"]), str(x["n_kept_total"])]
        over.add_row(c, *cells)
    console.print(over)
    from masktrl.commands.analyze.tables import print_first_order, print_k_sweep

    if "first_order" in result:
        print_first_order(result)
    if "k_sweep" in result:
        print_k_sweep(result)
    if all(block["n_disagree_total"] == 0 for block in result["pairs"].values()):
        console.print(
            "[yellow]no disagreement token: try a smaller --delta, more --minibatches, or stale "
            "rollouts "
            "(rollout.staleness, or --policy-step later than S-1) so that π moves away from μ[/]"
        )
