#!/usr/bin/env bash
# The wheels the GPU machine lacks, fetched into .whl/ (ignored by git) for scripts/gpu_round.sh,
# which installs them there (carry [".whl"] on the device call).
#   .whl/           torch-memory-saver 0.0.10 (the drop-in's benchmark and tests), megatron-core
#                   0.16.1 (deferalloc.megatron's GPU tests), scikit-build-core and what it needs
#                   (the offline pip_install test)
#   .whl/megatron/  the megatron-core versions of the megatron, sib, megatron_bench and curves steps
#                   (default 0.19.2, the newest tested; DFA_DEVICE_MEGATRON="0.16.1 0.19.2" for more)
# The device machine runs Python 3.12 on x86_64 with no network; a call carries at most 64 MiB of
# working tree, so the script prints what .whl holds at the end.  Run it from anywhere; it skips
# a wheel that is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
platforms=(--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64)
fetch() {  # folder, requirement...: each requirement alone, no dependencies, binary wheels for 3.12
  local dir=$1
  shift
  mkdir -p "$dir"
  python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp "${platforms[@]}" -d "$dir" "$@"
}
fetch .whl torch-memory-saver==0.0.10 megatron-core==0.16.1
# scikit-build-core and its dependencies on Python 3.12 (pure-Python wheels).
fetch .whl scikit-build-core packaging pathspec
for v in ${DFA_DEVICE_MEGATRON:-0.19.2}; do
  fetch .whl/megatron "megatron-core==$v"
done
du -sh .whl
find .whl -type f -name '*.whl' -printf '%P %s\n' | sort
