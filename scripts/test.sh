#!/usr/bin/env bash
# Builds and runs the whole test suite.  Without a GPU the CUDA suites show as Skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/env.sh
# The LibTorch face and the torch tests (label torch) with the venv's torch (setup.sh);
# DEFERALLOC_NO_TORCH=1 leaves them out.
build=${DFA_BUILD_DIR:-build}
torch_args=()
if [ "${DEFERALLOC_NO_TORCH:-0}" != 1 ]; then
  prefix=$(.venv/bin/python -c 'import torch;print(torch.utils.cmake_prefix_path)') \
    || { echo "test.sh: torch is not importable from .venv (see scripts/setup.sh)" >&2; exit 1; }
  torch_args=(-DDEFERALLOC_WITH_TORCH=ON "-DCMAKE_PREFIX_PATH=$prefix" "-DDEFERALLOC_PYTHON=$PWD/.venv/bin/python")
fi
cmake -S . -B "$build" "${DFA_CMAKE_ARGS[@]}" "${torch_args[@]}"
cmake --build "$build" -j"$(nproc)"
ctest --test-dir "$build" --output-on-failure
