"""The cases of issue #37 a hostile tester broke, each run as the user types it (docs/RELIABILITY.md,
"Replays, outputs and caches"): a replay at another sampling than its batch's, a symlinked run
folder, an ``--output`` inside a run, ``method.*`` numbers in exponent form, messages whose
suggested command must work, ``analyze sis --bias`` on its defaults, eval's memory, a sweep's
conflicting flags, incomplete vs damaged runs, and caches outside the current folder."""

import json
import os
import shlex
import sys
from pathlib import Path

import pytest

from masktrl.rollout.storage import read_rollouts, write_rollouts
from masktrl.runs.store import RunStore, eval_key
from tests.conftest import cli, copy_run, masktrl, snapshot


def tree(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


# --------------------------------------------------------------------------- 1. replays at the batch's sampling


def _batch_file(root, path, **meta):
    samples, recorded = read_rollouts(root / "steps" / "000001" / "rollouts.parquet")
    write_rollouts(path, samples, {**recorded, **meta})
    return path


@pytest.mark.parametrize(
    "field, value, key, shown",
    [
        ("temperature", 0.7, "rollout.temperature", "0.7"),
        ("quantization", "fp8", "rollout.quantization", "fp8"),
        ("rollout_dtype", "bfloat16", "rollout.dtype", "bfloat16"),
        # groups and lists of another size trained while run.yaml described the config's (hostile pass 3)
        ("n", 8, "rollout.n", "8"),
        ("logprobs_k", 3, "rollout.logprobs_k", "3"),
        ("logprobs_k", 999, "rollout.logprobs_k", "17"),  # compared as the lists stored: min(K, vocabulary 17)
    ],
)
def test_a_replay_of_a_file_sampled_otherwise_is_refused_naming_both_values(
    finished, tmp_path, cli_error, field, value, key, shown
):
    config, _, root = finished
    path = _batch_file(root, tmp_path / "s.parquet", **{field: value})
    configured = {
        "rollout.temperature": "1",
        "rollout.quantization": "null",
        "rollout.dtype": "null",
        "rollout.n": "4",
        "rollout.logprobs_k": "5",
    }[key]
    want = (
        f"error: --rollouts-from {path} was sampled with {key}={shown}, this config has "
        f"{key}={configured} "
        f"(pi is computed as mu was sampled); add --set {key}={shown}"
    )
    for extra in ((), ("--dry-run",)):
        assert (
            cli_error(
                "train",
                "--config",
                config,
                "--out",
                tmp_path / "out",
                "--run",
                "x",
                "--rollouts-from",
                path,
                "--set",
                "train.steps=1",
                *extra,
            )
            == want
        )
    assert not (tmp_path / "out").exists()


def test_a_replay_compares_list_sizes_as_stored(finished, tmp_path):
    """K above the vocabulary stores the whole vocabulary: a file of K = 999 replays under K = 20
    (both store 17 entries on the tiny vocabulary)."""
    config, _, root = finished
    path = _batch_file(root, tmp_path / "s.parquet", logprobs_k=999)
    sets = ["--set", "train.steps=1", "--set", "rollout.logprobs_k=20", "--dry-run"]
    r = cli("train", "--config", config, "--out", tmp_path / "out", "--run", "x", "--rollouts-from", path, *sets)
    assert r.exit_code == 0 and not (tmp_path / "out").exists()


def test_a_replay_of_a_run_folder_at_another_temperature_is_refused(finished, tmp_path, cli_error):
    config, _, root = finished
    line = cli_error(
        "train",
        "--config",
        config,
        "--out",
        tmp_path / "out",
        "--run",
        "x",
        "--rollouts-from",
        root,
        "--set",
        "rollout.temperature=0.5",
    )
    assert line == (
        f"error: --rollouts-from {root} was sampled with rollout.temperature=1, this config has "
        "rollout.temperature=0.5 "
        "(pi is computed as mu was sampled); add --set rollout.temperature=1"
    )
    assert not (tmp_path / "out").exists()


def test_a_replay_at_the_batch_temperature_starts_on_policy(finished, tmp_path):
    """Sampled at T = 0.7 by the starting policy and replayed from the same starting policy at the
    temperature the line names: at step 1 (one minibatch) pi equals mu, so every ratio is 1."""
    config, _, _ = finished
    _, out, root = copy_run(finished, tmp_path)  # the same warm-start cache: the replay starts from the same weights
    batch = tmp_path / "s07.parquet"
    cli(
        "rollout",
        "--model",
        root,
        "--step",
        0,
        "--data",
        "synthetic",
        "--prompts",
        6,
        "--n",
        4,
        "--logprobs-k",
        5,
        "--temperature",
        0.7,
        "--output",
        batch,
    )
    assert read_rollouts(batch)[1]["temperature"] == 0.7
    cli(
        "train",
        "--config",
        config,
        "--out",
        out,
        "--run",
        "replay",
        "--rollouts-from",
        batch,
        "--set",
        "rollout.temperature=0.7",
        "--set",
        "train.steps=1",
    )
    row = json.loads((out / "replay" / "metrics.jsonl").read_text().splitlines()[0])
    assert abs(row["ratio_max"] - 1) < 1e-4 and row["mask_frac"] == 0 and abs(row["ppo_kl"]) < 1e-6, row


# ---------------------------------------------------------- 4-5. no write through a symlink or into a run


def test_eval_and_analyses_refuse_a_symlinked_run_folder(finished, tmp_path, cli_error):
    _, _, root = finished
    elsewhere = tmp_path / "elsewhere" / "r"
    elsewhere.parent.mkdir()
    import shutil

    shutil.copytree(root, elsewhere)
    out = tmp_path / "out"
    out.mkdir()
    (out / "r").symlink_to(elsewhere)
    before = snapshot(elsewhere)
    line = cli_error("eval", "task", "--model", "r", "--out", out, "--k", 1, "--temperature", 0)
    assert line == f"error: {out / 'r'}: the run folder is a symbolic link; refused (not followed)"
    assert snapshot(elsewhere) == before
    r = cli("eval", "task", "--model", out, "--k", 1, "--temperature", 0)  # a folder of runs: skipped, said so
    assert "skipped: the run folder is a symbolic link (not followed)" in r.output and snapshot(elsewhere) == before
    assert cli_error("analyze", "sis", "--run", "r", "--out", out) == line  # an analysis writing into the run: the same
    assert snapshot(elsewhere) == before


def test_rollout_eval_and_analysis_output_inside_a_run_are_refused(finished, tmp_path, cli_error):
    _, out, root = copy_run(finished, tmp_path)
    before = snapshot(root)
    batch = root / "steps" / "000001" / "rollouts.parquet"
    line = cli_error("rollout", "--model", root, "--data", "synthetic", "--output", batch, "--force")
    assert line == (
        f"error: --output {batch} lies inside the run folder {root}; a run's files are written only "
        "by its own "
        "commands (nothing was changed): choose a path outside it"
    )
    (tmp_path / "link").symlink_to(root / "steps")  # the same folder by another name
    assert "lies inside the run folder" in cli_error(
        "rollout",
        "--model",
        root,
        "--data",
        "synthetic",
        "--output",
        tmp_path / "link" / "000001" / "rollouts.parquet",
        "--force",
    )
    model = root / "checkpoints" / "000002"
    import shutil

    shutil.copytree(model, tmp_path / "model")  # a model folder that is not a run
    assert "lies inside the run folder" in cli_error(
        "eval", "task", "--model", tmp_path / "model", "--output", root / "eval" / "x.json"
    )
    line = cli_error(
        "analyze", "dynamics", root, "--output", root / "steps" / "x"
    )  # an analysis: its analysis/ folder only
    assert line.endswith("choose a path outside it (or its analysis/ folder)"), line
    assert snapshot(root) == before
    assert RunStore(root, writable=False).status() == "complete"
    cli("analyze", "dynamics", root, "--output", root / "analysis" / "curves")


# --------------------------------------------------------------------------- 6. method numbers


def test_method_numbers_in_exponent_form_parse_as_in_typed_sections(tmp_path):
    from masktrl.config import load_config

    cfg = load_config(
        None,
        [
            "method.entropy_coef=1e-3",
            "method.kl_coef=1e-2",
            "method.correction.kind=token-tis",
            "method.correction.cap=5e0",
            "train.lr=1e-4",
        ],
    )
    block = cfg.method.to_dict()
    assert block["entropy_coef"] == 1e-3 and block["kl_coef"] == 1e-2 and block["correction"]["cap"] == 5.0
    assert cfg.method.params.entropy_coef == 1e-3 and cfg.method.correction.cap == 5.0 and cfg.train.lr == 1e-4
    path = tmp_path / "m.yaml"
    path.write_text("method:\n  name: grpo\n  entropy_coef: 1e-3\n")
    assert load_config(path).method.params.entropy_coef == 1e-3
    r = cli("config", "show", "--set", "method.entropy_coef=1e-3")
    assert "entropy_coef: 0.001" in r.output


def test_a_method_number_that_is_not_one_is_still_one_line(cli_error):
    assert (
        cli_error("config", "show", "--set", "method.entropy_coef=1e-3x")
        == "error: method.entropy_coef must be a number, got '1e-3x'"
    )


# --------------------------------------------------------------------------- 7. a suggested command that works


def test_an_eval_killed_before_recording_its_report_is_redone_by_the_suggested_command(finished, tmp_path, cli_error):
    _, out, root = copy_run(finished, tmp_path)
    eval_args = ("--k", 2, "--n-problems", 4)
    cli("eval", "task", "--model", root, *eval_args)
    store = RunStore(root)
    with store.updating() as manifest:  # the state a kill between the report's write and its record leaves
        del manifest["stages"][eval_key("task", 2)]
    assert store.eval_path("task", 2).is_file()
    line = cli_error("analyze", "compare", root, "--eval", "task")
    suggested = line.split("make them with: ", 1)[1]
    assert suggested == f"masktrl eval task --model {out}", line
    r = masktrl(
        *shlex.split(suggested)[1:]
    )  # as suggested: it redoes the unrecorded report (it used to skip it: "exists")
    assert r.returncode == 0 and "avg@16" in r.stdout, r.stdout + r.stderr
    assert RunStore(root, writable=False).is_done(eval_key("task", 2))
    cli("analyze", "compare", root, "--eval", "task", "--output", tmp_path / "cmp")


# --------------------------------------------------------------------------- 8. analyze sis --bias on its defaults


def test_analyze_sis_bias_default_k_fits_the_stored_lists(finished, tmp_path, cli_error):
    _, out, root = copy_run(finished, tmp_path)  # K = 5 stored: the default 5,10,20 does not fit
    r = cli("analyze", "sis", "--run", root, "--bias")
    assert "note: --k 5,10,20 (the default): 10, 20 above the stored list size K = 5; measured at 5" in " ".join(
        r.output.split()
    )
    result = json.loads((root / "analysis" / "sis-bias-step2.json").read_text())
    assert [row["k"] for row in result["ks"]] == [5]
    assert cli_error("analyze", "sis", "--run", root, "--bias", "--k", "5,10") == (
        "error: --k 10 is above the stored list size K = 5 (rollout.logprobs_k): lists can only be re-cut"
    )


def test_default_ks_put_the_stored_k_in_place_of_those_above_it():
    from masktrl.analysis.sis_bias import KS, default_ks

    assert default_ks(20) == (KS, None) and default_ks(64) == (KS, None)
    assert default_ks(17)[0] == (5, 10, 17) and "20 above the stored list size K = 17" in default_ks(17)[1]
    assert default_ks(3)[0] == (3,)


# --------------------------------------------------------------------------- 9. eval's memory


def test_eval_refuses_a_k_whose_report_cannot_fit_naming_its_own_options(finished, cli_error):
    _, _, root = finished
    line = cli_error("eval", "task", "--model", root, "--k", 100000000, "--batch-size", 1)
    assert line.startswith("error: --k 100000000 is above 65536") and "--batch-size" in line and "train." not in line


def test_eval_generates_at_most_batch_size_sequences_at_once():
    from masktrl.rl.evaluation import EvalBatches, sample_and_grade
    from masktrl.rollout.base import Generation, SamplingSettings
    from masktrl.tasks.base import Example

    calls = []

    class Engine:
        def generate(self, prompts, settings, seed):
            calls.append(len(prompts) * settings.n)
            return [
                [Generation([1, 2], [-0.1, -0.2], [[1]], [[-0.1]], True) for _ in range(settings.n)] for _ in prompts
            ]

    class Task:
        def score_many(self, examples, texts):
            return [1.0] * len(texts)

    class Tok:
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [1]}

        def decode(self, ids, skip_special_tokens=True):
            return "3"

    tok = Tok()
    examples = [Example(id=str(i), prompt="1+2=", answer="3") for i in range(3)]
    graded = sample_and_grade(
        Engine(),
        tok,
        Task(),
        examples,
        SamplingSettings(n=7, max_new_tokens=2),
        EvalBatches((0, "eval", "t"), 3, False),
    )
    assert max(calls) <= 3 and sum(calls) == 21
    assert [len(row) for row in graded.scores] == [7, 7, 7] and [len(row) for row in graded.answers] == [7, 7, 7]


