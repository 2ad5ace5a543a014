"""How masktrl's step time grows with the group size, the response length and the top-K.

Each point is a short run of the real training loop (``masktrl.recipes.train.train``) on the
tiny default with one setting changed; ``--steps`` steps are timed per run (the first and
the last, which writes the final checkpoint, are not). The points are run round-robin,
``--reps`` times, so load drift on a shared machine spreads over all of them.

* group size: ``rollout.n`` in ``--groups`` (32 prompts per step, so 4 -> 128 sequences);
* response length: ``rollout.max_new_tokens`` in ``--lengths`` with EOS suppressed
  (``generation_config.suppress_tokens``), so every response is exactly that long; the
  warm-started model answers in about 4 tokens and would otherwise stop there;
* top-K: ``rollout.logprobs_k`` in ``--ks``. The default tokenizer has 17 tokens, so K = 20
  already means "all of them"; this sweep uses a randomly initialised tiny model of the same
  shape with a ``--vocab``-token character vocabulary (EOS suppressed, ``max_new_tokens`` 6).

    python benchmarks/scaling.py --json outputs/bench/scaling.json
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    BENCH_TMP,
    PhaseTimer,
    bench_config,
    big_vocab_model,
    copy_model,
    count,
    group_phases,
    machine,
    median,
    parser,
    print_table,
    quiet,
    run_masktrl,
    warm_model,
    wrap_masktrl_phases,
    write_json,
)


def main(argv=None) -> dict:
    p = parser(__doc__.split("\n")[0])
    p.add_argument("--reps", type=count, default=2, help="rounds over all points")
    p.add_argument("--steps", type=count, default=4, help="timed steps per run")
    p.add_argument("--groups", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--lengths", type=int, nargs="+", default=[6, 12, 24])
    p.add_argument("--ks", type=int, nargs="+", default=[1, 5, 20, 100])
    p.add_argument("--vocab", type=int, default=4096, help="vocabulary of the model used for the K sweep")
    args = p.parse_args(argv)
    quiet()

    n_steps = args.steps + 2
    common = [
        f"train.steps={n_steps}",
        f"train.checkpoint_every={n_steps}",
        f"train.threads={args.threads}",
        "task.n_test=32",
    ]
    warm = warm_model(bench_config())
    BENCH_TMP.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=BENCH_TMP) as d:
        eos = _eos_id(warm)
        fixed_len = copy_model(warm, Path(d) / "fixed-length", suppress_tokens=[eos])
        big = big_vocab_model(Path(d) / "big-vocab", args.vocab, bench_config())
        copy_model(big, big, suppress_tokens=[_eos_id(big)])
        points = (
            [("group size", n, [f"model.path={warm}", f"rollout.n={n}"]) for n in args.groups]
            + [
                ("max_new_tokens, EOS off", t, [f"model.path={fixed_len}", f"rollout.max_new_tokens={t}"])
                for t in args.lengths
            ]
            + [
                (f"top-K, V={args.vocab}, EOS off", k, [f"model.path={big}", f"rollout.logprobs_k={k}"])
                for k in args.ks
            ]
        )
        runs = {i: [] for i in range(len(points))}
        timer = PhaseTimer()
        wrap_masktrl_phases(timer)
        try:
            for rep in range(args.reps):
                order = list(range(len(points)))
                order = order[rep % len(order) :] + order[: rep % len(order)]  # rotate the start point
                for i in order:
                    sweep, value, overrides = points[i]
                    phases: list[dict] = []
                    run = run_masktrl(
                        bench_config(*overrides, *common),
                        on_start=timer.take,
                        on_step=lambda phases=phases: phases.append(timer.take()),
                    )
                    counted = slice(1, len(run["step_times"]) - 1)
                    runs[i].append(
                        {
                            "step_s": run["step_times"][counted],
                            "cpu_s": run["cpu_times"][counted],
                            "tokens": [r["tokens"] for r in run["metrics"]][counted],
                            "phases": phases[counted],
                        }
                    )
                    print(
                        f"rep {rep + 1}/{args.reps} {sweep} = {value}: "
                        f"{1000 * median(runs[i][-1]['step_s']):.0f} ms/step",
                        flush=True,
                    )
        finally:
            timer.restore()

    rows = [point_stats(sweep, value, runs[i]) for i, (sweep, value, _) in enumerate(points)]
    result = {
        "points": rows,
        "settings": {
            "steps": args.steps,
            "reps": args.reps,
            "threads": args.threads,
            "vocab_for_k": args.vocab,
            "base": "configs/tiny.yaml (grpo, 32 prompts/step, n=8, max_new_tokens=6, K=20)",
        },
        "machine": machine(),
    }
    report(rows)
    write_json(args.json, result)
    return result


def _eos_id(model_dir: Path) -> int:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir).eos_token_id


def point_stats(sweep: str, value, blocks: list[dict]) -> dict:
    step_s = [t for b in blocks for t in b["step_s"]]
    tokens = [n for b in blocks for n in b["tokens"]]
    phase_sum: dict[str, float] = {}
    for b in blocks:
        for ph in b["phases"]:
            for k, v in ph.items():
                phase_sum[k] = phase_sum.get(k, 0.0) + v
    stages = group_phases(phase_sum, sum(step_s))
    return {
        "sweep": sweep,
        "value": value,
        "step_ms": 1000 * median(step_s),
        "cpu_ms": 1000 * median([t for b in blocks for t in b["cpu_s"]]),
        "tokens_per_step": median(tokens),
        "tokens_per_s": median([n / t for b in blocks for n, t in zip(b["tokens"], b["step_s"])]),
        "stage_ms": {k: 1000 * v / len(step_s) for k, v in stages.items()},
        "steps_counted": len(step_s),
    }


def report(rows: list[dict]) -> None:
    table = []
    for sweep in dict.fromkeys(r["sweep"] for r in rows):
        pts = [r for r in rows if r["sweep"] == sweep]
        first = pts[0]["step_ms"]
        for r in pts:
            s = r["stage_ms"]
            table.append(
                [
                    sweep,
                    r["value"],
                    r["step_ms"],
                    r["step_ms"] / first,
                    r["cpu_ms"],
                    r["tokens_per_step"],
                    r["tokens_per_s"],
                    s["rollout"],
                    s["logprobs"] + s["loss"] + s["backward"],
                    s["io"],
                ]
            )
    print_table(
        "masktrl step time vs group size, response length and K",
        [
            "sweep",
            "value",
            "ms/step",
            "x first",
            "CPU ms/step",
            "tokens/step",
            "tokens/s",
            "rollout ms",
            "update ms",
            "io ms",
        ],
        table,
    )


if __name__ == "__main__":
    main()
