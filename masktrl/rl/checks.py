"""Everything ``masktrl train`` can check before it writes anything; ``--dry-run``
(``recipes/preflight.py``) runs exactly these checks, prints what it found and stops.

``check`` builds the task (its data files and fields), finds the model (a folder, or the local
hub cache) and its tokenizer without loading the weights, checks the ``train.report_to``
trackers' packages, ``rollout.logprobs_k`` against the vocabulary (vLLM), the held-out prompts
against the model's context, the launch settings (accelerate / DeepSpeed), and
``--rollouts-from`` (its manifest hashes, its schema and rows, its tokenizer, and its recorded sampling:
temperature, top-p, the engine's dtype and quantisation, against the config). A failure
raises a ``MasktrlError`` naming the file or key.
"""

from __future__ import annotations

import random
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from masktrl.config import MOE_ARCHITECTURES, Config
from masktrl.errors import ConfigError
from masktrl.rl import tracking
from masktrl.rl.distributed import deepspeed_stage
from masktrl.tasks.base import Task

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from masktrl.rl.rollout_source import RolloutSource


@dataclass
class Checked:
    """What the checks found, reused by the run so nothing is built twice."""

    task: Task
    tokenizer: PreTrainedTokenizerBase  # the policy's tokenizer (the tiny model's: built from the task's alphabet)
    vocab_size: int  # the width of the model's logits: token ids lie in [0, vocab_size)
    context: int | None  # positions the model takes (prompt + response); None: unknown
    source: RolloutSource | None = None  # --rollouts-from
    report: list[tuple[str, str]] = field(default_factory=list)  # what was checked, for --dry-run


def check(cfg: Config, *, rollouts_from: str | None = None, out: Path | None = None) -> Checked:
    """Every check that needs no write (see the module doc); returns what the run reuses."""
    from masktrl.rl.distributed import check_launch_settings
    from masktrl.tasks import make_task

    report: list[tuple[str, str]] = []
    tracking.check_available(cfg.train.report_to)  # a tracker's missing package: one line
    check_launch_settings()
    task = make_task(cfg.task, cfg.model)
    try:
        tokenizer, vocab_size, context = policy_tokenizer(cfg, task)
        report.append(("task", f"{task.name}: {len(task.test_examples())} held-out problems"))
        report.append(("model", f"{cfg.model.path} (vocabulary {vocab_size}, context {context or 'unknown'})"))
        report += _model_checks(cfg, task, tokenizer, vocab_size, context)
        source = None
        if (
            not rollouts_from
        ):  # a task with nothing to train on (a one-row dataset held out whole): one line now, not a failed run
            task.train_examples(1, random.Random(0))
        if rollouts_from:
            source = _replay_source(cfg, rollouts_from, tokenizer, vocab_size)
            report.append(("--rollouts-from", f"{rollouts_from}: {source.num_steps} batches, verified"))
    except BaseException:
        task.close()
        raise
    if split := minibatch_split_note(cfg):
        report.append(("train.minibatches", split))
    if out is not None:
        report.append(("free disk under --out", _free(out)))
    return Checked(task, tokenizer, vocab_size, context, source, report)


