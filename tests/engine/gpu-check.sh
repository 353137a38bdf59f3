#!/usr/bin/env bash
# The engine test on a GPU: vLLM 0.33's CUDA build, real adaptive verification with CUDA
# graphs and vLLM's own profiled cost curves, no CPU lifts, no Triton interpreter.
#
#   tests/engine/gpu-check.sh [PYTEST ARGS...]
#
# Run it from a checkout on a machine with an NVIDIA GPU and either network access to PyPI
# or a wheelhouse (PIP_FIND_LINKS=DIR PIP_NO_INDEX=1). It builds .venv-gpu (vllm==0.33.0
# with the torch it pins, avest with its server extra, the test-only tests/engine/cpu_lift,
# pytest), then runs tests/engine/test_engine.py with AVEST_ENGINE_DEVICE=cuda: the same
# runs and assertions as on the CPU. The CPU suite never needs it. Bounded by TIMEOUT_S
# (default 1500 s); the log is also written to ${OUT:-.cache}/engine-gpu.log.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

PYTHON="${PYTHON:-python3}"
VENV="${VENV:-.venv-gpu}"
LOG="${OUT:-.cache}/engine-gpu.log"
mkdir -p "$(dirname "$LOG")"
nvidia-smi -L || { echo "gpu-check: no NVIDIA GPU visible" >&2; exit 2; }
if [[ ! -x "$VENV/bin/python" ]]; then
  "$PYTHON" -m venv "$VENV"
  pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
  "${pip[@]}" --upgrade pip
  "${pip[@]}" 'vllm==0.33.0'
  # avest and what its tests need, without moving vLLM's torch, protobuf or grpcio
  "${pip[@]}" -e '.[server]' pytest pytest-asyncio httpx
  "${pip[@]}" --no-deps -e tests/engine/cpu_lift
fi
"$VENV/bin/python" -c 'import torch; assert torch.cuda.is_available(), "torch sees no GPU"'
set -o pipefail
AVEST_ENGINE_DEVICE=cuda AVEST_ENGINE_PYTHON="$PWD/$VENV/bin/python" AVEST_REQUIRE_VLLM_ENV=1 \
  timeout "${TIMEOUT_S:-1500}" "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
  tests/engine/test_engine.py "$@" 2>&1 | tee "$LOG"
