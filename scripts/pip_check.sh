#!/usr/bin/env bash
# The packaging acceptance, as a user runs it: `python3 -m venv v && v/bin/pip install .`,
# then `import deferalloc` finds its own libraries with no environment variable set, and
# a CMake project finds the package inside it (deferalloc/lib/cmake).
#   scripts/pip_check.sh WORK_DIR [TORCH_PYTHON]
# WORK_DIR/v is the venv (kept: the README-example test runs in it); the wheel builds in
# WORK_DIR/pip-build (incremental across runs).  torch is not installed into v: a .pth
# file makes TORCH_PYTHON's site-packages (the shared .venv with torch 2.11.0) visible
# after v's own, which saves a second 3 GB download.  Needs PyPI for scikit-build-core
# (pip's isolated build environment), or, offline (the GPU machine), its wheels in the
# folder DFA_PIP_FIND_LINKS names (pip download scikit-build-core -d .whl).
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
work=$1
torch_py=${2:-}
mkdir -p "$work"
unset DEFERALLOC_LIB DEFERALLOC_CONF PYTHONPATH
[ -x /usr/local/cuda/bin/nvcc ] && export PATH=/usr/local/cuda/bin:$PATH
[ -x "$work/v/bin/python" ] || python3 -m venv "$work/v"
offline=()
[ -n "${DFA_PIP_FIND_LINKS:-}" ] && offline=(--no-index --find-links "$DFA_PIP_FIND_LINKS")
own=$("$work/v/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# A run before this one left the .pth below in v: pip's isolated build would then see the
# torch venv's packages, and scikit-build-core asks for the `cmake` package when it can
# import one (which offline, the GPU machine, no folder provides): the build runs without it.
rm -f "$own/deferalloc_ci_torch.pth"
t0=$SECONDS
"$work/v/bin/pip" install --quiet --disable-pip-version-check "${offline[@]}" "$src" -C "build-dir=$work/pip-build"
echo "pip install .: $((SECONDS - t0)) s"
if [ -n "$torch_py" ]; then
  site=$("$torch_py" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')
  echo "$site" > "$own/deferalloc_ci_torch.pth"
fi
# Where a GPU is, the same wheel must give CUDA tensors (driver:auto picks the GPU).
DFA_EXPECT_CUDA=0
nvidia-smi -L >/dev/null 2>&1 && DFA_EXPECT_CUDA=1
export DFA_EXPECT_CUDA
cd "$work"  # not the source tree: the installed package, not python/deferalloc
"$work/v/bin/python" - <<'PY'
import os
import deferalloc, torch
assert "site-packages" in deferalloc.library_path(), deferalloc.library_path()
if os.environ["DFA_EXPECT_CUDA"] == "1":
    assert deferalloc.driver_name() == "cuda", "a GPU is present but the wheel's library chose " + deferalloc.driver_name()
dev = "cuda" if deferalloc.driver_name() == "cuda" else "cpu"
t = deferalloc.deferred_empty((1 << 20,), torch.float32, dev)
deferalloc.materialize(t, "zero")
t.fill_(2.0)
deferalloc.release(t, keep="host")
assert not deferalloc.is_backed(t)
deferalloc.materialize(t, "restore")
assert t.sum().item() == 2.0 * (1 << 20)
print(f"pip install: ok ({deferalloc.driver_name()} driver, {t.device} tensor, library {deferalloc.library_path()})")
PY
# The CMake package inside the Python package: the consumer project links the installed
# wheel's libraries (no deferalloc::torch there: the wheel is built without LibTorch).
pkg=$("$work/v/bin/python" -c 'import deferalloc, os; print(os.path.dirname(deferalloc.__file__))')
dist=OFF; [ -f "$pkg/lib/libdeferalloc_distributed.so" ] && dist=ON
gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
cmake -S "$src/tests/consumer" -B "$work/consumer" "${gen[@]}" "-DCMAKE_PREFIX_PATH=$pkg" -DDFA_EXPECT_DISTRIBUTED=$dist \
      -DCMAKE_BUILD_TYPE=Release > "$work/consumer-configure.log" || { cat "$work/consumer-configure.log"; exit 1; }
cmake --build "$work/consumer" > "$work/consumer-build.log" || { cat "$work/consumer-build.log"; exit 1; }
for p in consumer consumer_optimizer $([ $dist = ON ] && echo consumer_distributed); do
  DEFERALLOC_CONF=driver:host,host_granularity_kb:64 "$work/consumer/$p"
done
