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
ctest --test-dir "$build" --output-on-failure || {
  rc=$?
  # The failed checks again at the end, where a log cut in the middle still shows them: the
  # FAIL lines of the Python tests (megatron_runs' check) and GoogleTest's failed cases.
  echo "---- failed checks (from $build/Testing/Temporary/LastTest.log)"
  grep -E '^(FAIL |\[  FAILED  \] [A-Za-z_]+\.)' "$build/Testing/Temporary/LastTest.log" | sort -u | tail -40 || true
  exit "$rc"
}
