"""Disk use of the paper recipes: each recipe's projected disk per step and per run
(``masktrl.runs.retention.project``, the numbers ``masktrl train`` prints at start), at
the documented bytes per generated token of its ``model.dtype`` (docs/ROLLOUTS.md), a given
rate, or one measured here.

``--measure`` writes a synthetic worst-case batch with the rollout storage format of this
checkout: 16 responses of 1,024 tokens, Qwen3's 151,936-token vocabulary, K = 20 top-K ids
uniform over it and float32 log-probabilities with no two alike (both compress worse than a
real model's), the sampled token the top-1 70% of the time, 200 prompt tokens and 3 kB of text
per response.

    python benchmarks/disk_projection.py                       # every recipe at the documented rate
    python benchmarks/disk_projection.py --set train.keep_checkpoints=2 --set rollout.store=resume
    python benchmarks/disk_projection.py --measure             # the worst case of this checkout's format
    python benchmarks/disk_projection.py --bytes-per-token 40  # a given rate
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# config.json of the Hugging Face models the recipes name (dense Qwen3; parameters counted below)
MODELS = {
    "Qwen/Qwen3-4B-Base": dict(
        vocab=151936, hidden=2560, intermediate=9728, layers=36, heads=32, kv_heads=8, head_dim=128, tied=True
    ),
    "Qwen/Qwen3-8B-Base": dict(
        vocab=151936, hidden=4096, intermediate=12288, layers=36, heads=32, kv_heads=8, head_dim=128, tied=False
    ),
}
ZERO_STAGE = {"qwen3-4b": 2, "qwen3-8b": 3}  # the accelerate config docs/CLUSTER.md runs each size with


def qwen3_parameters(vocab, hidden, intermediate, layers, heads, kv_heads, head_dim, tied) -> int:
    """Parameters of a dense Qwen3 (q/k/v/o projections, q/k norms, SwiGLU MLP, two RMSNorms per layer)."""
    attn = hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden + 2 * head_dim
    per_layer = attn + 3 * hidden * intermediate + 2 * hidden
    return layers * per_layer + vocab * hidden * (1 if tied else 2) + hidden


def measure_bytes_per_token(seqs=16, length=1024, vocab=151936, k=20, seed=0) -> float:
    from masktrl.rollout.base import Generation, Sample
    from masktrl.rollout.storage import write_rollouts

    rng = random.Random(seed)
    samples = []
    for _ in range(seqs):
        ids, logp, topk_ids, topk_logp = [], [], [], []
        for _ in range(length):
            top = rng.sample(range(vocab), k)
            lps = sorted((-abs(rng.gauss(0, 3)) * (j + 1) / 2 for j in range(k)), reverse=True)
            pick = 0 if rng.random() < 0.7 else rng.randrange(k)
            ids.append(top[pick])
            logp.append(lps[pick])
            topk_ids.append(top)
            topk_logp.append(lps)
        gen = Generation(response_ids=ids, logp=logp, topk_ids=topk_ids, topk_logp=topk_logp, finished=True)
        samples.append(
            Sample(
                "ex",
                "p " * 300,
                "42",
                [rng.randrange(vocab) for _ in range(200)],
                0,
                gen,
                text="x" * 3000,
                reward=1.0,
                advantage=0.5,
            )
        )
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rollouts.parquet"
        write_rollouts(path, samples, {"engine": "synthetic", "logprobs_k": k})
        return os.path.getsize(path) / (seqs * length)


def main() -> None:
    from masktrl.config import load_config
    from masktrl.runs.retention import human, project

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bytes-per-token", type=float, default=None, help="use this rate for every recipe")
    p.add_argument("--measure", action="store_true", help="measure a synthetic worst-case batch and use its rate")
    p.add_argument("--set", dest="overrides", action="append", default=[], help="config override for every recipe")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    bpt = measure_bytes_per_token() if args.measure else args.bytes_per_token
    if bpt is not None:
        print(
            f"rollout storage: {bpt:.1f} B per generated token (K = 20, V = 151,936)"
            + (" (measured, worst case)" if args.measure else " (given)")
        )
    rows = []
    overlays = sorted((ROOT / "configs" / "methods").glob("*.yaml"))
    for base, method in [
        (b, m) for b in ("qwen3-4b", "qwen3-8b") for m in overlays
    ]:  # each base with each method overlay
        cfg = load_config([ROOT / "configs" / f"{base}.yaml", method], args.overrides)
        n_params = qwen3_parameters(**MODELS[cfg.model.path])
        stage = ZERO_STAGE[base]
        proj = project(cfg, n_params, deepspeed_stage=stage, bytes_per_token=bpt)
        rows.append(
            {
                "recipe": f"{base} + {method.stem}",
                "bytes_per_token": proj.bytes_per_token,
                "params": n_params,
                "zero_stage": stage,
                "rollout_step": proj.rollout_step,
                "rollouts_kept": proj.rollouts_kept,
                "rollouts": proj.rollouts,
                "checkpoint": proj.checkpoint,
                "checkpoints_kept": proj.checkpoints_kept,
                "checkpoints": proj.checkpoints,
                "per_run": proj.per_run,
            }
        )
    print(
        f"{'recipe':28} {'params':>7} {'ZeRO':>4} {'B/token':>7} {'rollouts/step':>13} {'kept':>4} "
        f"{'rollouts':>9} "
        f"{'ckpt':>8} {'kept':>4} {'ckpts':>9} {'run':>9}"
    )
    for r in rows:
        print(
            f"{r['recipe']:28} {r['params'] / 1e9:6.2f}B {r['zero_stage']:>4} "
            f"{r['bytes_per_token']:7.1f} {human(r['rollout_step']):>13} {r['rollouts_kept']:>4} "
            f"{human(r['rollouts']):>9} {human(sum(r['checkpoint'].values())):>8} "
            f"{r['checkpoints_kept']:>4} "
            f"{human(r['checkpoints']):>9} {human(r['per_run']):>9}"
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps({"bytes_per_token": bpt, "overrides": args.overrides, "recipes": rows}, indent=2)
        )


if __name__ == "__main__":
    main()
