#!/usr/bin/env bash
# One call on the GPU machine: build, run the tests, run the benchmarks, print a table.
#   scripts/gpu_run.sh [build] [tests] [bench] [optbench] [demo]   (default: all)
# Logs and JSON go to $OUT (the device tool brings them back).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# The pip_install test offline: scikit-build-core's wheels carried in .whl (scripts/pip_check.sh).
if [ -z "${DFA_PIP_FIND_LINKS:-}" ] && ls .whl/scikit_build_core-*.whl >/dev/null 2>&1; then
  export DFA_PIP_FIND_LINKS=$PWD/.whl
fi
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(build tests bench optbench demo)
has() { [[ " ${steps[*]} " == *" $1 "* ]]; }
summary=()
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/gpu.txt" 2>&1
if has build; then
  prefix=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)' 2>/dev/null || true)
  # With the machine's torch: the LibTorch face, the torch tests and the torch baselines are
  # built in the same tree (scripts/gpu_torch_run.sh can then run with DFA_BUILD_DIR=build-gpu).
  cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 -DDEFERALLOC_BUILD_BENCHMARKS=ON \
        ${prefix:+-DCMAKE_PREFIX_PATH=$prefix -DDEFERALLOC_WITH_TORCH=ON -DDEFERALLOC_PYTHON=$(command -v python3)} \
        ${DFA_GPU_CMAKE_ARGS:-} > "$OUT/configure.log" 2>&1 \
    || { tail -40 "$OUT/configure.log"; exit 1; }
  if ! cmake --build build-gpu -j16 > "$OUT/build.log" 2>&1; then
    grep -E "error|Error" "$OUT/build.log" | head -40; exit 1
  fi
  summary+=("build: ok")
fi
if has tests; then
  ctest --test-dir build-gpu -L gpu -V --timeout 900 > "$OUT/ctest-gpu.log" 2>&1
  summary+=("ctest -L gpu: $(grep -E 'tests passed|tests failed' "$OUT/ctest-gpu.log" | tail -1)")
  ctest --test-dir build-gpu -LE gpu --output-on-failure --timeout 900 > "$OUT/ctest-other.log" 2>&1
  summary+=("ctest -LE gpu: $(grep -E 'tests passed|tests failed' "$OUT/ctest-other.log" | tail -1)")
  grep -E "Passed|Failed|Skipped|\*\*\*" "$OUT/ctest-gpu.log" "$OUT/ctest-other.log" | sed 's|.*log:||' | head -40
fi
bench() {  # name, extra args...
  local n=$1; shift
  "build-gpu/benchmarks/$n" --benchmark_out="$OUT/$n.json" --benchmark_out_format=json "$@" > "$OUT/$n.log" 2>&1 \
    || { echo "$n failed"; tail -20 "$OUT/$n.log"; }
}
if has bench; then bench bench_reservations --benchmark_min_time=0.3; fi
if has optbench; then
  df -h "${DFA_BENCH_DIR:-/tmp}" | tail -1
  if [ -n "${DFA_GDB:-}" ]; then  # a backtrace if it crashes (cuda-gdb debugs host code too)
    cuda-gdb -batch -ex run -ex bt -ex 'x/24a $sp' --args build-gpu/benchmarks/bench_optimizer --benchmark_filter="$DFA_GDB" \
      > "$OUT/gdb.log" 2>&1; grep -A25 -E "SIGSEGV|SIGABRT" "$OUT/gdb.log" | head -40
  fi
  bench bench_optimizer ${DFA_OPTBENCH_ARGS:-}
fi
if has bench || has optbench; then
  python3 benchmarks/report.py "$OUT"/bench_*.json > "$OUT/report.txt"; cat "$OUT/report.txt"
fi
if has demo; then
  ./build-gpu/examples/deferalloc_demo > "$OUT/demo.log" 2>&1; summary+=("demo: exit $?")
  tail -14 "$OUT/demo.log"
fi
printf '%s\n' "${summary[@]}"
