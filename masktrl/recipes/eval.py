"""``masktrl eval``: k sampled completions per problem of a benchmark, graded by the task's own
scorer, summarised as avg@k, pass@k and maj@k with a bootstrap CI over problems (the core is
``rl/evaluation.py``, shared with the evals during training and ``masktrl rollout``).

Results are JSON (schema in docs/EVAL.md), written atomically. For a run: ``<run>/eval/
<bench>-step<S>.json``, recorded in the manifest as stage ``eval/<bench>/<S:06d>`` with the
file's sha256. An existing result is never replaced unless ``force`` is set; a run's report
that its manifest does not record (an eval killed between the two writes) is not a result, and
the same command writes it again. A symbolic link as the run folder is refused (not followed),
and ``--output`` never lies inside a run folder.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from masktrl.config import EVAL_BENCHMARKS, OWN_TASK_BENCHMARKS, Config, check_seed, check_temperature
from masktrl.errors import ConfigError
from masktrl.rl.checks import check_response_room, fit_context, fit_default_length, model_context
from masktrl.rl.evaluation import (
    EvalBatches,
    bench_task_config,
    build_task,
    describe_data,
    eval_chat,
    generation_block,
    load_engine,
    reward_name,
    sample_and_grade,
    save,
    scores_are_partial,
    seed_name,
    summarize,
    template_label,
)
from masktrl.rollout.base import SamplingSettings
from masktrl.runs.locks import refuse_symlink
from masktrl.runs.resolve import ModelRef, model_path, refuse_inside_run, refuse_output_file, resolve_model
from masktrl.runs.store import RunStore, eval_key, is_run_folder

MATH_MAX_NEW_TOKENS = 4096  # default response length on math benchmarks for a model that is not a math run
MAX_K = 65536  # samples per problem: the report holds each one's answer, length and score
MEMORY_HINT = "lower --batch-size (sequences generated together), --k or --max-new-tokens"


@dataclass(frozen=True)
class EvalOptions:
    """What ``masktrl eval`` was asked for; None means "from the run's config, else a default"."""

    k: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int | None = None
    data: str | None = None
    template: str | None = None
    engine: str | None = None
    seed: int = 0
    n_problems: int | None = None
    batch_size: int | None = None
    dtype: str | None = None
    config: str | tuple[str, ...] | None = None  # YAML file(s), composed: the task section (and model.chat_template)
    overrides: tuple[str, ...] = ()  # --set task.KEY=VALUE (and model.chat_template=...)

    def validate(self, bench: str) -> None:
        check_benchmark(bench)
        if self.k < 1:
            raise ConfigError(f"--k must be >= 1, got {self.k}")
        if self.k > MAX_K:
            raise ConfigError(
                f"--k {self.k} is above {MAX_K}: the report keeps every sample's answer, length and "
                "score (--k per "
                "problem); --batch-size bounds what is generated at once, not the "
                "report"
            )
        check_temperature("--temperature", self.temperature, greedy=True)
        check_seed("--seed", self.seed)
        if self.temperature == 0 and self.k != 1:
            raise ConfigError("--temperature 0 is greedy decoding: all k samples would be identical; use --k 1")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--top-p must be in (0, 1], got {self.top_p}")
        for name in ("max_new_tokens", "n_problems", "batch_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if self.engine is not None and self.engine not in ("hf", "vllm"):
            raise ConfigError(f"--engine must be hf or vllm, got {self.engine!r}")
        if self.dtype is not None and self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"--dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if bench in OWN_TASK_BENCHMARKS and (
            self.data is not None or self.template is not None or self.config or self.overrides
        ):
            raise ConfigError(
                f"--data, --template, --config and --set apply to datasets; {bench} uses the run's own task"
            )
        if self.template is not None:
            from masktrl.tasks.templates import PromptTemplate

            PromptTemplate.resolve(self.template)

    def task_args(self) -> dict:
        return dict(template=self.template, data=self.data, config=self.config, overrides=self.overrides)


@dataclass
class EvalResult:
    report: dict
    path: Path


def check_benchmark(bench: str) -> None:
    if bench not in (*EVAL_BENCHMARKS, "dataset"):
        raise ConfigError(f"unknown benchmark {bench!r}; valid benchmarks: {', '.join(EVAL_BENCHMARKS)}, dataset")


def run(
    bench: str,
    model: str,
    step: int | None,
    opts: EvalOptions,
    *,
    out: Path | None = None,
    output: Path | None = None,
    force: bool = False,
    progress=None,
) -> EvalResult:
    """Evaluate ``model`` (a run folder or a run's name under ``out``, a model folder or a cached
    hub id) on ``bench``; the report goes to ``output`` (a model that is not a run only) or to
    its default place (``output_path``)."""
    ref, path = _target(bench, model, step, opts, out=out, output=output, force=force)
    cfg = _bench_config(bench, ref, opts)
    if opts.max_new_tokens is not None:  # before the data and the weights are loaded
        check_response_room(f"--max-new-tokens {opts.max_new_tokens}", opts.max_new_tokens, model_context(ref.weights))
    task = build_task(bench, cfg)
    try:  # the data loaded: now the weights
        engine, tokenizer = load_engine(cfg, ref.weights)
        chat = cfg.model.chat_template if bench in OWN_TASK_BENCHMARKS else False
        context = model_context(ref.weights)
        examples, too_long = fit_context(task.test_examples()[: opts.n_problems], tokenizer, chat, context)
        length = max_new_tokens(bench, ref, opts)
        if opts.max_new_tokens is None:  # a default fits the context, before any generation
            length = fit_default_length(length, examples, tokenizer, chat, context)
        settings = _sampling(opts, length)
        t0 = time.time()
        graded = sample_and_grade(
            engine,
            tokenizer,
            task,
            examples,
            settings,
            EvalBatches((opts.seed, "eval", seed_name(bench)), cfg.rollout.batch_size, chat),
            progress,
            label=f"eval {bench}",
        )
    finally:
        task.close()
    report = summarize(bench, examples, graded, seed=opts.seed, task=cfg.task.name, partial=scores_are_partial(task))
    report.update(
        model=ref.label,
        weights=ref.weights,
        run=ref.store.name if ref.store else None,
        step=ref.step,
        data=describe_data(bench, cfg),
        time_s=time.time() - t0,
        reward=reward_name(task),
        generation=generation_block(settings, engine.name, template_label(task), chat, opts.seed, cfg),
        prompts_too_long=too_long,
    )
    save(report, path, ref.store, bench, ref.step)
    return EvalResult(report, path)


def _sampling(opts: EvalOptions, max_new_tokens: int) -> SamplingSettings:
    """An eval's sampling: k samples a problem at ``--temperature`` (0: greedy), ``--top-p``."""
    return SamplingSettings(
        n=opts.k,
        max_new_tokens=max_new_tokens,
        temperature=opts.temperature or 1.0,
        top_p=opts.top_p,
        logprobs_k=1,
        greedy=opts.temperature == 0,
    )