def test_eval_out_of_memory_names_eval_options(monkeypatch, capsys):
    from masktrl import cli as entry
    from masktrl.recipes import eval as recipe

    def boom(*args, **kwargs):
        raise MemoryError("Unable to allocate 179. GiB")

    monkeypatch.setattr(recipe, "run", boom)
    monkeypatch.setattr(sys, "argv", ["masktrl", "eval", "task", "--model", "x", "--k", "1", "--temperature", "0"])
    with pytest.raises(SystemExit) as exc:
        entry.main()
    err = capsys.readouterr().err
    assert (
        exc.value.code == 2
        and "--batch-size" in err
        and "train.grad_accum" not in err
        and "rollout.batch_size" not in err
    ), err


# --------------------------------------------------------------------------- 10. a sweep's conflicting flags


def test_sweep_reports_set_method_name_against_methods(tmp_path, cli_error):
    line = cli_error("sweep", "--methods", "grpo,sis", "--set", "method.name=dppo", "--out", tmp_path / "s")
    assert line == (
        "error: --set method.name=dppo conflicts with --methods (every run of a sweep takes its "
        "method from "
        "--methods): drop one"
    )
    assert not (tmp_path / "s").exists()


# --------------------------------------------------------------------------- 11. incomplete vs damaged


def test_runs_lists_a_summary_written_but_not_recorded_as_incomplete(finished, tmp_path):
    """The state a kill between writing summary.json and recording it leaves in an extended run
    (the slow test below makes it for real): the recorded summary stage is the earlier session's."""
    _, out, root = copy_run(finished, tmp_path)
    m = json.loads((root / "manifest.json").read_text())
    (root / "manifest.json").write_text(json.dumps({**m, "status": "running", "pid": 2**22 + 12345}))
    summary = json.loads((root / "summary.json").read_text())
    (root / "summary.json").write_text(json.dumps({**summary, "eval_after": 0.5}))
    listing = " ".join(cli("runs", "--out", out).output.split())
    assert (
        "damaged" not in listing
        and f"incomplete r: interrupted; run the same command again (masktrl train --resume r --out {out} continues it)"
        in listing
    )


