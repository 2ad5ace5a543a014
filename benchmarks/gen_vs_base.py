"""Generation throughput at the lab shape against an earlier commit's, on the same machine in one run.

The transformers engine generates the lab's batches (configs/lab.yaml: a 2-layer model, hidden
size 128, 2,004-token vocabulary, 8 samples per prompt, 5 new tokens, K = 20 lists; random
weights, real task prompts) with this tree's code and with a baseline tree's (by default commit
19f900d, the code issue #39 starts from, extracted with ``git archive`` into a temporary
folder), each variant in its own process (one thread), the processes alternating round by
round. Each process times ``--reps`` batches after one warm-up; the figure is generated tokens
per second of process CPU time (what a machine shared with other jobs inflates least), the
median over ``--rounds`` rounds, and its ratio to the baseline's ``generate``. Two batch
sizes: 64 rows (8 prompts: benchmarks/roofline.py's lab shape, one training micro-batch) and
512 rows (64 prompts: the batch a lab step generates).

    python benchmarks/gen_vs_base.py --json benchmarks/results/gen_vs_base.json
    python benchmarks/gen_vs_base.py --base /path/to/old/checkout --rows 512 --rounds 5
    python benchmarks/gen_vs_base.py --ops --json benchmarks/results/gen_ops.json   # single operations
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import finish, machine, median, parser, write_json

ROOT = Path(__file__).resolve().parents[1]
BASE_COMMIT = "19f900d"
VARIANTS = {  # name -> HFEngine keywords (this tree); the baseline runs "generate" only
    "generate": {},
    "fused": {"decode": "fused"},
    "fused+inverse_cdf": {"decode": "fused", "draw": "inverse_cdf"},
    "drop_finished+inverse_cdf": {"drop_finished": True, "draw": "inverse_cdf"},
}

CHILD = r"""
import json, random, sys, time
import torch
torch.set_num_threads(1)
from masktrl.config import load_config
from masktrl.models.tiny import TinyModelConfig, build_tiny_model, tiny_tokenizer
from masktrl.rollout.base import SamplingSettings
from masktrl.rollout.hf import HFEngine
from masktrl.tasks import make_task

config, prompts_n, reps, engine_kw = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
cfg = load_config(config)
m = cfg.model
task = make_task(cfg.task, cfg.model)
tok = tiny_tokenizer(m.tokenizer, task.alphabet())
shape = TinyModelConfig(m.hidden_size, m.num_layers, m.num_heads, m.num_kv_heads, m.intermediate_size)
model = build_tiny_model(tok, shape, 0).to(torch.float32).eval()
examples = task.train_examples(prompts_n, random.Random(0))
prompts = [tok(ex.prompt, add_special_tokens=False)["input_ids"] for ex in examples]
r = cfg.rollout
settings = SamplingSettings(
    n=r.n, max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, logprobs_k=r.logprobs_k
)
engine = HFEngine(model, tok, **engine_kw)
engine.generate(prompts, settings, seed=0)
cpu = wall = tokens = 0
for rep in range(reps):
    c0, w0 = time.process_time(), time.perf_counter()
    gens = engine.generate(prompts, settings, seed=rep + 1)
    cpu += time.process_time() - c0
    wall += time.perf_counter() - w0
    tokens += sum(len(g.response_ids) for group in gens for g in group)
