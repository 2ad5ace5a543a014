"""The training step in bfloat16 against float32 on this CPU, side by side in one process.

Where a CPU has bfloat16 matrix units (Intel's AMX, AVX512-BF16), a bfloat16 GEMM runs several
times faster than a float32 one. Does that make masktrl's training step faster? This times one
training micro-batch (the policy's packed shared-prompt forward, the DAPO loss and the backward:
``roofline.py``'s packed step, a randomly initialised model of the shape's dimensions) three ways:

* ``float32``: the model in float32 (every preset's ``model.dtype``);
* ``bfloat16``: the same weights in bfloat16 (``model.dtype: bfloat16``); the chunked
  log-probabilities compute the output layer in float32 (masktrl/models/logprobs.py promotes);
* ``autocast``: the float32 model under ``torch.autocast("cpu", bfloat16)``, the mixed precision
  that accelerate's ``mixed_precision: bf16`` sets (configs/accelerate/ddp.yaml on GPUs; masktrl
  itself sets no autocast).

Variants run in alternating blocks of ``--steps`` steps (the order reversed every other round), by
the process's CPU clock; a round's ratio is its float32 block's time over the variant's, so a
change of the machine's speed between rounds cancels. Then the step's GEMMs alone: their shapes
recorded by torch's profiler in one float32 step, each timed in float32 and in bfloat16
(alternating), summed with their counts: what the matrix units could save if nothing else changed.

Both bfloat16 forms are another arithmetic, not the float32 step made faster: the trainer's
log-probabilities round to bfloat16's 8 bits (docs/LAB.md measures a bfloat16 engine's rounding
as a mismatch regime of the lab).

    python benchmarks/bf16_step.py --json benchmarks/results/bf16_step.json
"""

from __future__ import annotations

import copy
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

from common import count, die, finish, median, parser, print_table, quiet

VARIANTS = ("float32", "bfloat16", "autocast")
GEMM_OPS = ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm")
BF16_FLAGS = ("amx_bf16", "amx_tile", "avx512_bf16")


def cpu_bf16_flags() -> list[str]:
    """The bfloat16 matrix features this CPU reports (/proc/cpuinfo flags), in BF16_FLAGS order."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return [f for f in BF16_FLAGS if f in flags]


def sign_test_threshold(rounds: int, alpha: float = 0.05) -> int | None:
    """The fewest rounds out of ``rounds`` in which one side must win for a two-sided sign test at
    ``alpha`` (None when no count can reach it)."""
    for k in range(rounds // 2 + 1, rounds + 1):
        tail = sum(math.comb(rounds, i) for i in range(k, rounds + 1)) / 2**rounds
        if 2 * tail <= alpha:
            return k
    return None


def verdict(faster: int, slower: int, threshold: int | None) -> str:
    """The sign test's reading of a variant's round counts against float32."""
    if threshold is not None and faster >= threshold:
        return "faster"
    if threshold is not None and slower >= threshold:
        return "slower"
    return "not told apart"


def step_fns(model, samples) -> dict:
    """Per variant: one forward + DAPO loss + backward of ``samples`` (gradients dropped after)."""
    from masktrl.models import packing
    from roofline import step_fn

    low = copy.deepcopy(model).to(torch.bfloat16)
    runs = {"float32": (model, False), "bfloat16": (low, False), "autocast": (model, True)}
    out = {}
    for name, (m, autocast) in runs.items():
        run = step_fn(m, samples, packed=True, share=True)

        def step(m=m, run=run, autocast=autocast):
            with packing.segments_attention(m.base_model), torch.autocast("cpu", torch.bfloat16, enabled=autocast):
                loss = run()
            loss.backward()
            m.zero_grad(set_to_none=True)

        out[name] = step
    return out


def gemm_shapes(step) -> list[tuple[str, list, int]]:
    """(op, input shapes, count) of every GEMM one call of ``step`` runs."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    found: dict[tuple, int] = {}
    for e in prof.events():
        if e.name in GEMM_OPS:  # mm(a, b[, out]), bmm(a, b), addmm[_](self, a, b, ...): the two operands
            operands = e.input_shapes[1:3] if e.name.startswith("aten::addmm") else e.input_shapes[:2]
            key = (e.name, tuple(tuple(s) for s in operands))
            found[key] = found.get(key, 0) + 1
    return [(op, [list(s) for s in shapes], n) for (op, shapes), n in found.items()]


def gemm_fn(shapes: list, dtype):
    """One GEMM of ``shapes`` (its two matrix operands, batched for bmm) in ``dtype``."""
    a, b = (torch.randn(s, dtype=torch.float32).to(dtype) for s in shapes)
    return (lambda: torch.bmm(a, b)) if a.dim() == 3 else (lambda: torch.mm(a, b))


