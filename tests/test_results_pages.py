"""scripts/results_pages.py: the generated blocks and figures of README.md and docs/ are what their
committed data gives (rerunning the script leaves no diff), a block lives in one page only, a figure
quoted twice has one value, and each of these rules catches a planted breach."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import results_pages as rp

ROOT = rp.ROOT


def test_the_pages_are_as_generated_and_every_rule_holds():
    assert rp.check(ROOT) == []


def test_rerunning_the_generator_leaves_no_diff(tmp_path):
    for rel in ["README.md", "docs", "benchmarks/results"]:
        src = ROOT / rel
        (shutil.copytree if src.is_dir() else shutil.copy)(src, tmp_path / rel)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*.md")}
    assert rp.main(["--write", "--root", str(tmp_path)]) == 0
    assert {p: p.read_bytes() for p in tmp_path.rglob("*.md")} == before


def test_every_generator_has_its_block_and_its_figures_are_quoted():
    blocks, figs = rp.render(ROOT)
    texts = "".join(p.read_text() for p in rp.pages(ROOT))
    for name in blocks:
        assert texts.count(f"<!-- generated: {name} -->") == 1, name
    assert {m["name"] for m in rp.FIGURE.finditer(texts)} <= set(figs)
    assert rp.FIGURE.search(texts) and figs["disk.qwen3-4b.whole"].endswith("TB")


BLOCKS = {"t": "| a | 1 |\n"}
FIGS = {"x": "1.5", "y": "2 GB"}


def _page(block="| a | 1 |\n", fig="1.5"):
    return f"# P\n\n<!-- generated: t -->\n{block}<!-- /generated -->\n\nx is <!-- fig: x -->{fig}<!-- /fig -->.\n"


def test_a_clean_set_of_pages_has_no_problem():
    assert rp.problems({"A.md": _page(), "B.md": "y: <!-- fig: y -->2 GB<!-- /fig -->\n"}, BLOCKS, FIGS) == []


def test_a_planted_duplicate_block_is_caught():
    found = rp.problems({"A.md": _page(), "B.md": _page()}, BLOCKS, FIGS)
    assert found == ["block 't' appears 2 times (in ['A.md', 'B.md']): once only"]
    twice = rp.problems({"A.md": _page() + _page()}, BLOCKS, FIGS)
    assert any("appears 2 times" in line for line in twice)
    assert rp.problems({"A.md": "nothing\n"}, BLOCKS, FIGS) == ["block 't' appears 0 times (in []): once only"]


def test_a_figure_with_two_values_is_caught():
    other = "elsewhere: <!-- fig: x -->1.7<!-- /fig -->\n"
    found = rp.problems({"A.md": _page(), "B.md": other}, BLOCKS, FIGS)
    assert "figure 'x' has 2 values across the pages: ['1.5', '1.7']" in found
    assert "B.md: figure 'x' is '1.7', its data gives '1.5'" in found


def test_a_stale_block_or_figure_or_an_unknown_name_is_caught_and_write_fixes_the_stale():
    stale = _page(block="| a | 0 |\n", fig="9")
    found = rp.problems({"A.md": stale}, BLOCKS, FIGS)
    assert "A.md: block 't' differs from its data (run scripts/results_pages.py --write)" in found
    assert "A.md: figure 'x' is '9', its data gives '1.5'" in found
    assert rp.problems({"A.md": rp.rewrite(stale, BLOCKS, FIGS)}, BLOCKS, FIGS) == []
    unknown = _page() + "<!-- generated: u -->\nold\n<!-- /generated -->\n<!-- fig: z -->3<!-- /fig -->\n"
    found = rp.problems({"A.md": unknown}, BLOCKS, FIGS)
    assert "A.md: block 'u' has no generator in scripts/results_pages.py" in found
    assert "A.md: figure 'z' has no data in scripts/results_pages.py" in found
    assert rp.rewrite(unknown, BLOCKS, FIGS) == unknown  # unknown names are left as they are
    prose = _page() + "a figure is marked `<!-- fig: NAME -->1<!-- /fig -->` in the page\n"
    assert rp.problems({"A.md": prose}, BLOCKS, FIGS) == []  # an example in a code span is not a marker


def test_the_check_fails_on_a_planted_breach_in_a_copy_of_the_repository(tmp_path, capsys):
    for rel in ["README.md", "docs", "benchmarks/results"]:
        src = ROOT / rel
        (shutil.copytree if src.is_dir() else shutil.copy)(src, tmp_path / rel)
    readme = tmp_path / "README.md"
    readme.write_text(readme.read_text() + "\nDisk: <!-- fig: disk.qwen3-4b.whole -->0.9 TB<!-- /fig -->\n")
    assert rp.main(["--root", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "README.md: figure 'disk.qwen3-4b.whole' is '0.9 TB'" in err and "has 2 values" in err
    assert rp.main(["--write", "--root", str(tmp_path)]) == 0  # the figure rewritten from its data
    assert "0.9 TB" not in readme.read_text()


def test_the_gpu_checks_zero2_row_says_how_far_it_got(tmp_path):
    """A finished ZeRO-2 phase reads ok / not ok / failed; one cut short names the last run whose
    log exists beside the JSON, or says no log was kept."""
    args = rp._gpu_check_args(["--work", "w", "--json", "c.json", "--engine", "hf", "--shape", "tiny"])

    def row(z):
        return rp._zero2_row(tmp_path, "c.json", args, {"runs": {}, **({"zero2_resume": z} if z else {})})

    done = {"complete": True, "killed": True, "max_abs_weight_diff": 0.0}
    assert "| ok: bit-identical weights and metrics" in row({**done, "ok": True})
    assert "not ok: killed True, weight difference 0.5" in row({**done, "ok": False, "max_abs_weight_diff": 0.5})
    assert "failed: `OSError: disk full`" in row({"ok": False, "error": "resume: Traceback\nOSError: disk full\n"})
    assert "cut short (no log kept)" in row(None)
    assert "cut short (no log kept)" in row({"ok": False, "complete": False, "uninterrupted_wall_s": 9.0})
    (tmp_path / "c-zero2-full.log").write_text("x")
    (tmp_path / "c-zero2-crash.log").write_text("x")
    assert "cut short in the run to be killed (log: `c-zero2-crash.log`)" in row(None)
    assert "| c.json | ZeRO-2 kill + resume (tiny) | 3 |" in row(None)


def test_the_phase_table_says_how_short_each_phase_would_have_to_become_for_2x(tmp_path):
    """A run at 1.6x the base: 2x needs it a fifth shorter. A phase of half its time then has to
    fall to 60 % of it; a phase of a tenth cannot give 2x even at no cost."""
    import json

    def run(cpu, phases):
        return {
            "cpu_s": cpu,
            "wall_s": cpu,
            "phases_s": dict(zip(("warm start", "rollouts", "updates", "the rest"), phases)),
        }

    rows = [
        {
            "preset": "lab",
            "variant": "base",
            "cpu_s": 160.0,
            "ratio_vs_base": 1.0,
            "ratio_if_free": {},
            "runs": [run(160.0, (16, 64, 64, 16))],
        },
        {
            "preset": "lab",
            "variant": "this tree: fast-packed",
            "cpu_s": 100.0,
            "ratio_vs_base": 1.6,
            "ratio_if_free": {"warm start": 1.6 / 0.9, "rollouts": 1.6 / 0.7, "updates": 3.2, "the rest": 1.6 / 0.9},
            "runs": [run(100.0, (10, 30, 50, 10))],
        },
    ]
    machine = {"cpu": "Test CPU", "cores": 2, "torch": "2", "loadavg_1m": 1.0, "time": "t"}
    data = {
        "command": "python x",
        "machine": machine,
        "loadavg_1m_start": 1.0,
        "threads": 1,
        "rounds": 1,
        "base": "abc",
    }
    (tmp_path / rp.BENCH).mkdir(parents=True)
    (tmp_path / rp.BENCH / "p.json").write_text(json.dumps(data | {"rows": rows}))
    lines = rp.runs_per_cpu_hour_phases(tmp_path, "p.json").splitlines()
    table = [line.split(" | ") for line in lines if line.startswith("|") and "phase" not in line and "---" not in line]
    ours = table[4:]
    assert [r[4] for r in ours] == ["warm start", "rollouts", "updates", "the rest"]
    assert ours[2][5:] == ["50 %", "3.20×", "60 % of its time |"]
    assert ours[0][7] == "not even at no cost |" and ours[1][7] == "33 % of its time |"
    assert table[0][4:] == ["warm start", "10 %", "", " |"]  # the base's own rows: shares only


def test_the_rounds_table_lists_runs_in_the_order_they_ran_with_each_rounds_own_ratio(tmp_path):
    """Round 2 runs the trees in reverse; each run's ratio is to the base run of its own round,
    and the warm-start line spans this tree's runs only (the base's warm start is other code)."""
    import json

    def run(cpu, warm):
        return {
            "cpu_s": cpu,
            "wall_s": cpu,
            "phases_s": {"warm start": warm, "rollouts": 1.0, "updates": 2.0, "the rest": 3.0},
        }

    rows = [
        {"preset": "lab", "variant": "base", "runs": [run(300.0, 5.0), run(400.0, 50.0)]},
        {"preset": "lab", "variant": "this tree: a", "runs": [run(200.0, 20.0), run(250.0, 25.0)]},
        {"preset": "lab", "variant": "this tree: b", "runs": [run(150.0, 21.0), run(160.0, 22.0)]},
    ]
    (tmp_path / rp.BENCH).mkdir(parents=True)
    (tmp_path / rp.BENCH / "r.json").write_text(json.dumps({"base": "abc", "rounds": 2, "rows": rows}))
    lines = rp.runs_per_cpu_hour_rounds(tmp_path, "r.json").splitlines()
    table = [line.split(" | ") for line in lines[2:] if line.startswith("|")]
    assert [(r[0], r[1]) for r in table] == [
        ("| 1", "abc"),
        ("| 1", "a"),
        ("| 1", "b"),
        ("| 2", "b"),
        ("| 2", "a"),
        ("| 2", "abc"),
    ]
    assert [r[-1] for r in table] == ["1.00× |", "1.50× |", "2.00× |", "2.50× |", "1.60× |", "1.00× |"]
    assert table[1][2:7] == ["200", "20", "1", "2", "3"]
    assert lines[-1].startswith(
        "This tree's warm start, the same computation in each of its 4 runs, took 20.0-25.0 s, 25% longer"
    )
    # --pairs: the base ran beside each variant; each variant's ratio is to its own pair's base
    pair_rows = [
        {
            "preset": "lab",
            "variant": "base",
            "runs": [run(300.0, 5.0), run(310.0, 5.0), run(400.0, 5.0), run(410.0, 5.0)],
        },
        {
            "preset": "lab",
            "variant": "this tree: a",
            "runs": [run(200.0, 20.0) | {"paired_base_cpu_s": 300.0}, run(250.0, 25.0) | {"paired_base_cpu_s": 400.0}],
        },
        {
            "preset": "lab",
            "variant": "this tree: b",
            "runs": [run(155.0, 21.0) | {"paired_base_cpu_s": 310.0}, run(205.0, 22.0) | {"paired_base_cpu_s": 410.0}],
        },
    ]
    (tmp_path / rp.BENCH / "p.json").write_text(
        json.dumps({"base": "abc", "rounds": 2, "pairs": True, "rows": pair_rows})
    )
    lines = rp.runs_per_cpu_hour_rounds(tmp_path, "p.json").splitlines()
    assert "× abc beside it" in lines[0]
    table = [line.split(" | ") for line in lines[2:] if line.startswith("|")]
    assert [(r[0], r[1], r[2], r[-1]) for r in table] == [
        ("| 1", "abc", "300", " |"),
        ("| 1", "a", "200", "1.50× |"),
        ("| 1", "abc", "310", " |"),
        ("| 1", "b", "155", "2.00× |"),
        ("| 2", "abc", "400", " |"),
        ("| 2", "a", "250", "1.60× |"),
        ("| 2", "abc", "410", " |"),
        ("| 2", "b", "205", "2.00× |"),
    ]


def test_the_adamw_figures_compare_each_round_with_its_own_base(tmp_path):
    """adamw.*: per round, the medians of the later updates (the first, compiling update left
    out), the fused kernel lower in the rounds where its median is, and the base's range."""
    import json

    rows = [
        {"variant": "eager-packed", "runs": [{"update_s": [9.0, 0.6, 0.5, 0.7]}, {"update_s": [9.0, 0.4, 0.4]}]},
        {"variant": "adamw-fused", "runs": [{"update_s": [0.1, 0.5, 0.5, 0.5]}, {"update_s": [0.1, 0.5, 0.5]}]},
    ]
    (tmp_path / rp.BENCH).mkdir(parents=True)
    (tmp_path / rp.BENCH / "compile_update_adamw.json").write_text(json.dumps({"rows": rows}))
    assert rp._adamw_figures(tmp_path) == {
        "adamw.faster-rounds": "1 of the 2",
        "adamw.round-ratios": "1.20× and 0.80×",
        "adamw.base-range": "0.40 s to 0.60 s",
    }


