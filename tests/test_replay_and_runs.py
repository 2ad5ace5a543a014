"""`masktrl rollout`, `train --rollouts-from` and `masktrl runs`."""

import json

import pytest
from typer.testing import CliRunner

from masktrl.cli import app
from masktrl.rollout.storage import read_rollouts
from tests.conftest import write_tiny_config

runner = CliRunner()


def invoke(*args):
    result = runner.invoke(app, [str(a) for a in args])
    return result


@pytest.fixture(scope="module")
def source_run(tmp_path_factory):
    base = tmp_path_factory.mktemp("replay")
    cfg = write_tiny_config(base / "c.yaml")
    r = invoke("train", "--config", cfg, "--out", base / "out", "--run", "src")
    assert r.exit_code == 0, r.output
    return base, cfg, base / "out" / "src"


def test_rollout_command_writes_a_trainable_file(source_run):
    base, cfg, src = source_run
    out_file = base / "r.parquet"
    r = invoke(
        "rollout",
        "--model",
        src,
        "--data",
        "synthetic",
        "--n",
        4,
        "--logprobs-k",
        3,
        "--prompts",
        5,
        "--output",
        out_file,
    )
    assert r.exit_code == 0, r.output
    samples, meta = read_rollouts(out_file)
    assert len(samples) == 20 and meta["logprobs_k"] == 3 and meta["model"].endswith("000002")
    assert all(len(row) == 3 for s in samples for row in s.gen.topk_ids)
    # refuses to overwrite
    r = invoke(
        "rollout", "--model", "src", "--out", base / "out", "--data", "synthetic", "--output", out_file
    )  # a run by name
    assert r.exit_code == 2 or "already exists" in str(r.exception)


def test_two_methods_replaying_one_file_see_identical_tokens(source_run):
    base, cfg, src = source_run
    out_file = base / "shared.parquet"
    r = invoke(
        "rollout", "--model", src, "--data", "synthetic", "--n", 4, "--topk", 4, "--prompts", 12, "--output", out_file
    )
    assert r.exit_code == 0 and "deprecated: --topk; use --logprobs-k 4" in r.output, (
        r.output
    )  # the old spelling, visibly
    assert read_rollouts(out_file)[1]["logprobs_k"] == 4
    for method in ("grpo", "dppo"):
        r = invoke(
            "train",
            "--config",
            cfg,
            "--out",
            base / "out",
            "--run",
            f"replay-{method}",
            "--method",
            method,
            "--rollouts-from",
            out_file,
            "--set",
            "train.steps=2",
            "--set",
            "rollout.logprobs_k=4",  # the file's lists (a config of K = 5 is refused: run.yaml would misdescribe them)
        )
        assert r.exit_code == 0, r.output
    a, b = base / "out" / "replay-grpo", base / "out" / "replay-dppo"
    steps = sorted(p.name for p in (a / "steps").iterdir())
    assert steps == ["000001", "000002"]  # 12 prompts / 6 per step
    for s in steps:
        assert (a / "steps" / s / "rollouts.parquet").read_bytes() == (
            b / "steps" / s / "rollouts.parquet"
        ).read_bytes()
    src_tokens = [x.gen.response_ids for x in read_rollouts(out_file)[0]]
    replayed = [x.gen.response_ids for s in steps for x in read_rollouts(a / "steps" / s / "rollouts.parquet")[0]]
    assert replayed == src_tokens
    assert json.loads((a / "summary.json").read_text())["rollouts_from"] == str(out_file)


def test_replaying_a_run_folder(source_run):
    base, cfg, src = source_run
    r = invoke(
        "train",
        "--config",
        cfg,
        "--out",
        base / "out",
        "--run",
        "replay-run",
        "--method",
        "pdm",
        "--rollouts-from",
        "src",
    )  # a run by name under --out
    assert r.exit_code == 0, r.output
    for s in ("000001", "000002"):
        mine = read_rollouts(base / "out" / "replay-run" / "steps" / s / "rollouts.parquet")[0]
        theirs = read_rollouts(src / "steps" / s / "rollouts.parquet")[0]
        assert [x.gen.response_ids for x in mine] == [x.gen.response_ids for x in theirs]


