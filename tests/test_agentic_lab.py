"""The agentic lab (masktrl/tasks/kb.py, configs/agentic.yaml): its questions need the search tool,
its demonstrations are what the tool replies, the warm start trains on the calls and answers only,
and the tool statistics of eval, training metrics and analyze dynamics."""

from __future__ import annotations

import random

import pytest

from masktrl.errors import ConfigError
from masktrl.models.tiny import tiny_tokenizer
from masktrl.rollout.base import ENVIRONMENT, POLICY, Generation
from masktrl.tasks.kb import KBSearch, KBTask, final_answer


@pytest.fixture(scope="module")
def task():
    return KBTask(n_test=60)


def test_demonstrations_are_what_the_tool_replies(task):
    examples = task.test_examples() + task.train_examples(60, random.Random(3))
    hops = set()
    for ex in examples:
        env = KBSearch()
        env.reset({**ex.meta["fields"], "prompt": ex.prompt, "answer": ex.answer})
        segments = task.demonstration(ex)
        calls = [i for i, (text, trained) in enumerate(segments) if trained and text.startswith("<search>")]
        for i in calls:
            assert env.step(segments[i][0]) == (segments[i + 1][0], False)
            assert not segments[i + 1][1]  # the reply is not trained on
        hops.add(len(calls))
        assert task.score(ex, task.format_target(ex)) == 1.0
        assert ex.answer not in ex.prompt.split()  # only the tool knows the answer
    assert hops == {1, 2}  # one- and two-search questions


def test_held_out_problems_never_train(task):
    test_ids = {ex.id.split("/")[1] for ex in task.test_examples()}
    train_ids = {ex.id.split("/")[1] for ex in task.train_examples(500, random.Random(0))}
    assert not test_ids & train_ids
    assert [ex.id for ex in KBTask(n_test=60).test_examples()] == [ex.id for ex in task.test_examples()]


def test_answering_without_the_tool_is_chance(task):
    """The best fixed guess (the most frequent answer of the training problems) is near zero."""
    train = task.train_examples(2000, random.Random(1))
    counts: dict[str, int] = {}
    for ex in train:
        counts[ex.answer] = counts.get(ex.answer, 0) + 1
    best = max(counts, key=lambda a: counts[a])
    accuracy = sum(task.score(ex, f"answer {best}") for ex in task.test_examples()) / task.n_test
    assert accuracy <= 0.1


@pytest.mark.parametrize(
    "text, answer",
    [
        ("answer c3", "c3"),
        ("<search> p1 </search> p1 city c3 firm f2 answer c3", "c3"),
        ("answer c1 answer c3", "c3"),
        ("answer", None),
        ("c3", None),
        (None, None),
    ],
)
def test_final_answer(text, answer):
    assert final_answer(text) == answer


def test_words_tokenizer_round_trips(task):
    tok = tiny_tokenizer("words", task.alphabet())
    assert len(tok) == 3 + len(task.alphabet().split())
    for ex in task.test_examples()[:20]:
        text = ex.prompt + " " + task.format_target(ex)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.unk_token_id not in ids and tok.decode(ids) == text
        joined = [i for seg, _ in task.demonstration(ex) for i in tok(seg, add_special_tokens=False)["input_ids"]]
        assert joined == tok(task.format_target(ex), add_special_tokens=False)["input_ids"]  # token-in = text-in


def test_warm_start_trains_on_calls_and_answers_only(task):
    from masktrl.rl.warmstart import _sft_batch

    tok = tiny_tokenizer("words", task.alphabet())
    ex = next(e for e in task.test_examples() if e.prompt.startswith("city firm"))
    ids, attention, labels, weights = _sft_batch(tok, task, [ex])
    trained = [tok.convert_ids_to_tokens(int(i)) for i, lab in zip(ids[0], labels[0]) if lab != -100]
    calls = [w for seg, t in task.demonstration(ex) if t for w in seg.split()]
    assert trained == calls + [tok.eos_token]
    assert weights is None  # every trained token weighs 1: transformers' own loss


def test_direct_prompt_appends_the_answer_marker(task):
    ex = task.test_examples()[0]
    direct = task.direct_prompt(ex)
    assert direct.prompt == ex.prompt + " answer" and direct.answer == ex.answer and direct.id == ex.id


@pytest.mark.parametrize(
    "options, message",
    [
        ({"two_hop": 1.5}, "two_hop must be a number in"),
        ({"world_persons": 50}, "world_persons must be an integer in"),
        ({"cities": 1}, "cities must be an integer in"),
    ],
)
def test_bad_options(options, message):
    with pytest.raises(ConfigError, match=message):
        KBTask(n_test=5, **options)


def _gen(source, turn):
    n = len(source)
    return Generation(list(range(n)), [0.0] * n, [[0]] * n, [[0.0]] * n, True, source=source, turn=turn)


