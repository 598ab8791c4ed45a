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
DEFERALLOC_LIB=$lib DEFERALLOC_OPTIMIZER_LIB=$opt PYTHONPATH="$src/python" "$torch_py" - <<'PY'
import deferalloc, torch
from deferalloc.optim import StreamedAdamW
dev = "cuda" if deferalloc.driver_name() == "cuda" else "cpu"
t = deferalloc.deferred_empty((1 << 20,), torch.float32, dev)
deferalloc.materialize(t, "zero")
t += 1
deferalloc.release(t, keep="host")
deferalloc.materialize(t, "restore")
assert t.sum().item() == t.numel()
if dev == "cpu":
    m = torch.nn.Linear(64, 64).to(torch.bfloat16)
    opt = StreamedAdamW(m.parameters(), lr=1e-3, window_mb=16)
    m(torch.randn(8, 64, dtype=torch.bfloat16)).float().pow(2).mean().backward()
    before = m.weight.detach().clone()
    opt.step()
    assert not torch.equal(before, m.weight), "the step changed nothing"
else:  # a GPU: the optimizer has no kernels, and says so when asked to work on it
    m = torch.nn.Linear(64, 64, device="cuda", dtype=torch.bfloat16)
    try:
        StreamedAdamW(m.parameters(), lr=1e-3, window_mb=16).step()
        raise SystemExit("no_toolkit_check: a CUDA optimizer without kernels did not fail")
    except deferalloc.NoDevice as e:
        assert "without its CUDA kernels" in str(e), e
print(f"no_toolkit_check: the quick start and a StreamedAdamW step ran ({deferalloc.driver_name()} driver)")
PY
