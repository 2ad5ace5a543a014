"""Shared fixtures: a very small config so end-to-end runs take seconds, and a set of tiny
finished runs the analyses read."""

import pytest

TINY_TEST_YAML = """\
seed: 0
method: {name: grpo}
model: {hidden_size: 32, num_layers: 1, num_heads: 2, num_kv_heads: 1, intermediate_size: 64}
task: {name: arithmetic, digits: 1, n_test: 16}
warmstart: {steps: 40, batch_size: 16}
rollout: {prompts_per_step: 6, n: 4, max_new_tokens: 4, logprobs_k: 5}
train: {steps: 2, checkpoint_every: 1, lr: 1.0e-3}
"""


@pytest.fixture
def tiny_config(tmp_path):
    path = tmp_path / "tiny_test.yaml"
    path.write_text(TINY_TEST_YAML)
    return path


ANALYSIS_YAML = """\
seed: 0
method: {name: grpo}
model: {hidden_size: 32, num_layers: 1, num_heads: 2, num_kv_heads: 1, intermediate_size: 64}
task: {name: arithmetic, digits: 1, n_test: 16}
warmstart: {steps: 150, batch_size: 16}
rollout: {prompts_per_step: 8, n: 4, max_new_tokens: 4, logprobs_k: 5}
train: {steps: 3, checkpoint_every: 1, lr: 3.0e-3, minibatches: 2, eval_every: 2}
"""


@pytest.fixture(scope="session")
def analysis_runs(tmp_path_factory):
    """A folder of finished runs: grpo x seeds 0, 1, 2 and sis x seeds 0, 1 (3 steps each, 2
    minibatches, every checkpoint kept, K = 5 lists over a 17-token vocabulary). Tests that
    write into a run's analysis/ folder must not assume it is empty."""
    from masktrl.pipeline import sweep

    base = tmp_path_factory.mktemp("analysis")
    config = base / "tiny.yaml"
    config.write_text(ANALYSIS_YAML)
    out = base / "out"
    sweep.run_sweep(sweep.plan(out, ["grpo"], [0, 1, 2], config))
    sweep.run_sweep(sweep.plan(out, ["sis"], [0, 1], config))
    return out


@pytest.fixture
def cli_error(monkeypatch, capsys):
    """``cli_error(arg, ...)`` runs ``masktrl arg ...`` through the CLI's error boundary, checks it
    ended with exit code 2 and exactly one stderr line (no traceback), and returns that line."""
    import sys

    from masktrl import cli

    def run(*args) -> str:
        monkeypatch.setattr(sys, "argv", ["masktrl", *map(str, args)])
        with pytest.raises(SystemExit) as exc:
            cli.main()
        assert exc.value.code == 2
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and "Traceback" not in err, err
        return lines[0]

    return run