print(json.dumps({"cpu_s": cpu, "wall_s": wall, "tokens": tokens, "rows": len(prompts) * r.n}))
"""


def extract(commit: str, into: Path) -> Path:
    """The tree of ``commit`` (``git archive``) under ``into``."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def measure(tree: Path, prompts: int, reps: int, engine_kw: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    config = str(ROOT / "configs" / "lab.yaml")
    out = subprocess.run(
        [sys.executable, "-c", CHILD, config, str(prompts), str(reps), json.dumps(engine_kw)],
        cwd=tree,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def op_times(rows: int = 512, vocab: int = 2004, hidden: int = 128, k: int = 20, reps: int = 30) -> dict:
    """CPU milliseconds of the single operations of one decode step at ``rows`` x ``vocab``
    (one thread, this process): the draws, the records' ``topk`` and ``log_softmax``, the
    ``lm_head`` GEMM, and the inverse-CDF draw's parts."""
    import time

    import torch

    from masktrl.rollout.draw import draw_buffer, inverse_cdf

    torch.set_num_threads(1)
    torch.manual_seed(0)
    lp = torch.log_softmax(3 * torch.randn(rows, vocab), -1)
    p = lp.exp()
    h, w = torch.randn(rows, hidden), torch.randn(vocab, hidden)
    buf = draw_buffer(rows, vocab, "cpu")
    f32, f64 = torch.empty(rows, vocab), torch.empty(rows, vocab, dtype=torch.float64)
    ops = {
        "multinomial": lambda: torch.multinomial(p, 1),
        "exponential_": lambda: torch.empty_like(p).exponential_(),
        "softmax": lambda: torch.softmax(lp, -1),
        "log_softmax": lambda: torch.log_softmax(lp, -1),
        "topk": lambda: lp.topk(k, -1),
        "lm_head": lambda: torch.nn.functional.linear(h, w),
        "inverse_cdf (blocks of 64)": lambda: inverse_cdf(lp, buf),
        "exp + float64 cumsum, fresh tensors": lambda: lp.exp().cumsum(-1, dtype=torch.float64),
        "exp + float64 cumsum, reused buffers": lambda: torch.cumsum(
            torch.exp(lp, out=f32), -1, dtype=torch.float64, out=f64
        ),
    }
    out = {}
    for name, f in ops.items():
        f()
        c = time.process_time()
        for _ in range(reps):
            f()
        out[name] = 1000 * (time.process_time() - c) / reps
        print(f"  {rows} x {vocab}  {name:38s} {out[name]:7.3f} CPU ms", flush=True)
    return out


def main(argv=None) -> dict:
    p = parser(__doc__.split("\n")[0])
    p.add_argument("--base", default=None, help=f"a checkout of the baseline code (default: commit {BASE_COMMIT})")
    p.add_argument("--rows", default="64,512", help="batch sizes in rows (8 samples per prompt), comma-separated")
    p.add_argument("--rounds", type=int, default=3, help="rounds of alternating processes")
    p.add_argument("--reps", type=int, default=5, help="timed batches per process (after one warm-up)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="this tree's variants, comma-separated")
    p.add_argument("--ops", action="store_true", help="only the single operations' CPU times (512 x 2,004)")
    args = p.parse_args(argv)
    if args.ops:
        result = {"ops_cpu_ms": op_times(), "command": "python benchmarks/gen_vs_base.py --ops", "machine": machine()}
        write_json(args.json, result)
        return result
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(args.base) if args.base else extract(BASE_COMMIT, Path(tmp))
        runs = [("base:generate", base, {})] + [(v, ROOT, VARIANTS[v]) for v in variants]
        rows_out = []
        for rows in (int(x) for x in args.rows.split(",")):
            per: dict[str, list[dict]] = {name: [] for name, _, _ in runs}
            for r in range(args.rounds):
                for name, tree, kw in runs if r % 2 == 0 else list(reversed(runs)):
                    per[name].append(measure(tree, rows // 8, args.reps, kw))
                    last = per[name][-1]
                    print(
                        f"  {rows:4d} rows  {name:28s} {last['tokens'] / last['cpu_s']:9,.0f} tokens/CPU-s", flush=True
                    )
            rate = {n: median([x["tokens"] / x["cpu_s"] for x in v]) for n, v in per.items()}
            wall = {n: median([x["tokens"] / x["wall_s"] for x in v]) for n, v in per.items()}
            for name in per:
                rows_out.append(
                    {
                        "rows": rows,
                        "variant": name,
                        "tokens_per_cpu_s": rate[name],
                        "tokens_per_s": wall[name],
                        "ratio_vs_base_cpu": rate[name] / rate["base:generate"],
                        "ratio_vs_base_wall": wall[name] / wall["base:generate"],
                        "runs": per[name],
                    }
                )
    print(
        f"\ngeneration at the lab shape vs {args.base or BASE_COMMIT} (tokens per CPU-second, median of {args.rounds})"
    )
    for row in rows_out:
        print(
            f"  {row['rows']:4d} rows  {row['variant']:28s} {row['tokens_per_cpu_s']:9,.0f}"
            f"  x{row['ratio_vs_base_cpu']:.2f} (wall x{row['ratio_vs_base_wall']:.2f})"
        )
    return finish(
        "gen_vs_base.py",
        argv,
        load_start,
        args.json,
        base=args.base or BASE_COMMIT,
        threads=1,
        rounds=args.rounds,
        reps=args.reps,
        rows=rows_out,
    )


if __name__ == "__main__":
    main()
