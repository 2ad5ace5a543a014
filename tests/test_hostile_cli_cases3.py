"""Bad input a third hostile pass found in the analyses, eval, rollout, sweep and config
commands, each run as the user types it: one line on stderr and exit code 2, nothing stored
replaced, nothing written outside what was asked."""

import pytest

from tests.conftest import copy_run, snapshot


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


def _sampling(command, root, tmp_path) -> tuple:
    """``masktrl eval task`` (into the run) or ``masktrl rollout`` (into tmp_path/b.parquet) of ``root``."""
    if command == "eval":
        return ("eval", "task", "--model", root, "--k", 1)
    return ("rollout", "--model", root, "--data", "synthetic", "--output", tmp_path / "b.parquet")


@pytest.mark.parametrize("command", ["eval", "rollout"])
@pytest.mark.parametrize("seed", ["-1", "4294967296"])
def test_a_sampling_seed_out_of_range_is_one_line(finished, tmp_path, cli_error, command, seed):
    """``masktrl eval --seed -1`` was a 56-line traceback from numpy's SeedSequence (exit 1);
    ``masktrl rollout --seed -1`` wrote a file that records seed -1, where every config seed lies
    in [0, 2^32-1]."""
    _, out, root = finished
    before = snapshot(root)
    line = cli_error(*_sampling(command, root, tmp_path), "--seed", seed)
    assert line.endswith(f"--seed must be in [0, 4294967295], got {seed}")
    assert snapshot(root) == before and not (tmp_path / "b.parquet").exists()


@pytest.mark.parametrize("command", ["eval", "rollout"])
@pytest.mark.parametrize("tokens", ["256", "99999999999"])
def test_a_response_length_that_fills_the_context_is_refused(finished, tmp_path, cli_error, command, tokens):
    """``--max-new-tokens`` at or past the tiny model's 256 positions was accepted (responses could
    run past the positions the model has, and the report recorded the length), and a huge one
    ran into an out-of-memory error naming training keys; ``masktrl train`` refused the same
    length of rollout.max_new_tokens."""
    _, out, root = finished
    before = snapshot(root)
    line = cli_error(*_sampling(command, root, tmp_path), "--max-new-tokens", tokens)
    assert line.endswith(
        f"--max-new-tokens {tokens} leaves no room for a prompt in the model's context (256 positions)"
    )
    assert snapshot(root) == before and not (tmp_path / "b.parquet").exists()


def test_rollout_prompts_beyond_the_bound_are_refused_at_once(finished, tmp_path, cli_error):
    """``masktrl rollout --prompts 99999999999`` drew that many synthetic prompts in memory: the
    process was killed for memory."""
    _, out, root = finished
    line = cli_error(
        "rollout",
        "--model",
        root,
        "--data",
        "synthetic",
        "--prompts",
        "99999999999",
        "--output",
        tmp_path / "b.parquet",
    )
    assert line.startswith("error: --prompts 99999999999 is above 65536") and not (tmp_path / "b.parquet").exists()


def test_a_slurm_option_with_a_line_break_is_refused(finished, tmp_path, cli_error):
    """``--slurm $'time=1\\ntouch x'`` wrote ``touch x`` as a line of its own into every sbatch
    script: a command the job ran (and sbatch ignores the #SBATCH lines after it)."""
    config, _, _ = finished
    line = cli_error(
        "sweep", "--config", config, "--out", tmp_path / "out", "--methods", "grpo", "--seeds", "1",
        "--launcher", "slurm", "--no-submit", "--slurm", "time=1\ntouch x",
    )  # fmt: skip
    assert "the value holds a control character" in line and "#SBATCH" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "args, says",
    [
        (
            ("--step", "0"),
            "--step must be >= 1 (rollout step S, sampled by checkpoint S-1), got 0",
        ),  # "policy step ... -1"
        (("--top", "-3"), "--top must be >= 0, got -3"),  # listed no token, exit 0
        (("--k", "3"), "--k goes with --bias (the envelope list sizes of the gradient bias)"),  # ignored, exit 0
    ],
)
def test_analyze_sis_flags_that_cannot_mean_what_they_say(finished, cli_error, args, says):
    """``analyze sis --step 0`` said "policy step must be >= 0, got -1" (a number the user never
    gave); ``--top -3`` listed no token and ``--k`` without ``--bias`` was dropped, both exit 0."""
    _, _, root = finished
    before = snapshot(root)
    assert cli_error("analyze", "sis", "--run", root, *args).endswith(says)
    assert snapshot(root) == before


