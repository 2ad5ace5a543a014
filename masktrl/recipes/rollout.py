"""``masktrl rollout``: standalone generation into a rollout parquet that any method can train
on (``masktrl train --rollouts-from FILE``).

The file has the schema of a run's ``steps/<s>/rollouts.parquet`` (docs/ROLLOUTS.md): every
token's sampled id, behaviour log-probability and behaviour top-K list, plus the reward and
the group-normalised advantage of each response.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from pathlib import Path

from masktrl.config import Config, check_seed
from masktrl.errors import MasktrlError
from masktrl.models.loading import tokenizer_fingerprint
from masktrl.rl.checks import check_response_room, fit_default_length, model_context
from masktrl.rl.collect import generate_groups, score_groups, set_advantages
from masktrl.rl.evaluation import bench_task_config, build_task, eval_chat, load_engine
from masktrl.rollout.base import SamplingSettings, check_sampling
from masktrl.rollout.storage import write_rollouts
from masktrl.runs.resolve import refuse_inside_run, refuse_output_file, resolve_model
from masktrl.seeding import stream_seed
from masktrl.tasks import make_eval_task
from masktrl.tasks.math_data import BENCHMARKS

MAX_PROMPTS = 65536
"""The most prompts one ``masktrl rollout`` samples (``--prompts``)."""


@dataclass(frozen=True)
class RolloutOptions:
    n: int = 8
    logprobs_k: int = 20
    prompts: int | None = None  # None: 32 synthetic prompts, or every problem of a dataset
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int | None = None
    seed: int = 0
    engine: str | None = None
    template: str | None = None
    config: str | tuple[str, ...] | None = None  # YAML file(s), composed: the task section (and model.chat_template)
    overrides: tuple[str, ...] = ()  # --set task.KEY=VALUE (and model.chat_template=...)

    def validate(self) -> None:
        for name in ("n", "logprobs_k", "prompts", "max_new_tokens"):  # prompts, max_new_tokens: None is the default
            value = getattr(self, name)
            if value is not None and value < 1:
                raise MasktrlError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if self.prompts is not None and self.prompts > MAX_PROMPTS:  # drawn in memory first: was killed for memory
            raise MasktrlError(
                f"--prompts {self.prompts} is above {MAX_PROMPTS}: a rollout file is built in memory, "
                "every prompt's --n responses, before it is written"
            )
        check_seed("--seed", self.seed)
        if self.n < 2:
            raise MasktrlError("--n must be >= 2: group advantages need at least two samples per prompt")
        check_sampling(self.temperature, self.top_p, names=("--temperature", "--top-p"))  # finite, > 0; top-p in (0, 1]


def run(
    model: str,
    data: str,
    out_file: Path,
    opts: RolloutOptions,
    *,
    step: int | None = None,
    force: bool = False,
    out: Path | None = None,
) -> dict:
    """Sample ``opts.n`` responses per prompt of ``data`` from ``model`` (a run folder or a run's
    name under ``out``, a model folder or a hub id), score them, and write them with group
    advantages to ``out_file``; returns a summary of what was written."""
    opts.validate()
    out_file = Path(out_file)
    refuse_inside_run(out_file)  # a run's stored batch is recorded with its hash: never replaced from outside
    refuse_output_file(out_file, "parquet file", replace=force)
    ref = resolve_model(model, step, out)
    if opts.max_new_tokens is not None:  # before the data and the weights are loaded
        check_response_room(f"--max-new-tokens {opts.max_new_tokens}", opts.max_new_tokens, model_context(ref.weights))
    cfg = ref.cfg or Config()
    cfg = replace(
        cfg,
        rollout=replace(cfg.rollout, engine=opts.engine or (cfg.rollout.engine if ref.cfg else "hf")),
        model=replace(cfg.model, path=ref.weights),
    )  # a chat template or token counts come from these weights
    task, examples = _examples(data, cfg, opts)
    try:
        engine, tokenizer = load_engine(replace(cfg, model=replace(cfg.model, path=ref.weights)), ref.weights)
        chat = cfg.model.chat_template and data == "synthetic"
        max_new = opts.max_new_tokens or fit_default_length(
            cfg.rollout.max_new_tokens if ref.cfg else 1024, examples, tokenizer, chat, model_context(ref.weights)
        )
        settings = SamplingSettings(opts.n, max_new, opts.temperature, opts.top_p, opts.logprobs_k)
        groups = generate_groups(engine, tokenizer, examples, settings, stream_seed(opts.seed, "rollout-cmd"), chat)
        score_groups(task, examples, groups)
    finally:
        task.close()
    set_advantages(groups)
    samples = [s for g in groups for s in g]
    meta = {
        "engine": engine.name,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        **settings.__dict__,
        "rollout_dtype": cfg.rollout.dtype,
        "quantization": cfg.rollout.quantization,
        "model": ref.weights,
        "data": data,
        "seed": opts.seed,
    }
    write_rollouts(out_file, samples, meta)
    return {
        "file": str(out_file),
        "prompts": len(groups),
        "responses": len(samples),
        "tokens": sum(len(s.gen.response_ids) for s in samples),
        "reward_mean": sum(s.reward for s in samples) / max(1, len(samples)),
        "model": ref.weights,
    }


def _examples(data: str, cfg: Config, opts: RolloutOptions):
    """(task, examples): synthetic arithmetic prompts, or the problems of a benchmark / file."""
    if data == "synthetic":
        if cfg.task.name != "arithmetic":
            cfg = Config()
        task = build_task("synthetic", cfg)
        return task, task.train_examples(
            opts.prompts or 32, random.Random(stream_seed(opts.seed, "rollout-cmd-prompts"))
        )
    path = Path(data)
    if path.suffix in (".jsonl", ".json", ".parquet") and not (opts.config or opts.overrides):
        from masktrl.tasks.math_data import make_math_task

        task = make_math_task(test=None, test_file=str(path), template=opts.template or "base")
    else:  # a math preset, or `dataset` (task.source ...), with the --config / --set task keys
        bench = data if data in BENCHMARKS or data == "dataset" else "dataset"
        if bench != "dataset":
            opts = replace(opts, template=opts.template or "base")  # math presets: the base template unless told
        task_cfg = bench_task_config(
            bench,
            cfg,
            template=opts.template,
            data=data if bench == "dataset" and data != "dataset" else None,
            config=opts.config,
            overrides=opts.overrides,
        )
        chat = eval_chat(cfg, opts)
        task = make_eval_task(
            task_cfg, replace(cfg.model, chat_template=chat), whole_split=True
        )  # every row of task.split
    examples = task.test_examples()
    return task, examples[: opts.prompts] if opts.prompts else examples
