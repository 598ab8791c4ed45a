#!/usr/bin/env bash
# A built wheel, installed as a user without a compiler or CUDA toolkit installs it:
#   bash scripts/wheel_check.sh WHEEL [WORK_DIR] [TORCH_PYTHON]
# Makes WORK_DIR/v (default /tmp/deferalloc-wheel-check) with --system-site-packages (torch from
# the system Python), or, given TORCH_PYTHON, with that Python's site-packages added (a .pth
# file: the project's .venv here), installs WHEEL with no nvcc on PATH and no build, and runs
# from outside the source tree: on a GPU the quick start (a deferred tensor), a StreamedAdamW
# step (the wheel's CUDA kernels, sm_80 / 90 / 100 / 120 machine code) and a region
# pause / resume; on the CPU the CPU quick start and a StreamedAdamW step on CPU tensors.
# Needs the NVIDIA driver (CUDA 13: >= 580) on a GPU, nothing else but torch.
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
wheel=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
work=${2:-/tmp/deferalloc-wheel-check}
torch_py=${3:-}
keep=()
IFS=: read -ra dirs <<< "$PATH"
for d in "${dirs[@]}"; do [ -n "$d" ] && [ ! -x "$d/nvcc" ] && keep+=("$d"); done
PATH=$(IFS=:; printf '%s' "${keep[*]}")
export PATH
unset DEFERALLOC_LIB DEFERALLOC_OPTIMIZER_LIB DEFERALLOC_CONF PYTHONPATH CUDACXX
rm -rf "$work/v"
mkdir -p "$work"
python3 -m venv --system-site-packages "$work/v"
if [ -n "$torch_py" ]; then
  site=$("$torch_py" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')
  own=$("$work/v/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$site" > "$own/deferalloc_wheel_check_torch.pth"
fi
t0=$SECONDS
# --no-deps --no-index: the wheel alone (torch comes from the system), no source build possible.
"$work/v/bin/pip" install --quiet --disable-pip-version-check --no-deps --no-index --no-build-isolation "$wheel"
echo "wheel_check: installed $(basename "$wheel") in $((SECONDS - t0)) s (no nvcc on PATH: $(command -v nvcc || echo none))"
cd "$work"
"$work/v/bin/python" - <<'PY'
import deferalloc
assert "site-packages" in deferalloc.library_path(), deferalloc.library_path()
PY
"$work/v/bin/python" "$src/scripts/quickstart_check.py"