def minibatch_split_note(cfg: Config) -> str | None:
    """Where ``train.minibatches`` does not divide a full step's sequences into that many parts:
    the sample split cuts N sequences into parts of ceil(N / minibatches) (torch's chunk, kept so
    that existing runs continue as they began), which can make fewer updates than named (30 on
    512: 29). The line the dry run reports and a run warns with; None where the split makes the
    named number (always with ``train.minibatch_groups``, which cuts into exactly that many)."""
    if cfg.train.minibatch_groups is not False:
        return None
    n, m = cfg.rollout.prompts_per_step * cfg.rollout.n, cfg.train.minibatches
    size = -(-n // m)
    made = -(-n // size)
    if made == m:
        return None
    return (
        f"train.minibatches={m} cuts a step's {n} sequences into parts of {size} (ceil({n} / {m})): "
        f"{made} updates a step, not {m} (train.minibatches={made} makes the same split)"
    )


def _model_checks(cfg: Config, task, tokenizer, vocab_size: int, context: int | None) -> list[tuple[str, str]]:
    """The model's settings against the model, the engine and the task's held-out prompts: the
    report's lines of what is used (LoRA, truncated sampling, quantization, staleness, packing)."""
    from masktrl.tasks.prompts import wraps_chat

    report: list[tuple[str, str]] = []
    if cfg.model.lora.rank is not None:
        report.append(("lora", check_lora(cfg, tokenizer)))
    if cfg.rollout.top_p < 1.0 or cfg.rollout.top_k > 0:
        report.append(("truncated sampling", check_truncation(cfg, vocab_size)))
    if cfg.rollout.engine == "vllm" and cfg.rollout.logprobs_k > vocab_size:  # transformers records min(K, vocabulary)
        raise ConfigError(
            f"rollout.logprobs_k={cfg.rollout.logprobs_k} exceeds the model's vocabulary "
            f"({vocab_size}): "
            "the vllm engine cannot record that many entries per token"
        )
    report.extend(check_routing_replay(cfg, tokenizer))
    check_engine(cfg)
    if cfg.rollout.engine == "vllm":
        from masktrl.rollout.vllm import check_head_dim

        check_head_dim(meta_model(cfg, tokenizer).config)
    if cfg.train.quantization is not None:
        report.append(("train.quantization", check_train_quantization(cfg)))
    if isinstance(cfg.rollout.staleness, dict):
        report.append(("rollout.staleness", staleness_line(cfg.rollout.staleness)))
    if cfg.rollout.partial is not None:
        report.append(("rollout.partial", check_partial(cfg)))
    if cfg.train.packing:
        check_packing(cfg)
        report.append(("train.packing", "the model's attention can mask packed sequences"))
    check_response_room(f"rollout.max_new_tokens={cfg.rollout.max_new_tokens}", cfg.rollout.max_new_tokens, context)
    if context is not None:
        check_prompt_lengths(
            task.test_examples(),
            tokenizer,
            wraps_chat(task, cfg.model.chat_template),
            context - cfg.rollout.max_new_tokens,
            what=f"task {task.name}: held-out prompts",
            room=f"{context} positions less rollout.max_new_tokens={cfg.rollout.max_new_tokens}",
        )
    return report


def _replay_source(cfg: Config, rollouts_from: str, tokenizer, vocab_size: int):
    """``--rollouts-from``: the stored batches, checked against the run's sampling settings."""
    from masktrl.rl.rollout_source import RolloutSource

    source = RolloutSource(
        rollouts_from, cfg.rollout.prompts_per_step, tokenizer, vocab_size=vocab_size, steps=cfg.train.steps
    )
    m = source.meta
    if float(m.get("top_p", 1.0)) < 1.0 and "top_k" not in m:  # before kept sets were recorded
        raise ConfigError(top_p_refusal(f"--rollouts-from {rollouts_from} was sampled with top_p={m['top_p']}"))
    if float(m.get("top_p", 1.0)) < 1.0 or int(m.get("top_k", 0) or 0) > 0:
        kept_set_bound(
            f"--rollouts-from {rollouts_from} was sampled with top_p={m.get('top_p')}, top_k={m.get('top_k')}",
            m.get("engine", "hf"),
            int(m.get("top_k", 0) or 0),
            int(m.get("logprobs_k", 0) or 0),
            vocab_size,
        )
    source.check_sampled_as(cfg, rollouts_from)  # pi at the temperature mu was sampled at
    check_replay_source(cfg, source, rollouts_from)
    return source


def check_engine(cfg: Config) -> None:
    """``rollout.engine``'s package is installed on this machine (vLLM is imported only when its
    engine is built, long after the run folder is written): one line otherwise."""
    import importlib.util

    if cfg.rollout.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        from masktrl.rollout.vllm import NOT_INSTALLED

        raise ConfigError(f"rollout.engine=vllm: {NOT_INSTALLED}")


def check_start(plan, checked: Checked, dist, start: int) -> None:
    """Before a resumed run writes anything: checkpoint ``start`` of ``plan``'s run fits this
    launch (its DeepSpeed state) and, with ``--resume --force``, the model the new config builds
    (``check_checkpoint``). Nothing to check without a checkpoint."""
    if not start:
        return
    from masktrl.rl.train_state import check_resumable
    from masktrl.runs.store import RunStore

    path = RunStore(plan.root, writable=False).checkpoint_dir(start)
    check_resumable(path, dist)
    if plan.forced_changes:
        check_checkpoint(plan.cfg, checked.tokenizer, path)


def check_checkpoint(cfg: Config, tokenizer, path: Path) -> None:
    """The checkpoint at ``path`` loads into the policy ``cfg`` builds (``--resume --force`` with a
    changed ``model.*`` or task): LoRA adapters on both sides or on neither, and every tensor of
    the same name and shape, compared on the meta device (no weights are read). ConfigError
    naming the first difference otherwise, before anything is written."""
    from masktrl.models.lora import apply_lora, is_adapter_folder, read_adapter

    adapters = is_adapter_folder(path)
    rank = cfg.model.lora.rank
    if adapters != (rank is not None):
        held = "LoRA adapters" if adapters else "the full weights (no LoRA adapters)"
        raise ConfigError(
            f"model.lora.rank={rank if rank is not None else 'null'}: checkpoint {path.name} holds "
            f"{held}, "
            "which this model cannot load; --resume it with its own model.lora "
            "(nothing was changed)"
        )
    model = meta_model(cfg, tokenizer)
    if adapters:
        apply_lora(model, lora_settings(cfg), seed=cfg.seed)
        try:
            stored = {k: tuple(v.shape) for k, v in read_adapter(path)[2].items()}
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        own = {k: tuple(v.shape) for k, v in model.state_dict().items() if ".lora_" in k}
    else:
        stored = {k: tuple(v.shape) for k, v in _meta_checkpoint(path).state_dict().items()}
        own = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    differ = sorted(k for k in own.keys() | stored.keys() if own.get(k) != stored.get(k))
    if differ:
        key = differ[0]
        there, here = (list(d[key]) if key in d else "absent" for d in (stored, own))
        raise ConfigError(
            f"checkpoint {path.name} does not fit the model this config builds: {key} is {there} "
            f"there, {here} here "
            f"({len(differ)} tensors differ; a change of model.* or of the task's "
            "vocabulary cannot resume a "
            "checkpoint): --resume it with its own model and task (nothing was "
            "changed)"
        )


def _meta_checkpoint(path: Path):
    """A full checkpoint's model built from its own config.json on the meta device (what
    ``train_state.restore`` loads, without the weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    from masktrl.models.loading import load_model_config

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(load_model_config(path))


def check_train_quantization(cfg: Config) -> str:
    """``train.quantization``: the kernels it runs with exist here (``training_backend``) and the
    launch can carry it (not ZeRO-3, whose partitioned weights the FP8 hooks cannot read);
    returns the report line."""
    from masktrl.models.lowprec import training_backend

    t = cfg.train
    kind = training_backend(t.quantization, t.quantization_backend)
    if kind == "torchao" and cfg.model.path == "tiny" and cfg.model.architecture in MOE_ARCHITECTURES:
        raise ConfigError(
            "train.quantization_backend=torchao: torchao's float8 training covers linear layers, not "
            "a MoE "
            "block's fused experts (use fake)"
        )
    if deepspeed_stage() == 3:
        raise ConfigError(
            "train.quantization under DeepSpeed ZeRO-3: the FP8 forward reads whole weights, which "
            "ZeRO-3 "
            "partitions (use ZeRO-2 or DDP)"
        )
    how = (
        "fake-quantised (FP8 round trip in model.dtype, straight-through gradients)"
        if kind == "fake"
        else "torchao float8 training"
    )
    return f"{t.quantization}, {how}"


def check_routing_replay(cfg: Config, tokenizer) -> list[tuple[str, str]]:
    """``model.routing_replay``: the model has MoE layers whose routers can be replayed, the
    engine records routing (hf; vLLM cannot report it), and the training forward's layout allows
    it (no packing, no activation checkpointing); returns the report's line ([] when off)."""
    from masktrl.models.moe import NO_ROUTING, moe_routers

    if cfg.model.routing_replay is None:
        return []
    what = f"model.routing_replay={cfg.model.routing_replay}"
    if cfg.model.path == "tiny" and cfg.model.architecture not in MOE_ARCHITECTURES:
        raise ConfigError(
            f"{what}: model.architecture={cfg.model.architecture} is dense: routing replay needs a "
            f"mixture-of-experts model ({', '.join(MOE_ARCHITECTURES)})"
        )
    if cfg.rollout.engine != "hf":
        raise ConfigError(f"{what}: rollout.engine={cfg.rollout.engine}: {NO_ROUTING}")
    if cfg.train.packing:
        raise ConfigError(f"{what}: the replayed forward runs whole prompt+response rows; set train.packing=false")
    if cfg.train.gradient_checkpointing:
        raise ConfigError(
            f"{what}: activation checkpointing re-runs the routers outside the replay; "
            "set train.gradient_checkpointing=false"
        )
    routers = moe_routers(meta_model(cfg, tokenizer))
    if not routers:
        raise ConfigError(
            f"{what}: {cfg.model.path} is dense (no MoE routers): routing replay needs a mixture-of-experts model"
        )
    k = routers[0][2]
    return [
        (
            "model.routing_replay",
            f"the hf engine records the top-{k} experts of {len(routers)} MoE layers; training replays them",
        )
    ]


def check_replay_source(cfg: Config, source, spec: str) -> None:
    """Routing replay trains only on ``--rollouts-from`` batches that record the engine's routing."""
    if cfg.model.routing_replay is not None and not source.has_routing():
        raise ConfigError(
            f"model.routing_replay=rollout: --rollouts-from {spec} has no recorded routing "
            "(its batches were sampled without model.routing_replay)"
        )


def check_partial(cfg: Config) -> str:
    """``rollout.partial`` against the rest of the run (ConfigError otherwise): single-turn (an
    episode's tool turns have no decode position to switch at), no routing replay (the prefix's
    routing would come from the older copy), one process (the older policy is a copy of the whole
    model); ``--dry-run``'s line."""
    from masktrl.rl.distributed import launched

    for clash, why in (
        (cfg.task.env is not None, "task.env (multi-turn episodes)"),
        (cfg.model.routing_replay is not None, "model.routing_replay"),
        (launched(), "several processes (accelerate launch)"),
    ):
        if clash:
            raise ConfigError(f"rollout.partial cannot be combined with {why}")
    return (
        f"a weight sync lands in {cfg.rollout.partial:g} of the batches sampled ahead, at a decode "
        f"position in 1..{cfg.rollout.max_new_tokens - 1} drawn from the seed (column version; "
        "metrics rollout_token_age_*)"
    )


def staleness_line(value: dict) -> str:
    """``--dry-run``'s line for rollout.staleness as a distribution."""
    from masktrl.rl.schedule import staleness_spec

    spec = staleness_spec(value)
    shape = f", p = {spec['p']:g}" if spec["dist"] == "geometric" else ""
    return (
        f"{spec['dist']} batch ages {spec['min']}..{spec['max']}{shape}, drawn per step from the "
        "seed "
        "(metrics rollout_age)"
    )


def top_p_refusal(what: str) -> str:
    """The one line that refuses training on nucleus-sampled rollouts that do not record their
    kept sets (files written before they were recorded; docs/ROLLOUTS.md)."""
    return (
        f"{what} without recording each token's kept set: training on it needs top_p = 1 (the "
        "behaviour mu is the "
        "renormalised nucleus, and pi cannot be renormalised over a set that is not recorded)"
    )


def check_truncation(cfg: Config, vocab_size: int) -> str:
    """Truncated sampling (``rollout.top_p`` < 1 or ``rollout.top_k``) can be trained on without
    bias only if each token's kept set is a prefix of its recorded top-K list, i.e. holds at most
    K = ``rollout.logprobs_k`` tokens: refused up front otherwise (a nucleus can hold any number of
    tokens: bounded by top_k, or by the vocabulary). The vllm engine's kept sets are not read
    back: refused. Returns the report line."""
    r = cfg.rollout
    what = ", ".join(
        f
        for f in (f"rollout.top_p={r.top_p}" if r.top_p < 1.0 else "", f"rollout.top_k={r.top_k}" if r.top_k else "")
        if f
    )
    bound = kept_set_bound(what, r.engine, r.top_k, r.logprobs_k, vocab_size)
    return (
        f"{what}: kept sets of at most {bound} tokens, recorded as top-K prefixes; pi renormalised over "
        "them in training"
    )


def kept_set_bound(what: str, engine: str, top_k: int, logprobs_k: int, vocab_size: int) -> int:
    """The most tokens a kept set of this sampling can hold; ConfigError (starting with ``what``)
    when that is more than the recorded top-K list holds, or the engine is not hf."""
    if engine != "hf":
        raise ConfigError(
            f"{what}: training records each token's kept set with the hf engine only (rollout.engine={engine})"
        )
    bound = min(top_k, vocab_size) if top_k else vocab_size
    k = min(logprobs_k, vocab_size)
    if bound > k:
        raise ConfigError(
            f"{what}: a kept set can hold {bound} tokens, more than the {k} of the recorded top-K "
            "list, which is "
            "where training reads it from: set rollout.top_k <= "
            f"rollout.logprobs_k={logprobs_k}"
        )
    return bound


def check_packing(cfg: Config) -> None:
    """ConfigError when ``train.packing`` is on and the policy's architecture cannot mask packed
    sequences (models/packing.py: ``config_unsupported_reason``), read from its config without the
    weights. An architecture whose class is not known here is checked once loaded
    (``packing_unsupported``)."""
    from masktrl.models.packing import config_unsupported_reason

    reason = config_unsupported_reason(cfg.model)
    if reason:
        raise ConfigError(f"train.packing: {reason}; set train.packing=false")


def policy_tokenizer(cfg: Config, task) -> tuple[object, int, int | None]:
    """(tokenizer, vocabulary size, context length) of the policy, without its weights: the tiny
    model's tokenizer (``model.tokenizer``: characters or numbers), or the model folder / hub
    cache entry's tokenizer and config."""
    if cfg.model.path == "tiny":
        from masktrl.models.tiny import TinyModelConfig, tiny_tokenizer

        alphabet = task.alphabet()
        if alphabet is None and cfg.model.tokenizer in ("char", "words"):
            raise ConfigError(
                f"model.path=tiny builds a {'word' if cfg.model.tokenizer == 'words' else 'character'} tokenizer "
                "from the task's alphabet, and task "
                f"{task.name} has none: "
                "set model.path to a model folder or hub id"
            )
        tokenizer = tiny_tokenizer(cfg.model.tokenizer, alphabet)
        return tokenizer, len(tokenizer), TinyModelConfig.of(cfg.model).max_positions
    from masktrl.models.loading import load_model_config, load_tokenizer

    tokenizer = load_tokenizer(cfg.model.path)
    config = load_model_config(cfg.model.path)
    vocab = max(getattr(config, "vocab_size", None) or 0, len(tokenizer))
    return tokenizer, vocab, getattr(config, "max_position_embeddings", None)


def check_prompt_lengths(examples, tokenizer, chat_template: bool, limit: int, *, what: str, room: str) -> None:
    """ConfigError when any prompt is longer than ``limit`` tokens (the model's context less the
    response length: ``room`` says so), with how many and the longest."""
    too_long = prompts_too_long(examples, tokenizer, chat_template, limit)
    if too_long:
        worst = max(too_long, key=lambda ex: len(ex.prompt))
        raise ConfigError(
            f"{what}: {len(too_long)} of {len(examples)} are longer than the model's context "
            f"allows ({limit} tokens: {room}); "
            f"the longest, {worst.id}, has {len(worst.prompt)} characters; drop such prompts "
            "(task.max_prompt_tokens) or "
            "shorten rollout.max_new_tokens"
        )


def prompts_too_long(examples, tokenizer, chat_template: bool, limit: int) -> list:
    """The examples whose prompt is longer than ``limit`` tokens. A text with more than 64
    characters per allowed token is not tokenized at all (no tokenizer packs that many into
    one token): a megabyte of text would take seconds to encode only to be refused."""
    from masktrl.tasks import encode_prompt

    return [
        ex
        for ex in examples
        if len(ex.prompt) > 64 * max(limit, 1) or len(encode_prompt(tokenizer, ex.prompt, chat_template)) > limit
    ]


def fit_context(examples: list, tokenizer, chat_template: bool, context: int | None) -> tuple[list, int]:
    """(the examples whose prompt leaves room for a response in the model's ``context``, how many
    were left out); ConfigError if none is left. ``masktrl eval`` reports the count."""
    if not context:
        return examples, 0
    too_long = {id(ex) for ex in prompts_too_long(examples, tokenizer, chat_template, context - 1)}
    kept = [ex for ex in examples if id(ex) not in too_long]
    if not kept:
        raise ConfigError(
            f"all {len(examples)} problems have prompts longer than the model's context ({context} positions)"
        )
    return kept, len(examples) - len(kept)


def fit_default_length(length: int, examples: list, tokenizer, chat_template: bool, context: int | None) -> int:
    """A default response length (one the user did not give: eval's 4096 on a math benchmark,
    rollout's 1024) cut to the room the model's ``context`` leaves after the longest prompt of
    ``examples``, with a warning line on stderr when it is cut; ``length`` as it is when the context
    is unknown or no prompt fits (those are refused elsewhere). A length given as a flag is
    checked instead (``check_response_room``), never cut."""
    if not context or not examples:
        return length
    from masktrl.tasks import encode_prompt

    longest = max(len(encode_prompt(tokenizer, ex.prompt, chat_template)) for ex in examples)
    room = context - longest
    if room < 1 or length <= room:
        return length
    print(
        f"warning: the default response length {length} is cut to {room} tokens: the model's context is "
        f"{context} positions and the longest prompt {longest} tokens (--max-new-tokens sets it)",
        file=sys.stderr,
        flush=True,
    )
    return room


def check_response_room(given: str, max_new_tokens: int, context: int | None) -> None:
    """ConfigError when ``max_new_tokens`` (``given``: the key or flag as the user wrote it) fills
    the model's ``context``: no prompt fits before such a response, and one that long runs past
    the positions the model has (nothing stops it there)."""
    if context is not None and max_new_tokens >= context:
        raise ConfigError(f"{given} leaves no room for a prompt in the model's context ({context} positions)")


def model_context(weights: str) -> int | None:
    """The context length (positions) of a model folder or cached hub id, from its config."""
    from masktrl.models.loading import load_model_config

    return getattr(load_model_config(weights), "max_position_embeddings", None)


def meta_model(cfg: Config, tokenizer):
    """The policy built on the meta device (its modules and shapes, no weights)."""
    import torch

    with torch.device("meta"):
        if cfg.model.path == "tiny":
            from masktrl.rl.warmstart import new_tiny_model

            return new_tiny_model(cfg, tokenizer)
        from transformers import AutoModelForCausalLM

        from masktrl.models.loading import load_model_config

        return AutoModelForCausalLM.from_config(load_model_config(cfg.model.path))


def check_lora(cfg: Config, tokenizer) -> str:
    """``model.lora``: peft is installed and every target module exists in the policy (one line
    otherwise, before anything is written); returns the report line."""
    from masktrl.models.lora import import_peft, resolve_targets

    settings = lora_settings(cfg)
    settings.check()
    import_peft()
    targets = resolve_targets(meta_model(cfg, tokenizer), settings)
    return f"rank {settings.rank}, alpha {settings.alpha:g} on {', '.join(targets)}"


def lora_settings(cfg: Config):
    """``model.lora`` as ``models.lora.LoraSettings``."""
    from masktrl.models.lora import LoraSettings

    return LoraSettings.from_config(cfg.model.lora)


def projected_disk(cfg: Config, checked: Checked) -> str:
    """The disk a run of ``cfg`` will use at most (``retention.project``), for ``--dry-run``:
    the policy's parameters are counted on a model built on the meta device (no weights); a LoRA
    run's checkpoints hold its adapters only."""
    from masktrl.runs import retention

    model = meta_model(cfg, checked.tokenizer)
    if cfg.model.lora.rank is not None:
        from masktrl.models.lora import apply_lora

        apply_lora(model, lora_settings(cfg), seed=cfg.seed)
    n_params = retention.count_parameters(model, trainable_only=cfg.model.lora.rank is not None)
    projection = retention.project(cfg, n_params, deepspeed_stage=deepspeed_stage())
    return projection.summary().removeprefix("projected disk: ")


def _free(out: Path) -> str:
    for parent in [Path(out), *Path(out).parents]:
        if parent.exists():
            return f"{shutil.disk_usage(parent).free / 1e9:.1f} GB"
    return "unknown"
