#!/usr/bin/env bash
# Builds and runs the whole test suite.  Without a GPU the CUDA suites show as Skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/env.sh
cmake -S . -B build "${DFA_CMAKE_ARGS[@]}"
cmake --build build -j"$(nproc)"
ctest --test-dir build --output-on-failure
