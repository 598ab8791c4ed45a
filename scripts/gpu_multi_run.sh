#!/usr/bin/env bash
# The distributed optimizer on the two-GPU machine, in one call:
#   bash scripts/gpu_multi_run.sh
# Builds build-gpu (test_distributed and the LibTorch trainer only, against python3's
# torch), runs ctest -L multigpu: test_distributed.nccl2 (two threads, two GPUs, NCCL)
# and trainer_acceptance_ws2 (torchrun --nproc-per-node=2 --no-python ./trainer: tiers
# bit-identical, pause/resume with registered NCCL buffers, checkpoint resume, world 2
# vs world 1, peak HBM of host vs device tier).  Logs under $OUT; a table printed last.
# Meant to finish within 6 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export OUT NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
[ -x /usr/local/cuda/bin/nvcc ] && export PATH=/usr/local/cuda/bin:$PATH
PY=${DFA_PYTHON:-$(command -v python3)}
B=${DFA_BUILD_DIR:-build-gpu}
t0=$SECONDS
summary=()
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader > "$OUT/gpu.txt" 2>&1
nccl_dir=$("$PY" -c 'import nvidia.nccl as n;print(list(n.__path__)[0])' 2>/dev/null)
[ -n "$nccl_dir" ] && [ -f "$nccl_dir/lib/libnccl.so.2" ] && export DEFERALLOC_NCCL_LIB=${DEFERALLOC_NCCL_LIB:-$nccl_dir/lib/libnccl.so.2}
prefix=$("$PY" -c 'import torch;print(torch.utils.cmake_prefix_path)' 2>"$OUT/torch-import.log") \
  || { echo "no torch in $PY"; cat "$OUT/torch-import.log"; exit 1; }
"$PY" -c 'import torch;print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())' \
  > "$OUT/torch-version.txt" 2>&1
gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
cmake -S . -B $B "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 -DDEFERALLOC_WITH_TORCH=ON \
      -DDEFERALLOC_BUILD_BENCHMARKS=OFF "-DCMAKE_PREFIX_PATH=$prefix" "-DDEFERALLOC_PYTHON=$PY" \
      > "$OUT/multi-configure.log" 2>&1 || { tail -40 "$OUT/multi-configure.log"; exit 1; }
grep -E "deferalloc: (NCCL|nccl)" "$OUT/multi-configure.log"
if ! cmake --build $B -j"$(nproc)" --target test_distributed deferalloc_trainer > "$OUT/multi-build.log" 2>&1; then
  grep -E "error|Error" "$OUT/multi-build.log" | head -40; exit 1
fi
summary+=("build: ok in $((SECONDS - t0)) s ($(cat "$OUT/torch-version.txt"))")
ctest --test-dir $B -L multigpu -V --timeout 330 > "$OUT/ctest-multigpu.log" 2>&1
summary+=("ctest -L multigpu: $(grep -E 'tests passed|tests failed' "$OUT/ctest-multigpu.log" | tail -1)")
echo
echo "==== deferalloc distributed optimizer on $(wc -l < "$OUT/gpu.txt") x $(head -1 "$OUT/gpu.txt" | cut -d, -f2) ===="
grep -hE "Test +#.*(Passed|Failed|Skipped|\*\*\*)" "$OUT/ctest-multigpu.log" | sed 's/^[0-9]*: //'
grep -hE "^\[ +(OK|FAILED) +\]|driver under test|SKIPPED" "$OUT/ctest-multigpu.log" | sed 's/^[0-9]*: //' | sort -u
grep -hE "^[0-9]*: ?(trainer: world|step +(1|20) )" "$OUT"/trainer-ws2/host.log 2>/dev/null
[ -f "$OUT/trainer-ws2/summary.txt" ] && cat "$OUT/trainer-ws2/summary.txt"
summary+=("total: $((SECONDS - t0)) s")
printf '%s\n' "${summary[@]}"
