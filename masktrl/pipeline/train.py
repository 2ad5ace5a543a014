"""``masktrl train``: warm start, then rollout -> reward -> advantages -> update, step after step.

The loop reads top to bottom. Every random draw comes from a stream named by (seed, purpose,
step), so a resumed run reproduces an uninterrupted one; every artifact is written
atomically and recorded in the manifest only once complete.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from masktrl.config import Config, save_config
from masktrl.methods import get_method, make_params
from masktrl.pipeline import checkpoint as ckpt
from masktrl.pipeline.evaluate_task import heldout_accuracy
from masktrl.pipeline.rl import generate_groups, policy_update, sampling_settings, set_group_advantages, stream_seed
from masktrl.pipeline.store import RunStore, atomic_write_json
from masktrl.pipeline.warmstart import prepare_policy
from masktrl.rollout import make_engine
from masktrl.rollout.storage import write_rollouts
from masktrl.pipeline.tasks import make_task

MAX_REFILLS = 4  # dynamic sampling: rollout attempts per step before training on what was kept


@dataclass
class TrainResult:
    summary: dict
    store: RunStore


def run(cfg: Config, store: RunStore, progress=None) -> TrainResult:
    t_start = time.time()
    torch.set_num_threads(cfg.train.threads)
    torch.manual_seed(cfg.seed)
    store.root.mkdir(parents=True, exist_ok=True)
    save_config(cfg, store.root / "run.yaml")
    store.set_info(method=cfg.method_name, seed=cfg.seed, steps_planned=cfg.train.steps, status="running")

    task = make_task(cfg)
    model, tokenizer, ws_info = prepare_policy(cfg, task, store.root.parent, progress)
    store.mark_done("warmstart", [], config_hash=cfg.hash("model", "task", "warmstart"), info=ws_info)
    method = get_method(cfg.method_name)
    params = make_params(cfg.method_name, **cfg.method_params)
    engine = make_engine(cfg, model, tokenizer, ws_info.get("path", cfg.model.path))
    optimizer, scheduler = make_optimizer(model, cfg)
    settings = sampling_settings(cfg)
    test_set = task.test_examples()

    eval_before = heldout_accuracy(engine, tokenizer, task, test_set, settings, cfg.eval.greedy, seed=cfg.seed)
    store.mark_done("eval/before", [], accuracy=eval_before)
    bar = progress.add_task("RL", total=cfg.train.steps, info="") if progress else None
    for step in range(1, cfg.train.steps + 1):
        t0 = time.time()
        groups, gen_stats = collect_rollouts(engine, tokenizer, task, settings, method, params, cfg, step)
        samples = [s for g in groups for s in g]
        rollout_path = store.step_dir(step) / "rollouts.parquet"
        write_rollouts(rollout_path, samples, {"step": step, "engine": engine.name, **settings.__dict__})
        store.mark_done(f"step/{step:06d}/rollout", [rollout_path])
        t_rollout = time.time() - t0

        stats = policy_update(model, optimizer, scheduler, samples, method, params, cfg, cfg.seed, step) if samples else {}
        engine.sync_weights(model)
        store.mark_done(f"step/{step:06d}/train", [])

        n_tokens = sum(len(s.gen.response_ids) for g in gen_stats["all"] for s in g)
        row = {
            "step": step,
            **{k: v for k, v in gen_stats.items() if k != "all"},
            **stats,
            "clip_frac": stats.get("mask_frac"),
            "rollout_time_s": t_rollout,
            "step_time_s": time.time() - t0,
            "tokens_per_s": n_tokens / (time.time() - t0),
            "lr": scheduler.get_last_lr()[0],
        }
        if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step < cfg.train.steps:
            row["eval/heldout/accuracy"] = heldout_accuracy(
                engine, tokenizer, task, test_set, settings, cfg.eval.greedy, seed=cfg.seed
            )
        store.append_metrics(row)
        if step % cfg.train.checkpoint_every == 0 or step == cfg.train.steps:
            path = ckpt.save(store.checkpoint_dir(step), model, tokenizer, optimizer, scheduler, step)
            store.mark_done(f"checkpoint/{step:06d}", [path])
        if progress:
            progress.update(bar, advance=1, info=f"reward {row['reward_mean']:.3f}  {row['tokens_per_s']:.0f} tok/s")

    eval_after = heldout_accuracy(engine, tokenizer, task, test_set, settings, cfg.eval.greedy, seed=cfg.seed)
    store.mark_done("eval/after", [], accuracy=eval_after)
    summary = {
        "run": store.name,
        "method": cfg.method_name,
        "method_params": params.__dict__,
        "seed": cfg.seed,
        "steps": cfg.train.steps,
        "eval_before": eval_before,
        "eval_after": eval_after,
        "eval_split": f"{task.name} held-out, n={len(test_set)}",
        "eval_decoding": "greedy" if cfg.eval.greedy else f"sampled (T={cfg.rollout.temperature})",
        "warmstart": {k: ws_info.get(k) for k in ("source", "cached", "time_s", "final_loss")},
        "wall_time_s": time.time() - t_start,
    }
    atomic_write_json(store.root / "summary.json", summary)
    store.mark_done("summary", [store.root / "summary.json"])
    store.set_info(status="complete")
    return TrainResult(summary, store)


def make_optimizer(model, cfg: Config):
    t = cfg.train
    optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr, weight_decay=t.weight_decay, betas=(0.9, 0.999))
    updates_per_step = t.minibatches
    warmup = t.warmup_steps * updates_per_step
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, (i + 1) / warmup) if warmup else 1.0)
    return optimizer, scheduler


def collect_rollouts(engine, tokenizer, task, settings, method, params, cfg: Config, step: int):
    """One step's rollout batch: prompts_per_step groups with advantages.

    With dynamic sampling (DAPO), groups whose rewards are all equal carry no signal and are
    dropped, and more prompts are generated (up to MAX_REFILLS attempts) to refill the batch.
    """
    want = cfg.rollout.prompts_per_step
    dynamic = method.dynamic_sampling(params)
    kept, generated = [], []
    for attempt in range(MAX_REFILLS if dynamic else 1):
        rng = random.Random(stream_seed(cfg.seed, "prompts", step, attempt))
        examples = task.train_examples(want, rng)
        groups = generate_groups(
            engine, tokenizer, task, examples, settings, stream_seed(cfg.seed, "rollout", step, attempt),
            cfg.model.chat_template,
        )
        generated.extend(groups)
        for group in groups:
            method.shape_rewards(params, group, settings.max_new_tokens)
            if dynamic and len({s.reward for s in group}) == 1:
                continue
            set_group_advantages(group)
            kept.append(group)
        if len(kept) >= want:
            break
    kept = kept[:want]
    for g, group in enumerate(kept):
        for s in group:
            s.group = g
    all_samples = [s for g in generated for s in g]
    stats = {
        "all": generated,
        "reward_mean": sum(s.extra["score"] for s in all_samples) / len(all_samples),
        "response_len_mean": sum(len(s.gen.response_ids) for s in all_samples) / len(all_samples),
        "groups_kept": len(kept),
        "groups_generated": len(generated),
    }
    return kept, stats
