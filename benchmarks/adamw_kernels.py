"""The AdamW kernels on the lab's parameters, side by side in one process: foreach against fused.

``train.adamw`` chooses how AdamW runs (docs/CLUSTER.md, "The AdamW kernels"): torch's
multi-tensor kernels (``foreach``, the default) or its fused kernel (``fused``). Timing the lab's
update with each, in separate processes minutes apart, did not resolve them on a machine whose
speed changes from one run to the next (docs/BENCHMARKS.md §7, "The fused AdamW kernel"). This
times the optimizer step alone, in one process, the two kernels in alternating blocks: each round
runs ``--steps`` steps of one kernel and then of the other (the order reversed every other round),
on two copies of the lab policy's parameters (configs/lab.yaml's model, its own initialisation)
with fixed random gradients, by the process's CPU clock. A round's ratio is its foreach block's
time over its fused block's, so a change of the machine's speed between rounds cancels.

Reported: each kernel's median CPU milliseconds per step over the rounds, the median of the
rounds' ratios and in how many rounds fused was the faster, and what the difference comes to over
a lab run: ``train.steps`` x ``train.minibatches`` optimizer steps (300 x 8).

    python benchmarks/adamw_kernels.py --json benchmarks/results/adamw_kernels.json
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

from common import count, finish, median, parser, print_table, quiet

LAB = str(Path(__file__).resolve().parents[1] / "configs" / "lab.yaml")
KERNELS = ("foreach", "fused")


def lab_parameters(config: str = LAB) -> list[torch.Tensor]:
    """The trainable parameters of ``config``'s tiny policy, as ``masktrl train`` builds it
    before the warm start (their shapes are what the optimizer's time depends on)."""
    from masktrl.config import load_config
    from masktrl.models.tiny import tiny_tokenizer
    from masktrl.rl.warmstart import new_tiny_model
    from masktrl.tasks import make_task

    cfg = load_config(config)
    task = make_task(cfg.task, cfg.model)
    tokenizer = tiny_tokenizer(cfg.model.tokenizer, getattr(task, "alphabet", None))
    model = new_tiny_model(cfg, tokenizer)
    return [p.detach() for p in model.parameters() if p.requires_grad]


def optimizers(params: list[torch.Tensor], seed: int = 0) -> dict:
    """Per kernel: AdamW (the lab's lr and betas, weight decay 0.01 so that part runs too) over
    its own copy of ``params``, each with the same fixed gradients."""
    from masktrl.rl.schedule import adamw_kernels

    g = torch.Generator().manual_seed(seed)
    grads = [torch.randn(p.shape, generator=g) * 1e-3 for p in params]
    out = {}
    for kernel in KERNELS:
        copy = [torch.nn.Parameter(p.clone()) for p in params]
        for p, grad in zip(copy, grads):
            p.grad = grad.clone()
        opt = torch.optim.AdamW(copy, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.01, **adamw_kernels(copy, kernel))
        opt.step()  # the moments allocated before anything is timed
        out[kernel] = opt
    return out


def block_ms(opt, steps: int) -> float:
    """CPU milliseconds per step over ``steps`` steps of ``opt``."""
    t0 = time.process_time()
    for _ in range(steps):
        opt.step()
    return (time.process_time() - t0) / steps * 1e3


def main(argv=None) -> dict:
    p = parser(__doc__.split("\n")[0])
    p.add_argument("--rounds", type=count, default=40, help="rounds of one block per kernel (order alternating)")
    p.add_argument("--steps", type=count, default=20, help="optimizer steps per block")
    p.add_argument(
        "--run-updates", type=int, default=300 * 8, help="optimizer steps of a lab run (steps x minibatches)"
    )
    args = p.parse_args(argv)
    quiet()
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()[0]
    params = lab_parameters()
    opts = optimizers(params)
    rounds = []
    for r in range(args.rounds):
        order = KERNELS if r % 2 == 0 else KERNELS[::-1]
        rounds.append({kernel: block_ms(opts[kernel], args.steps) for kernel in order})
    ms = {k: median([x[k] for x in rounds]) for k in KERNELS}
    ratios = [x["foreach"] / x["fused"] for x in rounds]
    saved_s = (ms["foreach"] - ms["fused"]) * args.run_updates / 1e3
    print_table(
        f"AdamW on the lab's {sum(x.numel() for x in params):,} parameters, {args.rounds} rounds of {args.steps} steps",
        ["kernel", "CPU ms per step", "x foreach", "CPU s per lab run"],
        [[k, ms[k], ms["foreach"] / ms[k], ms[k] * args.run_updates / 1e3] for k in KERNELS],
    )
    print(f"fused faster in {sum(x > 1 for x in ratios)} of {len(ratios)} rounds; a lab run saves {saved_s:.1f} CPU s")
    return finish(  # argv None: finish reads sys.argv
        "adamw_kernels.py",
        argv,
        load_start,
        args.json,
        parameters=sum(p.numel() for p in params),
        tensors=len(params),
        rounds=rounds,
        steps=args.steps,
        threads=args.threads,
        run_updates=args.run_updates,
        ms_per_step=ms,
        round_ratio_median=median(ratios),
        fused_faster_rounds=sum(x > 1 for x in ratios),
        run_saving_cpu_s=saved_s,
    )


if __name__ == "__main__":
    main()
