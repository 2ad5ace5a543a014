"""`masktrl eval`: a tiny run and a tiny model folder evaluated end to end, the JSON report,
the manifest record, the refusal to overwrite, and the user errors (exit 2, one line)."""

import json
import string
import sys

import pytest

import masktrl.recipes.eval as ev
from masktrl.cli import main
from masktrl.errors import MasktrlError
from masktrl.rollout.base import Generation
from masktrl.runs.store import RunStore
from tests.conftest import cli, write_tiny_config

RUN = {"task": {"n_test": 12}, "warmstart": {"steps": 20}, "rollout": {"prompts_per_step": 4}}
PROBLEMS = [  # (problem, gold answer, the answer the patched "model" boxes)
    ("What is 1+1?", "2", "2"),
    ("What is 2+3?", "5", "05"),
    ("Half of one, as a decimal?", "0.5", "\\frac{1}{2}"),  # not string-equal: graded by math-verify
]


def cli_error(capsys, monkeypatch, *args) -> str:
    """Run the real entry point; assert exit code 2 and one stderr line without a traceback."""
    monkeypatch.delenv("MASKTRL_DEBUG", raising=False)
    monkeypatch.setattr(sys, "argv", ["masktrl", *map(str, args)])
    with pytest.raises(SystemExit) as exc:
        main()
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert exc.value.code == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("evalrun")
    write_tiny_config(root / "tiny.yaml", RUN)
    cli("train", "--config", root / "tiny.yaml", "--out", root / "out", "--run", "r")
    return root / "out" / "r"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random model whose character tokenizer covers printable ASCII (math prompts)."""
    from masktrl.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model

    root = tmp_path_factory.mktemp("evalmodel")
    tokenizer = build_char_tokenizer(string.printable)
    model = build_tiny_model(tokenizer, TinyModelConfig(32, 1, 2, 1, 64, max_positions=256), seed=0)
    model.save_pretrained(root / "tiny-math")
    tokenizer.save_pretrained(root / "tiny-math")
    data = root / "mini.jsonl"
    data.write_text(
        "".join(json.dumps({"id": f"p{i}", "problem": p, "answer": a}) + "\n" for i, (p, a, _) in enumerate(PROBLEMS))
    )
    return root / "tiny-math", data


def check_report(r: dict, k: int, n: int) -> None:
    for key in (
        "benchmark",
        "model",
        "step",
        "k",
        "n_problems",
        "avg_at_k",
        "pass_at_k",
        "maj_at_k",
        "ci95",
        "problems",
        "generation",
    ):
        assert key in r, key
    assert r["k"] == k and r["n_problems"] == n == len(r["problems"])
    assert 0.0 <= r["avg_at_k"] <= 1.0 and 0.0 <= r["pass_at_k"] <= 1.0 and 0.0 <= r["maj_at_k"] <= 1.0
    low, high = r["ci95"]
    assert 0.0 <= low <= r["avg_at_k"] <= high <= 1.0
    assert r["pass_at"]["1"] == pytest.approx(r["avg_at_k"]) and r["pass_at"][str(k)] == r["pass_at_k"]
    assert r["pass_at_k"] >= r["avg_at_k"] - 1e-12
    for p in r["problems"]:
        assert p["id"] and 0 <= p["correct"] <= k and p["correct"] == sum(p["scores"]) and len(p["answers"]) == k
    assert sum(p["correct"] for p in r["problems"]) == pytest.approx(r["avg_at_k"] * k * n)
    g = r["generation"]
    assert {"engine", "temperature", "top_p", "max_new_tokens", "seed", "template"} <= set(g)


def test_synthetic_on_a_run_writes_report_and_manifest(run_dir):
    result = cli("eval", "synthetic", "--model", run_dir, "--k", 4)
    assert "avg@4" in result.output and "synthetic-step2.json" in result.output
    path = run_dir / "eval" / "synthetic-step2.json"
    report = json.loads(path.read_text())
    check_report(report, k=4, n=12)
    assert report["benchmark"] == "synthetic" and report["step"] == 2 and report["run"] == "r"
    assert report["generation"]["template"] == "builtin:arithmetic"  # the task writes its own prompts (was null)
    assert report["generation"]["max_new_tokens"] == 4  # the run's rollout.max_new_tokens
    assert {p["id"] for p in report["problems"]} == {f"test/{p['id'].split('/')[1]}" for p in report["problems"]}
    store = RunStore(run_dir)
    assert store.is_done("eval/synthetic/000002")
    store.verify("eval/synthetic/000002")  # recorded with the file's hash

    # never overwritten silently; --force replaces it
    before = path.read_text()
    with pytest.raises(MasktrlError, match="already exists"):
        ev.run("synthetic", str(run_dir), None, ev.EvalOptions(k=4))
    assert path.read_text() == before
    cli("eval", "synthetic", "--model", run_dir, "--k", 2, "--force")
    assert json.loads(path.read_text())["k"] == 2
    RunStore(run_dir).verify("eval/synthetic/000002")


def test_evaluate_alias_step_choice_and_starting_policy(run_dir):
    cli("evaluate", "synthetic", "--model", run_dir, "--step", 1, "--k", 1, "--temperature", 0, "--n-problems", 5)
    r = json.loads((run_dir / "eval" / "synthetic-step1.json").read_text())
    check_report(r, k=1, n=5)
    assert r["generation"]["greedy"] is True and r["step"] == 1
    cli(
        "eval",
        "synthetic",
        "--model",
        run_dir / "checkpoints" / "000001",
        "--k",
        2,
        "--n-problems",
        3,
        "--seed",
        1,
        "--force",
    )
    assert json.loads((run_dir / "eval" / "synthetic-step1.json").read_text())["generation"]["seed"] == 1
    cli(
        "eval", "synthetic", "--model", run_dir.name, "--out", run_dir.parent, "--step", 0, "--k", 2, "--n-problems", 3
    )  # by name
    r0 = json.loads((run_dir / "eval" / "synthetic-step0.json").read_text())
    assert r0["step"] == 0 and ".cache" in r0["weights"]  # the warm-start policy


def test_math_benchmark_with_a_tiny_model_is_graded(model_dir):
    model, data = model_dir
    cli("eval", "gsm8k", "--model", model, "--data", data, "--k", 2, "--max-new-tokens", 6)
    r = json.loads((model.parent / "eval" / "gsm8k-tiny-math.json").read_text())
    check_report(r, k=2, n=3)
    assert r["step"] is None and r["run"] is None and r["data"] == str(data)
    assert r["generation"]["template"] == "base" and r["generation"]["max_new_tokens"] == 6
    assert [p["id"] for p in r["problems"]] == ["gsm8k/p0", "gsm8k/p1", "gsm8k/p2"]


def test_math_benchmark_correct_boxed_answers_score_one(model_dir, monkeypatch, tmp_path):
    model, data = model_dir

    def fake_generate(self, prompts, settings, seed):
        out = []
        for ids in prompts:
            text = self.tokenizer.decode(ids)
            answer = next(a for problem, _, a in PROBLEMS if problem in text)
            assert text.startswith("Problem: ") and text.endswith("Solution:")  # the base template, rendered once
            resp = self.tokenizer(f" The answer is \\boxed{{{answer}}}.", add_special_tokens=False)["input_ids"]
            resp.append(self.tokenizer.eos_token_id)
            gen = Generation(resp, [0.0] * len(resp), [[t] for t in resp], [[0.0] for _ in resp], True)
            out.append([gen] * settings.n)
        return out

    monkeypatch.setattr("masktrl.rollout.hf.HFEngine.generate", fake_generate)
    cli("eval", "math500", "--model", model, "--data", data, "--k", 3, "--output", tmp_path / "report.json")
    r = json.loads((tmp_path / "report.json").read_text())
    check_report(r, k=3, n=3)
    assert r["avg_at_k"] == 1.0 and r["pass_at_k"] == 1.0 and r["maj_at_k"] == 1.0 and r["ci95"] == [1.0, 1.0]
    assert r["problems"][2]["answers"] == ["\\frac{1}{2}"] * 3 and r["truncated_frac"] == 0.0


@pytest.mark.parametrize(
    "args, needle",
    [
        (["eval", "nosuch", "--model", "RUN"], "unknown benchmark 'nosuch'"),
        (["eval", "synthetic", "--model", "RUN", "--step", 7], "available steps: 0 (starting policy), 1, 2"),
        (["eval", "synthetic", "--model", "RUN", "--k", 0], "--k"),
        (["eval", "aime24", "--model", "RUN"], "pass --data FILE"),
        (["eval", "aime", "--model", "RUN", "--data", "missing.jsonl"], "missing.jsonl: no such file"),
        (["evaluate", "synthetic", "--model", "RUN", "--template", "chat"], "--template"),
        (["eval", "synthetic", "--model", "MODEL"], "needs a run"),
        (["eval", "synthetic", "--model", "RUN", "--output", "x.json"], "--output"),
        (["eval", "gsm8k", "--model", "MODEL", "--step", 1], "--step needs a run folder"),
    ],
)
def test_user_errors_exit_2_with_one_line(args, needle, run_dir, model_dir, capsys, monkeypatch):
    args = [run_dir if a == "RUN" else model_dir[0] if a == "MODEL" else a for a in args]
    files = sorted(p.name for p in (run_dir / "eval").iterdir()) if (run_dir / "eval").exists() else []
    line = cli_error(capsys, monkeypatch, *args)
    assert needle in line, line
    assert (sorted(p.name for p in (run_dir / "eval").iterdir()) if (run_dir / "eval").exists() else []) == files


def test_missing_data_line_names_the_expected_fields(run_dir, capsys, monkeypatch):
    line = cli_error(capsys, monkeypatch, "eval", "math500", "--model", run_dir)
    assert "math500" in line and "--data" in line and "problem" in line and "answer" in line
