#!/usr/bin/env bash
# Installs what the build needs on a Debian machine, once: compilers, CMake, Ninja,
# GoogleTest/GoogleMock, Google Benchmark.  The CUDA toolkit is expected in
# /usr/local/cuda (nvcc, headers, NCCL); without nvcc the CUDA kernels are skipped.
set -euo pipefail
need=()
command -v cmake >/dev/null || need+=(cmake)
command -v ninja >/dev/null || need+=(ninja-build)
command -v g++ >/dev/null || need+=(g++)
[ -f /usr/include/gtest/gtest.h ] || need+=(libgtest-dev)
[ -f /usr/include/gmock/gmock.h ] || need+=(libgmock-dev)
[ -f /usr/include/benchmark/benchmark.h ] || need+=(libbenchmark-dev)
if [ ${#need[@]} -gt 0 ]; then
  echo "setup: installing ${need[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}"
fi

# PyTorch faces: torch==2.11.0 (the GPU machine's version, PyPI's CUDA 13 wheel) in a
# project-local venv .venv; LibTorch (headers, CMake config, libtorch_cuda and the
# nvidia-* libraries it links) comes from the same wheel.  DEFERALLOC_NO_TORCH=1 skips it.
DFA_TORCH_VERSION=2.11.0
if [ "${DEFERALLOC_NO_TORCH:-0}" != 1 ]; then
  root=$(cd "$(dirname "$0")/.." && pwd)
  if ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then
    echo "setup: installing python3-venv"
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq python3-venv
  fi
  [ -x "$root/.venv/bin/python" ] || python3 -m venv "$root/.venv"
  # pip into .venv without its wheel cache (torch's CUDA wheels are 2.6 GB downloaded,
  # and the cache would hold them a second time) and with its temporary files inside .venv,
  # so that the install needs space on one filesystem only; a failure says how much there was.
  venv_pip() {
    local tmp="$root/.venv/pip-tmp"
    mkdir -p "$tmp"
    if ! TMPDIR="$tmp" "$root/.venv/bin/pip" install --quiet --disable-pip-version-check --no-cache-dir "$@"; then
      rm -rf "$tmp"
      echo "setup: 'pip install $*' failed (above); free space for .venv: $(df -Ph "$root/.venv" | awk 'NR==2{print $4}')" \
           "(torch==$DFA_TORCH_VERSION needs about 7.5 GB while it installs: 4.7 GB installed, 2.6 GB of downloads)" >&2
      exit 1
    fi
    rm -rf "$tmp"
  }
  if ! "$root/.venv/bin/python" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$DFA_TORCH_VERSION')" >/dev/null 2>&1; then
    echo "setup: installing torch==$DFA_TORCH_VERSION into .venv (about 4.6 GB installed with its CUDA libraries)"
    venv_pip "torch==$DFA_TORCH_VERSION"
  fi
  # benchmarks/plot.py draws docs/BENCHMARKS.md's plots with matplotlib.
  if ! "$root/.venv/bin/python" -c 'import matplotlib' >/dev/null 2>&1; then
    echo "setup: installing matplotlib into .venv"
    venv_pip matplotlib
  fi
  # transformers' LlamaForCausalLM for StreamedAdamW's example and GPU acceptance;
  # without it they use a built-in Llama.
  if ! "$root/.venv/bin/python" -c 'import transformers' >/dev/null 2>&1; then
    echo "setup: installing transformers into .venv"
    venv_pip transformers
  fi
  # The Hugging Face Trainer example: the Trainer needs accelerate.
  if ! "$root/.venv/bin/python" -c 'import accelerate' >/dev/null 2>&1; then
    echo "setup: installing accelerate into .venv"
    venv_pip accelerate
  fi
  # deferalloc.megatron's tests: megatron-core 0.16.1 in .venv, with the
  # dependencies its wheel declares (numpy, packaging) and psutil, which its
  # dist-checkpointing save uses.
  if ! "$root/.venv/bin/python" -c "import sys, megatron.core as m, psutil; sys.exit(m.__version__ != '0.16.1')" >/dev/null 2>&1; then
    echo "setup: installing megatron-core==0.16.1 and psutil into .venv"
    venv_pip "megatron-core==0.16.1" psutil
  fi
  # Every tested megatron-core (tests/torch/megatron_versions.txt) unpacked into
  # .megatron/<version>, one directory each, which the CPU tests put on PYTHONPATH.  From
  # 0.17 on the wheels declare Python >= 3.12 (cp312 only) while their Python code imports on
  # 3.11 (only a dataset helper extension is 3.12-only), so the cp312 wheel is fetched and
  # unpacked rather than installed.  About 10 MB each.
  for v in $(grep '^[0-9]' "$root/tests/torch/megatron_versions.txt"); do  # the lines CMake reads
    [ -f "$root/.megatron/$v/megatron/core/__init__.py" ] && continue
    echo "setup: unpacking megatron-core==$v into .megatron/$v"
    tmp=$(mktemp -d)
    "$root/.venv/bin/pip" download --quiet --disable-pip-version-check --no-cache-dir --no-deps \
      --only-binary=:all: --python-version 3.12 -d "$tmp" "megatron-core==$v"
    rm -rf "$root/.megatron/$v.tmp"  # a failed earlier unpack
    mkdir -p "$root/.megatron/$v.tmp"
    "$root/.venv/bin/python" -m zipfile -e "$tmp"/megatron_core-"$v"-*.whl "$root/.megatron/$v.tmp"
    rm -rf "$tmp" "$root/.megatron/$v"
    mv "$root/.megatron/$v.tmp" "$root/.megatron/$v"
  done
fi
