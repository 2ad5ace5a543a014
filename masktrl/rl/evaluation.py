"""The evaluation core shared by ``masktrl eval`` (``recipes/eval.py``), ``masktrl rollout``
and training: k sampled completions per problem graded by the task's own scorer
(:func:`sample_and_grade`), summarised as avg@k, pass@k and maj@k with a bootstrap CI over
problems (:func:`summarize`); the periodic evals of ``train.eval_benchmarks``
(:func:`periodic_eval`) and the run's own eval_before / eval_after (:func:`heldout_accuracy`).

Generation goes through the rollout engine interface used in training (``make_engine``:
transformers or vLLM), in batches of problems; grading is ``task.score_many`` (MathTask grades
in its killable math-verify pool). Reports are JSON (schema in docs/EVAL.md), written
atomically; for a run recorded in the manifest as stage ``eval/<bench>/<S:06d>``.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

import numpy as np

from masktrl.config import OWN_TASK_BENCHMARKS, SYNTHETIC_TASKS, Config, TaskConfig, from_dict, read_overrides
from masktrl.errors import ConfigError
from masktrl.io import atomic_write_json
from masktrl.models.loading import load_tokenizer
from masktrl.rl.agentic import with_environment
from masktrl.rl.sampling import grade, sample
from masktrl.rollout.base import ENVIRONMENT, SamplingSettings
from masktrl.runs.store import RunStore, eval_key
from masktrl.seeding import stream_seed
from masktrl.stats import avg_at_k, bootstrap_ci, maj_at_k, mean_se, pass_at_k_matrix
from masktrl.tasks import make_eval_task, make_task
from masktrl.tasks.grader import extract_answer, normalize

SCHEMA_VERSION = 1
ANSWER_CHARS = 100  # extracted answers are stored up to this length


def bench_task_config(
    bench: str,
    cfg: Config,
    *,
    template: str | None = None,
    data: str | None = None,
    config: str | None = None,
    overrides: tuple[str, ...] = (),
) -> TaskConfig:
    """The task section that evaluates ``bench`` (a math preset, or ``dataset``).

    In order: for ``dataset``, the whole task section of a run that trained on a dataset (its
    data, keys, template, reward); for a preset, the prompt settings of a run that trained on
    any dataset task (a named template, the system prompt, the chat-template arguments: the
    prompt it learned); then ``--template``, ``--data`` (a preset's file, or the dataset's
    ``task.source``), then the task section of ``--config`` and the ``--set task.*`` overrides
    (``model.chat_template`` may be set there too, see :func:`eval_chat`). The reward is the
    template's unless the overrides name one.
    """
    t = cfg.task
    raw: dict = {"name": bench}
    if bench == "dataset" and t.name == "dataset":  # the run's own dataset, template and reward
        raw.update(dataclasses.asdict(t))
    elif t.name != "arithmetic":
        if t.template is not None and "{" not in t.template:
            raw["template"] = t.template
        raw.update(system_prompt=t.system_prompt, chat_template_kwargs=dict(t.chat_template_kwargs))
    if template is not None:
        raw["template"] = template
    if data is not None:
        raw["source" if bench == "dataset" else "data"] = data
    given = eval_overrides(config, overrides)
    task_given = given.get("task") or {}
    if "name" in task_given and task_given["name"] != bench:  # it was replaced by the benchmark without a word
        raise ConfigError(
            f"task.name={task_given['name']} conflicts with the benchmark {bench} (the command's first "
            "argument names the task): drop one"
        )
    raw.update(task_given)
    raw["name"] = bench
    chat = given.get("model", {}).get("chat_template", cfg.model.chat_template)
    return from_dict({"task": raw, "model": {"chat_template": chat}}).task


def eval_overrides(config: str | None, overrides) -> dict:
    """The sections ``--config`` / ``--set`` of eval and rollout give: task.* keys and
    model.chat_template, each section a mapping (``--set task=5`` raised TypeError, ``--set
    model=5`` AttributeError, ``--set seed=3`` said "not seed.None"); ConfigError otherwise."""
    given = read_overrides(config, list(overrides))
    for section, value in given.items():
        keys = list(value) if isinstance(value, dict) else []
        if (section, keys) != ("model", ["chat_template"]) and (section != "task" or not isinstance(value, dict)):
            what = f"{section}.{keys[0]}" if keys else f"{section}={value!r}"
            raise ConfigError(
                f"--config/--set of eval and rollout take task.* keys and model.chat_template, not {what}"
            )
    return given


def eval_chat(cfg: Config, opts) -> bool:
    """Whether prompts go through the chat template: ``--template chat`` yes, ``base`` / ``instruct``
    / ``raw`` no (the math templates as text), else ``model.chat_template`` (the run's, or --set)."""
    if opts.template in ("base", "instruct", "raw"):
        return False
    if opts.template == "chat":
        return True
    given = eval_overrides(opts.config, opts.overrides).get("model", {})
    return bool(given.get("chat_template", cfg.model.chat_template))


def load_engine(cfg: Config, weights: str):
    from masktrl.rollout import make_engine

    if cfg.rollout.engine == "hf":
        import torch

        from masktrl.models.loading import load_model_and_tokenizer

        model, tokenizer = load_model_and_tokenizer(weights, cfg.model.dtype)
        if torch.cuda.is_available():  # generate on the GPU, as a plain train run does
            model.to("cuda")
    else:  # vLLM loads the weights itself
        model, tokenizer = None, load_tokenizer(weights)
    engine = make_engine(cfg.rollout, model, tokenizer, weights, dtype=cfg.model.dtype, seed=cfg.seed)
    return with_environment(engine, tokenizer, cfg.task), tokenizer  # task.env: multi-turn episodes


def build_task(bench: str, cfg: Config, tokenizer=None):
    """task (alias synthetic): the run's own synthetic task, arithmetic, residues or longtail (its
    fixed held-out split); else the task of ``cfg.task`` (see :func:`bench_task_config`) with
    every example of its split held out, rendered once (with the policy's chat template when
    ``cfg.model.chat_template``)."""
    if bench in OWN_TASK_BENCHMARKS:
        if cfg.task.name not in SYNTHETIC_TASKS:
            raise ConfigError(
                f"benchmark {bench} is the run's own synthetic task ({', '.join(SYNTHETIC_TASKS)}), "
                "but it trains on "
                f"{cfg.task.name!r}: evaluate it with masktrl eval dataset (or a "
                "math benchmark)"
            )
        return make_task(cfg.task, cfg.model)
    return make_eval_task(cfg.task, cfg.model, tokenizer)


def seed_name(bench: str) -> str:
    """The benchmark's name in its sampling seed: ``task`` samples as ``synthetic`` does (one
    benchmark, two names: the same completions)."""
    return "synthetic" if bench in OWN_TASK_BENCHMARKS else bench


def template_label(task) -> str:
    """How reports name the prompt template: base, chat, instruct, raw, dapo, custom (+chat), or
    ``builtin:<task>`` for a built-in task that writes its own prompts (synthetic arithmetic, residues)."""
    label = getattr(getattr(task, "template", None), "label", None)
    return label or f"builtin:{getattr(task, 'name', 'task')}"


def reward_name(task) -> str:
    reward = getattr(task, "reward", None)
    return getattr(reward, "name", None) or (
        "exact-match" if getattr(task, "answer_format", "plain") == "plain" else "boxed-match"
    )


def answer_of(task):
    """How a completion's answer is read for majority voting: the last ``\\boxed{}`` content,
    or the whole stripped completion for plain synthetic answers, or the task's own
    ``extract_answer`` (the agentic lab's: the word after the last ``answer``)."""
    own = getattr(task, "extract_answer", None)
    if callable(own):
        return own
    if getattr(task, "answer_format", None) == "plain":
        return lambda text: text.strip() or None
    return extract_answer


@dataclass
class Graded:
    scores: list[list[float]]  # [P][k]
    answers: list[list[str | None]]  # [P][k] extracted answers
    lengths: list[list[int]]  # [P][k] response tokens
    finished: list[list[bool]]  # [P][k] ended with EOS
    calls: list[list[int | None]] = dataclasses.field(
        default_factory=list
    )  # [P][k] tool calls answered; None: single-turn


class EvalBatches(NamedTuple):
    """How an evaluation's generation is cut and seeded: ``batch_size`` sequences at a time,
    batch i from the seed stream ``(*seed_key, i)``, prompts in the chat template or not."""

    seed_key: tuple
    batch_size: int
    chat_template: bool


def sample_and_grade(
    engine,
    tokenizer,
    task,
    examples,
    settings: SamplingSettings,
    batches: EvalBatches,
    progress=None,
    label: str = "eval",
) -> Graded:
    """``settings.n`` completions per example, generated as ``batches`` says, scored with
    ``task.score_many``. With ``n`` above ``batch_size`` each problem's samples come in parts of
    at most ``batch_size`` sequences (part j of problem i: the stream ``(*seed_key, i, j)``), so
    ``batch_size`` bounds what is generated at once whatever the ``n``."""
    seed_key, batch_size, chat_template = batches
    if not examples:
        raise ConfigError("no problems to evaluate")
    extract = answer_of(task)
    out = Graded([], [], [], [])
    bar = progress.add_task(label, total=len(examples), info="") if progress else None
    for chunk, n, seed, part, last in _calls(examples, settings.n, batch_size, seed_key):
        _, gens, texts = sample(engine, tokenizer, chunk, replace(settings, n=n), seed, chat_template)
        scores = grade(task, chunk, texts)
        for j, group in enumerate(texts):
            row = (
                scores[j],
                [_clip(extract(t)) for t in group],
                [len(g.response_ids) for g in gens[j]],
                [g.finished for g in gens[j]],
                [tool_calls(g) for g in gens[j]],
            )
            for column, values in zip((out.scores, out.answers, out.lengths, out.finished, out.calls), row):
                if part:
                    column[-1].extend(values)  # the next part of the same problem's samples
                else:
                    column.append(list(values))
        if progress and last:
            partial = scores_are_partial(task)
            acc = float(np.mean([s if partial else s > 0 for row in out.scores for s in row]))
            progress.update(bar, advance=len(chunk), info=f"avg@{settings.n} {acc:.3f}")
    return out


def tool_calls(gen) -> int | None:
    """The tool calls of a multi-turn response that the environment answered (its turns holding
    environment tokens), or None for a single-turn one."""
    if gen.source is None:
        return None
    return len({t for t, s in zip(gen.turn, gen.source) if s == ENVIRONMENT})


def tool_stats(graded: Graded) -> dict | None:
    """A multi-turn evaluation's tool statistics: calls per episode, the fraction of episodes that
    called the tool, the accuracy of those that did and of those that did not (None when no
    episode is in the group); None for a single-turn one."""
    pairs = [(c, s > 0) for cs, ss in zip(graded.calls, graded.scores) for c, s in zip(cs, ss) if c is not None]
    if not pairs:
        return None
    searched = [ok for c, ok in pairs if c > 0]
    not_searched = [ok for c, ok in pairs if c == 0]
    return {
        "calls_per_episode": float(np.mean([c for c, _ in pairs])),
        "searched_frac": len(searched) / len(pairs),
        "accuracy_given_search": float(np.mean(searched)) if searched else None,
        "accuracy_without_search": float(np.mean(not_searched)) if not_searched else None,
    }


def _calls(examples, n: int, batch_size: int, seed_key):
    """(examples, samples each, seed, part, last part) of each generation call of ``sample_and_grade``."""
    if n <= batch_size:
        per_batch = batch_size // n
        for i, start in enumerate(range(0, len(examples), per_batch)):
            yield examples[start : start + per_batch], n, stream_seed(*seed_key, i), 0, True
        return
    for i, ex in enumerate(examples):
        for part, first in enumerate(range(0, n, batch_size)):
            yield [ex], min(batch_size, n - first), stream_seed(*seed_key, i, part), part, first + batch_size >= n


def _clip(answer: str | None) -> str | None:
    return answer if answer is None or len(answer) <= ANSWER_CHARS else answer[:ANSWER_CHARS] + "…"


def summarize(
    bench: str, examples, graded: Graded, seed: int = 0, task: str | None = None, partial: bool = False
) -> dict:
    """The metrics block of a report: avg@k, pass@j (j = 1, 2, 4, ..., k), maj@k, CI, per problem.
    Benchmark ``task`` (the run's own task, named ``task``) adds ``task`` and the standard errors
    over problems of avg@k and pass@k (``avg_at_k_se``, ``pass_at_k_se``: sample std / sqrt(P),
    None for one problem); the other names keep the report they always had. With ``partial`` (a
    task graded with partial credit, scores in [0, 1]) avg@k is the mean score, pass@k and maj@k
    count fully correct samples (score 1), and the report says ``credit: partial``."""
    scores = np.array(graded.scores, dtype=float)  # [P, k]
    correct = scores >= 1 if partial else scores > 0
    k = correct.shape[1]
    per_problem = scores.mean(axis=1) if partial else np.asarray(avg_at_k(correct, per_problem=True))  # [P]
    low, high = bootstrap_ci(per_problem, n_boot=10000, seed=seed)
    ks = sorted({*(2**i for i in range(k.bit_length()) if 2**i <= k), k})
    report = {
        "schema": SCHEMA_VERSION,
        "benchmark": bench,
        "k": k,
        "n_problems": len(examples),
        "avg_at_k": float(per_problem.mean()),
        "ci95": [low, high],
        "pass_at_k": pass_at_k_matrix(correct, k),
        "pass_at": {str(j): pass_at_k_matrix(correct, j) for j in ks},
        "maj_at_k": maj_at_k(graded.answers, correct, normalize_fn=normalize),
        "response_len_mean": float(np.mean(graded.lengths)),
        "truncated_frac": float(1.0 - np.mean(graded.finished)),
        "problems": [
            {
                "id": ex.id,
                "answer": ex.answer,
                "correct": int(row.sum()),
                "k": k,
                "scores": [round(float(x), 6) for x in credit] if partial else [int(x) for x in row],
                "answers": answers,
            }
            for ex, row, credit, answers in zip(examples, correct, scores, graded.answers)
        ],
    }
    if partial:
        report["credit"] = "partial"
    tools = tool_stats(graded) if graded.calls else None
    if tools is not None:  # task.env: multi-turn episodes
        report["tools"] = tools
    if bench == "task":
        se = lambda values: None if len(values) < 2 else mean_se(values)[1]  # noqa: E731
        report.update(
            task=task, avg_at_k_se=se(per_problem), pass_at_k_se=se(pass_at_k_matrix(correct, k, per_problem=True))
        )
    return report


def generation_block(settings: SamplingSettings, engine: str, template, chat: bool, seed: int, cfg: Config) -> dict:
    return {
        "engine": engine,
        "temperature": 0.0 if settings.greedy else settings.temperature,
        "top_p": settings.top_p,
        "greedy": settings.greedy,
        "max_new_tokens": settings.max_new_tokens,
        "template": template,
        "chat_template": chat,
        "seed": seed,
        "batch_size": cfg.rollout.batch_size,
        "dtype": cfg.model.dtype,
    }


def describe_data(bench: str, cfg: Config) -> str:
    t = cfg.task
    if bench in OWN_TASK_BENCHMARKS and t.name == "arithmetic":
        return (
            f"arithmetic held-out split (ops={t.ops}, digits={t.digits}, "
            f"answer_format={t.answer_format}, n_test={t.n_test})"
        )
    if bench in OWN_TASK_BENCHMARKS:
        options = ", ".join(f"{k}={v}" for k, v in sorted(t.options.items()))
        return f"{t.name} held-out split (n_test={t.n_test}" + (f", {options})" if options else ")")
    if t.source:
        return f"{t.source} ({t.test_split or t.split})"
    return str(t.data) if t.data else "local datasets cache"


def save(report: dict, path: Path, store: RunStore | None, bench: str, step: int | None) -> None:
    """Write the report atomically; for a run, record it as stage ``eval/<bench>/<step>``."""
    report["created"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    atomic_write_json(path, report)
    if store is not None:
        store.mark_done(eval_key(bench, step), [path], avg_at_k=report["avg_at_k"], k=report["k"])


def scores_are_partial(task) -> bool:
    """Whether ``task`` grades with partial credit (a score in [0, 1] per completion, not right or
    wrong): its ``partial_scores`` attribute (tasks/residues.py with ``credit: partial``), False
    for a task without one. The held-out accuracy and eval's avg@k are then mean scores."""
    return bool(getattr(task, "partial_scores", False))


def heldout_accuracy(
    engine, tokenizer, task, examples, settings: SamplingSettings, greedy: bool, chat_template=False, seed=0
) -> float:
    """eval_before / eval_after: the fraction of ``examples`` (the task's held-out split) answered
    correctly with one completion each, greedy or sampled; for a task graded with partial credit
    (``scores_are_partial``) the mean score."""
    _, _, texts = sample(engine, tokenizer, examples, replace(settings, n=1, greedy=greedy), seed, chat_template)
    scores = [score for (score,) in grade(task, examples, texts)]
    if scores_are_partial(task):
        return sum(scores) / max(1, len(examples))
    return sum(score > 0 for score in scores) / max(1, len(examples))


def no_tool_accuracy(
    engine, tokenizer, task, examples, settings: SamplingSettings, greedy: bool, chat_template=False, seed=0
) -> float | None:
    """The held-out accuracy of the policy forbidden to call the tool: ``task.direct_prompt`` s
    (the answer marker appended) sampled without the environment. None unless the engine runs
    episodes (``task.env``) and the task has direct prompts (the agentic lab's ``kb``)."""
    if not hasattr(engine, "generate_episodes") or not hasattr(task, "direct_prompt"):
        return None
    direct = [task.direct_prompt(ex) for ex in examples]
    return heldout_accuracy(engine.inner, tokenizer, task, direct, settings, greedy, chat_template, seed)


def periodic_eval(
    cfg: Config, store: RunStore, engine, tokenizer, step: int, last_step: int, *, write: bool = True
) -> dict:
    """The ``train.eval_benchmarks`` evals due at ``step`` (every ``train.eval_every`` steps and
    at the last step), as metrics ``eval/<bench>/avg_at_k`` and ``eval/<bench>/pass_at_k``.

    Each writes ``<run>/eval/<bench>-step<S>.json`` (replaced when a resumed run redoes the
    step). At step 1 the benchmarks' data are loaded once, so a missing file fails the run
    early rather than at the first eval. ``write=False`` (the non-main processes of a
    multi-process run, which evaluate too) only returns the metrics.
    """
    benches = cfg.train.eval_benchmarks
    due = bool(benches) and (step == last_step or (cfg.train.eval_every and step % cfg.train.eval_every == 0))
    if not due:
        if benches and step == 1:
            for bench in benches:
                build_task(bench, _bench_config(cfg, bench), tokenizer).close()
        return {}
    e = cfg.eval
    settings = SamplingSettings(
        n=e.k,
        max_new_tokens=e.max_new_tokens or cfg.rollout.max_new_tokens,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        logprobs_k=1,
    )
    row = {}
    for bench in benches:
        report = _bench_report(cfg, store, engine, tokenizer, bench, step, settings)
        if write:
            save(report, store.eval_path(bench, step), store, bench, step)
        row[f"eval/{bench}/avg_at_k"] = report["avg_at_k"]
        row[f"eval/{bench}/pass_at_k"] = report["pass_at_k"]
    return row


def _bench_report(
    cfg: Config, store: RunStore, engine, tokenizer, bench: str, step: int, settings: SamplingSettings
) -> dict:
    """``bench``'s report on the policy after ``step`` (``periodic_eval``), not written."""
    chat = cfg.model.chat_template if bench in OWN_TASK_BENCHMARKS else False
    t0 = time.time()
    bench_cfg = _bench_config(cfg, bench)
    task = build_task(bench, bench_cfg, tokenizer)
    template = template_label(task)
    try:
        examples = task.test_examples()[: cfg.eval.n_problems]
        graded = sample_and_grade(
            engine,
            tokenizer,
            task,
            examples,
            settings,
            EvalBatches((cfg.seed, "eval", seed_name(bench), step), cfg.rollout.batch_size, chat),
        )
    finally:
        task.close()
    partial = scores_are_partial(task)
    report = summarize(bench, examples, graded, seed=cfg.seed, task=bench_cfg.task.name, partial=partial)
    report.update(
        model=str(store.root),
        weights=None,
        run=store.name,
        step=step,
        data=describe_data(bench, bench_cfg),
        reward=reward_name(task),
        time_s=time.time() - t0,
        generation=generation_block(settings, engine.name, template, chat, cfg.seed, cfg),
    )
    return report


def _bench_config(cfg: Config, bench: str) -> Config:
    """The run's config evaluating ``bench`` (train.eval_benchmarks): its prompt settings, the
    benchmark's ``eval.data`` file."""
    if bench in OWN_TASK_BENCHMARKS:
        return cfg
    return replace(cfg, task=bench_task_config(bench, cfg, data=cfg.eval.data.get(bench)))