def test_config_keys_with_a_prefix_no_key_has_is_refused(cli_error):
    """``masktrl config keys trian`` (a typo) printed an empty table and exited 0."""
    line = cli_error("config", "keys", "trian")
    assert line.endswith(
        "no config key starts with 'trian'; the sections: eval, method, model, rollout, seed, task, train, warmstart"
    )


def test_sweep_seeds_count_zero_says_so(tmp_path, cli_error):
    """``masktrl sweep --seeds 0`` said "--seeds must give distinct non-negative seeds, got '0'":
    0 is non-negative; the count is what is wrong."""
    line = cli_error("sweep", "--seeds", "0", "--print-commands", "--out", tmp_path / "out")
    assert line.endswith("--seeds 0: a count of seeds must be >= 1") and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "args, flag",
    [
        (("eval", "gsm8k", "--model", "RUN", "--data", ""), "--data"),  # ". is a folder: give a .jsonl ... file"
        (
            ("sweep", "--seeds", "1", "--print-commands", "--accelerate-config", ""),
            "--accelerate-config",
        ),  # ".: no such file"
        (("eval", "task", "--model", "RUN", "--output", ""), "--output' / '-o"),  # "--output . is a folder"
        (("rollout", "--model", "RUN", "--data", "synthetic", "--output", ""), "--output' / '-o"),
        (("rollout", "--model", "RUN", "--data", "", "--output", "x.parquet"), "--data"),  # "needs task.source"
    ],
)
def test_an_empty_file_option_is_named_empty(finished, tmp_path, cli_error, args, flag):
    """An empty ``--data``, ``--accelerate-config`` or eval's / rollout's ``--output`` (an unset
    shell variable) was read as the current folder: ". is a folder" / "--accelerate-config .: no
    such file" / "--output . is a folder"."""
    _, out, root = finished
    args = [root if a == "RUN" else a for a in args]
    line = cli_error(*args, "--out", tmp_path / "out")
    assert f"Invalid value for '{flag}': is empty" in line and not (tmp_path / "out").exists()


def test_compare_refuses_one_seed_counted_twice(finished, tmp_path, cli_error):
    """A copy of a run folder (or a rerun of its command under another name) compared beside it
    was a second replicate of the same seed: ``n`` 2 and a narrower interval from no new evidence."""
    _, _, root = finished
    _, _, twin = copy_run(finished, tmp_path)
    line = cli_error("analyze", "compare", root, twin, "--output", tmp_path / "c")
    assert line.endswith(
        f"{root} and {twin} are two complete runs of grpo with seed 0 (the same config: a copy or a rerun); "
        "the run is the unit of the comparison: give one of them"
    )
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("study", ["estimators", "disagreement"])
def test_a_replay_study_refuses_one_replicate_pooled_twice(finished, tmp_path, cli_error, study):
    """``--run out/r --run copy/r`` (a copied run folder) pooled the same batch, replayed from the
    same checkpoint, as two independent replicates: twice the batches, no new evidence."""
    _, _, root = finished
    _, _, twin = copy_run(finished, tmp_path)
    line = cli_error("analyze", study, "--run", root, "--run", twin, "--output", tmp_path / "s")
    assert line.endswith(
        "run r, step 2 is the same replicate as run r, step 2 (its config, rollout batch and checkpoint 1 have the "
        "same sha256: a copied run folder, or a rerun); give one of them"
    )
    assert not (tmp_path / "s").exists()


