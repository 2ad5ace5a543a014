"""The GPU check: the paper-scale paths of masktrl on one NVIDIA GPU in a few minutes, no hub.

    bash scripts/gpu_check.sh                      # the full check (GPU, vLLM, DeepSpeed)
    python benchmarks/gpu_check.py --shape tiny --engine hf --steps 2 --no-zero2 --work /tmp/g --json g.json   # CPU

What it does, in order (one JSON of results at the end, ``--json``):

1. **Model.** A Qwen3-0.6B-shaped causal LM built from its config with random weights (hidden
   1024, 28 layers, 16 query / 8 key-value heads of 128, MLP 3072, vocabulary 151,936; untied
   embeddings, since a random tied model is degenerate in engines) and a word-level tokenizer of
   151,932 number tokens plus pad/eos/unk/``=`` (``models/numbers.py``), saved as a Hugging Face
   folder in bf16. ``--shape tiny`` is a 2-layer, 64-wide model with 2,004 tokens (CPU tests).
2. **Task.** A local JSON-lines dataset of number-token prompts and a reward written next to
   it: the fraction of a completion's tokens that are even numbers. A random policy already
   scores about 1/2 with a spread inside every group, so every step has non-zero advantages and
   the weights really move (what the weight-sync check needs).
3. **grpo, pdm, sis**: ``masktrl train`` for ``--steps`` steps each in ``--dtype`` (bf16) with
   ``rollout.engine`` vLLM colocated (``rollout.sleep_mode: true``: the engine sleeps during the
   update), checkpoints at step ``steps // 2`` and the last. Per run: wall time, reward, the
   trainer's ``ppo_kl`` (mean log mu - log pi before the update), generated tokens/s
   (``tokens_per_s``: per second of step time; ``generation_tokens_per_s``: per second of
   rollout time). Each run's output goes to ``<json stem>-<method>.log`` beside the JSON as
   it comes, so a run that hangs or is cut short still says where it was.
4. **Weight sync.** The rollouts of step ``steps // 2 + 1`` were sampled by the engine after the
   sync of step ``steps // 2``'s update: the trainer's forward (``policy_token_batch``, in the
   training dtype) recomputes log pi of every sampled token with that checkpoint, and with the
   starting weights. Reported: mean |log mu - log pi| over all tokens and by response position
   (buckets 0, 1, 2-3, 4-7, ...), for both; ``sync_ok`` when the engine's log-probabilities are
   closer to the synced weights than to the starting ones.
5. **ZeRO-2 kill and resume** (``--no-zero2`` skips it): ``accelerate launch`` with DeepSpeed
   ZeRO-2 (``--accelerate-config``, one process; the transformers engine and a quarter of the
   rollout batch: this checks the resume, not speed), an uninterrupted 3-step run and one SIGKILLed
   during step 2's update (``MASKTRL_CRASH_AT=update:2``) then ``--resume``d. The uninterrupted
   run checkpoints at its end only, the other every step (equal results also say that writing a
   checkpoint leaves a run as it was), each keeping only its newest (one is 12 GB at the GPU
   shape: bf16 weights and DeepSpeed's fp32 optimizer state); reported: the largest weight
   difference between the two final checkpoints, whether the metrics (timings aside) are identical, and the resume's
   wall time. The three runs' output goes beside the JSON as it comes (``<json
   stem>-zero2-full.log``, ``-zero2-crash.log``, ``-zero2-resume.log``), and the JSON's
   ``zero2_resume`` after each run (``complete``: false until the comparison).

The JSON is rewritten after every phase (``complete``: false until the end), so a check cut short
by its timeout still leaves what it measured. Everything runs offline (``HF_HUB_OFFLINE=1``). Nothing here needs a GPU
except vLLM and the
GPU shape's memory: ``tests/test_gpu_check.py`` runs the same driver on CPU with the tiny shape
and the transformers engine.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TIMING = ("step_time_s", "rollout_time_s", "tokens_per_s")

SHAPES = {
    # Qwen3-0.6B's config.json (hub id Qwen/Qwen3-0.6B), untied; built from these numbers only
    "qwen3-0.6b": dict(
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=4096,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        numbers=151_932,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=512,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        numbers=2000,
    ),
}
# rollout sizes per shape: (prompts per step, samples per prompt, prompt tokens, response tokens)
SIZES = {"qwen3-0.6b": (16, 8, 64, 128), "tiny": (4, 4, 8, 8)}

REWARD = '''\
def score(prompts, completions, answers, **fields):
    """The fraction of a completion's tokens that are even numbers (a random policy: about 1/2)."""
    out = []
    for text in completions:
        words = text.split()
        out.append(sum(w.isdecimal() and int(w) % 2 == 0 for w in words) / max(1, len(words)))
    return out
