# Sourced by the scripts: CUDA on PATH, CMake arguments shared by every build.
if [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=/usr/local/cuda/bin:$PATH; fi
DFA_CMAKE_ARGS=(-G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo)
if ! command -v nvcc >/dev/null; then DFA_CMAKE_ARGS+=(-DDEFERALLOC_WITH_CUDA_KERNELS=OFF); fi
