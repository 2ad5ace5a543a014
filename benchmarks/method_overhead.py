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
    python benchmarks/method_overhead.py --corrections-only --variants cispo   # grpo + each correction, cispo
    python benchmarks/method_overhead.py --configs tiny \
        --variants sapo,gmpo,clip-cov,kl-cov,topr,m2po,prime-dppo,prime-ipo,two-sided,trm,trm-topk-kl

Off-policy corrections (``method.correction``, docs/METHODS.md §14) are variants too: grpo with
each kind at its defaults in bypass mode, and grpo + token-tis in decoupled mode, whose step
excludes the extra no-grad forward that computes pi_old; that forward is timed on its own and
reported as a ratio to grpo's step ("decoupled forward (pi_old)").
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

from common import Parser, count  # benchmarks/common.py (run as a script, its folder is on sys.path)
from masktrl.methods import BASELINES, TokenBatch, corrected_token_losses, get_method, make_correction, make_params
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
    ("cispo", "cispo", {}),
    # the 2025-26 baselines (docs/METHODS.md §16) at their defaults
    *[(name, name, {}) for name in BASELINES],
    ("trm-topk-kl", "trm", {"divergence": "topk-kl"}),
]

# grpo with each off-policy correction (docs/METHODS.md §14) at its defaults; label -> correction block
CORRECTIONS: dict[str, dict] = {
    **{f"grpo+{kind}": {"kind": kind} for kind in ("token-tis", "seq-tis", "token-mis", "seq-mis", "icepop", "opsm")},
    "grpo+seq-mis-geometric": {"kind": "seq-mis", "stat": "geometric"},
    **{
        f"grpo+rs-{stat}": {"kind": "rs", "stat": stat}
        for stat in ("token_k1", "seq_sum_k2", "seq_mean_k3", "seq_max_k3")
    },
    "grpo+token-tis (decoupled)": {"kind": "token-tis", "mode": "decoupled"},
}
DECOUPLED_FORWARD = "decoupled forward (pi_old)"

