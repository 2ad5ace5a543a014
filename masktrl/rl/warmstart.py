"""The policy RL starts from: the embedded tiny model after a short supervised warm start,
or a real checkpoint loaded as it is.

The warm start trains on (prompt, target + EOS) pairs of the task with the loss on the
target tokens only, so RL begins with non-trivial accuracy. Its result is cached under
``<out>/.cache/warmstart/<hash>/``, keyed by the model, task and warm-start settings and the
seed, so a second run (another method, the same seed) starts from the identical model.

``warmstart.json`` (written last: it marks the entry complete) records the sha256 of every
file of the entry; an entry is verified each time it is reused, and one that fails (a file
changed, missing or added, or an entry from before hashes were recorded) is rebuilt, never
trained on.
Building, verifying and loading an entry happen under a lock (``<out>/.cache/locks/``), so
runs started together never write one entry twice or read it half replaced.

With ``warmstart.target_accuracy`` the warm start stops at the first check (every
``CHECK_EVERY`` steps) whose greedy accuracy on ``CHECK_PROBLEMS`` fixed training problems
reaches the target. The lab's tiny model (``model.tokenizer: numbers``) gets the number
tokenizer and, with ``model.embedding_init: numbers``, structured number-token embeddings
(``models/numbers.py``, docs/LAB.md).
"""

from __future__ import annotations

import math
import random
import sys
import time
from pathlib import Path

import torch

from masktrl.config import Config
from masktrl.errors import ArtifactError, ConfigError
from masktrl.io import atomic_dir, atomic_write_json, sha256_file
from masktrl.models.loading import load_model_and_tokenizer, quiet_transformers
from masktrl.models.numbers import init_number_embeddings
from masktrl.models.tiny import TinyModelConfig, build_tiny_model, tiny_tokenizer
from masktrl.readers import read_json
from masktrl.rl.evaluation import heldout_accuracy
from masktrl.rl.schedule import adamw_foreach, lr_factor
from masktrl.rollout.base import SamplingSettings
from masktrl.rollout.hf import HFEngine
from masktrl.runs import locks
from masktrl.runs.store import folder_files, folder_problem, warmstart_cache

WARMSTART_VERSION = 3  # bump when the warm-start procedure changes: old cache entries are then ignored
CHECK_EVERY, CHECK_PROBLEMS = 100, 256  # warmstart.target_accuracy: how often, on how many training problems


def warmstart_key(cfg: Config) -> str:
    """The cache entry's name: the model, task and warm-start settings, the seed and, other than
    1, the thread count (it changes the reduction order, hence the weights: measured, a different
    held-out accuracy), so a run never starts from another thread count's warm start."""
    threads = "" if cfg.train.threads == 1 else f"-threads{cfg.train.threads}"
    settings = cfg.hash(
        "model", "task", "warmstart", exclude=("model.lora", "model.routing_replay")
    )  # LoRA, routing replay: after it
    return f"v{WARMSTART_VERSION}-{settings}-seed{cfg.seed}{threads}"


def prepare_policy(cfg: Config, task, out_dir: Path, progress=None):
    """Return (model, tokenizer, info) ready for RL. ``info`` says where the weights came from."""
    quiet_transformers()
    if cfg.model.path != "tiny":
        model, tokenizer = load_model_and_tokenizer(cfg.model.path, cfg.model.dtype)
        return model, tokenizer, {"source": cfg.model.path, "warmstart": None}
    cache = warmstart_cache(out_dir) / warmstart_key(cfg)
    with _entry_lock(cache):
        if (cache / "warmstart.json").is_file():
            problem = cache_problem(cache)
            if problem is None:
                model, tokenizer = load_model_and_tokenizer(cache, cfg.model.dtype)
                info = read_json(cache / "warmstart.json", error=ArtifactError, finite=False)  # verified just above
                return model, tokenizer, {**info, "cached": True, "path": str(cache)}
            print(f"warm-start cache {cache}: {problem}; building it again", file=sys.stderr, flush=True)
        return _train_entry(cfg, task, cache, progress)