def _target(
    bench: str, model: str, step: int | None, opts: EvalOptions, *, out: Path | None, output: Path | None, force: bool
) -> tuple[ModelRef, Path]:
    """(the model resolved, where its report goes), every refusal before anything is loaded."""
    opts.validate(bench)
    if output is not None:
        refuse_inside_run(output)
    ref = resolve_model(model, step, out)
    if bench in OWN_TASK_BENCHMARKS and ref.store is None:
        raise ConfigError(f"benchmark {bench} needs a run (--model <run>): {model} is no run folder (no run.yaml)")
    if output is not None and ref.store is not None:
        raise ConfigError(
            f"--output: a run's evals are stored in the run ({ref.store.root / 'eval'}); --output is "
            "for models that are not runs"
        )
    if ref.store is not None:
        refuse_symlink(ref.store.root)  # its report would be written outside --out
    path = Path(output) if output is not None else output_path(ref, bench, out)
    refuse_output_file(path, "JSON report", replace=force or not recorded(ref, bench))
    return ref, path


def _bench_config(bench: str, ref: ModelRef, opts: EvalOptions) -> Config:
    """The configuration the evaluation runs with: the run's (or a default one) with the options,
    the benchmark's task unless it is the run's own; a run's ``train.threads`` set for torch."""
    cfg = eval_config(ref, opts)
    if ref.store is not None:
        import torch

        torch.set_num_threads(cfg.train.threads)
    if bench not in OWN_TASK_BENCHMARKS:
        cfg = replace(
            cfg,
            model=replace(cfg.model, chat_template=eval_chat(cfg, opts)),
            task=bench_task_config(bench, cfg, **opts.task_args()),
        )
    return cfg