P, E = POLICY, ENVIRONMENT
EPISODES = [
    _gen([P, P, E, E, P, P, E, P], [0, 0, 0, 0, 1, 1, 1, 2]),  # two calls, three turns
    _gen([P, P], [0, 0]),  # answered at once
    _gen([P, P, E], [0, 0, 0]),  # one call, cut after the reply
]


def test_episode_stats_per_step():
    from masktrl.rl.collect import episode_stats

    stats = episode_stats(EPISODES)
    assert stats == pytest.approx({"turns_per_episode": 5 / 3, "calls_per_episode": 1.0, "tool_call_rate": 2 / 3})
    single = Generation([1, 2], [0.0, 0.0], [[0]] * 2, [[0.0]] * 2, True)
    assert episode_stats([single]) == {}  # single-turn metrics rows are unchanged


def test_eval_tool_statistics():
    from masktrl.rl.evaluation import Graded, tool_calls, tool_stats

    calls = [[tool_calls(g) for g in EPISODES]]
    graded = Graded([[1.0, 0.0, 0.0]], [[None] * 3], [[1] * 3], [[True] * 3], calls)
    assert calls == [[2, 0, 1]]
    assert tool_stats(graded) == pytest.approx(
        {"calls_per_episode": 1.0, "searched_frac": 2 / 3, "accuracy_given_search": 0.5, "accuracy_without_search": 0.0}
    )
    single = Generation([1], [0.0], [[0]], [[0.0]], True)
    assert tool_calls(single) is None
    assert tool_stats(Graded([[1.0]], [[None]], [[1]], [[True]], [[None]])) is None


def test_dynamics_plots_the_tool_metrics_when_logged():
    from types import SimpleNamespace

    from masktrl.analysis.dynamics import AGENTIC, metric_list

    run = SimpleNamespace(metrics=[{"step": 1, "reward_mean": 0.1, "turns_per_episode": 2.0, "tool_call_rate": 0.9}])
    keys = [k for k, _ in metric_list([run])]
    assert "turns_per_episode" in keys and "tool_call_rate" in keys and "calls_per_episode" not in keys
    plain = SimpleNamespace(metrics=[{"step": 1, "reward_mean": 0.1}])
    assert not {k for k, _ in AGENTIC} & {k for k, _ in metric_list([plain])}


def _cli(*args, cwd):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "masktrl.cli", *args], cwd=cwd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


@pytest.mark.slow
def test_the_agentic_lab_end_to_end(tmp_path):
    """A short agentic run (summary with the tool-forbidden accuracy, per-step tool metrics), a
    multi-turn rollout file from it that replays into --method sis and --method pdm, eval's tool
    statistics and analyze dynamics' tool curves (about 2 minutes on a loaded 2-core machine)."""
    import json

    from masktrl.rollout.storage import read_rollouts

    out = tmp_path / "out"
    small = ["--config", "agentic", "--out", str(out)]
    for key in ("warmstart.steps=60", "train.steps=1", "rollout.prompts_per_step=4", "rollout.n=4"):
        small += ["--set", key]
    small += ["--set", "task.n_test=8", "--set", "train.eval_every=0", "--set", "train.checkpoint_every=1"]
    _cli("train", *small, "--run", "base", cwd=tmp_path)
    summary = json.loads((out / "base" / "summary.json").read_text())
    assert summary["eval_after_no_tool"] is not None
    row = json.loads((out / "base" / "metrics.jsonl").read_text().splitlines()[-1])
    assert {"turns_per_episode", "calls_per_episode", "tool_call_rate", "env_calls", "env_truncated"} <= set(row)

    file = tmp_path / "mt.parquet"
    _cli(
        "rollout",
        "--model",
        str(out / "base"),
        "--data",
        "synthetic",
        "-o",
        str(file),
        "--prompts",
        "4",
        "--n",
        "4",
        cwd=tmp_path,
    )
    samples, _ = read_rollouts(file)
    assert any(ENVIRONMENT in s.gen.source for s in samples)  # the file holds tool replies
    for method in ("sis", "pdm"):
        _cli("train", *small, "--rollouts-from", str(file), "--method", method, "--run", method, cwd=tmp_path)
        assert (out / method / "summary.json").is_file()

    _cli("eval", "task", "--model", str(out / "base"), "--k", "2", cwd=tmp_path)
    report = json.loads(next((out / "base" / "eval").glob("task-*.json")).read_text())
    assert set(report["tools"]) == {
        "calls_per_episode",
        "searched_frac",
        "accuracy_given_search",
        "accuracy_without_search",
    }
    _cli("analyze", "dynamics", str(out / "base"), "--output", str(tmp_path / "dyn"), cwd=tmp_path)
    assert "tool_call_rate" in json.loads((tmp_path / "dyn" / "dynamics.json").read_text())["metrics"]
