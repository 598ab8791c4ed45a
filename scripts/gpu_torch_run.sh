#!/usr/bin/env bash
# The PyTorch integration on the GPU machine, in one call:
#   scripts/gpu_torch_run.sh [build] [tests] [bench]   (default: all three)
# Builds build-gpu-torch against the machine's python3 torch (DFA_PYTHON to choose
# another interpreter), runs ctest -L torch (plus the caching-allocator and preload
# suites on the CUDA driver), bench_pause_resume and bench_allocation, and prints a short
# table last.  Logs and JSON go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# The pip_install test offline: scikit-build-core's wheels carried in .whl (scripts/pip_check.sh).
if [ -z "${DFA_PIP_FIND_LINKS:-}" ] && ls .whl/scikit_build_core-*.whl >/dev/null 2>&1; then
  export DFA_PIP_FIND_LINKS=$PWD/.whl
fi
[ -x /usr/local/cuda/bin/nvcc ] && export PATH=/usr/local/cuda/bin:$PATH
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(build tests bench)
has() { [[ " ${steps[*]} " == *" $1 "* ]]; }
PY=${DFA_PYTHON:-$(command -v python3)}
B=${DFA_BUILD_DIR:-build-gpu-torch}
summary=()
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/gpu.txt" 2>&1
if has build; then
  prefix=$("$PY" -c 'import torch;print(torch.utils.cmake_prefix_path)' 2>"$OUT/torch-import.log") \
    || { echo "no torch in $PY"; cat "$OUT/torch-import.log"; exit 1; }
  "$PY" -c 'import torch;print("torch", torch.__version__, "cuda", torch.version.cuda)' > "$OUT/torch-version.txt" 2>&1
  gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
  cmake -S . -B $B "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
        -DDEFERALLOC_WITH_TORCH=ON "-DCMAKE_PREFIX_PATH=$prefix" "-DDEFERALLOC_PYTHON=$PY" \
        > "$OUT/torch-configure.log" 2>&1 || { tail -40 "$OUT/torch-configure.log"; exit 1; }
  if ! cmake --build $B -j"$(nproc)" > "$OUT/torch-build.log" 2>&1; then
    grep -E "error|Error" "$OUT/torch-build.log" | head -40; exit 1
  fi
  summary+=("build: ok ($(cat "$OUT/torch-version.txt"))")
fi
if has tests; then
  ctest --test-dir $B -L torch -V --timeout 900 > "$OUT/ctest-torch.log" 2>&1
  summary+=("ctest -L torch: $(grep -E 'tests passed|tests failed' "$OUT/ctest-torch.log" | tail -1)")
  ctest --test-dir $B -R 'test_caching|c_api_caching|preload' -V --timeout 900 > "$OUT/ctest-caching.log" 2>&1
  summary+=("ctest caching/preload (cuda + host): $(grep -E 'tests passed|tests failed' "$OUT/ctest-caching.log" | tail -1)")
  grep -hE "Test +#.*(Passed|Failed|Skipped|\*\*\*)" "$OUT/ctest-torch.log" "$OUT/ctest-caching.log" | sed 's/^[0-9]*: //'
fi
if has bench; then
  $B/benchmarks/bench_pause_resume > "$OUT/bench_pause_resume.log" 2>&1
  summary+=("bench_pause_resume: exit $?")
  mkdir -p "$OUT/gbench"
  $B/benchmarks/bench_allocation --benchmark_min_time=0.3 --benchmark_out="$OUT/gbench/bench_allocation.json" \
    --benchmark_out_format=json > "$OUT/bench_allocation.log" 2>&1
  summary+=("bench_allocation: exit $?")
  # The figures in the schema of benchmarks/bench_json.py, for docs/data/<date>/ (benchmarks/plot.py).
  "$PY" benchmarks/bench_json.py convert "$OUT/gbench/bench_allocation.json" --out "$OUT/bench_allocation.json" \
    --device "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" \
    --command "$B/benchmarks/bench_allocation --benchmark_min_time=0.3 (scripts/gpu_torch_run.sh bench)"
fi
echo
echo "==== deferalloc PyTorch integration on $(cut -d, -f1 "$OUT/gpu.txt") ===="
if [ -f "$OUT/ctest-torch.log" ]; then
  grep -A8 "^[0-9]*: mode " "$OUT/ctest-torch.log" | sed 's/^[0-9]*: //' | grep -v "^--"
  grep -hE "deferred tensor: 100 cycles|CUDA graph over a deferred" "$OUT/ctest-torch.log" | sed 's/^[0-9]*: //' | sort -u
fi
[ -f "$OUT/bench_pause_resume.log" ] && grep -vE "^RESULT" "$OUT/bench_pause_resume.log"
[ -f "$OUT/gbench/bench_allocation.json" ] && "$PY" benchmarks/allocation/report_allocation.py "$OUT/gbench/bench_allocation.json" | tee "$OUT/report_allocation.txt"
printf '%s\n' "${summary[@]}"
