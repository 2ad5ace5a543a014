"""``masktrl analyze sis``: the SIS report of a run."""

from __future__ import annotations

from masktrl.commands.analyze import DEFAULT_OUT, Command, OutOpt, app, fmt, options, sis_options, written
from masktrl.commands.ui import console, kv_table


def _dev_over_training(tr: dict) -> list[tuple[str, str]]:
    """Mean over the logged steps of D, D_SIS and D_SIS / D (rows of the SIS table)."""
    rows = []
    for key, label in (("log_r_dev", "D"), ("log_w_dev", "D_SIS"), ("log_dev_ratio", "D_SIS / D")):
        vals = [v for v in tr.get(key) or [] if v is not None and v == v]
        if vals:
            rows.append((f"{label}, mean over {len(vals)} logged steps", fmt(sum(vals) / len(vals), 4)))
    return rows


@app.command(cls=Command)
def sis(
    run: options.RunArg,
    out: OutOpt = DEFAULT_OUT,
    step: options.StepOpt = None,
    top: sis_options.TopOpt = 10,
    bias: sis_options.BiasOpt = False,
    k: sis_options.KOpt = None,
) -> None:
    """SIS: accept rate over training, residual top-K mass, tokens outside the top-K, accepted
    vs rejected tokens; --bias: the top-K envelope's gradient bias."""
    from masktrl.analysis import sis_report
    from masktrl.analysis.io import load_run

    sis_report.check_flags(step, top, k, bias)
    info = load_run(run, out)
    if bias:
        from masktrl.analysis import sis_bias
        from masktrl.analysis.io import analysis_dir, default_replay_step

        ks = sis_bias.parse_ks(k)
        bias_step = step if step is not None else default_replay_step(info.root)
        bias_result = sis_bias.sis_bias(info.root, bias_step, ks)  # checked and computed before anything is written
    rep = sis_report.sis_report(info, step, top)
    paths = sis_report.save(rep, info.root)
    r = rep["replay"]
    hyp = " (hypothetical: the run's method is " + rep["method"] + ")" if rep["hypothetical"] else ""
    rows = [
        ("accept rate, recomputed" + hyp, fmt(r["accept_rate"], 4)),
        ("accept rate, logged", fmt(r["accept_rate_logged"], 4)),
        ("tested (k in behaviour top-K)", fmt(r["tested_frac"])),
        ("accepted / tested", fmt(r["accepted_frac_of_tested"])),
        ("sampled outside behaviour top-K", fmt(r["outside_topk_frac"])),
        ("D = Σ|log r| per sequence, recomputed", fmt(r["log_r_dev"], 4)),
        ("D = Σ|log r| per sequence, logged", fmt(r["log_r_dev_logged"], 4)),
        ("D_SIS = Σ|log w| per sequence, recomputed" + hyp, fmt(r["log_w_dev"], 4)),
        ("D_SIS = Σ|log w| per sequence, logged", fmt(r["log_w_dev_logged"], 4)),
        ("D_SIS / D", fmt(r["log_dev_ratio"])),
        *_dev_over_training(rep["training"]),
        ("1 − π(top-K): mean", fmt(r["pi_residual_mean"], 4)),
        *[(f"1 − π(top-K): {q}", fmt(v, 4)) for q, v in r["pi_residual_quantiles"].items()],
        ("valid tokens", str(r["n_valid"])),
    ]
    console.print(kv_table(f"SIS at step {rep['step']} (policy {rep['policy_step']}), run {rep['run']}", rows))
    from rich.table import Table

    t = Table(title="most frequent sampled tokens")
    for col in ("accepted", "count", "acc. share", "rejected", "count", "rej. share"):
        t.add_column(col, justify="right")
    acc, rej = rep["tokens"]["accepted"], rep["tokens"]["rejected"]
    for i in range(max(len(acc), len(rej))):
        a = acc[i] if i < len(acc) else None
        b = rej[i] if i < len(rej) else None
        t.add_row(
            *(repr(a["token"]), str(a["count"]), fmt(a["share_of_this_token"], 2)) if a else ("", "", ""),
            *(repr(b["token"]), str(b["count"]), fmt(b["share_of_this_token"], 2)) if b else ("", "", ""),
        )
    console.print(t)
    if bias:
        if bias_result.get("ks_note"):
            console.print(f"[yellow]note:[/] {bias_result['ks_note']}", highlight=False)
        print_bias(bias_result)
        paths += sis_bias.save(bias_result, analysis_dir(info.root))
    written(paths)


def print_bias(res: dict) -> None:
    from rich.table import Table

    t = Table(
        title=f"SIS gradient bias at step {res['step']} ({res['n_valid']} valid tokens"
        f"{', hypothetical: not a SIS run' if res['hypothetical'] else ''}): cosine "
        "/ relative norm ‖g − g_ref‖ / ‖g_ref‖; "
        f"base (no SIS) vs on-policy: {fmt(res['base_vs_on_policy']['cos'])} / "
        f"{fmt(res['base_vs_on_policy']['rel_norm'])}"
    )
    for col in ("K", "ξ_K", "accept rate", "vs exact-envelope SIS", "vs base", "vs on-policy"):
        t.add_column(col, justify="right")
    for r in res["ks"]:
        t.add_row(
            str(r["k"]),
            fmt(r["xi_mean"]),
            fmt(r["accept_rate"]),
            f"{fmt(r['vs_exact']['cos'])} / {fmt(r['vs_exact']['rel_norm'])}",
            f"{fmt(r['vs_base']['cos'])} / {fmt(r['vs_base']['rel_norm'])}",
            f"{fmt(r['vs_on_policy']['cos'])} / {fmt(r['vs_on_policy']['rel_norm'])}",
        )
    e = res["exact"]
    t.add_row(
        "exact",
        "0",
        fmt(e["accept_rate"]),
        "1 / 0",
        f"{fmt(e['vs_base']['cos'])} / {fmt(e['vs_base']['rel_norm'])}",
        f"{fmt(e['vs_on_policy']['cos'])} / {fmt(e['vs_on_policy']['rel_norm'])}",
    )
    console.print(t)
