"""scripts/mismatch_table.py: the behaviour-source table of docs/NOTEBOOK.md §7."""

import importlib.util
import math
import os
from pathlib import Path

import pytest

from masktrl.analysis import compare as cmp
from masktrl.analysis.io import RunInfo
from masktrl.config import from_dict

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("mismatch_table", ROOT / "scripts" / "mismatch_table.py")
mt = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mt)


def _run(seed, final, mismatch, mask, correction=None, name=None, steps=60):
    cfg = from_dict({"seed": seed, "method": {"name": "grpo", **({"correction": correction} if correction else {})}})
    # mismatch grows linearly from `mismatch` at step 1; mask_frac constant; kl_k3 = mismatch / 10
    metrics = [
        {
            "step": t,
            "reward_mean": 0.4,
            "mismatch/logp_abs_mean": mismatch * (1 + 0.01 * (t - 1)),
            "mismatch/kl_k3": mismatch / 10,
            "mask_frac": mask,
        }
        for t in range(1, steps + 1)
    ]
    return RunInfo(Path(f"/nowhere/{name or 'grpo-seed' + str(seed)}"), cfg, metrics, {"eval_after": final}, "complete")


def test_table_rows_carry_compare_numbers_and_run_means():
    plain = [_run(s, 0.40 + 0.01 * s, 0.08, 0.18) for s in range(3)]
    tis = [
        _run(s, 0.45 + 0.01 * s, 0.10, 0.10, correction={"kind": "token-tis", "mode": "decoupled"}, name=f"tis{s}")
        for s in range(3)
    ]
    table = cmp.compare(plain + tis, "grpo", test="paired", n_boot=200)
    by_root = {str(r.root): r for r in plain + tis}
    for row in table["methods"]:
        row["behaviour"] = mt.group_behaviour([by_root[p] for p in row["runs"]])
        row["display"] = mt.short_label(row["label"], by_root[row["runs"][0]].cfg.resolved_method())
    tis_row = table["methods"][1]
    b = tis_row["behaviour"]
    assert b["mismatch_start"] == pytest.approx(0.10)
    # the last 50 of 60 steps: t = 11..60, mean factor 1 + 0.01 * (mean(t) - 1) = 1 + 0.01 * 34.5
    assert b["mismatch_end"] == pytest.approx(0.10 * 1.345)
    assert b["kl_k3_end"] == pytest.approx(0.01) and b["mask_frac"] == pytest.approx(0.10)
    assert math.isnan(b["entropy_end"])
    logged = _run(0, 0.4, 0.08, 0.18, steps=60)
    for t, m in enumerate(logged.metrics):
        m["entropy"] = 3.0 if t < 10 else 2.0  # the last 50 of 60 steps: 2.0
    assert mt.group_behaviour([logged])["entropy_end"] == pytest.approx(2.0)
    text = mt.markdown([{"source": "fp8", "table": table}])
    lines = text.splitlines()
    assert lines[2].startswith("| grpo | fp8 | 3 | 0.410 ± 0.010 | base |")
    assert lines[3].startswith("| grpo + token-tis (decoupled) | fp8 | 3 | 0.460 ± 0.010 | +0.050 [+0.050, +0.050] |")
    assert "0.100 → 0.135" in lines[3] and lines[3].endswith("| 0.100 | — |")  # no entropy logged: a dash


def test_short_labels_and_missing_values():
    ice = {"name": "grpo", "correction": {"kind": "icepop", "mode": "bypass"}}
    assert mt.short_label("grpo[correction.kind=icepop,correction.mode=bypass]", ice) == "grpo + icepop"
    naive = {"name": "grpo", "correction": {"kind": "none", "mode": "decoupled"}}
    assert mt.short_label("grpo[correction.mode=decoupled]", naive) == "grpo (decoupled)"
    assert mt.short_label("grpo", {"name": "grpo"}) == "grpo"
    # a folder of one group: compare labels it "grpo", the correction still shows, with its non-default keys
    ignore = {"name": "grpo", "correction": {"kind": "token-tis", "mode": "decoupled", "cap": 1.0, "floor": 1.0}}
    assert mt.short_label("grpo", ignore) == "grpo + token-tis cap=1,floor=1 (decoupled)"
    assert (
        mt.short_label("grpo", {**ignore, "dual_clip": 3.0})
        == "grpo + token-tis cap=1,floor=1 (decoupled), dual_clip=3"
    )
    assert mt.short_label("grpo", {"name": "grpo", "dual_clip": 3.0}) == "grpo, dual_clip=3"
    assert mt.short_label("dppo[divergence=topk-tv]", {"name": "dppo"}) == "dppo[divergence=topk-tv]"
    assert mt.run_means([{"step": 1}], "mismatch/kl_k3") != mt.run_means([{"step": 1}], "mismatch/kl_k3")  # nan
    assert math.isnan(mt.first_value([{"step": 1}], "mismatch/logp_abs_mean"))
    assert mt.small(7.6e-13) == "7.6e-13" and mt.small(0.0) == "0.000" and mt.f3(float("nan")) == "—"