CONFIGS = {
    "tiny": dict(
        vocab_size=32,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        intermediate_size=512,
    ),
    "30M": dict(
        vocab_size=8192,
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        intermediate_size=1536,
    ),
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


def policy_logprobs(model, data: dict, chunk: int, sampled_only: bool = False) -> torch.Tensor:
    """[N, 1+K] log pi at the sampled and behaviour top-K ids ([N, 1] with ``sampled_only``)."""
    hidden = model.model(input_ids=data["input_ids"]).last_hidden_state  # [B, T, H]
    h = hidden.reshape(-1, hidden.shape[-1])  # [N, H]
    weight = model.get_output_embeddings().weight  # [V, H]
    ids = data["sampled"][:, None] if sampled_only else torch.cat([data["sampled"][:, None], data["topk_ids"]], dim=1)
    return token_logprobs(h, weight, ids, chunk_size=chunk)


def old_forward(model, data: dict, chunk: int) -> tuple[torch.Tensor, float, float]:
    """The decoupled mode's extra forward: pi_old at the sampled and list ids, no gradient;
    returns it with its wall and CPU seconds."""
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.no_grad():
        old = policy_logprobs(model, data, chunk)
    return old, time.perf_counter() - t0, time.process_time() - c0


def train_step(
    model, data: dict, method, params, sampled_only: bool, chunk: int, correction=None, old: torch.Tensor | None = None
) -> tuple[float, float]:
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
    batch = TokenBatch(
        lp[:, 0],
        data["behavior_logp"],
        data["sampled"],
        data["topk_ids"],
        data["topk_behavior_logp"],
        topk_logp,
        data["seq_ids"],
        weight.shape[0],
        pi_sq,
    )
    out = losses(method, params, batch, data, correction, old)
    loss = method.aggregate(params, out.loss, batch, horizon=data["input_ids"].shape[1])
    loss.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0, time.process_time() - c0


def losses(method, params, batch: TokenBatch, data: dict, correction, old: torch.Tensor | None):
    """The method's token losses, with ``correction`` applied when given (pi_old from ``old``)."""
    u = data["u"] if method.needs_u(params) else None
    if correction is None:
        return method.token_losses(batch, data["advantages"], params, u=u)
    kw = {} if old is None else {"old_logp": old[:, 0], "old_topk_logp": old[:, 1:]}
    return corrected_token_losses(method, batch, data["advantages"], params, correction, u=u, **kw)[0]


def method_part(
    data: dict,
    method,
    params,
    sampled_only: bool,
    repeats: int,
    vocab: int,
    correction=None,
    old: torch.Tensor | None = None,
) -> float:
    """Median CPU seconds of the method's own work: TokenBatch -> token_losses -> aggregate -> backward
    to log pi (no model), on log-probabilities near the behaviour's."""
    gen = torch.Generator().manual_seed(2)
    lp_k = (data["behavior_logp"] + 0.05 * torch.randn(data["behavior_logp"].shape, generator=gen)).clamp_max(0.0)
    topk = data["topk_behavior_logp"] if sampled_only else (data["topk_behavior_logp"] + 0.05).clamp_max(0.0)
    ts = []
    for _ in range(repeats):
        logp = lp_k.clone().requires_grad_(True)
        c0 = time.process_time()
        batch = TokenBatch(
            logp,
            data["behavior_logp"],
            data["sampled"],
            data["topk_ids"],
            data["topk_behavior_logp"],
            topk,
            data["seq_ids"],
            vocab,
            data["pi_sq_sum"] if method.needs_full_pi(params) else None,
        )
        out = losses(method, params, batch, data, correction, old)
        method.aggregate(params, out.loss, batch, horizon=data["input_ids"].shape[1]).backward()
        ts.append(time.process_time() - c0)
    return statistics.median(ts)


def bench_config(
    name: str,
    cfg: dict,
    seqs: int,
    tokens: int,
    k: int,
    repeats: int,
    warmup: int,
    chunk: int,
    variants: list[tuple[str, str, dict]] = VARIANTS,
    corrections: dict[str, dict] | None = None,
) -> dict:
    model = build_model(cfg, seed=0)
    n_params = sum(p.numel() for p in model.parameters())
    data = synthetic_batch(model, seqs, tokens, k, seed=1, noise=0.05)
    entries = [(label, get_method(m), make_params(m, **kw), False, None) for label, m, kw in variants]
    entries.append(("grpo (sampled id only)", get_method("grpo"), make_params("grpo"), True, None))
    corrections = CORRECTIONS if corrections is None else corrections
    entries += [
        (label, get_method("grpo"), make_params("grpo"), False, make_correction(block))
        for label, block in corrections.items()
    ]
    times: dict[str, list[tuple[float, float]]] = {e[0]: [] for e in entries}
    old_times: list[tuple[float, float]] = []
    old_all = None
    rng = random.Random(0)
    for rep in range(warmup + repeats):
        order = entries[:]
        rng.shuffle(order)
        for label, method, params, sampled_only, corr in order:
            old = None
            if corr is not None and corr.needs_old:  # the extra forward (decoupled, or a ratio on pi_old), timed apart
                old, wall, cpu = old_forward(model, data, chunk)
                old_all = old
                if rep >= warmup:
                    old_times.append((wall, cpu))
            t = train_step(model, data, method, params, sampled_only, chunk, corr, old)
            if rep >= warmup:
                times[label].append(t)
    base = times["grpo"]
    step_grpo = statistics.median(b[1] for b in base)
    part = {e[0]: method_part(data, e[1], e[2], e[3], 50, cfg["vocab_size"], e[4], old_all) for e in entries}
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
    extra = {}
    if old_times:  # the decoupled forward on its own, as a fraction of grpo's whole step (paired by order only)
        extra[DECOUPLED_FORWARD] = {
            "median_cpu_s": statistics.median(t[1] for t in old_times),
            "ratio": statistics.median(t[1] for t in old_times) / step_grpo,
            "median_wall_s": statistics.median(t[0] for t in old_times),
            "ratio_wall": statistics.median(t[0] for t in old_times) / statistics.median(b[0] for b in base),
        }
    return {
        "extra": extra,
        "config": name,
        "params": n_params,
        "tokens": seqs * tokens,
        "k": k,
        "repeats": repeats,
        "methods": rows,
        "loadavg": os.getloadavg(),
    }


def main() -> None:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--threads", type=count, default=1, help="intra-op threads (1: stable CPU-time ratios on a shared machine)"
    )
    p.add_argument("--quick", action="store_true", help="fewer repeats and a smaller 30M batch")
    p.add_argument("--json", type=str, default=None)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument(
        "--configs", type=str, default=",".join(CONFIGS), help=f"comma-separated subset of {', '.join(CONFIGS)}"
    )
    p.add_argument(
        "--variants",
        type=str,
        default=None,
        help="comma-separated variant labels to time (grpo, the baseline, is always included); default all",
    )
    p.add_argument(
        "--corrections-only",
        action="store_true",
        help="time grpo with each off-policy correction (and the decoupled forward), plus --variants if given",
    )
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    variants = select_variants((args.variants or "grpo") if args.corrections_only else args.variants)
    corrections = CORRECTIONS if (args.corrections_only or args.variants is None) else {}
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
        res = bench_config(name, CONFIGS[name], seqs, tokens, k, reps, warm, args.chunk, variants, corrections)
        results.append(res)
        _print(res, args.threads)
    labels = [label for label, _, _ in variants] + list(corrections)
    core = [r["methods"][label]["ratio"] for r in results for label in labels]
    core_part = [r["methods"][label]["ratio_from_method_part"] for r in results for label in labels]
    core_wall = [r["methods"][label]["ratio_wall"] for r in results for label in labels]
    summary = {
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "torch": torch.__version__,
            "threads": args.threads,
            "loadavg_start": load0,
            "loadavg_end": os.getloadavg(),
        },
        "configs": results,
        "max_overhead_ratio": max(core),
        "max_overhead_ratio_wall": max(core_wall),
        "max_overhead_ratio_from_method_part": max(core_part),
        "per_method_ratio": {
            f"{r['config']}/{label}": row["ratio"] for r in results for label, row in r["methods"].items()
        },
        "per_method_ratio_wall": {
            f"{r['config']}/{label}": row["ratio_wall"] for r in results for label, row in r["methods"].items()
        },
        "goal_all_le_1.05": max(core) <= 1.05,
        "decoupled_forward_ratio": {r["config"]: r["extra"][DECOUPLED_FORWARD]["ratio"] for r in results if r["extra"]},
    }
    print(
        f"max overhead ratio over all methods and configs: cpu {max(core):.3f} (wall "
        f"{max(core_wall):.3f}, "
        f"from the method part alone {max(core_part):.3f}); "
        f"load average {load0[0]:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )
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
    title = (
        f"{res['config']} Qwen3 ({res['params'] / 1e6:.1f}M params), {res['tokens']} tokens, "
        f"K={res['k']}, "
        f"{threads} threads, median of {res['repeats']}, load avg {res['loadavg'][0]:.1f}"
    )
    try:
        from rich.console import Console
        from rich.table import Table

        t = Table(title=title)
        for c in ("method", "cpu s", "ratio (cpu)", "wall s", "ratio (wall)", "method part ms", "ratio from part"):
            t.add_column(c, justify="right")
        for label, row in res["methods"].items():
            t.add_row(
                label,
                f"{row['median_cpu_s']:.4f}",
                f"{row['ratio']:.3f}",
                f"{row['median_wall_s']:.4f}",
                f"{row['ratio_wall']:.3f}",
                f"{1000 * row['method_part_cpu_s']:.2f}",
                f"{row['ratio_from_method_part']:.3f}",
            )
        for label, row in res.get("extra", {}).items():
            t.add_row(
                label,
                f"{row['median_cpu_s']:.4f}",
                f"{row['ratio']:.3f}",
                f"{row['median_wall_s']:.4f}",
                f"{row['ratio_wall']:.3f}",
                "-",
                "-",
            )
        Console(width=160).print(t)
    except ImportError:
        print(title)
        for label, row in res["methods"].items():
            print(
                f"{label:>28} {row['median_cpu_s']:10.4f} {row['ratio']:8.3f} "
                f"{row['median_wall_s']:10.4f} "
                f"{row['ratio_wall']:8.3f} {1000 * row['method_part_cpu_s']:8.2f} "
                f"{row['ratio_from_method_part']:8.3f}"
            )
        for label, row in res.get("extra", {}).items():
            print(
                f"{label:>28} {row['median_cpu_s']:10.4f} {row['ratio']:8.3f} "
                f"{row['median_wall_s']:10.4f} {row['ratio_wall']:8.3f}"
            )


if __name__ == "__main__":
    main()