def gemm_ms(gemms, rounds: int, reps: int) -> dict:
    """CPU ms of the step's GEMMs alone per dtype (each GEMM its count times): the median over
    ``rounds`` alternating rounds of ``reps`` calls per GEMM."""
    fns = {
        name: [(gemm_fn(shapes, dt), n) for _, shapes, n in gemms]
        for name, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16))
    }
    for calls in fns.values():
        for f, _ in calls:
            f()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(rounds):
        for name in fns if r % 2 == 0 else list(fns)[::-1]:
            total = 0.0
            for f, n in fns[name]:
                t0 = time.process_time()
                for _ in range(reps):
                    f()
                total += (time.process_time() - t0) / reps * n
            times[name].append(total * 1e3)
    return {k: median(v) for k, v in times.items()}


def measure(name: str, spec: dict, rounds: int, steps: int, gemm_rounds: int, gemm_reps: int) -> dict:
    from roofline import build

    model, _, samples, _, _ = build(name, spec, torch.device("cpu"), torch.float32)
    model.train()
    fns = step_fns(model, samples)
    for f in fns.values():  # warm-up: allocator, first-call dispatch
        f()
    blocks = []
    for r in range(rounds):
        block = {}
        for v in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
            t0 = time.process_time()
            for _ in range(steps):
                fns[v]()
            block[v] = (time.process_time() - t0) / steps * 1e3
        blocks.append(block)
    gemms = gemm_shapes(fns["float32"])
    threshold = sign_test_threshold(rounds)
    rows = {}
    for v in VARIANTS:
        ratios = [b["float32"] / b[v] for b in blocks]
        faster = sum(x > 1 for x in ratios)
        slower = sum(x < 1 for x in ratios)
        rows[v] = {
            "cpu_ms": median([b[v] for b in blocks]),
            "ratio_median": median(ratios),
            "faster_rounds": faster,
            "slower_rounds": slower,
            "verdict": None if v == "float32" else verdict(faster, slower, threshold),
        }
    return {
        "shape": name,
        "tokens_run": sum(len(s.gen.response_ids) for s in samples),
        "sequences": len(samples),
        "rounds": blocks,
        "variants": rows,
        "gemms": [{"op": op, "shapes": shapes, "count": n} for op, shapes, n in gemms],
        "gemm_ms": gemm_ms(gemms, gemm_rounds, gemm_reps),
        "sign_test_threshold": threshold,
    }


def main(argv=None) -> dict:
    from roofline import shapes

    p = parser(__doc__.split("\n")[0])
    p.add_argument("--shapes", default="lab,long", help="comma-separated: default, lab, long (roofline.py's)")
    p.add_argument("--rounds", type=count, default=10, help="rounds of one block per variant (order alternating)")
    p.add_argument("--steps", default="lab=10,long=1,default=5", help="steps per block, per shape")
    p.add_argument("--gemm-rounds", type=count, default=5, help="rounds of the GEMMs alone (dtypes alternating)")
    p.add_argument("--gemm-reps", type=count, default=5, help="calls per GEMM in a round")
    args = p.parse_args(argv)
    names = [s.strip() for s in args.shapes.split(",") if s.strip()]
    try:
        steps = {k: int(v) for k, v in (x.split("=") for x in args.steps.split(","))}
    except ValueError:
        die(f"error: --steps must be shape=N pairs, got {args.steps!r}")
    if not names:
        die("error: --shapes names no shape: default, lab, long")
    if unknown := [n for n in names if n not in ("default", "lab", "long")]:
        die(f"error: unknown shape(s) {', '.join(unknown)}: default, lab, long")
    if min(steps.values(), default=1) < 1:
        die(f"error: --steps must be at least 1 for every shape, got {args.steps!r}")
    quiet()
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()[0]
    results = []
    for name, spec in shapes(names).items():
        r = measure(name, spec, args.rounds, steps.get(name, 1), args.gemm_rounds, args.gemm_reps)
        results.append(r)
        g = r["gemm_ms"]
        print_table(
            f"{name}: one training micro-batch, {args.rounds} rounds of {steps.get(name, 1)} step(s) per variant",
            ["variant", "CPU ms per step", "x float32 (median of rounds)", "faster / slower rounds", "verdict"],
            [
                [v, x["cpu_ms"], x["ratio_median"], f"{x['faster_rounds']} / {x['slower_rounds']}", x["verdict"] or ""]
                for v, x in r["variants"].items()
            ],
        )
        print(f"  the step's GEMMs alone: float32 {g['float32']:.1f} ms, bfloat16 {g['bfloat16']:.1f} ms")
    return finish(  # argv None: finish reads sys.argv
        "bf16_step.py",
        argv,
        load_start,
        args.json,
        cpu_bf16_flags=cpu_bf16_flags(),
        cpu_capability=torch.backends.cpu.get_cpu_capability(),
        threads=args.threads,
        shapes=results,
    )


if __name__ == "__main__":
    main()
