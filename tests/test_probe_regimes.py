"""scripts/probe_regimes.py: every probe and control is a valid config, and the failure rule counts
collapsed seeds and seeds that ended below their start (issue #40's search)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from masktrl.config import load_config

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import probe_regimes as P


@pytest.mark.parametrize("name", list(P.PROBES))
def test_every_probe_and_its_control_is_a_valid_config_that_differs_in_its_factor(name):
    presets, regime, control = P.PROBES[name]
    paths = ["lab", *presets[1::2], "methods/verl-grpo"]
    a = load_config(paths, regime, method="grpo", seed=0)
    b = load_config(paths, control, method="grpo", seed=0)
    assert a.method.name == "grpo" and a.method.params.dual_clip == 3.0  # verl's default GRPO, not the lab's
    assert a.to_dict() != b.to_dict()


def _run(seed, before, after, collapsed):
    return {"seed": seed, "eval_before": before, "eval_after": after, "collapse": {"collapsed": collapsed}}


def test_a_seed_fails_when_it_collapsed_or_ended_below_its_start():
    cell = {"runs": [_run(0, 0.2, 0.4, False), _run(1, 0.2, 0.1, False), _run(2, 0.2, 0.3, True)]}
    assert P.failed(cell) == 2
    assert P.failed({"runs": [_run(0, 0.2, 0.2, False)]}) == 0  # equal to the start is not below it


def test_the_table_has_one_row_per_seed_of_every_cell_written(tmp_path, capsys):
    folder = tmp_path / "top-p"
    folder.mkdir()
    cell = {"runs": [_run(0, 0.24, 0.41, False), _run(1, 0.25, 0.01, True)]}
    (folder / "grpo.json").write_text(json.dumps(cell))
    P.main(["table", "--cells", str(tmp_path)])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| top-p |")]
    assert len(rows) == 2
    assert "0.250 → 0.010 | yes | yes" in rows[1] and "rollout.top_p=0.9" in rows[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(P.PROBES))
def test_every_probe_and_its_control_passes_the_dry_run(name, tmp_path):
    """The run-time checks (a kept set that fits the recorded list, routing replay on an MoE, ...)
    accept every probe: the search does not stop on a refusal hours in."""
    presets, regime, control = P.PROBES[name]
    for sets in (regime, control):
        command = ["train", "--config", "lab", *presets, "--config", "methods/verl-grpo", "--dry-run"]
        command += ["--out", str(tmp_path)] + [x for item in sets for x in ("--set", item)]
        r = subprocess.run([sys.executable, "-m", "masktrl.cli", *command], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-500:]