def _train_entry(cfg: Config, task, cache: Path, progress=None):
    """Build the tiny model, warm-start it and store it as the cache entry
    ``cache``; (model, tokenizer, info) as reloaded."""
    m = cfg.model
    tokenizer = tiny_tokenizer(m.tokenizer, task.alphabet())
    model = new_tiny_model(cfg, tokenizer)
    if m.embedding_init == "numbers":
        init_number_embeddings(model, tokenizer)
    t0 = time.time()
    checks: list[tuple[int, float]] = []
    losses = supervised_warmstart(model, tokenizer, task, cfg, progress, checks)
    check_diverged(model, losses, cfg)
    info = {
        "source": "tiny",
        "warmstart": cfg.warmstart.__dict__,
        "final_loss": losses[-1] if losses else None,
        "steps_done": len(losses),
        "train_accuracy_checks": checks,
        "time_s": time.time() - t0,
    }
    files = _save_atomically(model, tokenizer, info, cache)
    # Reload what was stored, so a first run and a cached rerun start from identical objects.
    model, tokenizer = load_model_and_tokenizer(cache, cfg.model.dtype)
    return model, tokenizer, {**info, "files": files, "cached": False, "path": str(cache)}


def check_diverged(model, losses: list[float], cfg: Config) -> None:
    """ConfigError, before the warm start is cached, when its weights are not finite: it was
    cached, and the run stopped saying "its logits are not the linear head of its last hidden
    state (max difference nan); not supported", an architecture it does support."""
    if all(bool(torch.isfinite(p).all()) for p in model.parameters()):
        return
    step = next((i + 1 for i, v in enumerate(losses) if not math.isfinite(v)), None)
    at = f" (its loss was not finite from step {step} of {len(losses)})" if step is not None else ""
    raise ConfigError(
        f"the warm start diverged: its weights are not finite{at}; lower warmstart.lr={cfg.warmstart.lr:g} "
        "(nothing was cached)"
    )


def new_tiny_model(cfg: Config, tokenizer):
    """The tiny model of ``cfg.model`` with ``tokenizer``'s vocabulary, initialised from ``cfg.seed``
    (on the meta device too: the disk projection counts its parameters)."""
    m = cfg.model
    return build_tiny_model(tokenizer, TinyModelConfig.of(m), seed=cfg.seed, architecture=m.architecture)


def supervised_warmstart(model, tokenizer, task, cfg: Config, progress=None, checks: list | None = None) -> list[float]:
    """The supervised steps; returns their losses. With ``warmstart.target_accuracy`` it stops at
    the first check (every CHECK_EVERY steps) that reaches the target, appending each check's
    (step, accuracy) to ``checks``."""
    ws = cfg.warmstart
    if ws.steps == 0:
        return []
    rng = random.Random(f"warmstart-{cfg.seed}")
    check = _accuracy_check(model, tokenizer, task, cfg) if ws.target_accuracy is not None else None
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=ws.lr, weight_decay=0.0, foreach=adamw_foreach(params))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lr_factor("constant", ws.warmup_steps, ws.steps)
    )  # see docs/DESIGN.md
    model.train()
    losses: list[float] = []
    task_id = progress.add_task("warm start", total=ws.steps, info="") if progress else None
    for step in range(ws.steps):
        batch = task.train_examples(ws.batch_size, rng)
        input_ids, attention, labels, weights = _sft_batch(tokenizer, task, batch)
        if weights is None:
            loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        else:
            loss = weighted_target_loss(model(input_ids=input_ids, attention_mask=attention).logits, labels, weights)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if progress:
            progress.update(task_id, advance=1, info=f"loss {loss.item():.3f}")
        if check is not None and (step + 1) % CHECK_EVERY == 0:
            accuracy = check()
            model.train()
            if checks is not None:
                checks.append((step + 1, accuracy))
            if accuracy >= ws.target_accuracy:
                if progress:  # the bar ends where the warm start did, and its clock stops
                    progress.update(
                        task_id, total=step + 1, info=f"loss {loss.item():.3f}, target reached: accuracy {accuracy:.2f}"
                    )
                    progress.stop_task(task_id)
                break
    model.eval()
    return losses


def _accuracy_check(model, tokenizer, task, cfg: Config):
    """A function returning the model's greedy accuracy on CHECK_PROBLEMS training problems (a
    fixed draw of the seed, apart from the training stream; the task never draws held-out ones).

    Why: how many steps the tiny model needs before it answers well varies with the seed and with
    the CPU's floating-point kernels, and RL needs a start that is neither collapsed (all samples
    of many groups fail: no gradient) nor saturated (docs/LAB.md).
    """
    examples = task.train_examples(CHECK_PROBLEMS, random.Random(f"warmstart-check-{cfg.seed}"))
    settings = SamplingSettings(n=1, max_new_tokens=cfg.rollout.max_new_tokens, logprobs_k=1)
    engine = HFEngine(model, tokenizer, batch_size=cfg.rollout.batch_size)
    return lambda: heldout_accuracy(engine, tokenizer, task, examples, settings, greedy=True)


