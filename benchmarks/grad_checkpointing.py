"""Peak memory and time of the policy's training forward + backward with and without
activation checkpointing (``train.gradient_checkpointing``), on a >= 30M-parameter Qwen3 on CPU.

Four variants, each in a fresh subprocess: {plain, checkpointed} x {shared-prompt forward (each
distinct prompt once), whole sequences (every response with its prompt)}. A step is
``policy_token_batch`` (the trainer's forward: log-probabilities at the sampled and top-K ids)
and the backward of a policy-gradient loss; no optimizer step (its state is the same either
way). Peak extra memory is the process's peak RSS (``ru_maxrss``) minus its RSS right before the
first step, so it counts the activations kept for the backward, the gradients and the
temporaries. Time is the median of ``--repeats`` steps after that first one, as wall time and
as process CPU time (user + sys; the steadier of the two on a shared machine). The variants run
interleaved for ``--rounds`` rounds (rotating the order) and each number is the median over
rounds: the ratios are measured side by side, which stays meaningful on a shared machine.

    python benchmarks/grad_checkpointing.py                      # 31.5M parameters, 2 x 4 x (64 + 256) tokens
    python benchmarks/grad_checkpointing.py --json outputs/bench/grad_checkpointing.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import count, peak_rss_mib, rss_mib, run_worker  # noqa: E402  (benchmarks/common.py)

VARIANTS = ("plain-shared", "checkpointed-shared", "plain-whole", "checkpointed-whole")


def worker(args) -> dict:
    import torch

    from masktrl.models import checkpointing
    from masktrl.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model
    from masktrl.rl.policy import policy_token_batch
    from masktrl.rollout.base import Generation, Sample

    torch.set_num_threads(args.threads)
    tok = build_char_tokenizer("0123456789+-*= abcdefghijklmnopqrstuvwxyz")
    cfg = TinyModelConfig(
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.heads // 2,
        intermediate_size=4 * args.hidden,
        max_positions=args.prompt + args.response + 8,
    )
    model = build_tiny_model(tok, cfg, seed=0)
    n_params = sum(p.numel() for p in model.parameters())
    if args.variant.startswith("checkpointed"):
        checkpointing.enable(model)
    share = args.variant.endswith("shared")
    rng = random.Random(0)
    vocab = len(tok)
    samples = []
    for g in range(args.prompts):
        prompt = [rng.randrange(vocab) for _ in range(args.prompt)]
        for _ in range(args.group):
            ids = [rng.randrange(vocab) for _ in range(args.response)]
            topk = [[rng.randrange(vocab) for _ in range(args.topk)] for _ in ids]
            gen = Generation(
                response_ids=ids,
                logp=[-1.0] * len(ids),
                topk_ids=topk,
                topk_logp=[[-1.0] * args.topk for _ in ids],
                finished=True,
            )
            samples.append(Sample(f"p{g}", "", "", prompt, g, gen, advantage=rng.uniform(-1, 1)))

    def step():
        model.train()
        out = policy_token_batch(model, samples, temperature=1.0, chunk=1024, share=share)
        assert out.shared_prompt is share
        (out.batch.logp * out.advantages).sum().backward()
        model.zero_grad(set_to_none=True)

    base_rss = rss_mib()
    t0 = time.perf_counter()
    step()
    first = time.perf_counter() - t0
    peak = peak_rss_mib()
    times, cpu = [], []
    for _ in range(args.repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return {
        "variant": args.variant,
        "params": n_params,
        "peak_extra_mib": peak - base_rss,
        "first_s": first,
        "time_s": statistics.median(times) if times else first,
        "times_s": times,
        "cpu_s": statistics.median(cpu) if cpu else first,
    }


def run_variant(args, variant: str) -> dict:
    keys = ("hidden", "layers", "heads", "prompts", "group", "prompt", "response", "topk", "threads", "repeats")
    return run_worker(__file__, variant, args, keys)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--prompts", type=int, default=2, help="distinct prompts")
    p.add_argument("--group", type=int, default=4, help="responses per prompt")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    p.add_argument("--response", type=int, default=256, help="response tokens")
    p.add_argument("--topk", type=int, default=5)
    p.add_argument("--threads", type=count, default=1)
    p.add_argument("--repeats", type=count, default=2, help="timed steps per process (after the first)")
    p.add_argument("--rounds", type=count, default=2)
    p.add_argument("--json", default=None)
    p.add_argument("--worker", choices=VARIANTS, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        args.variant = args.worker
        print(json.dumps(worker(args)))
        return
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        for v in VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]:
            runs[v].append(run_variant(args, v))
    med = {
        v: {k: statistics.median(x[k] for x in rs) for k in ("peak_extra_mib", "time_s", "cpu_s")}
        for v, rs in runs.items()
    }
    params = runs[VARIANTS[0]][0]["params"]
    tokens = args.prompts * args.group * (args.prompt + args.response)
    print(
        f"{params / 1e6:.1f}M parameters, {args.prompts} prompts x {args.group} responses x "
        f"({args.prompt} + {args.response}) tokens, "
        f"{args.threads} thread(s), medians of {args.rounds} rounds"
    )
    print(f"{'variant':22} {'peak extra MiB':>15} {'wall s':>8} {'cpu s':>8}")
    for v in VARIANTS:
        print(f"{v:22} {med[v]['peak_extra_mib']:15.0f} {med[v]['time_s']:8.2f} {med[v]['cpu_s']:8.2f}")
    ratios = {}
    for path in ("shared", "whole"):
        plain, ckpt = med[f"plain-{path}"], med[f"checkpointed-{path}"]
        ratios[path] = {
            k: ckpt[m] / plain[m] for k, m in (("memory", "peak_extra_mib"), ("time", "time_s"), ("cpu", "cpu_s"))
        }
        print(
            f"checkpointed / plain, {path:6}: memory {ratios[path]['memory']:.2f}x, wall time "
            f"{ratios[path]['time']:.2f}x, "
            f"cpu time {ratios[path]['cpu']:.2f}x"
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps(
                {
                    "config": {k: v for k, v in vars(args).items() if k != "worker"},
                    "params": params,
                    "tokens": tokens,
                    "runs": runs,
                    "medians": med,
                    "ratios": ratios,
                    "loadavg": os.getloadavg(),
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
