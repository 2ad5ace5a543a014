"""``masktrl sweep``: the grid runs once, complete runs are skipped, interrupted ones resume."""

import json
import shutil

import pytest
from typer.testing import CliRunner

from masktrl.cli import app
from masktrl.errors import ConfigError, MasktrlError
from masktrl.recipes import sweep
from tests.conftest import write_tiny_config

runner = CliRunner()


def _sweep(config, out, *args):
    result = runner.invoke(
        app,
        ["sweep", "--methods", "grpo,dppo", "--seeds", "1", "--config", str(config), "--out", str(out), *args],
        env={"COLUMNS": "200"},
    )
    assert result.exit_code == 0, (result.output, result.exception)
    return result.output


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    base = tmp_path_factory.mktemp("sweep")
    config = write_tiny_config(base / "tiny.yaml")
    output = _sweep(config, base / "out")
    return config, base / "out", output


def _copy(swept, tmp_path):
    config, out, _ = swept
    shutil.copytree(out, tmp_path / "out")
    return config, tmp_path / "out"


def test_sweep_trains_the_grid_and_prints_the_compare_table(swept):
    _, out, output = swept
    for name in ("grpo-seed0", "dppo-seed0"):
        summary = json.loads((out / name / "summary.json").read_text())
        assert summary["run"] == name and summary["seed"] == 0
    assert summary["method"] == "dppo"
    assert len(list((out / ".cache" / "warmstart").iterdir())) == 1  # one warm start for the seed
    assert "train grpo-seed0" in output and "dppo" in output and "only 1 seed" in output
    assert (out / "analysis" / "compare.json").is_file() and (out / "analysis" / "compare.png").stat().st_size > 0


def test_a_sweep_of_one_method_spec_tables_it_as_its_own_baseline(swept, tmp_path):
    # the default baseline is the first spec; the table's label is the method name, not the spec
    config, out = _copy(swept, tmp_path)
    result = runner.invoke(
        app,
        [
            "sweep",
            "--methods",
            "dppo:divergence=topk-tv",
            "--seeds",
            "1",
            "--config",
            str(config),
            "--out",
            str(out / "spec"),
        ],
        env={"COLUMNS": "200"},
    )
    assert result.exit_code == 0, (result.output, result.exception)
    table = json.loads((out / "spec" / "analysis" / "compare.json").read_text())
    assert table["baseline"] == "dppo" and table["methods"][0]["runs"] == [
        str(out / "spec" / "dppo-divergence-topk-tv-seed0")
    ]


def test_sweep_skips_complete_runs(swept, tmp_path):
    config, out = _copy(swept, tmp_path)
    before = {p: p.read_bytes() for p in out.glob("*/summary.json")}
    output = _sweep(config, out)
    assert "2 complete, 0 to run" in output and output.count("] skip ") == 2
    assert {p: p.read_bytes() for p in out.glob("*/summary.json")} == before


def test_interrupted_run_resumes_in_place(swept, tmp_path):
    config, out = _copy(swept, tmp_path)
    root = out / "grpo-seed0"
    (root / "summary.json").unlink()
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["status"] = "interrupted"
    (root / "manifest.json").write_text(json.dumps(manifest))
    [item, _] = sweep.plan(out, ["grpo", "dppo"], [0], config)
    assert item.state == "resume" and item.root == root
    output = _sweep(config, out)
    assert "resuming an interrupted run" in output
    assert (
        json.loads((root / "manifest.json").read_text())["status"] == "complete" and (root / "summary.json").is_file()
    )


def test_unresumable_run_restarts_in_a_fresh_folder(swept, tmp_path):
    config, out = _copy(swept, tmp_path)
    (out / "dppo-seed0" / "summary.json").unlink()
    (out / "dppo-seed0" / "manifest.json").unlink()
    output = _sweep(config, out)
    assert "cannot resume" in output and "train dppo-seed0-retry1" in output
    assert (out / "dppo-seed0-retry1" / "summary.json").is_file()
    assert not (out / "dppo-seed0" / "summary.json").exists()  # the broken attempt is left as it was
    [_, item] = sweep.plan(out, ["grpo", "dppo"], [0], config)
    assert item.state == "complete" and item.root.name == "dppo-seed0-retry1"


