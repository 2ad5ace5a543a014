#!/usr/bin/env bash
# The GPU check (docs/BENCHMARKS.md, "GPU check"): on one NVIDIA GPU, offline, in about 8 minutes,
# a Qwen3-0.6B-shaped model built from its config (random weights), vLLM colocated with sleep
# mode, bf16 training, 10 steps each of grpo, pdm and sis, the weight-sync check (vLLM log mu vs
# the trainer's log pi at the same weights, by response position), generated tokens/s, and a
# DeepSpeed ZeRO-2 run killed and resumed. One JSON of results.
#
#   bash scripts/gpu_check.sh [RESULTS.json] [gpu_check.py options]   (default gpu_check.json)
#   bash scripts/gpu_check.sh out.json --engine hf   (no vLLM on the machine: the rest, ZeRO-2 included)
#
# Needs: the CUDA build of torch, then pip install -e '.[vllm,deepspeed,data]' (vLLM, DeepSpeed,
# datasets for the local JSON-lines task). Scratch files go to $MASKTRL_GPU_CHECK_WORK (default
# a fresh temporary folder, deleted at the end unless MASKTRL_GPU_CHECK_KEEP=1).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-gpu_check.json}"
python="${PYTHON:-python}"
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "error: no NVIDIA GPU visible (nvidia-smi -L failed)" >&2
    exit 2
fi
# the packages the options need are the driver's check (gpu_check.py: missing_packages); CUDA is this one's
cuda=$("$python" - <<'PY'
import importlib.util
if importlib.util.find_spec("torch") is None:
    print("none")
else:
    import torch
    print("yes" if torch.cuda.is_available() else "no")
PY
)
if [ "$cuda" != "yes" ]; then
    if [ "$cuda" = "none" ]; then
        echo "error: torch is not installed (install the CUDA build of torch)" >&2
    else
        echo "error: torch sees no CUDA device (install the CUDA build of torch)" >&2
    fi
    exit 2
fi
work="${MASKTRL_GPU_CHECK_WORK:-$(mktemp -d -t masktrl-gpu-check.XXXXXX)}"
if [ "${MASKTRL_GPU_CHECK_KEEP:-0}" != "1" ] && [ -z "${MASKTRL_GPU_CHECK_WORK:-}" ]; then
    trap 'rm -rf "$work"' EXIT
fi
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
cd "$repo"
timeout "${MASKTRL_GPU_CHECK_TIMEOUT:-540}" "$python" benchmarks/gpu_check.py --work "$work" --json "$out" "${@:2}"