def folder_runs(model: str) -> list[Path] | None:
    """The run folders in ``model`` when it is a folder of runs (a sweep's ``--out``: neither a run
    nor a model folder, with run folders in it), in name order; else None."""
    p = model_path(model)
    if not p.is_dir() or is_run_folder(p) or (p / "config.json").is_file():
        return None
    return sorted(c for c in p.iterdir() if is_run_folder(c)) or None


def run_folder(
    bench: str,
    runs: list[Path],
    step: int | None,
    opts: EvalOptions,
    *,
    out: Path | None = None,
    output: Path | None = None,
    force: bool = False,
    progress=None,
) -> Iterator[tuple[Path, EvalResult | str]]:
    """:func:`run` on every complete run of ``runs``, each ``(root, result)`` yielded as it ends; a
    run that is not complete, or whose report exists (without ``force``), is skipped with the
    reason, so a rerun does what is left. The options are checked before the first run."""
    opts.validate(bench)
    if output is not None:
        raise ConfigError(
            "--output: each run's evals are stored in the run; --output is for one model that is not a run"
        )
    for root in runs:
        status = RunStore(root, writable=False).status()
        if root.is_symlink():
            result: EvalResult | str = "skipped: the run folder is a symbolic link (not followed)"
        elif status != "complete":
            result = f"skipped: {status}, not complete"
        elif (
            (path := output_path(ref := resolve_model(str(root), step, out), bench, out)).exists()
            and not force
            and recorded(ref, bench)
        ):
            result = f"skipped: {path} exists"
        else:
            result = run(bench, str(root), step, opts, out=out, force=force, progress=progress)
        yield root, result


def recorded(ref: ModelRef, bench: str) -> bool:
    """Whether the report at ``output_path`` is a finished one: for a run, recorded in its manifest
    (an eval killed between writing its report and recording it left an unfinished one, which the
    same command replaces); for a model that is not a run, any file there."""
    if ref.store is None:
        return True
    return (ref.store.stage(eval_key(bench, ref.step)) or {}).get("status") == "done"


def output_path(ref: ModelRef, bench: str, out: Path | None) -> Path:
    """``<run>/eval/<bench>-step<S>.json``; for a model folder ``eval/`` beside it; for a hub id
    ``<out>/eval/`` (``out``: the folder of runs, ``outputs`` by default)."""
    if ref.store is not None:
        return ref.store.eval_path(bench, ref.step)
    p = Path(ref.weights)
    folder = p.parent / "eval" if p.exists() else Path(out if out is not None else "outputs") / "eval"
    return folder / f"{bench}-{p.resolve().name if p.exists() else ref.weights.replace('/', '__')}.json"


def eval_config(ref: ModelRef, opts: EvalOptions) -> Config:
    """The run's config (or the defaults) with the command line's engine, dtype and batch size."""
    cfg = ref.cfg or Config()
    dtype = opts.dtype or (cfg.model.dtype if ref.cfg else _default_dtype())
    rollout = replace(
        cfg.rollout,
        engine=opts.engine or (cfg.rollout.engine if ref.cfg else "hf"),
        batch_size=opts.batch_size or cfg.rollout.batch_size,
    )
    return replace(cfg, seed=opts.seed, model=replace(cfg.model, path=ref.weights, dtype=dtype), rollout=rollout)


def _default_dtype() -> str:
    import torch

    return "bfloat16" if torch.cuda.is_available() else "float32"


def max_new_tokens(bench: str, ref: ModelRef, opts: EvalOptions) -> int:
    if opts.max_new_tokens is not None:
        return opts.max_new_tokens
    if bench in OWN_TASK_BENCHMARKS or (ref.cfg is not None and ref.cfg.task.name != "arithmetic"):
        return ref.cfg.rollout.max_new_tokens  # what the run trained with
    return MATH_MAX_NEW_TOKENS
