"""Peak memory and time of chunked ``token_logprobs`` vs a naive full log_softmax (CPU, float32).

Each variant runs forward + backward in a fresh subprocess. Peak extra memory is the process's
peak RSS (``getrusage(RUSAGE_SELF).ru_maxrss``) minus the RSS measured right after the inputs
were allocated and touched, so it counts logits, softmax buffers and the [V, H] weight
gradient (which both variants need). Time is the median wall time of ``--repeats`` runs in
that process (the first run sets the memory peak); process CPU time (user + sys, all threads)
is reported next to it, because on a shared machine wall time mostly measures the scheduler.

    python benchmarks/logprob_memory.py                 # V=151936, H=1024, 4 x 1024 tokens
    python benchmarks/logprob_memory.py --quick --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

from common import count, peak_rss_mib, rss_mib, run_worker  # benchmarks/common.py


def worker(args) -> dict:
    import torch

    from masktrl.models.logprobs import token_logprobs

    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    n = args.seqs * args.tokens
    hidden = torch.randn(args.seqs, args.tokens, args.hidden, generator=gen).requires_grad_(True)  # after final norm
    weight = (0.02 * torch.randn(args.vocab, args.hidden, generator=gen)).requires_grad_(True)  # lm_head init scale
    ids = torch.randint(0, args.vocab, (args.seqs, args.tokens, 1 + args.topk), generator=gen)  # sampled + top-K
    g = torch.randn(args.seqs, args.tokens, 1 + args.topk, generator=gen)
    base_rss = rss_mib()
    base_peak = peak_rss_mib()

    def step():
        if args.variant == "naive":
            logits = hidden @ weight.T  # [B, T, V]
            lp = torch.log_softmax(logits / args.temperature, dim=-1).gather(-1, ids)
        else:
            lp = token_logprobs(hidden, weight, ids, temperature=args.temperature, chunk_size=args.chunk)
        (lp * g).sum().backward()
        hidden.grad = weight.grad = None

    times, cpu = [], []
    for _ in range(args.repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    peak = peak_rss_mib()
    return {
        "variant": args.variant,
        "tokens": n,
        "peak_extra_mib": peak - base_rss,  # valid while the step's peak exceeds the import-time peak
        "peak_rss_mib": peak,
        "base_rss_mib": base_rss,
        "peak_before_step_mib": base_peak,
        "time_s": statistics.median(times),
        "times_s": times,
        "cpu_s": statistics.median(cpu),  # user + sys of all threads
    }


def run_variant(args, variant: str) -> dict:
    keys = ("vocab", "hidden", "seqs", "tokens", "topk", "chunk", "threads", "repeats", "temperature")
    return run_worker(__file__, variant, args, keys)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--seqs", type=int, default=4)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--topk", type=int, default=20, help="ids per token = 1 + topk (sampled + behaviour top-K)")
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--threads", type=count, default=2)
    p.add_argument("--repeats", type=count, default=1)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--quick", action="store_true", help="V=32768, H=512, 4 x 256 tokens, chunk 256, 3 repeats")
    p.add_argument("--json", type=str, default=None)
    p.add_argument("--worker", choices=["naive", "chunked"], default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        args.variant = args.worker
        print(json.dumps(worker(args)))
        return
    if args.quick:
        args.vocab, args.hidden, args.tokens, args.chunk, args.repeats = 32768, 512, 256, 256, 3
    results = {v: run_variant(args, v) for v in ("naive", "chunked")}
    mem_ratio = results["chunked"]["peak_extra_mib"] / results["naive"]["peak_extra_mib"]
    time_ratio = results["chunked"]["time_s"] / results["naive"]["time_s"]
    cpu_ratio = results["chunked"]["cpu_s"] / results["naive"]["cpu_s"]
    summary = {
        "config": {
            k: getattr(args, k)
            for k in ("vocab", "hidden", "seqs", "tokens", "topk", "chunk", "threads", "repeats", "temperature")
        },
        "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version()},
        "results": results,
        "peak_mem_ratio": mem_ratio,
        "time_ratio": time_ratio,
        "cpu_time_ratio": cpu_ratio,
        "loadavg": os.getloadavg(),
        "goals": {
            "peak_mem_ratio<=0.25": mem_ratio <= 0.25,
            "time_ratio<=1.2": time_ratio <= 1.2,
            "cpu_time_ratio<=1.2": cpu_ratio <= 1.2,
        },
    }
    import torch

    summary["machine"]["torch"] = torch.__version__
    _print_table(args, results, mem_ratio, time_ratio, cpu_ratio)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)


def _print_table(args, results, mem_ratio, time_ratio, cpu_ratio) -> None:
    title = (
        f"token_logprobs: V={args.vocab}, H={args.hidden}, {args.seqs}x{args.tokens} tokens, "
        f"{1 + args.topk} ids/token, chunk {args.chunk}, {args.threads} threads, fwd+bwd "
        "float32, "
        f"load avg {os.getloadavg()[0]:.1f}"
    )
    rows = [(v, f"{r['peak_extra_mib']:.0f}", f"{r['time_s']:.2f}", f"{r['cpu_s']:.2f}") for v, r in results.items()]
    rows.append(("chunked / naive", f"{mem_ratio:.3f}", f"{time_ratio:.3f}", f"{cpu_ratio:.3f}"))
    try:
        from rich.console import Console
        from rich.table import Table

        t = Table(title=title)
        for c in ("variant", "peak extra MiB", "wall s (median)", "cpu s (median)"):
            t.add_column(c, justify="right")
        for r in rows:
            t.add_row(*r)
        Console(width=160).print(t)
    except ImportError:
        print(title)
        for r in [("variant", "peak extra MiB", "wall s", "cpu s")] + rows:
            print(f"{r[0]:>16} {r[1]:>15} {r[2]:>10} {r[3]:>10}")


if __name__ == "__main__":
    main()