def test_changed_config_is_refused_before_anything_runs(swept):
    config, out, _ = swept
    with pytest.raises(MasktrlError, match="different config.*train.lr"):
        sweep.plan(out, ["grpo"], [0], config, ["train.lr=0.5"])


@pytest.mark.parametrize("text", ["", "0", "a", "1,1", "-1,2"])
def test_bad_seed_lists(text):
    with pytest.raises(ConfigError):
        sweep.parse_seeds(text)


def test_seed_and_method_parsing():
    assert sweep.parse_seeds("3") == [0, 1, 2] and sweep.parse_seeds("0,4,7") == [0, 4, 7]
    assert sweep.parse_methods("grpo, sis") == ["grpo", "sis"]
    with pytest.raises(ConfigError, match="valid methods"):
        sweep.parse_methods("grpo,nosuch")


def test_method_specs_with_parameters_are_their_own_runs(tmp_path):
    """``pdm:tail=agg,pdm:tail=uniform``: two variants of one method in one sweep, each run
    named after its spec and configured with its parameters; a bad spec is one ConfigError."""
    from masktrl.recipes import slurm

    config = write_tiny_config(tmp_path / "tiny.yaml")
    specs = sweep.parse_methods("grpo, pdm:tail=agg, pdm:tail=uniform, dppo:divergence=topk-kl:delta_pos=0.1")
    items = sweep.plan(tmp_path / "out", specs, [3], config)
    assert [i.name for i in items] == [
        "grpo-seed3",
        "pdm-tail-agg-seed3",
        "pdm-tail-uniform-seed3",
        "dppo-divergence-topk-kl-delta_pos-0.1-seed3",
    ]
    params = [(i.cfg.method_name, i.cfg.method.to_dict()) for i in items]
    assert params[1][0] == params[2][0] == "pdm"
    assert params[1][1]["tail"] == "agg" and params[2][1]["tail"] == "uniform"
    assert params[3][0] == "dppo" and params[3][1]["divergence"] == "topk-kl" and params[3][1]["delta_pos"] == 0.1
    argv = slurm.train_command(items[2], out=tmp_path / "out", config=config, overrides=["train.steps=2"])
    assert argv[argv.index("--method") + 1] == "pdm" and argv[-1] == "pdm-tail-uniform-seed3"
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--set"] == ["train.steps=2", "method.tail=uniform"]
    for bad in ("pdm:tail", "pdm:=x", "nosuch:tail=agg", "pdm:tail=agg,pdm:tail=agg"):
        with pytest.raises(ConfigError):
            sweep.parse_methods(bad)
    with pytest.raises(ConfigError):  # an unknown parameter is caught when the config is built
        sweep.plan(tmp_path / "out", ["pdm:nosuch=1"], [0], config)


def test_method_specs_that_train_the_same_config_are_refused(tmp_path, cli_error):
    """``dppo`` and ``dppo:divergence=topk-kl`` (its default) would be one method twice in the
    compare table under two names: the sweep refuses them before anything runs, in one line."""
    config = write_tiny_config(tmp_path / "tiny.yaml")
    with pytest.raises(ConfigError, match="'dppo:divergence=topk-kl' trains the same config as 'dppo'"):
        sweep.plan(tmp_path / "out", ["dppo", "dppo:divergence=topk-kl"], [0, 1], config)
    with pytest.raises(ConfigError, match="same config"):  # the parameter given explicitly on both
        sweep.plan(tmp_path / "out", ["pdm:tail=agg", "pdm:tail=agg:divergence=kl"], [0], config)
    assert len(sweep.plan(tmp_path / "out", ["dppo", "dppo:divergence=binary-tv"], [0, 1], config)) == 4
    line = cli_error(
        "sweep",
        "--methods",
        "dppo,dppo:divergence=topk-kl",
        "--seeds",
        "1",
        "--config",
        config,
        "--out",
        tmp_path / "out",
    )
    assert "same config" in line
    assert not (tmp_path / "out").exists()
