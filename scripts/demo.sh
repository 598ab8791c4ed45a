#!/usr/bin/env bash
# Builds and runs the main job: deferalloc_demo (GPU when present, host driver otherwise).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/env.sh
cmake -S . -B build "${DFA_CMAKE_ARGS[@]}" -DDEFERALLOC_BUILD_TESTS=OFF -DDEFERALLOC_BUILD_BENCHMARKS=OFF >/dev/null
cmake --build build -j"$(nproc)" --target deferalloc_demo deferalloc_optimizer
./build/examples/deferalloc_demo "$@"