@pytest.mark.slow  # a killed training and its resume, in their own processes
def test_runs_tells_a_run_killed_before_recording_its_summary_from_a_damaged_one(finished, tmp_path):
    _, out, root = copy_run(finished, tmp_path)
    r = masktrl(
        "train",
        "--resume",
        "r",
        "--out",
        out,
        "--force",
        "--set",
        "train.steps=3",
        env={"MASKTRL_CRASH_AT": "summary-write:1"},
    )
    assert r.returncode != 0 and (root / "summary.json").is_file()
    listing = cli("runs", "--out", out).output
    assert "damaged" not in listing and "interrupted" in listing, listing
    line = next(x for x in listing.splitlines() if x.startswith("incomplete r:"))
    suggested = line.split("(", 1)[1].split(" continues it")[0]
    assert suggested == f"masktrl train --resume r --out {out}"
    r = masktrl(*shlex.split(suggested)[1:])
    assert r.returncode == 0, r.stderr[-2000:]
    assert RunStore(root, writable=False).status() == "complete"
    summary = json.loads((root / "summary.json").read_text())
    summary["eval_after"] = 0.99  # now edited after it was recorded: damaged
    (root / "summary.json").write_text(json.dumps(summary))
    listing = " ".join(cli("runs", "--out", out).output.split())
    assert "damaged r: summary.json: content hash mismatch" in listing and "restore it from a copy" in listing, listing


