"""scripts/results_cells.py (issue #40.5): one JSON per grid cell from run folders, the RESULTS tables
generated from them (paired design of docs/ANALYSIS.md), --check / --write on marked blocks, and
the machine record every run's summary.json carries."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sps

from masktrl.analysis.io import RunInfo
from masktrl.config import from_dict
from masktrl.stats import paired_mdd, sign_flip_p
from tests.conftest import cli, write_tiny_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import results_cells as rc

MACHINE = {"cpu_model": "Test CPU 9000", "threads": 2, "commit": "abc123"}


def _run(folder, seed, final, correction=None, name=None):
    cfg = from_dict({"seed": seed, "method": {"name": "grpo", **({"correction": correction} if correction else {})}})
    metrics = [
        {
            "step": t,
            "reward_mean": 0.4,
            "mismatch/logp_abs_mean": 0.08,
            "mismatch/kl_k3": 0.008,
            "mask_frac": 0.2,
            "entropy": 1.0,
        }
        for t in range(1, 41)
    ]
    summary = {"eval_before": 0.3, "eval_after": final, "steps": 40, "machine": MACHINE}
    return RunInfo(Path(f"/nowhere/{folder}/{name or 'grpo'}-seed{seed}"), cfg, metrics, summary, "complete")


BASE = [0.40, 0.42, 0.38, 0.41, 0.39]
TIS = [0.45, 0.44, 0.41, 0.47, 0.40]


@pytest.fixture
def synthetic(monkeypatch):
    runs = {
        "fp8": [_run("fp8", s, v) for s, v in enumerate(BASE)]
        + [_run("fp8", s, v, {"kind": "token-tis", "mode": "decoupled"}, "tis") for s, v in enumerate(TIS)]
    }
    monkeypatch.setattr(rc, "expand_runs", lambda paths: [r.root for p in paths for r in runs[Path(p).name]])
    by_root = {r.root: r for rs in runs.values() for r in rs}
    monkeypatch.setattr(rc, "load_run", lambda root: by_root[Path(root)])
    return runs


def test_cells_hold_every_seed_and_the_table_is_the_paired_design(synthetic, tmp_path):
    paths, removed = rc.write_cells([Path("fp8")], tmp_path / "cells")
    assert removed == []
    assert [p.relative_to(tmp_path / "cells").as_posix() for p in paths] == [
        "fp8/grpo.json",
        "fp8/grpo_correction.cap=2.0.json",
    ]  # the label
    cell = json.loads(paths[1].read_text())
    assert (
        cell["source"] == "fp8" and cell["method"]["correction"]["mode"] == "decoupled" and "seed" not in cell["config"]
    )
    assert [r["seed"] for r in cell["runs"]] == [0, 1, 2, 3, 4] and [r["eval_after"] for r in cell["runs"]] == TIS
    assert cell["runs"][0]["machine"] == MACHINE and cell["runs"][0]["mismatch"]["logp_abs_step1"] == 0.08
    assert cell["runs"][0]["collapse"]["collapsed"] is False
    before = {p: p.read_bytes() for p in paths}
    rc.write_cells([Path("fp8")], tmp_path / "cells")  # the same runs: the same bytes
    assert {p: p.read_bytes() for p in paths} == before

    text = rc.tables(tmp_path / "cells")["fp8"]
    d = np.subtract(TIS, BASE)
    row = next(line for line in text.splitlines() if "correction" in line).split(" | ")
    ref = sps.ttest_rel(TIS, BASE)
    assert row[3].startswith(f"{d.mean():+.3f} [")
    assert row[4] == f"{ref.pvalue:.3f}" and row[5] == f"{sign_flip_p(d):.3f}" == "0.062"
    assert row[6] == f"{max(ref.pvalue, sign_flip_p(d)):.3f}"  # one row: Holm is the larger p
    assert row[7] == f"{paired_mdd(d, alpha=0.05):.3f}" and row[8] == "0/5"
    assert "Test CPU 9000 x2" in row[10] and "0: 0.450" in row[9]


def test_check_and_write_the_marked_blocks(synthetic, tmp_path):
    rc.write_cells([Path("fp8")], tmp_path / "cells")
    doc = tmp_path / "RESULTS.md"
    doc.write_text("# Results\n\n<!-- cells:fp8 -->\nold table\n<!-- /cells:fp8 -->\n\nafter\n")
    assert rc.main(["tables", "--cells", str(tmp_path / "cells"), "--check", str(doc)]) == 1
    assert rc.main(["tables", "--cells", str(tmp_path / "cells"), "--write", str(doc)]) == 0
    assert rc.main(["tables", "--cells", str(tmp_path / "cells"), "--check", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("# Results\n\n<!-- cells:fp8 -->\n| cell |") and text.endswith(
        "<!-- /cells:fp8 -->\n\nafter\n"
    )
    assert rc.tables(tmp_path / "cells")["fp8"] in text


def test_a_run_records_its_machine_and_its_cell_is_written(warm_out, tmp_path):
    config = write_tiny_config(warm_out.parent / "cell.yaml", {"train": {"steps": 1, "checkpoint_every": 1}})
    cli("train", "--config", config, "--out", warm_out / "src", "--run", "grpo-seed0")
    summary = json.loads((warm_out / "src" / "grpo-seed0" / "summary.json").read_text())
    m = summary["machine"]
    assert m["threads"] == 1 and m["torch_threads"] >= 1 and isinstance(m.get("cpu_model", ""), str)
    assert "commit" not in m or len(m["commit"].split("-")[0]) == 40
    (path,), _ = rc.write_cells([warm_out / "src"], tmp_path / "cells")
    cell = json.loads(path.read_text())
    assert cell["runs"][0]["machine"] == m and cell["runs"][0]["eval_after"] == summary["eval_after"]
    assert "| grpo | 1 |" in rc.tables(tmp_path / "cells")["src"]


def test_same_compares_every_value_but_the_commits(tmp_path, capsys):
    """`same A B`: a rerun made at another commit equals its committed cell; any other value that
    differs (a float in its last bit, a missing key, a list of another length) is named, exit 1."""
    cell = {
        "cell": "fp8/grpo",
        "runs": [{"seed": 0, "eval_after": 0.1 + 0.2, "machine": {**MACHINE}, "collapse": {"collapsed": False}}],
    }
    rerun = json.loads(json.dumps(cell))
    rerun["runs"][0]["machine"]["commit"] = "def456-dirty"
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(cell))
    b.write_text(json.dumps(rerun))
    assert rc.main(["same", str(a), str(b)]) == 0
    for change in (
        lambda c: c["runs"][0].__setitem__("eval_after", np.nextafter(0.1 + 0.2, 1.0)),
        lambda c: c["runs"][0]["machine"].__setitem__("cpu_model", "Other CPU"),
        lambda c: c["runs"][0].pop("seed"),
        lambda c: c["runs"].append({}),
        lambda c: c["runs"][0]["collapse"].__setitem__("collapsed", 0),  # 0 is not False
    ):
        other = json.loads(json.dumps(rerun))
        change(other)
        b.write_text(json.dumps(other, default=float))
        assert rc.main(["same", str(a), str(b)]) == 1
    assert "differ in 1 value(s)" in capsys.readouterr().err
    assert rc.main(["same", str(tmp_path / "missing.json"), str(b)]) == 2


def test_write_removes_a_cell_whose_label_changed(synthetic, tmp_path):
    """A cell's file is named by its label, and a label depends on the other cells of the sweep; a
    file the sweep no longer gives is removed (and said), so no run stands in two cells."""
    (tmp_path / "cells" / "fp8").mkdir(parents=True)
    stale = tmp_path / "cells" / "fp8" / "tis.json"  # as if written when the label was "tis"
    stale.write_text("{}")
    other = tmp_path / "cells" / "bf16" / "grpo.json"  # another source's cells are left alone
    other.parent.mkdir()
    other.write_text("{}")
    paths, removed = rc.write_cells([Path("fp8")], tmp_path / "cells")
    assert removed == [stale] and not stale.exists() and other.exists() and len(paths) == 2