'''


def build_model(shape: str, dest: Path, dtype: str, device: str) -> dict:
    """Save a random model of ``shape`` and its number tokenizer to ``dest``; its facts."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from masktrl.models.numbers import build_number_tokenizer

    spec = dict(SHAPES[shape])
    tok = build_number_tokenizer(spec.pop("numbers"))
    rope_theta = spec.pop("rope_theta")
    config = Qwen3Config(
        vocab_size=len(tok),
        tie_word_embeddings=False,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        **spec,
    )
    t0 = time.time()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        with torch.device(device):
            model = Qwen3ForCausalLM(config)
    model = model.to(getattr(torch, dtype))
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.bos_token_id = None
    model.save_pretrained(dest)
    tok.save_pretrained(dest)
    params = sum(p.numel() for p in model.parameters())
    del model
    return {
        "shape": shape,
        "parameters": params,
        "vocab_size": len(tok),
        "build_s": round(time.time() - t0, 1),
        **SHAPES[shape],
    }


def write_task(work: Path, shape: str, n_rows: int = 512) -> tuple[Path, Path]:
    """A JSON-lines dataset of number-token prompts and the reward file; their paths."""
    import random

    numbers = SHAPES[shape]["numbers"]
    prompt_len = SIZES[shape][2]
    rng = random.Random(0)
    data = work / "data.jsonl"
    with data.open("w") as f:
        for i in range(n_rows):
            words = [str(rng.randrange(numbers)) for _ in range(prompt_len - 1)] + ["="]
            f.write(json.dumps({"prompt": " ".join(words), "answer": "0", "id": i}) + "\n")
    reward = work / "reward.py"
    reward.write_text(REWARD)
    return data, reward


def run_config(
    args, model_dir: Path, data: Path, reward: Path, method: str, steps: int, engine: str, extra: dict | None = None
) -> dict:
    """The resolved-config overlay of one run (written as YAML by the caller)."""
    prompts, n, _, new_tokens = SIZES[args.shape]
    half = max(1, steps // 2)
    cfg = {
        "seed": 0,
        "method": {"name": method},
        "model": {"path": str(model_dir), "dtype": args.dtype},
        "task": {"name": "dataset", "source": str(data), "reward": f"{reward}:score", "n_test": 16, "template": "raw"},
        "warmstart": {"steps": 0},
        "rollout": {
            "engine": engine,
            "prompts_per_step": prompts,
            "n": n,
            "max_new_tokens": new_tokens,
            "logprobs_k": 20,
        },
        "train": {
            "steps": steps,
            "lr": args.lr,
            "checkpoint_every": steps,
            "keep_steps": [half],
            "threads": args.threads,
        },
    }
    if engine == "vllm":
        cfg["rollout"].update(
            {
                "gpu_memory_utilization": args.gpu_memory_utilization,
                "sleep_mode": args.sleep_mode,
                "enforce_eager": args.enforce_eager,
            }
        )
    for section, values in (extra or {}).items():
        cfg.setdefault(section, {}).update(values)
    return cfg


def _env() -> dict:
    paths = [str(REPO), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def masktrl(
    *args, env=None, launcher: list[str] | None = None, timeout: float = 600, log: Path | None = None
) -> subprocess.CompletedProcess:
    """``masktrl ARGS`` in a child process. With ``log`` its output (stdout and stderr, unbuffered)
    goes to that file as it comes, so a run that hangs or is cut short by an outer timeout still
    says where it was; the result's ``stdout`` is then the file's text, and a run past ``timeout``
    is killed and returns code 124."""
    cmd = [*(launcher or [sys.executable]), "-m", "masktrl.cli", *args]
    if log is None:
        return subprocess.run(cmd, capture_output=True, text=True, env=env or _env(), timeout=timeout, cwd=REPO)
    with open(log, "w") as f:
        try:
            code = subprocess.run(
                cmd,
                stdout=f,
                stderr=subprocess.STDOUT,
                env={**(env or _env()), "PYTHONUNBUFFERED": "1"},
                timeout=timeout,
                cwd=REPO,
            ).returncode
        except subprocess.TimeoutExpired:
            code = 124
    return subprocess.CompletedProcess(cmd, code, stdout=log.read_text(errors="replace"), stderr="")


def _write_yaml(path: Path, cfg: dict) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _metrics(root: Path) -> list[dict]:
    return [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _bucket(t: int) -> str:
    """Response position buckets 0, 1, 2-3, 4-7, 8-15, ..."""
    if t < 2:
        return str(t)
    lo = 1 << (t.bit_length() - 1)
    return f"{lo}-{2 * lo - 1}"


def logp_gap(weights: Path, rollouts: Path, dtype: str, device: str, temperature: float = 1.0) -> dict:
    """Mean |log mu - log pi| of the stored rollouts against the trainer's forward at ``weights``,
    overall and by response-position bucket."""
    import torch

    from masktrl.models.loading import load_model_and_tokenizer
    from masktrl.rl.policy import policy_token_batch
    from masktrl.rollout.storage import read_rollouts

    samples, _ = read_rollouts(rollouts)
    model, _ = load_model_and_tokenizer(weights, dtype=dtype)
    model.to(device).eval()
    with torch.no_grad():
        out = policy_token_batch(model, samples, temperature=temperature, chunk=1024)
    gap = (out.batch.behavior_logp.double() - out.batch.logp.double()).abs().cpu()  # [N]
    positions = [t for s in samples for t in range(len(s.gen.response_ids))]
    buckets: dict[str, list[float]] = {}
    for t, g in zip(positions, gap.tolist()):
        buckets.setdefault(_bucket(t), []).append(g)
    del model
    if device != "cpu":
        torch.cuda.empty_cache()
    order = sorted(buckets, key=lambda b: int(b.split("-")[0]))
    return {
        "tokens": len(positions),
        "mean_abs_dlogp": float(gap.mean()),
        "max_abs_dlogp": float(gap.max()),
        "mean_abs_dlogp_by_position": {b: statistics.fmean(buckets[b]) for b in order},
    }


def log_path(json_path: Path, run: str) -> Path:
    """Where one run of the check logs: beside the JSON (it outlives ``--work``), ``<stem>-<run>.log``
    (a method's name, or ``zero2-full``, ``zero2-crash``, ``zero2-resume``)."""
    return json_path.with_name(f"{json_path.stem}-{run}.log")


def method_run(args, work: Path, model_dir: Path, data: Path, reward: Path, method: str) -> dict:
    cfg = _write_yaml(
        work / f"{method}.yaml", run_config(args, model_dir, data, reward, method, args.steps, args.engine)
    )
    t0 = time.time()
    r = masktrl(
        "train", "--config", str(cfg), "--out", str(work / "out"), "--run", method, log=log_path(args.json, method)
    )
    wall = time.time() - t0
    if r.returncode != 0:
        return {"ok": False, "wall_s": round(wall, 1), "error": (r.stderr or r.stdout)[-3000:]}
    root = work / "out" / method
    rows = _metrics(root)
    tokens = [row["tokens_per_s"] * row["step_time_s"] for row in rows]
    result = {
        "ok": True,
        "wall_s": round(wall, 1),
        "steps": len(rows),
        "reward_mean_first": rows[0]["reward_mean"],
        "reward_mean_last": rows[-1]["reward_mean"],
        "ppo_kl_mean": statistics.fmean(row["ppo_kl"] for row in rows),
        "step_time_s_median": statistics.median(row["step_time_s"] for row in rows),
        "tokens_per_s_median": statistics.median(row["tokens_per_s"] for row in rows),
        "generation_tokens_per_s": sum(tokens) / max(1e-9, sum(row["rollout_time_s"] for row in rows)),
        "grad_norm_last": rows[-1].get("grad_norm"),
    }
    half = max(1, args.steps // 2)
    if args.steps > half:  # the rollouts of step half+1 came from the engine after the sync of step half
        rollouts = root / "steps" / f"{half + 1:06d}" / "rollouts.parquet"
        synced = logp_gap(root / "checkpoints" / f"{half:06d}", rollouts, args.dtype, args.device)
        start = logp_gap(model_dir, rollouts, args.dtype, args.device)
        result["weight_sync"] = {
            "rollout_step": half + 1,
            "at_synced_weights": synced,
            "at_starting_weights": start,
            "sync_ok": synced["mean_abs_dlogp"] < start["mean_abs_dlogp"],
        }
    return result


def zero2_resume(args, work: Path, model_dir: Path, data: Path, reward: Path, progress=None) -> dict:
    """An uninterrupted ZeRO-2 run and one killed in step 2's update then resumed: same result?
    ``progress(partial)`` is called after each of the three runs with what is known so far (the
    caller saves it: a check cut short by its timeout still says which run it was in)."""
    from safetensors.torch import load_file

    partial: dict = {"ok": False, "complete": False}

    def done(**facts) -> None:
        partial.update(facts)
        if progress is not None:
            progress(dict(partial))

    steps = 3
    prompts, n, _, new_tokens = SIZES[args.shape]
    # the check is the resume, not the throughput: a smaller batch
    rollout = {"prompts_per_step": max(2, prompts // 4), "n": max(2, n // 2), "max_new_tokens": max(4, new_tokens // 4)}

    def config(name: str, checkpoint_every: int) -> Path:
        # only the newest checkpoint kept: at the GPU shape one is 12 GB (bf16 weights + DeepSpeed's
        # fp32 optimizer state)
        train = {"checkpoint_every": checkpoint_every, "keep_steps": [], "keep_checkpoints": 1}
        extra = {"train": train, "rollout": rollout}
        return _write_yaml(work / name, run_config(args, model_dir, data, reward, "grpo", steps, "hf", extra))

    # the uninterrupted run checkpoints at its end only, the run to be killed every step (its resume
    # starts from step 1's): equal results also say that writing a checkpoint leaves a run as it was
    full_cfg, crash_cfg = config("zero2-full.yaml", steps), config("zero2-crash.yaml", 1)
    launcher = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(args.accelerate_config),
        "--num_processes",
        "1",
        "--main_process_port",
        str(args.port),
    ]
    out = work / "out"

    def log(run: str) -> Path:
        return log_path(args.json, run)

    t0 = time.time()
    full = masktrl(
        "train",
        "--config",
        str(full_cfg),
        "--out",
        str(out),
        "--run",
        "zero2-full",
        launcher=launcher,
        log=log("zero2-full"),
    )
    t_full = time.time() - t0
    if full.returncode != 0:
        return {"ok": False, "error": "uninterrupted run: " + (full.stderr or full.stdout)[-3000:]}
    done(uninterrupted_wall_s=round(t_full, 1))
    crash = masktrl(
        "train",
        "--config",
        str(crash_cfg),
        "--out",
        str(out),
        "--run",
        "zero2-crash",
        launcher=launcher,
        env={**_env(), "MASKTRL_CRASH_AT": "update:2"},
        log=log("zero2-crash"),
    )
    killed = crash.returncode != 0 and not (out / "zero2-crash" / "summary.json").exists()
    done(killed=killed)
    t1 = time.time()
    resumed = masktrl("train", "--resume", "zero2-crash", "--out", str(out), launcher=launcher, log=log("zero2-resume"))
    t_resume = time.time() - t1
    if resumed.returncode != 0:
        return {"ok": False, "killed": killed, "error": "resume: " + (resumed.stderr or resumed.stdout)[-3000:]}
    a = load_file(out / "zero2-full" / "checkpoints" / f"{steps:06d}" / "model.safetensors")
    b = load_file(out / "zero2-crash" / "checkpoints" / f"{steps:06d}" / "model.safetensors")
    diff = max((a[k].float() - b[k].float()).abs().max().item() for k in a) if a.keys() == b.keys() else float("inf")
    strip = lambda rows: [{k: v for k, v in row.items() if k not in TIMING} for row in rows]  # noqa: E731
    same_metrics = strip(_metrics(out / "zero2-full")) == strip(_metrics(out / "zero2-crash"))
    shards = len(list((out / "zero2-crash" / "checkpoints" / f"{steps:06d}" / "deepspeed").rglob("*optim_states.pt")))
    return {
        "ok": killed and diff == 0.0 and same_metrics,
        "complete": True,
        "killed": killed,
        "deepspeed_optimizer_shards": shards,
        "max_abs_weight_diff": diff,
        "bit_identical_weights": diff == 0.0,
        "metrics_identical": same_metrics,
        "uninterrupted_wall_s": round(t_full, 1),
        "resume_wall_s": round(t_resume, 1),
    }


def versions() -> dict:
    import importlib.metadata as md

    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__}
    for pkg in ("transformers", "vllm", "deepspeed", "accelerate", "peft"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
        out["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    return out


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--work", type=Path, required=True, help="scratch folder (model, data, runs); created")
    p.add_argument("--json", type=Path, required=True, help="where the results go")
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    p.add_argument("--engine", choices=["vllm", "hf"], default="vllm")
    p.add_argument("--methods", default="grpo,pdm,sis")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--device", default=None, help="where the sync check recomputes log pi (default: cuda if available)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--sleep-mode", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="vLLM without CUDA graphs: a start-up of seconds instead of a minute",
    )
    p.add_argument("--zero2", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--accelerate-config", type=Path, default=REPO / "configs" / "accelerate" / "zero2.yaml")
    p.add_argument("--port", type=int, default=29517)
    return p.parse_args(argv)


def missing_packages(args: argparse.Namespace) -> list[str]:
    """The packages the check asked for needs and this Python lacks: vLLM only for the vllm engine
    (``--engine hf`` checks the rest without it), DeepSpeed only for the ZeRO-2 phase."""
    need = ["torch", "transformers", "accelerate", "datasets", "safetensors", "yaml"]
    need += ["vllm"] if args.engine == "vllm" else []
    need += ["deepspeed"] if args.zero2 else []
    return [name for name in need if importlib.util.find_spec(name) is None]


def main(argv=None) -> int:
    args = parse(argv)
    missing = missing_packages(args)
    if missing:
        print(
            f"error: missing packages: {' '.join(missing)} "
            "(pip install -e '.[vllm,deepspeed,data]'; without vLLM: --engine hf)",
            file=sys.stderr,
        )
        return 2
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.time()
    args.work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(REPO))
    results: dict = {"check": "gpu_check", "argv": sys.argv[1:], "versions": versions()}
    model_dir = args.work / "model"
    results["model"] = build_model(args.shape, model_dir, args.dtype, args.device)
    data, reward = write_task(args.work, args.shape)
    results["runs"] = {}
    args.json.parent.mkdir(parents=True, exist_ok=True)

    def save(done: bool) -> None:  # after every phase: a check cut short by its timeout still leaves its results
        results["wall_s"] = round(time.time() - t0, 1)
        results["complete"] = done
        runs_ok = all(r.get("ok") and r.get("weight_sync", {}).get("sync_ok", True) for r in results["runs"].values())
        results["ok"] = done and runs_ok and results.get("zero2_resume", {"ok": True})["ok"]
        args.json.write_text(json.dumps(results, indent=2) + "\n")

    save(False)
    for method in [m for m in args.methods.split(",") if m]:
        results["runs"][method] = method_run(args, args.work, model_dir, data, reward, method)
        print(f"{method}: {json.dumps(results['runs'][method])[:400]}", flush=True)
        save(False)
    if args.zero2:

        def progress(partial: dict) -> None:
            results["zero2_resume"] = partial
            save(False)

        results["zero2_resume"] = zero2_resume(args, args.work, model_dir, data, reward, progress)
        print(f"zero2: {json.dumps(results['zero2_resume'])[:400]}", flush=True)
    save(True)
    print(f"wrote {args.json} (ok={results['ok']}, {results['wall_s']} s)")
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
