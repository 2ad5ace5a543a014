"""Time one training step of every method and variant against ``grpo`` on the same batch.

A step = policy forward (Qwen3 built from a config, no hub) -> ``token_logprobs`` at the sampled
token and the behaviour top-K ids (as ``rl/update.py`` does) -> ``token_losses`` ->
``aggregate`` -> backward. The batch is synthetic but consistent: a perturbed copy of the model
is the behaviour policy; tokens are sampled from it and its top-K lists recorded.

Variants run interleaved in a fresh random order every repeat; each variant's ratio is the
median over repeats of (its time / grpo's time in the same repeat). The headline ratio uses
process CPU time (``time.process_time``) with one intra-op thread: the overhead of a method is
the cost of its extra ops, and on a shared 2-core machine neither scheduler waits nor OpenMP
spin-waits should count. Wall-time ratios are reported too, with the load average.

    python benchmarks/method_overhead.py                # tiny (~0.4M) and ~30M configs
    python benchmarks/method_overhead.py --quick --json out.json
    python benchmarks/method_overhead.py --configs tiny --variants pdm-kl-agg,pdm-kl-bracket
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import random
import statistics
import time

import torch

from masktrl.methods import TokenBatch, get_method, make_params
from masktrl.models.logprobs import token_logprobs, token_square_mass

VARIANTS: list[tuple[str, str, dict]] = [
    ("grpo", "grpo", {}),
    ("dapo", "dapo", {}),
    ("gspo", "gspo", {}),
    *[(f"dppo-{d}", "dppo", {"divergence": d}) for d in ("binary-tv", "binary-kl", "topk-tv", "topk-kl")],
    ("dppo-topk-kl-replace_last", "dppo", {"divergence": "topk-kl", "rule": "replace_last"}),
    *[(f"pdm-{d}-{t}", "pdm", {"divergence": d, "tail": t}) for d in ("kl", "tv") for t in ("agg", "uniform")],
    ("pdm-kl-bracket", "pdm", {"divergence": "kl", "tail": "bracket"}),
    ("pdm-kl-bracket-mask", "pdm", {"divergence": "kl", "tail": "bracket", "uncertain": "mask"}),
    ("pdm-kl-exact", "pdm", {"divergence": "kl", "tail": "exact"}),  # + one chunked no-grad pass for sum_V pi^2
    *[(f"sis-{b}", "sis", {"base": b}) for b in ("grpo", "dapo", "gspo")],
]

CONFIGS = {
    "tiny": dict(vocab_size=32, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                 head_dim=32, intermediate_size=512),
    "30M": dict(vocab_size=8192, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                head_dim=64, intermediate_size=1536),
}


def build_model(cfg: dict, seed: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(**cfg, max_position_embeddings=2048, tie_word_embeddings=True, attn_implementation="sdpa")
    return Qwen3ForCausalLM(config).float()


@torch.no_grad()
def synthetic_batch(model, seqs: int, tokens: int, k: int, seed: int, noise: float):
    """Inputs, sampled tokens and behaviour top-K lists from a perturbed copy of ``model``."""
    gen = torch.Generator().manual_seed(seed)
    behaviour = copy.deepcopy(model)
    for p in behaviour.parameters():
        p.add_(noise * p.abs().mean() * torch.randn(p.shape, generator=gen))
    v = model.config.vocab_size
    input_ids = torch.randint(0, v, (seqs, tokens), generator=gen)
    mu_lp = torch.log_softmax(behaviour(input_ids=input_ids).logits.float() / 1.0, -1)  # [B, T, V]
    sampled = torch.multinomial(mu_lp.reshape(-1, v).exp(), 1, generator=gen).reshape(seqs, tokens)
    top = mu_lp.topk(k, dim=-1)
    adv = torch.randn(seqs, generator=gen).repeat_interleave(tokens)  # one advantage per sequence
    return {
        "input_ids": input_ids,
        "sampled": sampled.reshape(-1),
        "behavior_logp": mu_lp.gather(-1, sampled[..., None]).reshape(-1),
        "topk_ids": top.indices.reshape(-1, k),
        "topk_behavior_logp": top.values.reshape(-1, k),
        "seq_ids": torch.arange(seqs).repeat_interleave(tokens),
        "advantages": adv,
        "u": torch.rand(seqs * tokens, generator=gen),
        "pi_sq_sum": mu_lp.reshape(-1, v).exp().square().sum(-1),  # for the method-only timing
    }


def train_step(model, data: dict, method, params, sampled_only: bool, chunk: int) -> tuple[float, float]:
    t0, c0 = time.perf_counter(), time.process_time()
    hidden = model.model(input_ids=data["input_ids"]).last_hidden_state  # [B, T, H]
    h = hidden.reshape(-1, hidden.shape[-1])  # [N, H]
    weight = model.get_output_embeddings().weight  # [V, H]
    if sampled_only:  # a trainer that never reads pi at the list ids
        lp = token_logprobs(h, weight, data["sampled"][:, None], chunk_size=chunk)  # [N, 1]
        topk_logp = data["topk_behavior_logp"]
    else:
        ids = torch.cat([data["sampled"][:, None], data["topk_ids"]], dim=1)  # [N, 1+K]
        lp = token_logprobs(h, weight, ids, chunk_size=chunk)
        topk_logp = lp[:, 1:]
    pi_sq = token_square_mass(h.detach(), weight.detach(), chunk_size=chunk) if method.needs_full_pi(params) else None
    batch = TokenBatch(lp[:, 0], data["behavior_logp"], data["sampled"], data["topk_ids"], data["topk_behavior_logp"],
                       topk_logp, data["seq_ids"], weight.shape[0], pi_sq)
    out = method.token_losses(batch, data["advantages"], params, u=data["u"] if method.needs_u(params) else None)
    loss = method.aggregate(params, out.loss, batch, horizon=data["input_ids"].shape[1])
    loss.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0, time.process_time() - c0


def method_part(data: dict, method, params, sampled_only: bool, repeats: int, vocab: int) -> float:
    """Median CPU seconds of the method's own work: TokenBatch -> token_losses -> aggregate -> backward
    to log pi (no model), on log-probabilities near the behaviour's."""
    gen = torch.Generator().manual_seed(2)
    lp_k = (data["behavior_logp"] + 0.05 * torch.randn(data["behavior_logp"].shape, generator=gen)).clamp_max(0.0)
    topk = data["topk_behavior_logp"] if sampled_only else (data["topk_behavior_logp"] + 0.05).clamp_max(0.0)
    ts = []
    for _ in range(repeats):
        logp = lp_k.clone().requires_grad_(True)
        c0 = time.process_time()
        batch = TokenBatch(logp, data["behavior_logp"], data["sampled"], data["topk_ids"], data["topk_behavior_logp"],
                           topk, data["seq_ids"], vocab, data["pi_sq_sum"] if method.needs_full_pi(params) else None)
        out = method.token_losses(batch, data["advantages"], params, u=data["u"] if method.needs_u(params) else None)
        method.aggregate(params, out.loss, batch, horizon=data["input_ids"].shape[1]).backward()
        ts.append(time.process_time() - c0)
    return statistics.median(ts)