# --------------------------------------------------------------------------- 12-13. caches


@pytest.mark.slow  # two commands in their own processes
def test_analyses_of_runs_given_by_path_write_nothing_in_the_current_folder(finished, tmp_path):
    _, out, root = copy_run(finished, tmp_path)
    here = tmp_path / "here"
    here.mkdir()
    for args in (["analyze", "dynamics", root, "--output", tmp_path / "dyn"], ["analyze", "dynamics", root]):
        r = masktrl(*args, cwd=here)
        assert r.returncode == 0 and "Matplotlib" not in r.stderr, r.stderr
        assert tree(here) == [], tree(here)
    assert (tmp_path / "dyn" / ".cache" / "matplotlib").is_dir()  # beside the figure it drew
    assert (out / "analysis" / ".cache" / "matplotlib").is_dir()  # a single run's dynamics: its folder's analysis/
    assert not [p for p in os.listdir(tmp_path) if p.startswith("matplotlib-")]


def test_a_cache_folder_that_cannot_be_written_moves_beside_the_figure(tmp_path, monkeypatch):
    from masktrl import caches

    blocked = tmp_path / "file"
    blocked.write_text("")  # --out names a file: nothing can be created under it
    monkeypatch.setattr(caches, "_mode", "out")
    monkeypatch.setenv("MPLCONFIGDIR", str(blocked / ".cache" / "matplotlib"))
    monkeypatch.delitem(sys.modules, "matplotlib", raising=False)  # not imported yet, as under a fresh command
    caches.settle_matplotlib(tmp_path / "fig")
    assert os.environ["MPLCONFIGDIR"] == str(tmp_path / "fig" / ".cache" / "matplotlib")


