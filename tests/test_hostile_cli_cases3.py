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