def _sft_batch(tokenizer, task, examples):
    """Right-padded prompt+target+EOS with labels only on target and EOS, and the targets' loss
    weights ([B, L], or None where every trained token weighs 1). A multi-turn task's target is
    its ``demonstration`` (calls, tool replies, answer): each segment tokenised on its own, as the
    rollouts append replies, and the replies (environment tokens) not trained on. A segment's
    flag is True/False (trained or not) or a weight > 0 (a task's ``weighted_target``, e.g.
    residues' ``answer_weight``: the answer among a long scratchpad)."""
    segmented = [target_segments(task, ex) for ex in examples]
    # every string of the batch in one tokenizer call (the same ids as one call per string)
    texts = [t for ex, segments in zip(examples, segmented) for t in (ex.prompt, *(text for text, _ in segments))]
    encoded = iter(tokenizer(texts, add_special_tokens=False)["input_ids"]) if texts else iter(())
    rows, label_rows, weight_rows = [], [], []
    for segments in segmented:
        p = next(encoded)
        t, labels, weights = [], [], []
        for _, trained in segments:
            ids = next(encoded)
            t += ids
            labels += ids if trained else [-100] * len(ids)
            weights += [float(trained)] * len(ids)
        rows.append(p + t + [tokenizer.eos_token_id])
        label_rows.append([-100] * len(p) + labels + [tokenizer.eos_token_id])
        weight_rows.append([0.0] * len(p) + weights + [1.0])
    return padded_batch(tokenizer.pad_token_id, rows, label_rows, weight_rows)


def padded_batch(pad: int, rows: list, label_rows: list, weight_rows: list):
    """The rows right-padded to the longest: input ids (``pad``), attention, labels (-100) and the
    weights (0; None where every weight is 0 or 1)."""
    width = max(len(r) for r in rows)
    input_ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    attention = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    labels = torch.tensor([r + [-100] * (width - len(r)) for r in label_rows])
    weighted = any(w not in (0.0, 1.0) for row in weight_rows for w in row)
    weights = torch.tensor([r + [0.0] * (width - len(r)) for r in weight_rows]) if weighted else None
    return input_ids, attention, labels, weights


def target_segments(task, example) -> list:
    """The target as (text, trained or weight) segments: a multi-turn task's demonstration, a
    weighted target where the task gives one, else the whole target, trained."""
    if hasattr(task, "demonstration"):
        return task.demonstration(example)
    weighted = task.weighted_target(example) if hasattr(task, "weighted_target") else None
    return weighted if weighted is not None else [(task.format_target(example), True)]


def weighted_target_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_t w_t CE_t / sum_t w_t over the labelled positions: each position predicts the next
    token (as transformers' causal-LM loss), each target token's cross-entropy weighted by its
    weight; with every weight 1 it is the mean transformers computes."""
    logits = logits[:, :-1].float()
    labels, weights = labels[:, 1:], weights[:, 1:]
    ce = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100, reduction="none"
    )
    w = weights.reshape(-1) * (labels.reshape(-1) != -100)
    return (ce * w).sum() / w.sum()


def _save_atomically(model, tokenizer, info: dict, dest: Path) -> dict:
    """Write the entry; returns its files' sha256 (also recorded in its warmstart.json)."""
    with atomic_dir(dest) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        files = {name: sha256_file(tmp / name) for name in folder_files(tmp)}
        atomic_write_json(
            tmp / "warmstart.json", {**info, "files": files}
        )  # written last: marks the cache entry complete
    return files


def cache_problem(entry: Path) -> str | None:
    """Why the cache entry cannot be used (a file added, changed or missing: every file of the
    entry but warmstart.json is recorded, so a tokenizer file dropped in changes nothing
    unnoticed), or None if it verifies."""
    try:
        files = read_json(entry / "warmstart.json", error=ArtifactError, finite=False).get(
            "files"
        )  # bounded: a deep file is unreadable
    except ArtifactError as exc:
        return f"warmstart.json: {str(exc).split(': ', 1)[-1]}"
    except (OSError, AttributeError):
        return "warmstart.json is unreadable"
    if not isinstance(files, dict) or not files or not all(isinstance(v, str) for v in files.values()):
        return "no file hashes recorded (an entry from an older masktrl)"
    return folder_problem(entry, files, ignore=("warmstart.json",))


def _entry_lock(entry: Path):
    """The cache entry's lock: ``<out>/.cache/locks/warmstart-<entry>.lock``
    (the warm-start folder holds entries only)."""
    return locks.cache_lock(entry.parent.parent / "locks" / f"warmstart-{entry.name}.lock")
