"""Generation throughput at the lab shape against an earlier commit's, on the same machine in one run.

The transformers engine generates the lab's batches (configs/lab.yaml: a 2-layer model, hidden
size 128, 2,004-token vocabulary, 8 samples per prompt, 5 new tokens, K = 20 lists; random
weights, real task prompts) with this tree's code and with a baseline tree's (by default commit
19f900d, the code issue #39 starts from, extracted with ``git archive`` into a temporary
folder), each variant in its own process (``--threads`` torch threads, one by default), the
processes alternating round by round. Each process times ``--reps`` batches after one warm-up;
the figure is generated tokens per second of process CPU time (what a machine shared with other
jobs inflates least), the median over ``--rounds`` rounds, and its ratio to the baseline's
``generate``. Two batch sizes: 64 rows (8 prompts: benchmarks/roofline.py's lab shape, one
training micro-batch) and 512 rows (64 prompts: the batch a lab step generates).

``floor`` is not an engine but the operations a batch's records cannot do without, on tensors
of the batch's shapes and nothing else (``FLOOR_CHILD``): the model's GEMMs, the attention, and
per step ``log_softmax``, the top-K list, the inverse-CDF draw and the sampled token's log mu,
then the records' conversion to lists. Its tokens per CPU-second over the baseline's is the most
any eager loop that records the same lists with torch's kernels can reach on the machine.

    python benchmarks/gen_vs_base.py --json benchmarks/results/gen_vs_base.json
    python benchmarks/gen_vs_base.py --base /path/to/old/checkout --rows 512 --rounds 5
    python benchmarks/gen_vs_base.py --ops --json benchmarks/results/gen_ops.json   # single operations
    python benchmarks/gen_vs_base.py --top-p 0.9 --variants generate,fused --rows 512   # nucleus sampling
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import count, finish, machine, median, parser, write_json

ROOT = Path(__file__).resolve().parents[1]
BASE_COMMIT = "19f900d"
VARIANTS = {  # name -> HFEngine keywords (this tree); the baseline runs "generate" only
    "generate": {},
    "fused": {"decode": "fused"},
    "fused+inverse_cdf": {"decode": "fused", "draw": "inverse_cdf"},
    "drop_finished+inverse_cdf": {"drop_finished": True, "draw": "inverse_cdf"},
    "floor": None,  # not an engine: FLOOR_CHILD, the arithmetic any loop recording these lists must run
}

CHILD = r"""
import json, os, random, sys, time
import torch
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
from masktrl.config import load_config
from masktrl.models.tiny import TinyModelConfig, build_tiny_model, tiny_tokenizer
from masktrl.rollout.base import SamplingSettings
from masktrl.rollout.hf import HFEngine
from masktrl.tasks import make_task

config, prompts_n, reps, engine_kw = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
top_p = float(sys.argv[5]) if len(sys.argv) > 5 else None
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
    n=r.n,
    max_new_tokens=r.max_new_tokens,
    temperature=r.temperature,
    top_p=r.top_p if top_p is None else top_p,
    logprobs_k=r.logprobs_k,
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
rows = len(prompts) * r.n
print(json.dumps({"cpu_s": cpu, "wall_s": wall, "tokens": tokens, "rows": rows, "threads": torch.get_num_threads()}))
"""


# The floor of a batch: only the operations whose results the records are made of or that produce
# them, on tensors of the batch's shapes, one after another with nothing else in between: every
# Linear of the model (the shared prefill's on each prompt's tokens once, then one per decode step
# on every row), the attention at each step's key length, and per step log_softmax, the top-K
# list, the inverse-CDF draw (the cheapest exact draw masktrl has) and the sampled token's log mu;
# then the records' conversion to Python lists. No norms, rotary embedding, residual adds,
# activation, embedding, Python loop or bookkeeping: a lower bound on the CPU time of any eager
# implementation that records the same lists with the same GEMMs.
FLOOR_CHILD = r"""
import json, os, random, sys, time
import torch
import torch.nn.functional as F
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
from masktrl.config import load_config
from masktrl.models.tiny import TinyModelConfig, build_tiny_model, tiny_tokenizer
from masktrl.rollout.draw import draw_buffer, inverse_cdf
from masktrl.tasks import make_task

config, prompts_n, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
cfg = load_config(config)
m, r = cfg.model, cfg.rollout
task = make_task(cfg.task, cfg.model)
tok = tiny_tokenizer(m.tokenizer, task.alphabet())
shape = TinyModelConfig(m.hidden_size, m.num_layers, m.num_heads, m.num_kv_heads, m.intermediate_size)
model = build_tiny_model(tok, shape, 0).to(torch.float32).eval()
examples = task.train_examples(prompts_n, random.Random(0))
width = max(len(tok(ex.prompt, add_special_tokens=False)["input_ids"]) for ex in examples)
c = model.config
rows, steps, k, vocab = prompts_n * r.n, r.max_new_tokens, r.logprobs_k, c.vocab_size
hq, hk, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
linears = [mod.weight for layer in model.model.layers for mod in layer.modules() if isinstance(mod, torch.nn.Linear)]
head = model.lm_head.weight
g = torch.Generator().manual_seed(0)
def x_of(n, w):
    return torch.randn(n, w.shape[1], generator=g)
