"""vLLM (the community CPU build) on the long shape's generation, for reference beside the HF engine.

Replays the generation batches that ``roofline.py --shapes long`` timed: the same two prompts,
``n`` samples each, and each response exactly as long as the ``generate`` variant's response in
that row was (the long shape's length rule depends on the sampled tokens, which differ between
engines, so the lengths are fixed per request instead: ``min_tokens = max_tokens = L``,
``ignore_eos``). The model is the long shape's (benchmarks/long_shape.py, same folder), float32,
sampled at T = 1 with top-K = 20 log-probability lists (``logprobs_mode="processed_logprobs"``,
as masktrl's vLLM engine records them); one request per response, so the ``n`` requests of a
prompt share its prompt KV blocks through vLLM's prefix cache. Timed after one untimed
warm-up batch; tokens/s per wall second and per CPU-second (all threads of the process), and
against the same bandwidth bound as roofline.py's rows.

Run in the vLLM venv (scripts/setup_vllm_venv.sh), with the environment scripts/test_vllm.sh
sets (the script sets these defaults itself) and one OpenMP thread unless
``VLLM_CPU_OMP_THREADS_BIND`` says otherwise:

    python benchmarks/roofline.py --shapes long --no-training --gen-reps 3 --json outputs/bench/roofline_gen.json
    .venv-vllm/bin/python benchmarks/vllm_long.py --batches outputs/bench/roofline_gen.json \
        --json outputs/bench/vllm_long.json
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

for _k, _v in {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "TORCH_COMPILE_DISABLE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "0",
}.items():
    os.environ.setdefault(_k, _v)

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import die, machine, parser, print_table, quiet, write_json  # noqa: E402


def long_rows(path: str) -> tuple[dict, dict]:
    """(roofline's long ``generate`` row, the whole result) from roofline.py's JSON."""
    result = json.loads(Path(path).read_text())
    rows = [
        g
        for g in result.get("generation", [])
        if g["shape"] == "long" and g.get("variant") == "generate" and g.get("batches")
    ]
    if not rows:
        die(f"{path} holds no long-shape generate batches: run roofline.py --shapes long --json {path} first")
    return rows[0], result


def main(argv=None) -> dict:
    p = parser(__doc__.split("\n")[0])
    p.add_argument(
        "--batches", required=True, metavar="FILE", help="roofline.py's JSON (its long-shape generation rows)"
    )
    args = p.parse_args(argv)
    quiet()
    import torch
    import vllm
    from transformers import AutoModelForCausalLM

    from long_shape import long_model
    from roofline import generation_bounds

    row, roof = long_rows(args.batches)
    prompts, n = row["prompts"], row["n"]
    model_dir = long_model()
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.set_num_threads(args.threads)
    llm = vllm.LLM(
        model=str(model_dir),
        dtype="float32",
        enforce_eager=True,
        seed=0,
        max_logprobs=20,
        logprobs_mode="processed_logprobs",
        max_model_len=hf.config.max_position_embeddings,
    )

    def run(lengths, seed):
        requests = [vllm.inputs.TokensPrompt(prompt_token_ids=list(prompts[i // n])) for i in range(len(lengths))]
        params = [
            vllm.SamplingParams(
                n=1,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                max_tokens=L,
                min_tokens=L,
                ignore_eos=True,
                logprobs=20,
                seed=seed * 1000 + i,
                detokenize=False,
            )
            for i, L in enumerate(lengths)
        ]
        t0, c0 = time.perf_counter(), time.process_time()
        out = llm.generate(requests, params, use_tqdm=False)
        t, c = time.perf_counter() - t0, time.process_time() - c0
        got = [len(o.outputs[0].token_ids) for o in out]
        assert got == list(lengths), "vLLM did not generate the requested lengths"
        assert all(len(o.outputs[0].logprobs) == L for o, L in zip(out, lengths))
        return t, c

    batches = row["batches"]
    run(batches[0]["lengths"], seed=99)  # warm-up
    times, cpus, tokens, bw_time = [], [], 0, 0.0
    for b in batches:
        t, c = run(b["lengths"], b["seed"])
        times.append(t)
        cpus.append(c)
        tokens += sum(b["lengths"])
        bw_time += generation_bounds(
            hf, prompts, n, b["lengths"], roof["bandwidth_bytes_per_s"], roof["matmul_peak_flops"]
        )[0]
    result = {
        "engine": f"vllm {vllm.__version__}",
        "batches": len(batches),
        "rows": len(prompts) * n,
        "generated_tokens": tokens / len(batches),
        "time_ms": 1000 * sum(times) / len(batches),
        "cpu_ms": 1000 * sum(cpus) / len(batches),
        "tokens_per_s": tokens / sum(times),
        "tokens_per_cpu_s": tokens / sum(cpus),
        "bandwidth_bound_tokens_per_s": tokens / bw_time,
        "bandwidth_utilisation": bw_time / sum(times),
        "omp_threads_bind": os.environ["VLLM_CPU_OMP_THREADS_BIND"],
        "machine": machine(),
        "hf_rows": {
            g["variant"]: {k: g[k] for k in ("tokens_per_s", "tokens_per_cpu_s", "bandwidth_utilisation")}
            for g in roof["generation"]
            if g["shape"] == "long"
        },
    }
    print_table(
        "long shape generation: vLLM-cpu on roofline.py's batches (and roofline.py's HF rows)",
        ["engine", "ms per batch", "CPU ms", "tokens", "tokens/s", "tokens per CPU-s", "% of bandwidth bound"],
        [
            [
                result["engine"],
                result["time_ms"],
                result["cpu_ms"],
                result["generated_tokens"],
                result["tokens_per_s"],
                result["tokens_per_cpu_s"],
                100 * result["bandwidth_utilisation"],
            ]
        ]
        + [
            [
                f"hf {v}",
                float("nan"),
                float("nan"),
                float("nan"),
                h["tokens_per_s"],
                h["tokens_per_cpu_s"],
                100 * h["bandwidth_utilisation"],
            ]
            for v, h in result["hf_rows"].items()
        ],
    )
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