def test_scratch_folders_live_under_out(tmp_path, monkeypatch):
    from masktrl import caches

    monkeypatch.setattr(caches, "_mode", None)
    monkeypatch.setattr(caches, "_scratch_root", None)
    monkeypatch.delenv("MPLCONFIGDIR", raising=False)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    caches.contain(["rollout", "--out", str(tmp_path / "out")])
    with caches.scratch("masktrl-datasets-") as folder:
        assert Path(folder).parent == tmp_path / "out" / ".cache"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "out" / ".cache" / "torchinductor")
    caches.contain(["rollout"])  # no --out: the system's temporary folder, as before
    with caches.scratch("x-") as folder:
        assert Path(folder).parent != tmp_path / "out" / ".cache"


@pytest.mark.slow  # a command in its own process
def test_a_command_given_out_writes_nothing_in_tmp(finished, tmp_path):
    _, out, root = copy_run(finished, tmp_path)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(8)))
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    r = masktrl(
        "rollout",
        "--model",
        root,
        "--out",
        out,
        "--data",
        "dataset",
        "--set",
        f"task.source={data}",
        "--set",
        "task.reward=exact-match",
        "--output",
        out / "gen.parquet",
        "--n",
        2,
        "--prompts",
        4,
        env={"TMPDIR": str(tmp)},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert list(tmp.iterdir()) == []  # the datasets arrow cache and torch's inductor folder: under out/.cache
