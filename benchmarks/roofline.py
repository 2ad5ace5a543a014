"""How close each stage of a masktrl step is to what the machine can do.

Measures the machine: the matmul peak (FLOP/s of a large float32 GEMM at ``--threads``) and the
memory bandwidth (a float32 triad a = b + s c over arrays far larger than the caches). Then, for
the default shape (configs/tiny.yaml), the lab (configs/lab.yaml) and the long shape
(benchmarks/long_shape.py), with a randomly initialised model of the shape's dimensions:

* **training forward + backward** of one micro-batch (policy forward, DAPO loss, backward),
  padded (today's forward) and packed (masktrl/models/packing.py), each with and without prompt
  sharing. Model FLOPs of the tokens a variant runs (padding not counted):
  6 N per token (N = parameters outside the embeddings) + 6 V H per response token (the
  lm_head, at response positions only) + causal attention 12 n_layers d_q per attended
  (query, key) pair (QK^T and AV, 2 FLOP per multiply-add, x3 for forward + backward; a
  sequence of L tokens has L(L+1)/2 pairs, a shared-prompt response of r tokens r p + r(r+1)/2
  against its p-token prompt); MFU =
  those FLOPs / time / the measured peak; on a CPU also per second of process CPU time
  against the GEMM's FLOP per CPU-second (what waiting for a shared CPU does not inflate). Memory: the bytes autograd
  saves for the backward
  (activations; distinct storages), and on a GPU the peak allocated memory; with ``--rss`` (CPU,
  Linux) also the process's peak resident memory during one step, each variant in a fresh
  process (``VmHWM`` reset through ``/proc/self/clear_refs`` just before the step): the
  process's peak, and how much of it the step added to the resident memory just before it
  (the latter is smaller when the allocator kept memory freed before the step, so the table
  shows the process's peak, the JSON both).
* **generation** with the HF engine (shared prefill, K = 20 lists), transformers ``generate``,
  ``rollout.drop_finished`` (masktrl/rollout/decode.py), ``rollout.decode: fused`` and fused with
  ``rollout.draw: inverse_cdf`` (masktrl/rollout/fused.py) alternating on the same prompts and
  seeds: generated tokens/s (wall and per CPU-second) against the bound of the bytes the
  responses need (every weight once per decode step, each running row's KV cache once per
  step, at the measured bandwidth: generation is memory-bound) and against the compute bound
  (2 N per generated token); the share of row-steps spent on rows that had already ended,
  counted at the model's forward.

Runs on the GPU when there is one (``--device auto``), else on the CPU.

    python benchmarks/roofline.py --json outputs/bench/roofline.json
    python benchmarks/roofline.py --shapes long --reps 3 --cache-variants
    python benchmarks/roofline.py --rss --no-generation --reps 1
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

from common import count, finish, median, parser, print_table, quiet

TEMPERATURE, CHUNK, K = 1.0, 1024, 20


# --------------------------------------------------------------------------- the machine


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def matmul_peak(device, n: int, reps: int = 5, cpu_time: bool = False) -> float:
    """FLOP/s of an n x n x n float32 GEMM, best of ``reps`` (TF32 off: plain float32). With
    ``cpu_time``: per second of process CPU time (all threads), which a CPU shared with other
    processes does not inflate."""
    torch.backends.cuda.matmul.allow_tf32 = False
    clock = time.process_time if cpu_time else time.perf_counter
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    c = torch.empty(n, n, device=device)
    torch.matmul(a, b, out=c)
    best = float("inf")
    for _ in range(reps):
        sync(device)
        t0 = clock()
        torch.matmul(a, b, out=c)
        sync(device)
        best = min(best, clock() - t0)
    return 2 * n**3 / best


def bandwidth(device, mib: int, reps: int = 5) -> float:
    """Bytes/s of a float32 triad a = b + 0.5 c (two arrays read, one written), best of ``reps``."""
    n = mib * 2**20 // 4
    b = torch.rand(n, device=device)
    c = torch.rand(n, device=device)
    a = torch.empty(n, device=device)
    torch.add(b, c, alpha=0.5, out=a)
    best = float("inf")
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        torch.add(b, c, alpha=0.5, out=a)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 3 * n * 4 / best


# --------------------------------------------------------------------------- shapes


def shapes(names: list[str]) -> dict:
    """name -> (model dims, tokenizer kind, task overrides, sequences per micro-batch, response length sampler)."""
    out = {}
    if "default" in names:  # configs/tiny.yaml: 64 prompts x 8, one micro-batch; answers of 3-4 digits + EOS
        out["default"] = dict(config=[], micro=512, group=8, response=lambda rng, ex: rng.choice((4, 5)))
    if "lab" in names:  # configs/lab.yaml: 64 x 8 in 8 minibatches; 4 numbers + EOS
        out["lab"] = dict(
            config=[str(Path(__file__).resolve().parents[1] / "configs" / "lab.yaml")],
            micro=64,
            group=8,
            response=lambda rng, ex: 5,
        )
    if "long" in names:  # benchmarks/long_shape.py: 2 prompts x 8, responses around the prompt's target length
        from long_shape import row_length
        from masktrl.tasks.longtail import target_length

        out["long"] = dict(
            config=None,
            micro=16,
            group=8,
            response=lambda rng, ex: row_length(target_length(ex.prompt), rng.randrange(64), rng.randrange(64)),
        )
    return out


def build(name: str, spec: dict, device, dtype, seed: int = 0):
    """(model, samples) of a shape: the shape's model dims (random weights), real task prompts,
    random response tokens of the shape's lengths, random behaviour log-probs and top-K lists."""
    from masktrl.config import load_config
    from masktrl.models.tiny import TinyModelConfig, build_tiny_model, tiny_tokenizer
    from masktrl.rollout.base import Generation, Sample
    from masktrl.tasks import make_task

    if name == "long":
        from long_shape import LONG_MODEL, long_config, long_model

        cfg = long_config(long_model())
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(cfg.model.path)
        model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=dtype)
        dims = LONG_MODEL
    else:
        cfg = load_config(spec["config"] or None)
        m = cfg.model
        task = make_task(cfg.task, cfg.model)
        tok = tiny_tokenizer(m.tokenizer, task.alphabet())
        model = build_tiny_model(
            tok, TinyModelConfig(m.hidden_size, m.num_layers, m.num_heads, m.num_kv_heads, m.intermediate_size), seed
        ).to(dtype)
        dims = dict(hidden_size=m.hidden_size, num_layers=m.num_layers, num_heads=m.num_heads)
    task = make_task(cfg.task, cfg.model)
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    samples = []
    for g, ex in enumerate(task.train_examples(spec["micro"] // spec["group"], rng)):
        prompt = tok(ex.prompt, add_special_tokens=False)["input_ids"]
        for _ in range(spec["group"]):
            n = spec["response"](rng, ex)
            ids = [rng.randrange(3, vocab) for _ in range(n)]
            topk = [rng.sample(range(vocab), min(K, vocab)) for _ in range(n)]
            gen = Generation(
                ids,
                [-rng.uniform(0.5, 3) for _ in range(n)],
                topk,
                [sorted((-rng.uniform(0.1, 5) for _ in range(len(topk[0]))), reverse=True) for _ in range(n)],
                True,
            )
            samples.append(Sample(ex.id, ex.prompt, ex.answer, prompt, g, gen, advantage=rng.uniform(-1, 1)))
    rng.shuffle(samples)
    return model.to(device), tok, samples, dims, cfg


def param_counts(model) -> tuple[int, int, int]:
    """(all parameters, parameters outside the input and output embeddings, V*H of the lm_head)."""
    total = sum(p.numel() for p in model.parameters())
    emb_in = model.get_input_embeddings().weight.numel()
    head = model.get_output_embeddings().weight.numel()
    return total, total - emb_in - head, head


def train_flops(model, dims: dict, lengths: list[int], response_tokens: int) -> float:
    """Model FLOPs of forward + backward over packed sequences of ``lengths`` (tokens run):
    6 N per token, 6 V H per response token, causal attention 6 n_layers d_q L(L+1)/2 x 2 per
    sequence (QK^T and AV, 2 FLOP per multiply-add)."""
    _, n, head = param_counts(model)
    d_q = model.config.num_attention_heads * getattr(model.config, "head_dim", dims["hidden_size"] // dims["num_heads"])
    layers = model.config.num_hidden_layers
    attn = sum(3 * 2 * 2 * layers * d_q * L * (L + 1) / 2 for L in lengths)
    return 6 * n * sum(lengths) + 6 * head * response_tokens + attn


# --------------------------------------------------------------------------- training


def variants(samples) -> dict:
    """name -> (packed, share)."""
    from masktrl.rl.policy import can_share_prompts

    out = {"padded": (False, False), "packed": (True, False)}
    if can_share_prompts(samples):
        out = {"padded, shared prompt": (False, True), "packed, shared prompt": (True, True), **out}
    return out


def work(samples, packed: bool, share: bool):
    """(segment lengths the forward runs, real tokens, padded tokens it computes)."""
    from masktrl.rl.policy import _distinct_prompts

    if share:
        prompts, group = _distinct_prompts(samples)
        heads = [len(s.gen.response_ids) - 1 for s in samples]
        # a shared-prompt response attends to its prompt too: count its attention against prompt + response
        lengths = [len(p) for p in prompts]
        real = sum(lengths) + sum(heads)
        padded = len(prompts) * max(lengths) + len(samples) * max(heads)
        attn_lengths = lengths + heads  # approximation for the FLOP count below: see train_flops_shared
        return attn_lengths, real, padded
    lengths = [len(s.prompt_ids) + len(s.gen.response_ids) - (1 if packed else 0) for s in samples]
    return lengths, sum(lengths), len(samples) * max(lengths)


def shared_attention_flops(model, dims, samples) -> float:
    """Causal attention FLOPs (forward + backward) of the shared-prompt layout: each distinct
    prompt once, each response attending to its prompt and its own earlier tokens."""
    from masktrl.rl.policy import _distinct_prompts

    prompts, group = _distinct_prompts(samples)
    d_q = model.config.num_attention_heads * getattr(model.config, "head_dim", dims["hidden_size"] // dims["num_heads"])
    layers = model.config.num_hidden_layers
    pairs = sum(len(p) * (len(p) + 1) / 2 for p in prompts)
    for s, g in zip(samples, group):
        r, p = len(s.gen.response_ids) - 1, len(prompts[g])
        pairs += r * p + r * (r + 1) / 2
    return 3 * 2 * 2 * layers * d_q * pairs


def step_fn(model, samples, packed: bool, share: bool):
    """One forward + DAPO loss + backward of ``samples`` (gradients dropped after)."""
    import dataclasses

    import masktrl.methods  # noqa: F401
    from masktrl.methods.registry import get_method
    from masktrl.models import packing
    from masktrl.models.logprobs import token_logprobs_and_entropy
    from masktrl.rl import policy

    method = get_method("dapo")
    params = method.make_params()
    with torch.no_grad():  # the padded outputs' non-differentiable fields (behaviour, ids)
        ref = policy.policy_token_batch(model, samples, TEMPERATURE, CHUNK, share=share)
    device = next(model.parameters()).device
    if share:
        prompts, group = policy._distinct_prompts(samples)
        layout = packing.pack_shared(prompts, group, [s.gen.response_ids for s in samples]).to(device)
    else:
        layout = packing.pack_whole([s.prompt_ids for s in samples], [s.gen.response_ids for s in samples]).to(device)
    ids = torch.cat([ref.batch.sampled_ids[:, None], ref.batch.topk_ids], dim=1)

    def run():
        if packed:
            h = packing.packed_hidden(model.base_model, layout)
            lp, _ = token_logprobs_and_entropy(
                h, model.get_output_embeddings().weight, ids, temperature=TEMPERATURE, chunk_size=CHUNK
            )
            batch = dataclasses.replace(ref.batch, logp=lp[:, 0], topk_logp=lp[:, 1:])
        else:
            batch = policy.policy_token_batch(model, samples, TEMPERATURE, CHUNK, share=share).batch
        losses = method.token_losses(batch, ref.advantages, params)
        loss = method.aggregate(params, losses.loss, batch, horizon=512)
        return loss

    return run


def saved_bytes(run) -> int:
    """(bytes autograd saves for the backward of ``run()``'s loss, distinct storages, with the
    logits chunk the log-probability pass keeps for its backward (masktrl/models/logprobs.py:
    held on the autograd context, not through the saved-tensor hooks); the backward's duration
    is not measured here)."""
    from masktrl.models import logprobs

    seen: dict[int, int] = {}
    forward = logprobs._forward

    def keeping(*args):
        out = forward(*args)
        if out[3] is not None:
            seen[out[3].untyped_storage().data_ptr()] = out[3].untyped_storage().nbytes()
        return out

    def pack(t):
        try:
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        except (RuntimeError, NotImplementedError):
            pass
        return t

    logprobs._forward = keeping
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = run()
    finally:
        logprobs._forward = forward
    loss.backward()
    return sum(seen.values())


def measure_training(name, model, dims, samples, device, reps: int, peak: float, cpu_peak: float | None) -> list[dict]:
    model.train()
    vs = variants(samples)
    runs = {v: step_fn(model, samples, packed, share) for v, (packed, share) in vs.items()}
    times = {v: [] for v in vs}
    cpu = {v: [] for v in vs}
    for r in range(reps + 1):  # the first round is a warm-up
        order = list(vs) if r % 2 == 0 else list(reversed(vs))
        for v in order:
            model.zero_grad(set_to_none=True)
            sync(device)
            t0, c0 = time.perf_counter(), time.process_time()
            runs[v]().backward()
            sync(device)
            if r:
                times[v].append(time.perf_counter() - t0)
                cpu[v].append(time.process_time() - c0)
    rows = []
    response_tokens = sum(len(s.gen.response_ids) for s in samples)
    for v, (packed, share) in vs.items():
        lengths, real, padded = work(samples, packed, share)
        if share:
            _, n, head = param_counts(model)
            flops = 6 * n * real + 6 * head * response_tokens + shared_attention_flops(model, dims, samples)
        else:
            flops = train_flops(model, dims, lengths, response_tokens)
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        act = saved_bytes(runs[v])
        peak_mem = (torch.cuda.max_memory_allocated() - base) if device.type == "cuda" else None
        t, c = median(times[v]), median(cpu[v])
        rows.append(
            {
                "shape": name,
                "variant": v,
                "time_ms": 1000 * t,
                "cpu_ms": 1000 * c,
                "tokens_run": real,
                "tokens_computed": real if packed else padded,
                "padding_share": 0.0 if packed else 1 - real / padded,
                "model_gflop": flops / 1e9,
                "tflops": flops / t / 1e12,
                "mfu": flops / t / peak,
                "mfu_cpu_time": None if cpu_peak is None else flops / c / cpu_peak,
                "saved_activation_mib": act / 2**20,
                "peak_mib": None if peak_mem is None else peak_mem / 2**20,
            }
        )
    model.zero_grad(set_to_none=True)
    return rows


def _status_kib(field: str) -> int:
    """A ``/proc/self/status`` memory field (VmRSS, VmHWM) in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def rss_child(name: str, variant: str, threads: int) -> None:
    """In a fresh process: build the shape, run one forward + loss + backward of ``variant`` and
    print the step's peak resident memory above the resident memory just before it (KiB)."""
    import gc

    torch.set_num_threads(threads)
    spec = shapes([name])[name]
    model, _, samples, _, _ = build(name, spec, torch.device("cpu"), torch.float32)
    model.train()
    packed, share = variants(samples)[variant]
    run = step_fn(model, samples, packed, share)
    gc.collect()
    before = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident size
    run().backward()
    print(f"RSS {_status_kib('VmHWM') - before} {before}", flush=True)


def measure_rss(names: list[str], threads: int) -> dict:
    """(shape, variant) -> (step's peak RSS above its start, RSS at its start), MiB; one child
    process per variant so that no allocator cache of another variant hides the step's peak."""
    import subprocess

    out = {}
    for name, spec in shapes(names).items():
        _, _, samples, _, _ = build(name, spec, torch.device("cpu"), torch.float32)
        for v in variants(samples):
            res = subprocess.run(
                [sys.executable, __file__, "--rss-child", name, v, "--threads", str(threads)],
                capture_output=True,
                text=True,
                check=True,
            )
            line = [ln for ln in res.stdout.splitlines() if ln.startswith("RSS ")][-1]
            peak, before = (int(x) / 1024 for x in line.split()[1:])
            out[(name, v)] = (peak, before)
            print(
                f"  {name:8s} {v:22s} step peak RSS +{peak:,.0f} MiB (process at {before:,.0f} MiB before it)",
                flush=True,
            )
    return out


# --------------------------------------------------------------------------- generation


GEN_VARIANTS = {  # variant -> HFEngine keywords
    "generate": {},
    "drop_finished": {"drop_finished": True},
    "fused": {"decode": "fused"},  # records bit-identical to generate's (docs/ROLLOUTS.md)
    "fused+icdf": {"decode": "fused", "draw": "inverse_cdf"},  # equal in distribution
}


def count_row_steps(model):
    """A forward pre-hook on ``model``'s output layer adding up the rows of every decode step
    (the engine's prefill runs the base model only, and the fused loop's lean step calls the
    output layer as the forward does, so exactly the decode steps count); returns (handle,
    counter)."""
    count = [0]

    def hook(module, args):
        count[0] += args[0].shape[0]

    return model.get_output_embeddings().register_forward_pre_hook(hook), count


def generation_bounds(model, prompts, n: int, lengths: list[int], bw: float, peak: float) -> tuple[float, float]:
    """(bandwidth-bound seconds, compute-bound seconds) of the work the responses of
    ``lengths`` need (rows in ``num_return_sequences`` order): every decode step reads every
    weight once, each running row reads its own KV cache (its prompt and its response so far);
    2 N FLOP per generated token. Rows that have ended need nothing."""
    total, n_params, head = param_counts(model)
    c = model.config
    kv_dim = c.num_key_value_heads * getattr(c, "head_dim", c.hidden_size // c.num_attention_heads)
    kv_token = 2 * c.num_hidden_layers * kv_dim * model.dtype.itemsize  # K and V of one position
    steps = max(lengths)
    kv_reads = sum(len(prompts[i // n]) * L + L * (L - 1) // 2 for i, L in enumerate(lengths))  # positions read
    bw_time = (steps * total * model.dtype.itemsize + kv_reads * kv_token) / bw
    return bw_time, 2 * (n_params + head) * sum(lengths) / peak


def measure_generation(name, model, tok, samples, cfg, device, bw: float, peak: float, reps: int) -> list[dict]:
    """HF engine tokens/s at the shape, ``generate`` and ``rollout.drop_finished`` alternating
    (same prompts, same seeds), against the bandwidth and compute bounds of the work each
    variant's responses need; the row-steps spent on rows that had already ended, counted."""
    import contextlib

    from masktrl.rollout.base import SamplingSettings
    from masktrl.rollout.hf import HFEngine

    model.eval()
    prompts, seen = [], set()
    for s in samples:
        if tuple(s.prompt_ids) not in seen:
            seen.add(tuple(s.prompt_ids))
            prompts.append(s.prompt_ids)
    n = len(samples) // len(prompts)
    stack = contextlib.ExitStack()
    if name == "long":
        from long_shape import follow_target_lengths

        stack.enter_context(follow_target_lengths(tok))
    settings = SamplingSettings(n=n, max_new_tokens=cfg.rollout.max_new_tokens, temperature=1.0, logprobs_k=K)
    engines = {v: HFEngine(model, tok, **kw) for v, kw in GEN_VARIANTS.items()}
    times = {v: [] for v in engines}
    cpu = {v: [] for v in engines}
    tokens = {v: [] for v in engines}
    row_steps = {v: [] for v in engines}
    bound = {v: [] for v in engines}
    batches = {v: [] for v in engines}  # each timed batch's seed and response lengths (vllm_long.py replays them)
    handle, count = count_row_steps(model)
    with stack:
        for r in range(reps + 1):  # the first round is a warm-up
            for v in list(engines) if r % 2 == 0 else list(reversed(engines)):
                count[0] = 0
                sync(device)
                t0, c0 = time.perf_counter(), time.process_time()
                gens = engines[v].generate(prompts, settings, seed=r)
                sync(device)
                if not r:
                    continue
                times[v].append(time.perf_counter() - t0)
                cpu[v].append(time.process_time() - c0)
                lengths = [len(g.response_ids) for grp in gens for g in grp]
                tokens[v].append(sum(lengths))
                row_steps[v].append(count[0])
                bound[v].append(generation_bounds(model, prompts, n, lengths, bw, peak))
                batches[v].append({"seed": r, "lengths": lengths})
    handle.remove()
    total = param_counts(model)[0]
    rows = []
    for v in engines:
        t, c, toks = sum(times[v]), sum(cpu[v]), sum(tokens[v])
        bw_time, compute_time = (sum(b[i] for b in bound[v]) for i in (0, 1))
        rows.append(
            {
                "shape": name,
                "variant": v,
                "time_ms": 1000 * t / reps,
                "cpu_ms": 1000 * c / reps,
                "generated_tokens": toks / reps,
                "rows": len(prompts) * n,
                "tokens_per_s": toks / t,
                "tokens_per_cpu_s": toks / c,
                "bandwidth_bound_tokens_per_s": toks / bw_time,
                "bandwidth_utilisation": bw_time / t,
                "compute_bound_tokens_per_s": toks / compute_time,
                "weights_mib": total * model.dtype.itemsize / 2**20,
                "weights_fit_in_cache": total * model.dtype.itemsize < 32 * 2**20,
                "row_steps_wasted": 1 - toks / sum(row_steps[v]),
                "prompts": prompts,
                "n": n,
                "batches": batches[v],
            }
        )
    return rows


def generation_cache_variants(name, model, tok, samples, cfg, device, reps: int) -> list[dict]:
    """transformers ``generate`` (no log-prob recording, ``num_return_sequences``) with its
    dynamic KV cache and with a static one (``cache_implementation="static"``, no compile):
    tokens/s of each, alternating, same prompts and seeds."""
    import contextlib

    model.eval()
    prompts = list(dict.fromkeys(tuple(s.prompt_ids) for s in samples))
    n = len(samples) // len(prompts)
    width = max(map(len, prompts))
    pad = tok.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts], device=device)
    att = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    stack = contextlib.ExitStack()
    if name == "long":
        from long_shape import follow_target_lengths

        stack.enter_context(follow_target_lengths(tok))
    out = {"dynamic cache": [], "static cache": []}
    toks = {}
    with stack, torch.no_grad():
        for r in range(reps + 1):
            for variant in out if r % 2 == 0 else reversed(list(out)):
                extra = {"cache_implementation": "static"} if variant == "static cache" else {}
                torch.manual_seed(r)
                sync(device)
                t0 = time.perf_counter()
                g = model.generate(
                    input_ids=ids,
                    attention_mask=att,
                    do_sample=True,
                    temperature=1.0,
                    top_p=1.0,
                    top_k=0,
                    max_new_tokens=cfg.rollout.max_new_tokens,
                    num_return_sequences=n,
                    pad_token_id=pad,
                    **extra,
                )
                sync(device)
                if r:
                    out[variant].append(time.perf_counter() - t0)
                resp = g[:, width:]
                toks[variant] = int(((resp != pad) | (resp == tok.eos_token_id)).sum())
    return [
        {"shape": name, "variant": v, "time_ms": 1000 * median(t), "tokens_per_s": toks[v] / median(t)}
        for v, t in out.items()
    ]


# --------------------------------------------------------------------------- main


def main(argv=None) -> dict:
    p = parser(__doc__.split("\n")[0])
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda")
    p.add_argument("--shapes", default="default,lab,long", help="comma-separated: default, lab, long")
    p.add_argument("--reps", type=count, default=3, help="timed repetitions per variant (after one warm-up)")
    p.add_argument("--gen-reps", type=count, default=1, help="timed generation batches per shape (after one warm-up)")
    p.add_argument("--no-generation", action="store_true")
    p.add_argument("--no-training", action="store_true", help="generation (and --cache-variants) only")
    p.add_argument(
        "--cache-variants", action="store_true", help="also time generate with a dynamic vs a static KV cache"
    )
    p.add_argument("--gemm", type=int, default=None, help="GEMM size (default 4096 on CPU, 8192 on GPU)")
    p.add_argument("--triad-mib", type=int, default=512, help="size of each triad array (MiB)")
    p.add_argument(
        "--rss",
        action="store_true",
        help="CPU: also each training variant's peak resident memory, one process per variant",
    )
    p.add_argument("--rss-child", nargs=2, metavar=("SHAPE", "VARIANT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rss_child:
        rss_child(*args.rss_child, args.threads)
        return {}
    quiet()
    load_start = os.getloadavg()[0]
    device = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else ("cpu" if args.device == "auto" else args.device)
    )
    torch.set_num_threads(args.threads)
    gemm = args.gemm or (8192 if device.type == "cuda" else 4096)
    peak = matmul_peak(device, gemm)
    cpu_peak = matmul_peak(device, gemm, cpu_time=True) if device.type == "cpu" else None
    bw = bandwidth(device, args.triad_mib)
    print(
        f"{device}: float32 GEMM peak {peak / 1e9:,.1f} GFLOP/s"
        + (f" ({cpu_peak / 1e9:,.1f} per CPU-second)" if cpu_peak else "")
        + f", triad bandwidth {bw / 1e9:,.1f} GB/s ({args.threads} thread(s))",
        flush=True,
    )
    names = [s.strip() for s in args.shapes.split(",") if s.strip()]
    train_rows, gen_rows, cache_rows, info = [], [], [], {}
    for name, spec in shapes(names).items():
        model, tok, samples, dims, cfg = build(name, spec, device, torch.float32)
        total, n, head = param_counts(model)
        info[name] = {
            "parameters": total,
            "non_embedding": n,
            "sequences": len(samples),
            "prompt_tokens_mean": sum(len(s.prompt_ids) for s in samples) / len(samples),
            "response_tokens_mean": sum(len(s.gen.response_ids) for s in samples) / len(samples),
        }
        if not args.no_training:
            train_rows += measure_training(name, model, dims, samples, device, args.reps, peak, cpu_peak)
        for r in train_rows:
            if r["shape"] == name:
                extra = f", per CPU-second {100 * r['mfu_cpu_time']:5.1f} %" if r["mfu_cpu_time"] is not None else ""
                print(
                    f"  {name:8s} {r['variant']:22s} {r['time_ms']:9.1f} ms  MFU {100 * r['mfu']:5.1f} %{extra}",
                    flush=True,
                )
        if not args.no_generation:
            gen_rows += measure_generation(name, model, tok, samples, cfg, device, bw, peak, args.gen_reps)
            for g in gen_rows[-len(GEN_VARIANTS) :]:
                print(
                    f"  {name:8s} generation, {g['variant']:13s} {g['tokens_per_s']:,.0f} tokens/s, "
                    f"{100 * g['bandwidth_utilisation']:.1f} % of the bandwidth bound",
                    flush=True,
                )
            if args.cache_variants:
                cache_rows += generation_cache_variants(name, model, tok, samples, cfg, device, args.gen_reps)
                for c in cache_rows[-2:]:
                    print(f"  {name:8s} generate, {c['variant']}: {c['tokens_per_s']:,.0f} tokens/s", flush=True)
        del model
    if args.rss and device.type == "cpu" and not args.no_training:
        rss = measure_rss(names, args.threads)
        for r in train_rows:
            step, before = rss.get((r["shape"], r["variant"]), (None, None))
            r["step_peak_rss_mib"], r["rss_before_mib"] = step, before
            r["process_peak_rss_mib"] = None if step is None else step + before
    fields = {
        "device": str(device),
        "matmul_peak_flops": peak,
        "matmul_peak_flops_per_cpu_s": cpu_peak,
        "bandwidth_bytes_per_s": bw,
        "threads": args.threads,
        "shapes": info,
        "training": train_rows,
        "generation": gen_rows,
        "generate_cache": cache_rows,
    }
    if device.type == "cuda":
        fields["gpu"] = torch.cuda.get_device_name()
    report(fields)
    return finish("roofline.py", argv, load_start, args.json, **fields)


def report(r: dict) -> None:
    if r["training"]:
        print_table(
            f"training forward + backward, one micro-batch ({r['device']}; peak "
            f"{r['matmul_peak_flops'] / 1e9:,.0f} GFLOP/s)",
            [
                "shape",
                "variant",
                "ms",
                "CPU ms",
                "tokens run",
                "padding %",
                "GFLOP",
                "MFU %",
                "MFU % (CPU time)",
                "saved activations MiB",
                "process peak RSS MiB",
            ],
            [
                [
                    t["shape"],
                    t["variant"],
                    t["time_ms"],
                    t["cpu_ms"],
                    t["tokens_run"],
                    100 * t["padding_share"],
                    t["model_gflop"],
                    100 * t["mfu"],
                    float("nan") if t["mfu_cpu_time"] is None else 100 * t["mfu_cpu_time"],
                    t["saved_activation_mib"],
                    float("nan") if t.get("process_peak_rss_mib") is None else t["process_peak_rss_mib"],
                ]
                for t in r["training"]
            ],
        )
    if r["generation"]:
        print_table(
            f"generation, HF engine (bandwidth {r['bandwidth_bytes_per_s'] / 1e9:,.1f} GB/s)",
            [
                "shape",
                "variant",
                "ms",
                "CPU ms",
                "tokens",
                "tokens/s",
                "tokens per CPU-s",
                "bandwidth bound tokens/s",
                "% of bound",
                "compute bound tokens/s",
                "row-steps on finished rows %",
                "weights MiB",
            ],
            [
                [
                    g["shape"],
                    g["variant"],
                    g["time_ms"],
                    g["cpu_ms"],
                    g["generated_tokens"],
                    g["tokens_per_s"],
                    g["tokens_per_cpu_s"],
                    g["bandwidth_bound_tokens_per_s"],
                    100 * g["bandwidth_utilisation"],
                    g["compute_bound_tokens_per_s"],
                    100 * g["row_steps_wasted"],
                    g["weights_mib"],
                ]
                for g in r["generation"]
            ],
        )
    if r.get("generate_cache"):
        print_table(
            "transformers generate, KV cache kind (no log-prob recording)",
            ["shape", "cache", "ms", "tokens/s"],
            [[c["shape"], c["variant"], c["time_ms"], c["tokens_per_s"]] for c in r["generate_cache"]],
        )


if __name__ == "__main__":
    main()