def bench_config(name: str, cfg: dict, seqs: int, tokens: int, k: int, repeats: int, warmup: int, chunk: int,
                 variants: list[tuple[str, str, dict]] = VARIANTS) -> dict:
    model = build_model(cfg, seed=0)
    n_params = sum(p.numel() for p in model.parameters())
    data = synthetic_batch(model, seqs, tokens, k, seed=1, noise=0.05)
    entries = [(label, get_method(m), make_params(m, **kw), False) for label, m, kw in variants]
    entries.append(("grpo (sampled id only)", get_method("grpo"), make_params("grpo"), True))
    times: dict[str, list[tuple[float, float]]] = {e[0]: [] for e in entries}
    rng = random.Random(0)
    for rep in range(warmup + repeats):
        order = entries[:]
        rng.shuffle(order)
        for label, method, params, sampled_only in order:
            t = train_step(model, data, method, params, sampled_only, chunk)
            if rep >= warmup:
                times[label].append(t)
    base = times["grpo"]
    step_grpo = statistics.median(b[1] for b in base)
    part = {e[0]: method_part(data, e[1], e[2], e[3], 50, cfg["vocab_size"]) for e in entries}
    rows = {}
    for label, ts in times.items():
        rows[label] = {
            "median_cpu_s": statistics.median(t[1] for t in ts),
            "ratio": statistics.median(t[1] / b[1] for t, b in zip(ts, base)),  # CPU time
            "median_wall_s": statistics.median(t[0] for t in ts),
            "ratio_wall": statistics.median(t[0] / b[0] for t, b in zip(ts, base)),
            "method_part_cpu_s": part[label],
            "ratio_from_method_part": 1.0 + (part[label] - part["grpo"]) / step_grpo,
        }
    return {"config": name, "params": n_params, "tokens": seqs * tokens, "k": k, "repeats": repeats, "methods": rows,
            "loadavg": os.getloadavg()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (1: stable CPU-time ratios on a shared machine)")
    p.add_argument("--quick", action="store_true", help="fewer repeats and a smaller 30M batch")
    p.add_argument("--json", type=str, default=None)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--configs", type=str, default=",".join(CONFIGS), help=f"comma-separated subset of {', '.join(CONFIGS)}")
    p.add_argument("--variants", type=str, default=None,
                   help="comma-separated variant labels to time (grpo, the baseline, is always included); default all")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    variants = select_variants(args.variants)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if not configs or any(c not in CONFIGS for c in configs):
        p.error(f"--configs must name some of {', '.join(CONFIGS)}, got {args.configs!r}")
    load0 = os.getloadavg()
    plans = [("tiny", 16, 64, 8, 30, 3), ("30M", 4, 64, 20, 9, 1)]
    if args.quick:
        plans = [("tiny", 16, 64, 8, 10, 2), ("30M", 2, 64, 20, 4, 1)]
    results = []
    for name, seqs, tokens, k, reps, warm in plans:
        if name not in configs:
            continue
        res = bench_config(name, CONFIGS[name], seqs, tokens, k, reps, warm, args.chunk, variants)
        results.append(res)
        _print(res, args.threads)
    core = [r["methods"][label]["ratio"] for r in results for label, _, _ in variants]
    core_part = [r["methods"][label]["ratio_from_method_part"] for r in results for label, _, _ in variants]
    core_wall = [r["methods"][label]["ratio_wall"] for r in results for label, _, _ in variants]
    summary = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "torch": torch.__version__,
                    "threads": args.threads, "loadavg_start": load0, "loadavg_end": os.getloadavg()},
        "configs": results,
        "max_overhead_ratio": max(core),
        "max_overhead_ratio_wall": max(core_wall),
        "max_overhead_ratio_from_method_part": max(core_part),
        "per_method_ratio": {f"{r['config']}/{label}": row["ratio"] for r in results for label, row in r["methods"].items()},
        "per_method_ratio_wall": {f"{r['config']}/{label}": row["ratio_wall"] for r in results for label, row in r["methods"].items()},
        "goal_all_le_1.05": max(core) <= 1.05,
    }
    print(f"max overhead ratio over all methods and configs: cpu {max(core):.3f} (wall {max(core_wall):.3f}, "
          f"from the method part alone {max(core_part):.3f}); "
          f"load average {load0[0]:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)


def select_variants(spec: str | None) -> list[tuple[str, str, dict]]:
    """The variants named in ``spec`` (comma-separated labels), grpo first; all when ``spec`` is None."""
    if spec is None:
        return VARIANTS
    labels = {v[0]: v for v in VARIANTS}
    names = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in labels]
    if unknown:
        raise SystemExit(f"unknown variant {unknown[0]!r}; valid: {', '.join(labels)}")
    return [labels["grpo"]] + [labels[n] for n in names if n != "grpo"]


