"""Hostile pass 5: a sweep's grid and its folders between invocations, ``--set`` on ``eval`` and
``rollout``, run folders with odd names. Each case is one line and exit code 2 naming what is
wrong, or a correct result; never a run in the wrong folder, never one folder for two configs."""

import os
import shutil
from pathlib import Path

import pytest

from tests.conftest import cli, write_tiny_config

RULE = Path(__file__).resolve().parents[1] / "examples" / "tanh_clip.py"
CORRECTION = """import torch
from masktrl.methods import register_correction


@register_correction("clamp", keys={"cap": 2.0})
def clamp(log_rho, valid, seq_ids, adv, keys):
    return log_rho.exp().clamp(max=keys["cap"]), torch.ones_like(valid)
"""


def test_a_sweep_of_a_correction_file_in_a_folder_names_its_runs_one_folder_under_out(tmp_path):
    """The value's path went into the run name: the run was trained in out/grpo-correction-kind-c/
    corr.py:clamp-seed0 (a folder of runs of its own, with a .cache), and --print-commands printed
    --run corr.py:clamp-seed0, a command for another folder."""
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "corr.py").write_text(CORRECTION)
    config, out = write_tiny_config(tmp_path / "t.yaml"), tmp_path / "out"
    spec = f"grpo:correction.kind={tmp_path / 'c' / 'corr.py'}:clamp"
    result = cli("sweep", "--methods", spec, "--seeds", "1", "--config", config, "--out", out, "--print-commands")
    assert "--run grpo-correction-kind-corr.py:clamp-seed0" in result.output, result.output
    assert not out.exists()


def test_a_sweep_refuses_a_run_name_train_would_refuse(tmp_path, cli_error):
    """A rule of 195 characters made a 201-byte run name that the sweep trained (train --run
    refuses names over 200 bytes, so the printed commands and --resume NAME failed)."""
    name = "x" * 195
    rules = tmp_path / "long.py"
    rules.write_text(RULE.read_text().replace('"tanh_clip", TanhClipParams', f'"{name}", TanhClipParams'))
    config, out = write_tiny_config(tmp_path / "t.yaml"), tmp_path / "out"
    line = cli_error("sweep", "--methods", f"{rules}:{name}", "--seeds", "1", "--config", config, "--out", out)
    assert "makes an invalid run name" in line and "longer than 200 bytes" in line, line
    assert not out.exists()


def test_a_sweep_refuses_two_method_specs_that_make_one_run_name(tmp_path, cli_error):
    """Two files' rules of one name (a/r.py:tanh_clip, b/r.py:tanh_clip) both made tanh_clip-seed0:
    --print-commands printed the second one's command twice, and the sweep trained the first and
    then stopped at the second, finding its folder holding a complete run."""
    for folder, eps in (("a", "0.28"), ("b", "0.3")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "r.py").write_text(
            RULE.read_text().replace("eps_high: float = 0.28", f"eps_high: float = {eps}")
        )
    config, out = write_tiny_config(tmp_path / "t.yaml"), tmp_path / "out"
    methods = f"{tmp_path / 'a' / 'r.py'}:tanh_clip,{tmp_path / 'b' / 'r.py'}:tanh_clip"
    for extra in (["--print-commands"], []):
        line = cli_error("sweep", "--methods", methods, "--seeds", "1", "--config", config, "--out", out, *extra)
        assert "both make the run name 'tanh_clip-seed0'" in line, line
    assert not out.exists()


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """A finished sweep of grpo and dppo, one seed: ``(config, out)`` (copy it before changing it)."""
    base = tmp_path_factory.mktemp("swept")
    config = write_tiny_config(base / "t.yaml")
    cli("sweep", "--methods", "grpo,dppo", "--seeds", "1", "--config", config, "--out", base / "out")
    return config, base / "out"


@pytest.mark.parametrize(
    "damage, says",
    [
        (lambda out: (out / "grpo-seed0" / "summary.json").unlink(), "grpo-seed0/summary.json: missing"),
        (lambda out: os.truncate(out / "grpo-seed0" / "summary.json", 10), "summary.json: content hash mismatch"),
        (lambda out: os.truncate(out / "dppo-seed0" / "metrics.jsonl", 50), "metrics.jsonl: the rows up to summary"),
    ],
)
def test_a_sweep_over_a_damaged_complete_run_stops_before_anything_runs(swept, tmp_path, cli_error, damage, says):
    """A deleted summary.json made the complete run an interrupted one to resume (`train grpo-seed0
    (resuming an interrupted run)`), which train refused as `holds a complete run: --resume it`; an
    edited summary or metrics file was skipped as complete, every other run trained, and the sweep
    stopped at its compare table."""
    config, out = swept
    shutil.copytree(out, tmp_path / "out")
    out = tmp_path / "out"
    damage(out)
    (out / "analysis" / "compare.json").unlink()
    line = cli_error("sweep", "--methods", "grpo,dppo,sis", "--seeds", "1", "--config", config, "--out", out)
    assert says in line and "a damaged run: the sweep changed nothing" in line, line
    assert not (out / "sis-seed0").exists() and not (out / "analysis" / "compare.json").exists()


