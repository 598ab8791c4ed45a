#!/usr/bin/env bash
# Before a release: what the test command (scripts/test.sh) leaves out to stay fast.
#   bash scripts/release_check.sh [BUILD_DIR]     (default build-release; about an hour on 2 cores)
# 1. every CPU Megatron test in full on every tested megatron-core
#    (-DDEFERALLOC_MEGATRON_FULL_MATRIX=ON; the test command runs the newest in full, the
#    oldest's construction and handles, a quick flow between: tests/CMakeLists.txt);
# 2. the CPU torch suites on the oldest torch pyproject.toml's [torch] allows
#    (scripts/torch_versions.sh; a 2.6 GB download the first time), when DFA_RELEASE_TORCH is set
#    to its version (e.g. DFA_RELEASE_TORCH=2.6.0).
# The GPU rounds (docs/CONTRIBUTING.md) come on top.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
build=${1:-build-release}
prefix=$(.venv/bin/python -c 'import torch;print(torch.utils.cmake_prefix_path)')
cmake -S . -B "$build" "${DFA_CMAKE_ARGS[@]}" -DDEFERALLOC_WITH_TORCH=ON "-DCMAKE_PREFIX_PATH=$prefix" \
      "-DDEFERALLOC_PYTHON=$PWD/.venv/bin/python" -DDEFERALLOC_MEGATRON_FULL_MATRIX=ON
cmake --build "$build" -j"$(nproc)"
ctest --test-dir "$build" -R megatron -LE gpu --output-on-failure --timeout 1500
if [ -n "${DFA_RELEASE_TORCH:-}" ]; then
  bash scripts/torch_versions.sh "$DFA_RELEASE_TORCH" ".venv-torch-$DFA_RELEASE_TORCH" "$build"
fi