def _print(res: dict, threads: int) -> None:
    title = (f"{res['config']} Qwen3 ({res['params'] / 1e6:.1f}M params), {res['tokens']} tokens, K={res['k']}, "
             f"{threads} threads, median of {res['repeats']}, load avg {res['loadavg'][0]:.1f}")
    try:
        from rich.console import Console
        from rich.table import Table

        t = Table(title=title)
        for c in ("method", "cpu s", "ratio (cpu)", "wall s", "ratio (wall)", "method part ms", "ratio from part"):
            t.add_column(c, justify="right")
        for label, row in res["methods"].items():
            t.add_row(label, f"{row['median_cpu_s']:.4f}", f"{row['ratio']:.3f}", f"{row['median_wall_s']:.4f}",
                      f"{row['ratio_wall']:.3f}", f"{1000 * row['method_part_cpu_s']:.2f}", f"{row['ratio_from_method_part']:.3f}")
        Console(width=160).print(t)
    except ImportError:
        print(title)
        for label, row in res["methods"].items():
            print(f"{label:>28} {row['median_cpu_s']:10.4f} {row['ratio']:8.3f} {row['median_wall_s']:10.4f} "
                  f"{row['ratio_wall']:8.3f} {1000 * row['method_part_cpu_s']:8.2f} {row['ratio_from_method_part']:8.3f}")


if __name__ == "__main__":
    main()
