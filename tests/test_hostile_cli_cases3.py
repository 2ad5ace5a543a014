"""Bad input a third hostile pass found in the analyses, eval, rollout, sweep and config
commands, each run as the user types it: one line on stderr and exit code 2, nothing stored
replaced, nothing written outside what was asked."""

import pytest

from tests.conftest import snapshot


@pytest.mark.parametrize("analysis", ["dynamics", "compare"])
def test_an_analysis_output_that_is_a_run_folder_is_refused(finished, tmp_path, cli_error, analysis):
    """``--output out/r`` (the run folder itself, not a folder inside it) wrote dynamics.json and
    dynamics.png into the run, beside its recorded files: the check looked at the folders above
    the path only."""
    _, out, root = finished
    before = snapshot(root)
    line = cli_error("analyze", analysis, root, "--output", root)
    assert f"--output {root} is the run folder {root}" in line and "nothing was changed" in line
    assert snapshot(root) == before


def test_an_empty_analysis_output_is_refused(finished, tmp_path, cli_error, monkeypatch):
    """``--output ''`` (an unset shell variable) was read as the current folder: the analysis
    wrote its JSON and PNG there."""
    _, out, root = finished
    monkeypatch.chdir(tmp_path)
    line = cli_error("analyze", "dynamics", root, "--output", "")
    assert "--output" in line and "is empty" in line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("n_boot", ["0", "-5", "99999999999"])
def test_compare_n_boot_out_of_range_is_one_line(finished, tmp_path, cli_error, n_boot):
    """``--n-boot 0`` (or negative) was a 50-line ValueError traceback from stats.bootstrap_ci and
    exit 1; ``--n-boot 99999999999`` was killed by the kernel (scipy keeps every resample's mean)."""
    _, out, root = finished
    line = cli_error("analyze", "compare", root, "--n-boot", n_boot, "--output", tmp_path / "c")
    assert line.endswith(f"--n-boot must be in [1, 1000000], got {n_boot} (the bootstrap keeps one mean per resample)")
    assert not (tmp_path / "c").exists()


def test_a_steps_range_too_long_is_refused_before_it_is_expanded(finished, tmp_path, cli_error):
    """``--steps 1:99999999999`` was expanded into a set of 10^11 steps before any check: the
    process was killed for memory."""
    _, out, root = finished
    line = cli_error("analyze", "estimators", "--run", root, "--steps", "1:99999999999", "--output", tmp_path / "e")
    assert line.endswith("--steps 1:99999999999: more than 100000 steps (each one is replayed)")