def test_runs_of_a_run_folder_names_its_parent(finished, cli_error):
    """``masktrl runs --out out/r`` (a run folder, not a folder of runs) said "no runs in out/r"
    and exited 0, as if the run did not exist."""
    _, out, root = finished
    line = cli_error("runs", "--out", root)
    assert line.endswith(f"{root} is a run folder, not a folder of runs: masktrl runs --out {out} lists it")


@pytest.mark.parametrize("flag", ["--eval", "--interaction"])
def test_compare_empty_eval_or_interaction_is_named_empty(finished, tmp_path, cli_error, flag):
    """``--eval ''`` said "make them with: masktrl eval  --model ..." (a command that cannot run);
    ``--interaction ''`` was taken as not given: exit 0 with no interaction test."""
    _, _, root = finished
    line = cli_error("analyze", "compare", root, flag, "", "--output", tmp_path / "c")
    assert f"Invalid value for '{flag}': is empty" in line and not (tmp_path / "c").exists()


def test_a_default_response_length_is_cut_to_the_room_the_model_leaves(finished, tmp_path):
    """eval's default of 4096 response tokens on a math benchmark, and rollout's 1024 for a model
    that is not a run, were used as they were on the tiny model's 256 positions (the report
    recorded 4096; only --max-new-tokens was checked). Now a default is cut to the context less
    the longest prompt, with a warning line, and the report or file records the length used."""
    import json
    import shutil

    import pyarrow.parquet as pq

    from tests.conftest import cli

    _, out, root = finished
    model = tmp_path / "model"  # a model folder, not a run
    shutil.copytree(root / "checkpoints" / "000002", model)
    data = tmp_path / "g.jsonl"
    data.write_text('{"problem": "1+1", "answer": "2"}\n{"problem": "' + "2+2 " * 20 + '", "answer": "4"}\n')
    res = cli("eval", "gsm8k", "--model", model, "--data", data, "--k", "1", "--output", tmp_path / "r.json")
    cut = json.loads((tmp_path / "r.json").read_text())["generation"]["max_new_tokens"]
    assert 1 <= cut < 256 - 20 and f"the default response length 4096 is cut to {cut} tokens" in res.output
    res = cli("rollout", "--model", model, "--data", data, "--n", "2", "--output", tmp_path / "b.parquet")
    meta = json.loads(pq.read_schema(tmp_path / "b.parquet").metadata[b"masktrl"])
    assert meta["max_new_tokens"] == cut and "the default response length 1024 is cut" in res.output
    given = cli("eval", "gsm8k", "--model", model, "--data", data, "--k", "1", "--max-new-tokens", "9",
                "--output", tmp_path / "g.json")  # fmt: skip
    assert "cut" not in given.output
    assert json.loads((tmp_path / "g.json").read_text())["generation"]["max_new_tokens"] == 9


@pytest.mark.parametrize(
    "value, why",
    [
        ("comment=a b", "has a blank outside quotes"),
        ('comment="a b', "leaves a quote open"),
        ("comment=run#3", "has a # outside quotes"),
    ],
)
def test_a_slurm_value_sbatch_would_cut_is_refused(finished, tmp_path, cli_error, value, why):
    """Values were written into the #SBATCH line as given, where sbatch ends an argument at a blank
    outside quotes, reads an unquoted # as the start of a comment and stops at an open quote: the
    job ran with `--comment=a` (and a stray `b`), or sbatch refused every script at submission."""
    config, _, _ = finished
    line = cli_error(
        "sweep", "--config", config, "--out", tmp_path / "out", "--methods", "grpo", "--seeds", "1",
        "--launcher", "slurm", "--no-submit", "--slurm", value,
    )  # fmt: skip
    assert line.startswith(f"error: --slurm {value!r}: this value {why}"), line
    assert line.endswith("so it would not reach --comment as written in the job's #SBATCH line")
    assert not (tmp_path / "out").exists()


def test_a_quoted_or_escaped_slurm_value_is_written_as_given():
    from masktrl.recipes.slurm import parse_options

    given = ['comment="a b"', "comment='run #3'", "comment=a\\ b", "constraint=a|b", "x=", "exclusive"]
    assert parse_options(given) == [f"--{v}" for v in given]