def test_a_slurm_script_keeps_an_out_folder_with_a_space_or_percent_in_one_log_path(tmp_path):
    """`#SBATCH --output=/x/o u t%j/...` was written unquoted: sbatch splits an #SBATCH line at
    whitespace (the log went to /x/o) and expands %j in the path (a folder that does not exist)."""
    import shlex

    config, out = write_tiny_config(tmp_path / "t.yaml"), tmp_path / "o u t%j"
    cli(
        "sweep",
        "--methods",
        "grpo",
        "--seeds",
        "1",
        "--config",
        config,
        "--out",
        out,
        "--launcher",
        "slurm",
        "--no-submit",
    )
    lines = (out / ".sweep" / "slurm" / "grpo-seed0.sbatch").read_text().splitlines()
    output = next(line for line in lines if line.startswith("#SBATCH --output="))
    # sbatch reads an #SBATCH line's words as a POSIX shell does (quotes, backslashes), then %% as %
    assert shlex.split(output.removeprefix("#SBATCH ")) == [
        f"--output={str(out.resolve()).replace('%', '%%')}/.sweep/slurm/grpo-seed0-%j.log"
    ]
    assert "#SBATCH --job-name=masktrl-grpo-seed0" in lines


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A complete 2-step tiny run ``out/r0`` and a 3-problem data file: ``(out, data)``."""
    base = tmp_path_factory.mktemp("finished5")
    config = write_tiny_config(base / "t.yaml")
    cli("train", "--config", config, "--out", base / "out", "--run", "r0")
    data = base / "d.jsonl"
    data.write_text("".join(f'{{"problem": "{a}+1=", "answer": "{a + 1}"}}\n' for a in range(3)))
    return base / "out", data


@pytest.mark.parametrize("command", ["eval", "rollout"])
@pytest.mark.parametrize("given", ["task=5", "model=5", "seed=3"])
def test_eval_and_rollout_refuse_a_set_that_is_not_a_section_of_keys(finished_run, tmp_path, cli_error, command, given):
    """`--set task=5` was a TypeError traceback (exit 1), `--set model=5` an AttributeError one, and
    `--set seed=3` said `not seed.None`."""
    out, data = finished_run
    args = ["--model", "r0", "--out", out, "--set", f"task.source={data}", "--set", given]
    if command == "eval":
        line = cli_error("eval", "dataset", "--k", "1", *args)
    else:
        line = cli_error("rollout", "--data", "dataset", "--output", tmp_path / "x.parquet", *args)
    assert line.endswith(f"take task.* keys and model.chat_template, not {given}"), line


@pytest.mark.parametrize("bench, data", [("dataset", None), ("gsm8k", "data")])
def test_eval_refuses_a_task_name_other_than_its_benchmark(finished_run, cli_error, bench, data):
    """`masktrl eval dataset --set task.name=gsm8k` evaluated the dataset: the key was replaced by the
    benchmark without a word (rollout alike)."""
    out, file = finished_run
    given = ["--set", f"task.source={file}"] if data is None else ["--data", file]
    other = "gsm8k" if bench == "dataset" else "math500"
    line = cli_error("eval", bench, "--model", "r0", "--out", out, "--k", "1", *given, "--set", f"task.name={other}")
    assert (
        line == f"error: task.name={other} conflicts with the benchmark {bench} (the command's first argument "
        "names the task): drop one"
    ), line


@pytest.mark.parametrize("name", ["[bold]q", ":smile:"])
def test_a_run_name_that_looks_like_markup_is_printed_as_it_is_named(tmp_path, name):
    """rich read the run's name as markup: `masktrl train --run '[bold]q'` printed `artifacts: out/q`
    (`:smile:` an emoji, `[i]` nothing), and eval `results: out/q/eval/...`: paths of no run."""
    config, out = write_tiny_config(tmp_path / "t.yaml"), tmp_path / "out"
    trained = cli("train", "--config", config, "--out", out, "--run", name)
    assert f"masktrl train run {name} method grpo" in trained.output
    assert f"artifacts: {out / name}" in trained.output, trained.output
    evaluated = cli("eval", "task", "--model", name, "--out", out, "--k", "1")
    assert f"results: {out / name / 'eval' / 'task-step2.json'}" in evaluated.output, evaluated.output
    analysed = cli("analyze", "dynamics", name, "--out", out)
    assert f"{out / 'analysis' / 'dynamics.json'}" in analysed.output


@pytest.mark.parametrize("study", ["estimators", "disagreement"])
def test_a_replay_study_refuses_more_minibatches_than_sequences(swept, cli_error, study):
    """`--minibatches 99999999999` on a batch of 24 sequences replayed 24 updates of one sequence
    and recorded `minibatches: 99999999999` in the study's JSON (train refuses such a split)."""
    _, out = swept
    line = cli_error("analyze", study, "--run", "grpo-seed0", "--out", out, "--steps", "2", "--minibatches", "25")
    assert line.endswith(
        "--minibatches 25: run grpo-seed0, step 2 has 24 sequences, fewer than the minibatches (each needs one); "
        "give --minibatches 24 or fewer"
    ), line
    assert not list((out / "grpo-seed0").glob("analysis/*"))


