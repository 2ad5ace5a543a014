"""masktrl vs TRL's GRPOTrainer on identical work: steps/s and generated tokens/s.

Both sides, in one process, alternating blocks (masktrl, TRL, TRL, masktrl, ...):

* the same model: the tiny Qwen3 that ``masktrl train`` warm-starts (configs/tiny.yaml),
  saved once; each block loads a fresh copy from that folder;
* the same character tokenizer (saved with the model) and the same prompts in the same
  order: the 3-digit additions masktrl draws for steps 1..N, given to TRL as its dataset
  with ``shuffle_dataset=False``;
* the same reward: masktrl's arithmetic scorer (``ArithmeticTask.score_many``);
* the same batch: ``--prompts`` prompts x ``--group`` samples per step, one optimizer update
  per step (TRL: per_device_train_batch_size = prompts x group, gradient_accumulation_steps=1,
  num_iterations=1; masktrl: train.minibatches=1), ``--max-new-tokens`` completion tokens,
  temperature 1, top_p 1, no top-k filtering;
* the same loss: DAPO's clipped per-token loss with clip-higher (eps 0.2 / 0.28), token-mean
  over the batch (TRL ``loss_type="dapo"``, ``beta=0``: no reference model), group-normalised
  advantages, no dynamic sampling and no overlong shaping on either side (TRL has neither);
* the same optimizer: AdamW (betas 0.9/0.999, no weight decay), constant learning rate,
  grad-norm clip 1.0; the same torch thread count;
* on CPU, float32, transformers ``generate`` with KV cache on both sides (TRL: no vLLM,
  ``use_cpu=True``, ``bf16=False``, ``gradient_checkpointing=False``).

What differs, and is reported, not hidden: masktrl records the behaviour log-probability of
every sampled token and its top-K list (``--k``, default 20 as in the preset) during
generation and recomputes log pi at the sampled and top-K ids; TRL records nothing during
generation and, on-policy, uses the detached current log-probabilities as the old ones.
masktrl writes each step's rollout parquet, manifest and metrics line (included in its
timing); TRL logs one metrics dict per step (``logging_steps=1``, in memory) and saves
nothing. Checkpoints are outside the timed steps on both sides.

Timed steps: each block runs N = steps + 2 steps; the first step of a block (warm-up) and the
last (masktrl's final checkpoint; TRL's last step has no following mark) are not counted.
A step is one iteration of the trainer's own loop: for masktrl, between two progress
updates of ``train.train``; for TRL, between two ``on_step_begin`` callbacks (generation,
reward, loss, backward, optimizer, logging and fetching the next batch).

    .venv-bench/bin/python benchmarks/vs_trl.py --json outputs/bench/vs_trl.json

``--shape long`` runs the same comparison on the long shape (benchmarks/long_shape.py): the
``longtail`` task (prompts of 64-256 tokens, responses of 32-512 with a log-normal length), an
11 M-parameter model, 2 prompts x 8 samples per step, ``max_new_tokens`` 512; masktrl trains
with the packed forward (``train.packing``, ``train.micro_batch_tokens``). ``--ablate`` adds
masktrl with packing off, with prompt sharing off, and with both off; ``--drop-finished`` adds
masktrl generating with ``rollout.drop_finished=true`` (its own decode loop, in which ended
responses leave the batch).

    .venv-bench/bin/python benchmarks/vs_trl.py --shape long --ablate --json outputs/bench/vs_trl_long.json
    .venv-bench/bin/python benchmarks/vs_trl.py --shape long --drop-finished --json outputs/bench/vs_trl_long_drop.json

``--shape both`` runs the default shape and then the long shape in one run and writes one JSON
(``shapes``: each shape's result, with the command, the load and the machine); the long shape
then also runs masktrl with its default settings (``masktrl, the defaults``: nothing set, so
``auto`` packs the training forward and drops finished rows at 512 new tokens) and with both off
(``masktrl, no packing``: the defaults before ``auto``). Each shape's ``default_cpu_time_ratio``
is TRL's CPU time per step over masktrl's with the settings a user gets (issue #39's goals: >= 2x
at the default shape, >= 2.5x at the long shape; a busy machine inflates wall time, not CPU
time). docs/BENCHMARKS.md §1's table is generated from it:

    python benchmarks/vs_trl.py --shape both --drop-finished --json benchmarks/results/vs_trl.json
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

from common import (
    BENCH_TMP,
    PhaseTimer,
    bench_config,
    count,
    die,
    finish,
    group_phases,
    machine,
    median,
    parser,
    print_table,
    quiet,
    run_masktrl,
    warm_model,
    wrap_common_phases,
    wrap_masktrl_phases,
    wrap_trl_phases,
    write_json,
)

GOALS = {"default": 2.0, "long": 2.5}  # issue #39's: CPU time per step against TRL's, with the defaults a user gets
DEFAULT_SIDE = {
    "default": "masktrl",
    "long": "masktrl-defaults",
}  # the long shape's "masktrl" side packs by a token budget; its defaults side sets nothing (auto packs, drops rows)
LONG_MICRO_BATCH_TOKENS = 8192  # the long shape's packed micro-batch budget: a step's batch in one pass, as TRL does

# masktrl sides: name -> (prompt sharing, packing)
SIDES = {
    "masktrl": (True, True),
    "masktrl-unpacked": (True, False),
    "masktrl-unshared": (False, True),
    "masktrl-neither": (False, False),
    "masktrl-dropfinished": (True, True),  # masktrl with rollout.drop_finished=true
    "masktrl-defaults": (True, True),  # the long shape with nothing set: auto turns packing and drop_finished on
}
EXTRA_SIDES = ("masktrl-defaults", "masktrl-unpacked", "masktrl-unshared", "masktrl-neither", "masktrl-dropfinished")
LABELS = {
    "masktrl": "masktrl",
    "masktrl-unpacked": "masktrl, no packing",
    "masktrl-unshared": "masktrl, no prompt sharing",
    "masktrl-neither": "masktrl, neither",
    "masktrl-dropfinished": "masktrl, drop_finished",
    "masktrl-defaults": "masktrl, the defaults",
    "trl": "TRL",
}


def main(argv=None) -> dict:
    p = parser(__doc__.split("\n")[0])
    p.add_argument(
        "--shape",
        choices=("default", "long", "both"),
        default="default",
        help="default: the tiny preset's arithmetic; long: long prompts and heavy-tailed responses (long_shape.py); "
        "both: the two in turn, in one run and one JSON (with the long shape's default-settings side)",
    )
    p.add_argument(
        "--reps", type=count, default=None, help="blocks per side, alternating (ABBA order); default 4 (long: 2)"
    )
    p.add_argument("--steps", type=count, default=None, help="timed steps per block; default 6 (long: 1)")
    p.add_argument(
        "--prompts", type=int, default=None, help="prompts per step (rollout.prompts_per_step); default 32 (long: 2)"
    )
    p.add_argument("--group", type=int, default=8, help="samples per prompt (rollout.n, TRL num_generations)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="completion length limit; default 6 (long: 512)")
    p.add_argument("--k", type=int, default=20, help="masktrl's recorded top-K (rollout.logprobs_k)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--no-phases", action="store_true", help="do not time the stages inside each step")
    p.add_argument(
        "--ablate-sharing",
        action="store_true",
        help="add a side: masktrl with its per-group prompt sharing (generation prefill "
        "and "
        "training forward) switched off, i.e. every sequence runs its prompt, as "
        "TRL does",
    )
    p.add_argument(
        "--ablate",
        action="store_true",
        help="add masktrl with packing off, with prompt sharing off, and with both off (packing: --shape long only)",
    )
    p.add_argument(
        "--drop-finished",
        action="store_true",
        help="add masktrl with rollout.drop_finished=true (its own decode loop: ended responses leave the batch)",
    )
    args = p.parse_args(argv)
    quiet()
    try:
        import trl  # noqa: F401
    except ImportError:
        die("vs_trl needs TRL: pip install -e '.[bench]' (see docs/BENCHMARKS.md §1)")
    if args.shape != "both":
        result = compare(args, args.shape)
        write_json(args.json, result)
        return result
    load_start = os.getloadavg()[0]
    shapes = {shape: compare(args, shape, defaults_side=True) for shape in ("default", "long")}
    return finish("vs_trl.py", argv, load_start, args.json, shapes=shapes)


def compare(args, shape: str, defaults_side: bool = False) -> dict:
    """One shape's comparison (``args``' unset sizes take the shape's defaults); with
    ``defaults_side`` the long shape also runs masktrl with its default settings (nothing set:
    ``auto`` packs and drops finished rows there) and with both off (the defaults before ``auto``)."""
    args = argparse.Namespace(**vars(args), shape_run=shape)
    long = shape == "long"
    defaults = {"reps": (4, 2), "steps": (6, 1), "prompts": (32, 2), "max_new_tokens": (6, 512)}
    for key, (short_value, long_value) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, long_value if long else short_value)

    n_steps = args.steps + 2
    common = [
        "method.name=dapo",
        "method.dynamic_sampling=false",
        f"rollout.prompts_per_step={args.prompts}",
        f"rollout.n={args.group}",
        f"rollout.max_new_tokens={args.max_new_tokens}",
        f"rollout.logprobs_k={args.k}",
        f"train.steps={n_steps}",
        f"train.checkpoint_every={n_steps}",
        "train.minibatches=1",
        f"train.lr={args.lr}",
        f"train.threads={args.threads}",
    ]
    if long:
        from long_shape import follow_target_lengths, long_config, long_model, param_count

        model_dir = long_model()
        cfg = long_config(
            model_dir,
            *common,
            "train.packing=true",
            f"train.micro_batch_tokens={LONG_MICRO_BATCH_TOKENS}",
            "rollout.drop_finished=false",
        )
        cfg_defaults = long_config(model_dir, *common)  # nothing set: auto's choices (one packed micro-batch)
        cfg_unpacked = long_config(  # the defaults before auto: one padded micro-batch, the fixed-batch loop
            model_dir, *common, "train.packing=false", "rollout.drop_finished=false"
        )
        cfg_drop = long_config(
            model_dir,
            *common,
            "train.packing=true",
            f"train.micro_batch_tokens={LONG_MICRO_BATCH_TOKENS}",
            "rollout.drop_finished=true",
        )
    else:
        base = bench_config(f"train.threads={args.threads}")
        model_dir = warm_model(base)  # the tiny preset's warm start, cached under outputs/.cache
        cfg = bench_config(
            f"model.path={model_dir}", *common, "task.n_test=32"
        )  # eval before/after is not timed; keep it short
        cfg_unpacked = cfg_defaults = cfg
        cfg_drop = bench_config(f"model.path={model_dir}", *common, "task.n_test=32", "rollout.drop_finished=true")
    dataset_rows = masktrl_prompts(cfg, n_steps)

    timer = PhaseTimer()
    if not args.no_phases:
        from trl import GRPOTrainer

        wrap_common_phases(timer)
        wrap_masktrl_phases(timer, common=False)
        wrap_trl_phases(timer, GRPOTrainer, common=False)
    names = ["masktrl", "trl"]
    if args.ablate:
        names[1:1] = ["masktrl-unpacked", "masktrl-unshared", "masktrl-neither"]
    elif args.ablate_sharing:
        names.insert(1, "masktrl-unshared")
    if defaults_side and long:
        names.insert(1, "masktrl-defaults")  # the side a user gets
        if "masktrl-unpacked" not in names:
            names.insert(2, "masktrl-unpacked")  # the defaults before auto
    if args.drop_finished:
        names.insert(1, "masktrl-dropfinished")
    sides = {name: [] for name in names}
    stack = contextlib.ExitStack()
    if long:
        from transformers import AutoTokenizer

        stack.enter_context(follow_target_lengths(AutoTokenizer.from_pretrained(model_dir)))
    try:
        with stack:
            for rep in range(args.reps):
                order = tuple(sides) if rep % 2 == 0 else tuple(reversed(sides))
                for side in order:
                    t0 = time.time()
                    if side == "trl":
                        block = run_trl_block(cfg, model_dir, dataset_rows, args, timer)
                    else:
                        share, packed = SIDES[side]
                        with prompt_sharing(share):
                            side_cfg = {"masktrl-dropfinished": cfg_drop, "masktrl-defaults": cfg_defaults}.get(side)
                            block = run_masktrl_block(side_cfg or (cfg if packed else cfg_unpacked), timer)
                    sides[side].append(block)
                    print(
                        f"rep {rep + 1}/{args.reps} {side:7s}: median step "
                        f"{1000 * median(block['step_s']):.0f} ms, "
                        f"{median(block['tokens']):.0f} tokens/step ({time.time() - t0:.0f} s "
                        "with set-up)",
                        flush=True,
                    )
    finally:
        timer.restore()

    result = summarise(sides, args)
    result["machine"] = machine()
    result["settings"] = {
        "shape": shape,
        "prompts_per_step": args.prompts,
        "group_size": args.group,
        "max_new_tokens": args.max_new_tokens,
        "masktrl_topk": args.k,
        "timed_steps_per_block": args.steps,
        "reps": args.reps,
        "threads": args.threads,
        "model": str(model_dir),
        "loss": "dapo (token-mean), eps_low 0.2, eps_high 0.28, beta 0, num_iterations 1",
    }
    if long:
        result["settings"].update(
            parameters=param_count(model_dir),
            micro_batch_tokens=LONG_MICRO_BATCH_TOKENS,
            response_tokens_per_step=median([n for b in sides["masktrl"] for n in b["tokens"]]),
        )
    report(result)
    return result


def masktrl_prompts(cfg, n_steps: int) -> list[dict]:
    """The prompts masktrl draws at steps 1..n_steps (dynamic sampling off: attempt 0), in order."""
    import random

    from masktrl.seeding import stream_seed
    from masktrl.tasks import make_task

    task = make_task(cfg.task, cfg.model)
    rows = []
    for step in range(1, n_steps + 1):
        rng = random.Random(stream_seed(cfg.seed, "prompts", step, 0))
        rows += [
            {"prompt": ex.prompt, "answer": ex.answer, "id": ex.id}
            for ex in task.train_examples(cfg.rollout.prompts_per_step, rng)
        ]
    return rows


# --------------------------------------------------------------------------- masktrl


def run_masktrl_block(cfg, timer: PhaseTimer) -> dict:
    phases: list[dict] = []
    run = run_masktrl(cfg, on_start=timer.take, on_step=lambda: phases.append(timer.take()))
    counted = slice(1, len(run["step_times"]) - 1)  # drop warm-up and the final (checkpoint) step
    return {
        "threads": [torch.get_num_threads()],
        "step_s": run["step_times"][counted],
        "cpu_s": run["cpu_times"][counted],
        "tokens": [r["tokens"] for r in run["metrics"]][counted],
        "phases": phases[counted],
        "reward_mean": median([r["reward_mean"] for r in run["metrics"]]),
    }


@contextmanager
def prompt_sharing(on: bool):
    """Switch masktrl's per-group prompt sharing off (``on=False``) for an ablation: the engine
    prefills every sample's prompt (``num_return_sequences``) and the policy forward runs each
    prompt+response whole, exactly the code paths used when all prompts are distinct."""
    from masktrl.rl import policy
    from masktrl.rollout import hf

    if on:
        yield
        return
    saved = hf.shared_prefill, policy._distinct_prompts
    hf.shared_prefill = lambda model, ids, att, n: {"input_ids": ids, "attention_mask": att, "num_return_sequences": n}
    policy._distinct_prompts = lambda samples: ([s.prompt_ids for s in samples], list(range(len(samples))))
    try:
        yield
    finally:
        hf.shared_prefill, policy._distinct_prompts = saved


# --------------------------------------------------------------------------- TRL


def run_trl_block(cfg, model_dir: Path, rows: list[dict], args, timer: PhaseTimer) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from trl import GRPOConfig, GRPOTrainer

    from masktrl.tasks import make_task
    from masktrl.tasks.base import Example

    task = make_task(cfg.task, cfg.model)
    tokens = [0]
    rewards: list[float] = []

    def arithmetic_reward(prompts, completions, completion_ids, answer, id, **kw):
        tokens[0] += sum(len(c) for c in completion_ids)
        scores = task.score_many([Example(i, p, a) for i, p, a in zip(id, prompts, answer)], completions)
        rewards.extend(scores)
        return scores

    marks: list[float] = []
    cpu_marks: list[float] = []
    threads: set[int] = set()
    per_step_tokens: list[int] = []
    phases: list[dict] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, *a, **kw):
            timer.take()

        def on_step_begin(self, *a, **kw):
            threads.add(torch.get_num_threads())
            if marks:
                per_step_tokens.append(tokens[0])
                phases.append(timer.take())
            tokens[0] = 0
            marks.append(time.perf_counter())
            cpu_marks.append(time.process_time())

    n_steps = cfg.train.steps
    out_dir = Path(tempfile.mkdtemp(prefix="trl-", dir=BENCH_TMP))
    try:
        targs = GRPOConfig(
            output_dir=str(out_dir),
            use_cpu=True,
            bf16=False,
            fp16=False,
            gradient_checkpointing=False,
            per_device_train_batch_size=cfg.rollout.prompts_per_step * cfg.rollout.n,
            gradient_accumulation_steps=1,
            num_generations=cfg.rollout.n,
            num_iterations=1,
            max_completion_length=cfg.rollout.max_new_tokens,
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            top_k=0,
            loss_type="dapo",
            epsilon=0.2,
            epsilon_high=0.28,
            beta=0.0,
            scale_rewards="group",
            mask_truncated_completions=False,
            learning_rate=cfg.train.lr,
            lr_scheduler_type="constant",
            warmup_steps=0,
            weight_decay=0.0,
            adam_beta1=0.9,
            adam_beta2=0.999,
            max_grad_norm=cfg.train.grad_clip,
            max_steps=n_steps,
            logging_steps=1,
            save_strategy="no",
            eval_strategy="no",
            report_to="none",
            disable_tqdm=True,
            log_completions=False,
            shuffle_dataset=False,
            remove_unused_columns=False,
            dataloader_num_workers=0,
            seed=cfg.seed,
        )
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=arithmetic_reward,
            args=targs,
            train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer,
            callbacks=[Clock()],
        )
        trainer.remove_callback(PrinterCallback)
        trainer.remove_callback(ProgressCallback)
        torch.set_num_threads(args.threads)
        trainer.train()
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    step_s = [b - a for a, b in zip(marks, marks[1:])]  # steps 1..N-1
    cpu_s = [b - a for a, b in zip(cpu_marks, cpu_marks[1:])]
    return {
        "step_s": step_s[1:],
        "cpu_s": cpu_s[1:],
        "tokens": per_step_tokens[1:],
        "phases": phases[1:],
        "reward_mean": sum(rewards) / max(1, len(rewards)),
        "threads": sorted(threads),
    }


# --------------------------------------------------------------------------- results


def side_stats(blocks: list[dict]) -> dict:
    step_s = [t for b in blocks for t in b["step_s"]]
    tok = [n / t for b in blocks for n, t in zip(b["tokens"], b["step_s"])]
    phase_sum: dict[str, float] = {}
    for b in blocks:
        for ph in b["phases"]:
            for k, v in ph.items():
                phase_sum[k] = phase_sum.get(k, 0.0) + v
    n = len(step_s)
    total = sum(step_s)
    return {
        "step_ms_median": 1000 * median(step_s),
        "cpu_ms_median": 1000 * median([t for b in blocks for t in b["cpu_s"]]),
        "steps_per_s": 1 / median(step_s),
        "tokens_per_s": median(tok),
        "tokens_per_step": median([n for b in blocks for n in b["tokens"]]),
        "steps_counted": n,
        "reward_mean": median([b["reward_mean"] for b in blocks]),
        "phases_ms": {k: 1000 * v / n for k, v in sorted(phase_sum.items())} if phase_sum else {},
        "stage_ms": {k: 1000 * v / n for k, v in group_phases(phase_sum, total).items()} if phase_sum else {},
        "block_step_ms": [1000 * median(b["step_s"]) for b in blocks],
        "torch_threads_seen": sorted({t for b in blocks for t in b.get("threads", [])}),
    }


def summarise(sides: dict, args) -> dict:
    m, t = side_stats(sides["masktrl"]), side_stats(sides["trl"])
    paired = [tb / mb for mb, tb in zip(m["block_step_ms"], t["block_step_ms"])]
    speedup = median(paired)
    out = {
        "masktrl": m,
        "trl": t,
        "speedup_vs_trl": speedup,
        "speedup_per_rep": paired,
        "speedup_of_medians": t["step_ms_median"] / m["step_ms_median"],
        "tokens_per_s_ratio": m["tokens_per_s"] / t["tokens_per_s"],
        "cpu_time_ratio": t["cpu_ms_median"] / m["cpu_ms_median"],
    }
    for side in EXTRA_SIDES:
        if side in sides:
            u = side_stats(sides[side])
            key = side.replace("-", "_")
            out[key] = u
            out[f"{key.split('_')[1]}_cpu_time_ratio"] = t["cpu_ms_median"] / u["cpu_ms_median"]
            out[f"{key.split('_')[1]}_speedup_vs_trl"] = median(
                [tb / ub for ub, tb in zip(u["block_step_ms"], t["block_step_ms"])]
            )
            out[f"{key.split('_')[1]}_vs_masktrl"] = median(
                [ub / mb for mb, ub in zip(m["block_step_ms"], u["block_step_ms"])]
            )
    if "masktrl-unshared" in sides:  # the names of earlier runs' JSON
        out["prompt_sharing_speedup"] = out["unshared_vs_masktrl"]
    shape, default_side = args.shape_run, DEFAULT_SIDE[args.shape_run]
    if default_side in sides:  # the goal: CPU time per step with the settings a user gets by default
        short = default_side.removeprefix("masktrl-")
        ratio = out["cpu_time_ratio"] if default_side == "masktrl" else out[f"{short}_cpu_time_ratio"]
        out |= {"default_side": default_side, "default_cpu_time_ratio": ratio, "goal": GOALS[shape]}
        out["goal_met"] = ratio >= GOALS[shape]
    return out


def report(r: dict) -> None:
    cols = [("masktrl", r["masktrl"])]
    cols += [(LABELS[side], r[side.replace("-", "_")]) for side in EXTRA_SIDES if side.replace("-", "_") in r]
    cols.append(("TRL", r["trl"]))
    m, t = r["masktrl"], r["trl"]
    lines = [
        ("steps/s", "steps_per_s", m["steps_per_s"] / t["steps_per_s"]),
        ("step time, median (ms)", "step_ms_median", t["step_ms_median"] / m["step_ms_median"]),
        ("CPU time per step, median (ms)", "cpu_ms_median", r["cpu_time_ratio"]),
        ("generated tokens/s", "tokens_per_s", r["tokens_per_s_ratio"]),
        ("generated tokens/step", "tokens_per_step", float("nan")),
        ("reward mean", "reward_mean", float("nan")),
        ("timed steps", "steps_counted", float("nan")),
    ]
    rows = [[label, *[c[key] for _, c in cols], ratio] for label, key, ratio in lines]
    for stage in m["stage_ms"]:
        rows.append([f"  {stage} (ms/step)", *[c["stage_ms"].get(stage, 0.0) for _, c in cols], float("nan")])
    print_table(
        "masktrl vs TRL GRPOTrainer (same model, prompts, batch, loss)",
        ["", *[n for n, _ in cols], "masktrl speed-up vs TRL"],
        rows,
    )
    per_rep = ", ".join(f"{x:.2f}" for x in r["speedup_per_rep"])
    print(f"speedup_vs_trl = {r['speedup_vs_trl']:.2f}x (median of paired blocks: {per_rep})")
    if "goal" in r:
        verdict = "met" if r["goal_met"] else "MISSED"
        print(
            f"CPU time per step with the default settings ({LABELS[r['default_side']]}): "
            f"{r['default_cpu_time_ratio']:.2f}x TRL's; goal >= {r['goal']}x: {verdict}"
        )
    for side in (side.removeprefix("masktrl-") for side in EXTRA_SIDES):
        if f"{side}_speedup_vs_trl" in r:
            print(
                f"{LABELS['masktrl-' + side]}: {r[side + '_speedup_vs_trl']:.2f}x TRL; masktrl is "
                f"{r[side + '_vs_masktrl']:.2f}x faster"
            )


if __name__ == "__main__":
    main()