pre_x = [x_of(prompts_n * (width - 1), w) for w in linears]
step_x = [x_of(rows, w) for w in linears]
hid = torch.randn(rows, head.shape[1], generator=g)
pre_q = torch.randn(prompts_n, hq, width - 1, d, generator=g)
pre_kv = torch.randn(prompts_n, hk, width - 1, d, generator=g)
q = torch.randn(rows, hq, 1, d, generator=g)
keys = torch.randn(rows, hk, width + steps, d, generator=g)
buf = draw_buffer(rows, vocab, "cpu")
def batch():
    with torch.no_grad():
        for w, x in zip(linears, pre_x):
            F.linear(x, w)
        for _ in c.layer_types:
            F.scaled_dot_product_attention(pre_q, pre_kv, pre_kv, is_causal=True, enable_gqa=True)
        ids, logp, top_ids, top_lp = [], [], [], []
        for t in range(steps):
            for w, x in zip(linears, step_x):
                F.linear(x, w)
            kv = keys[:, :, : width + t]
            for _ in c.layer_types:
                F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
            lp = torch.log_softmax(F.linear(hid, head), -1)
            vals, idx = lp.topk(k, -1)
            nxt = inverse_cdf(lp, buf)
            ids.append(nxt)
            logp.append(lp.gather(1, nxt[:, None]).squeeze(1))
            top_ids.append(idx)
            top_lp.append(vals)
        for part in (ids, logp, top_ids, top_lp):
            torch.stack(part, 1).tolist()
batch()
c0, w0 = time.process_time(), time.perf_counter()
for _ in range(reps):
    batch()
cpu, wall = time.process_time() - c0, time.perf_counter() - w0
tokens, threads = reps * rows * steps, torch.get_num_threads()
print(json.dumps({"cpu_s": cpu, "wall_s": wall, "tokens": tokens, "rows": rows, "threads": threads}))
"""


def extract(commit: str, into: Path) -> Path:
    """The tree of ``commit`` (``git archive``) under ``into``."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def measure(tree: Path, prompts: int, reps: int, engine_kw: dict | None, top_p: float = 1.0, threads: int = 1) -> dict:
    """One child process's timed batches with ``threads`` torch threads: the engine with
    ``engine_kw`` sampling with ``top_p``, or the floor (None; top-p 1)."""
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    config = str(ROOT / "configs" / "lab.yaml")
    child = (
        [CHILD, config, str(prompts), str(reps), json.dumps(engine_kw), repr(top_p)] if engine_kw is not None else None
    )
    out = subprocess.run(
        [sys.executable, "-c", *(child or [FLOOR_CHILD, config, str(prompts), str(reps)])],
        cwd=tree,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def op_times(
    rows: int = 512, vocab: int = 2004, hidden: int = 128, k: int = 20, reps: int = 30, threads: int = 1
) -> dict:
    """CPU milliseconds of the single operations of one decode step at ``rows`` x ``vocab``
    (``threads`` torch threads, this process): the draws, the records' ``topk`` and
    ``log_softmax``, the ``lm_head`` GEMM, and the inverse-CDF draw's parts."""
    import time

    import torch

    from masktrl.rollout.draw import draw_buffer, inverse_cdf

    torch.set_num_threads(threads)
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
    p.add_argument("--rounds", type=count, default=3, help="rounds of alternating processes")
    p.add_argument("--reps", type=count, default=5, help="timed batches per process (after one warm-up)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="this tree's variants, comma-separated")
    p.add_argument("--ops", action="store_true", help="only the single operations' CPU times (512 x 2,004)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling for every engine (the lab's: 1)")
    args = p.parse_args(argv)
    if not 0 < args.top_p <= 1:
        p.error(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.ops:
        command = "python benchmarks/gen_vs_base.py --ops" + (f" --threads {args.threads}" if args.threads > 1 else "")
        result = {"ops_cpu_ms": op_times(threads=args.threads), "command": command, "machine": machine()}
        write_json(args.json, result)
        return result
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if args.top_p < 1 and "floor" in variants:
        p.error("the floor has no top-p cut: leave it out of --variants with --top-p")
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(args.base) if args.base else extract(BASE_COMMIT, Path(tmp))
        runs = [("base:generate", base, {})] + [(v, ROOT, VARIANTS[v]) for v in variants]
        rows_out = []
        for rows in (int(x) for x in args.rows.split(",")):
            per: dict[str, list[dict]] = {name: [] for name, _, _ in runs}
            for r in range(args.rounds):
                for name, tree, kw in runs if r % 2 == 0 else list(reversed(runs)):
                    per[name].append(measure(tree, rows // 8, args.reps, kw, args.top_p, args.threads))
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
        threads=args.threads,
        rounds=args.rounds,
        reps=args.reps,
        top_p=args.top_p,
        rows=rows_out,
    )


if __name__ == "__main__":
    main()