def test_a_replay_study_refuses_a_partition_count_no_study_can_run(swept, cli_error):
    """`--partitions 1000000000` started replaying each batch a billion times (killed after minutes,
    no word), as `--steps 1:99999999999` did before it was bounded."""
    _, out = swept
    line = cli_error("analyze", "estimators", "--run", "grpo-seed0", "--out", out, "--partitions", "1000000000")
    assert line.endswith("--partitions 1000000000: more than 100000 replays of each batch"), line


def test_a_replay_study_refuses_partitions_that_are_copies_of_one_update(swept, cli_error):
    """With one minibatch a partition is only the order of the batch's sequences, and the study's
    default update (unmasked) draws no random numbers: `--partitions 3 --minibatches 1` replayed
    the same update three times, which `--replicate partition` counted as three replicates. sis
    draws its uniforms from the partition's seed, so its partitions differ and stay allowed."""
    _, out = swept
    args = ("--out", out, "--steps", "2", "--minibatches", "1", "--partitions", "3", "--no-exact")
    line = cli_error("analyze", "disagreement", "--run", "grpo-seed0", *args, "--replicate", "partition")
    assert line.endswith(
        "--partitions 3: run grpo-seed0, step 2 is replayed as one minibatch and the update (unmasked) draws no "
        "random numbers, so every partition is the same update (copies, not replicates); give --partitions 1, or "
        "--minibatches 2 or more"
    ), line
    assert not list((out / "grpo-seed0").glob("analysis/*"))
    study = out.parent / "sis-partitions"
    cli("analyze", "disagreement", "--run", "grpo-seed0", *args, "--update-method", "sis", "--output", study)
    assert any(f.suffix == ".json" for f in study.iterdir())


@pytest.mark.parametrize(
    "text, says",
    [("a: [\n", "cannot parse"), ("- a\n", "not an accelerate config (a YAML list"), ("", "(an empty file")],
)
def test_a_slurm_sweep_refuses_an_accelerate_config_no_launch_can_read(tmp_path, cli_error, text, says):
    """Only the file's existence was checked: the sweep wrote (and submitted) a job per run, each
    to fail at `accelerate launch` on the cluster."""
    bad = tmp_path / "acc.yaml"
    bad.write_text(text)
    config, out = write_tiny_config(tmp_path / "t.yaml"), tmp_path / "out"
    line = cli_error(
        "sweep", "--methods", "grpo", "--seeds", "1", "--config", config, "--out", out,
        "--accelerate-config", bad, "--launcher", "slurm", "--no-submit",
    )  # fmt: skip
    assert says in line and "acc.yaml" in line, line
    assert not out.exists()


@pytest.mark.parametrize("flags", [("--print-commands",), ("--launcher", "slurm", "--no-submit"), ()])
def test_a_sweep_whose_out_is_a_file_is_refused(tmp_path, cli_error, flags):
    """``sweep --print-commands --out FILE`` printed a train command for every run, each to fail at
    its start with "not a folder", and exited 0."""
    out = tmp_path / "f"
    out.write_text("x")
    line = cli_error("sweep", "--methods", "grpo", "--seeds", "1", "--out", out, *flags)
    assert line == f"error: --out {out}: a file, not a folder (the sweep's runs are folders under it)"
    assert out.read_text() == "x"
