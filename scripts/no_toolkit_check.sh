#!/usr/bin/env bash
# A build without the CUDA toolkit, as on a machine that has none: configures and builds the
# libraries (allocator, regions, optimizer without its CUDA kernels, LD_PRELOAD library) and
# the demo with find_package(CUDAToolkit) disabled and no nvcc on PATH, checks that configure
# said so, that nothing links the CUDA runtime, and runs the demo on the host driver; with
# a Python that has torch, also the README's quick start and a StreamedAdamW step on the CPU (on
# a GPU: that the optimizer, which has no kernels, fails naming the cause).
#   scripts/no_toolkit_check.sh WORK_DIR [TORCH_PYTHON]
# Unoptimised (-O0, no debug info) to keep it short; the ctest no_toolkit_build runs it.
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
work=$1
torch_py=${2:-}
mkdir -p "$work"
# No toolkit to find: no folder holding an nvcc on PATH, the hints pointing nowhere.
keep=()
IFS=: read -ra dirs <<< "$PATH"
for d in "${dirs[@]}"; do [ -n "$d" ] && [ ! -x "$d/nvcc" ] && keep+=("$d"); done
PATH=$(IFS=:; printf '%s' "${keep[*]}")
export PATH CUDAToolkit_ROOT=/nonexistent CUDA_PATH=/nonexistent CUDA_HOME=/nonexistent CUDACXX=
unset DEFERALLOC_LIB DEFERALLOC_OPTIMIZER_LIB DEFERALLOC_CONF
if command -v nvcc >/dev/null; then echo "no_toolkit_check: nvcc is still on PATH ($(command -v nvcc))" >&2; exit 1; fi
gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
t0=$SECONDS
cmake -S "$src" -B "$work/build" "${gen[@]}" -DCMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit=ON \
      -DCMAKE_BUILD_TYPE=None "-DCMAKE_CXX_FLAGS=-O0 -g0" -DDEFERALLOC_BUILD_TESTS=OFF \
      -DDEFERALLOC_BUILD_BENCHMARKS=OFF -DDEFERALLOC_BUILD_EXAMPLES=ON > "$work/configure.log" 2>&1 \
  || { cat "$work/configure.log"; exit 1; }
grep -q "deferalloc: no CUDA toolkit found" "$work/configure.log" \
  || { cat "$work/configure.log"; echo "no_toolkit_check: configure did not say that the toolkit is absent" >&2; exit 1; }
cmake --build "$work/build" -j2 --target deferalloc deferalloc_optimizer deferalloc_preload deferalloc_demo \
      > "$work/build.log" 2>&1 || { tail -50 "$work/build.log"; exit 1; }
echo "no_toolkit_check: configured and built in $((SECONDS - t0)) s"
lib=$(find "$work/build" -name 'libdeferalloc.so' | head -1)
opt=$(find "$work/build" -name 'libdeferalloc_optimizer.so' | head -1)
for so in "$lib" "$opt" "$(find "$work/build" -name 'libdeferalloc_preload.so' | head -1)"; do
  if readelf -d "$so" | grep -E 'NEEDED.*(libcuda|libcudart|libnccl)'; then
    echo "no_toolkit_check: $so links a CUDA library" >&2; exit 1
  fi
done
DEFERALLOC_CONF=driver:host,host_granularity_kb:64 "$(find "$work/build" -name deferalloc_demo -type f | head -1)" \
  > "$work/demo.log" 2>&1 || { tail -30 "$work/demo.log"; exit 1; }
echo "no_toolkit_check: deferalloc_demo ran on the host driver"
[ -n "$torch_py" ] || exit 0
DEFERALLOC_LIB=$lib DEFERALLOC_OPTIMIZER_LIB=$opt PYTHONPATH="$src/python" "$torch_py" "$src/scripts/quickstart_check.py" --no-kernels