def test_the_adamw_run_figures_take_the_saving_off_the_fast_packed_run(tmp_path):
    import json

    (tmp_path / rp.BENCH).mkdir(parents=True)
    (tmp_path / rp.BENCH / "adamw_kernels.json").write_text(json.dumps({"run_saving_cpu_s": 20.0}))
    rows = [
        {"variant": "base", "cpu_s": 300.0, "ratio_vs_base": None},
        {"variant": "this tree: fast-packed", "cpu_s": 200.0, "ratio_vs_base": 1.4},
    ]
    (tmp_path / rp.BENCH / "runs_per_cpu_hour_lab_pairs.json").write_text(json.dumps({"rows": rows}))
    assert rp._adamw_run_figures(tmp_path) == {"adamw.run-share": "10.0%", "adamw.projected": "1.56×"}


def test_the_bf16_figures_bound_the_step_by_its_gemms(tmp_path):
    """bf16.*: each variant's median ratio; the GEMMs' float32/bfloat16 ratio, their share of the
    float32 step, and the step's ratio had only its GEMMs gone bfloat16 (the rest unchanged)."""
    import json

    variants = {
        v: {"ratio_median": r, "cpu_ms": 40.0} for v, r in (("float32", 1.0), ("bfloat16", 0.9), ("autocast", 1.1))
    }
    shape = {"shape": "lab", "variants": variants, "gemm_ms": {"float32": 16.0, "bfloat16": 4.0}}
    (tmp_path / rp.BENCH).mkdir(parents=True)
    (tmp_path / rp.BENCH / "bf16_step.json").write_text(json.dumps({"shapes": [shape]}))
    assert rp._bf16_figures(tmp_path) == {
        "bf16.lab.bfloat16": "0.90×",
        "bf16.lab.autocast": "1.10×",
        "bf16.lab.gemm-ratio": "4.0×",
        "bf16.lab.gemm-share": "40%",
        "bf16.lab.gemm-bound": "1.43×",  # 40 / (40 - 16 + 4)
    }
