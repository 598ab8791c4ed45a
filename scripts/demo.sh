#!/usr/bin/env bash
# Builds and runs the main job: deferalloc_demo (GPU when present, host driver otherwise).
set -euo pipefail
cd "$(dirname "$0")/.."
DEFERALLOC_NO_TORCH=1 bash scripts/setup.sh  # the demo needs no torch
source scripts/env.sh
cmake -S . -B build-demo "${DFA_CMAKE_ARGS[@]}" -DDEFERALLOC_BUILD_TESTS=OFF -DDEFERALLOC_BUILD_BENCHMARKS=OFF >/dev/null
cmake --build build-demo -j"$(nproc)" --target deferalloc_demo
./build-demo/examples/deferalloc_demo "$@"