def test_a_folder_without_complete_runs_is_one_line_and_exit_2(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert mt.main([str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")


def test_an_unwritable_json_path_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(mt, "folder_table", lambda folder, eval_bench, n_boot: {"source": "x", "table": {}})
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    assert mt.main([str(tmp_path), "--json", str(blocked / "table.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: cannot write {blocked / 'table.json'}")


def test_figure_draws_one_panel_per_folder_and_a_bad_path_is_exit_2(tmp_path, capsys, monkeypatch):
    plain = [_run(s, 0.40 + 0.01 * s, 0.08, 0.18) for s in range(3)]
    tis = [_run(s, 0.45 + 0.02 * s, 0.10, 0.10, correction={"kind": "token-tis"}, name=f"tis{s}") for s in range(3)]
    folders = []
    for source in ("float32", "fp8"):
        table = cmp.compare(plain + tis, "grpo", test="paired", n_boot=200)
        for row in table["methods"]:
            row["behaviour"] = mt.group_behaviour(plain)
        folders.append({"source": source, "table": table})
    alone = {"source": "verl", "table": cmp.compare(plain, "grpo", test="paired", n_boot=200)}
    fig = mt.figure(folders + [alone])  # a folder of its baseline alone gets no panel
    assert len(fig.axes) == 2 and [a.get_title() for a in fig.axes] == ["float32 (n = 3)", "fp8 (n = 3)"]
    (dot,) = [ln for ln in fig.axes[0].lines if ln.get_marker() == "o"]
    assert dot.get_xdata()[0] == pytest.approx(0.06)  # the group's paired difference
    monkeypatch.setattr(mt, "folder_table", lambda folder, eval_bench, n_boot: folders[0])
    out = tmp_path / "fig.png"
    assert mt.main([str(tmp_path), "--figure", str(out)]) == 0 and out.read_bytes()[:4] == b"\x89PNG"
    capsys.readouterr()
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    assert mt.main([str(tmp_path), "--figure", str(blocked / "fig.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: cannot write {blocked / 'fig.png'}")


def test_the_figure_cache_is_temporary_and_the_environment_restored(monkeypatch):
    from masktrl.caches import temporary_matplotlib_cache

    monkeypatch.setenv("MPLCONFIGDIR", "/somewhere")
    with temporary_matplotlib_cache() as folder:
        assert os.environ["MPLCONFIGDIR"] == str(folder) and folder.is_dir()
    assert not folder.exists() and os.environ["MPLCONFIGDIR"] == "/somewhere"
    monkeypatch.delenv("MPLCONFIGDIR")
    with temporary_matplotlib_cache():
        pass
    assert "MPLCONFIGDIR" not in os.environ


def _folder(source, base_scores, method_scores, name="tis"):
    plain = [_run(s, v, 0.08, 0.18) for s, v in enumerate(base_scores)]
    other = [
        _run(s, v, 0.10, 0.10, correction={"kind": "token-tis"}, name=f"{name}{s}") for s, v in enumerate(method_scores)
    ]
    table = cmp.compare(plain + other, "grpo", test="paired", n_boot=200)
    by_root = {str(r.root): r for r in plain + other}
    for row in table["methods"]:
        row["behaviour"] = mt.group_behaviour([by_root[p] for p in row["runs"]])
        row["display"] = mt.short_label(row["label"], by_root[row["runs"][0]].cfg.resolved_method())
    return {"source": source, "table": table}


def test_pooled_differences_are_seed_means_over_the_folders_against_a_reference():
    from scipy import stats as sps

    a = _folder("float32", [0.40, 0.42, 0.38, 0.41], [0.43, 0.44, 0.40, 0.40])
    b = _folder("fp8", [0.37, 0.36, 0.39], [0.38, 0.40, 0.37])  # seed 3 missing: pooled over seeds 0-2
    (row,) = mt.pooled([a, b])
    want = [
        ((0.43 - 0.40) + (0.38 - 0.37)) / 2,
        ((0.44 - 0.42) + (0.40 - 0.36)) / 2,
        ((0.40 - 0.38) + (0.37 - 0.39)) / 2,
    ]
    assert row["display"] == "grpo + token-tis" and row["seeds"] == [0, 1, 2]
    assert row["diffs"] == pytest.approx(want) and row["mean"] == pytest.approx(sum(want) / 3)
    ref = sps.ttest_1samp(want, 0.0)
    half = sps.t.ppf(0.975, 2) * sps.sem(want)
    assert (
        row["p_t"] == pytest.approx(ref.pvalue) and row["p_sign_flip"] == 0.5
    )  # +0.02, +0.03, 0: 4 of the 8 flips as extreme
    assert row["p"] == max(row["p_t"], row["p_sign_flip"]) and row["p_holm"] == pytest.approx(
        row["p"]
    )  # one method: Holm is p
    assert (row["ci_low"], row["ci_high"]) == pytest.approx((sum(want) / 3 - half, sum(want) / 3 + half))
    text = mt.pooled_markdown([row], ["float32", "fp8"])
    assert "mean over float32, fp8" in text and text.splitlines()[2].startswith("| grpo + token-tis | 3 | +0.017 [")
    # a method absent from one folder is not pooled; neither is one with a single shared seed
    alone = _folder("bf16", [0.40], [0.41])
    assert mt.pooled([a, alone]) == []
    c = {
        "source": "x",
        "table": cmp.compare([_run(s, 0.4, 0.08, 0.18) for s in range(3)], "grpo", test="paired", n_boot=200),
    }
    assert mt.pooled([a, c]) == []


def test_pooled_json_holds_folders_and_pooled(tmp_path, capsys, monkeypatch):
    import json

    folders = {
        "f32": _folder("f32", [0.40, 0.42, 0.38], [0.43, 0.44, 0.40]),
        "fp8": _folder("fp8", [0.37, 0.36, 0.39], [0.38, 0.40, 0.37]),
    }
    monkeypatch.setattr(mt, "folder_table", lambda folder, eval_bench, n_boot: folders[folder.name])
    out = tmp_path / "t.json"
    assert mt.main([str(tmp_path / "f32"), str(tmp_path / "fp8"), "--pooled", "--json", str(out)]) == 0
    assert "mean over f32, fp8" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert [f["source"] for f in data["folders"]] == ["f32", "fp8"] and data["pooled"][0]["seeds"] == [0, 1, 2]
    assert mt.main([str(tmp_path / "f32"), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["pooled"] is None