def test_incompatible_tokenizer_is_refused(source_run, tmp_path):
    base, cfg, src = source_run
    other = tmp_path / "other.yaml"
    other.write_text(
        cfg.read_text().replace("digits: 1", "digits: 1, answer_format: boxed")
    )  # boxed adds characters to the vocabulary
    r = invoke("train", "--config", other, "--out", tmp_path / "out", "--run", "x", "--rollouts-from", src)
    assert r.exit_code != 0 and "tokenizer" in str(r.exception)


def test_runs_lists_status(source_run):
    base, cfg, src = source_run
    r = runner.invoke(app, ["runs", "--out", str(base / "out")], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "src" in r.output and "complete" in r.output and "2 / 2" in r.output
    # a run whose process died without saying so reads as interrupted
    m = json.loads((src / "manifest.json").read_text())
    (src / "manifest.json").write_text(json.dumps({**m, "status": "running", "pid": 2**22 + 12345}))
    r = runner.invoke(
        app, ["runs", str(base / "out")], env={"COLUMNS": "200"}
    )  # the deprecated spelling still works, and says so
    assert "interrupted" in r.output and "deprecated" in r.output
    (src / "manifest.json").write_text(json.dumps(m))


def test_a_replay_that_is_not_the_configured_run_is_refused_before_training(source_run, tmp_path, cli_error):
    """A replay shorter than train.steps, or cut into batches of another size, says so and names the fix."""
    base, cfg, src = source_run
    out_file = base / "short.parquet"
    r = invoke(
        "rollout",
        "--model",
        src,
        "--data",
        "synthetic",
        "--n",
        4,
        "--logprobs-k",
        3,
        "--prompts",
        12,
        "--output",
        out_file,
    )
    assert r.exit_code == 0, r.output
    out = tmp_path / "out"
    line = cli_error(
        "train", "--config", cfg, "--out", out, "--run", "x", "--rollouts-from", out_file, "--set", "train.steps=5"
    )
    assert "2 batches of 6 prompts, fewer than train.steps=5; add --set train.steps=2" in line
    line = cli_error(
        "train",
        "--config",
        cfg,
        "--out",
        out,
        "--run",
        "x",
        "--rollouts-from",
        out_file,
        "--set",
        "rollout.prompts_per_step=5",
        "--set",
        "train.steps=2",
    )
    assert (
        "12 prompt groups do not make whole steps of rollout.prompts_per_step=5" in line
        and "prompts_per_step=4" in line
    )
    line = cli_error(
        "train",
        "--config",
        cfg,
        "--out",
        out,
        "--run",
        "x",
        "--rollouts-from",
        src,
        "--set",
        "rollout.prompts_per_step=3",
    )
    assert "its batches have 6 prompts each" in line and "--set rollout.prompts_per_step=6" in line
    assert not out.exists() or not any(out.iterdir())  # nothing written


def test_runs_table_folds_long_names_at_80_columns(monkeypatch, tmp_path):
    """Runs named <method>-<timestamp> differ in their last digits: at 80 columns the names are
    folded onto two lines, never cut to `dppo-20261…`."""
    import masktrl.runs.listing as listing
    from masktrl.commands import ui

    names = [f"dppo[divergence=binary-tv]-seed{s}-20261201-10{s}512" for s in range(3)]
    rows = [
        dict(
            name=n,
            method="dppo[divergence=binary-tv]",
            seed=s,
            steps_done=800,
            steps_planned=800,
            last_reward=0.5,
            last_eval=0.7,
            status="complete",
        )
        for s, n in enumerate(names)
    ]
    monkeypatch.setattr(listing, "list_runs", lambda folder: rows)
    monkeypatch.setattr(ui.console, "width", 80)  # the width a terminal reports, for this test only
    with ui.console.capture() as cap:
        from masktrl.commands.runs import runs

        runs(out=tmp_path)
    first_column = "".join(line.split("│")[1].strip() for line in cap.get().splitlines() if line.startswith("│"))
    for n in names:
        assert n in first_column, cap.get()
    assert "…" not in cap.get()
