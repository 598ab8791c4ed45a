"""StreamedAdamW.step() from Python on a GPU: throughput against its same-run baselines.

Part (c) of tests/torch/test_optim_gpu.py alone, for a sweep of sizes and windows: the
host tier vs the duplex pinned-copy bound, vs a hand-written chunked offload in plain
PyTorch (pinned FP32 state, two GPU slots, H2D / torch._fused_adamw_ / D2H on three
streams), vs megatron-core's HybridDeviceOptimizer when its wheel is given, and the
Python overhead per step for 1,000 parameters.

    DEFERALLOC_LIB=build/allocator/libdeferalloc.so PYTHONPATH=python \\
      python benchmarks/optimizer/bench_optim_py.py --params 0.5 1.0 --window-mb 512
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "torch"))
import test_optim_gpu as G  # noqa: E402
import torch  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=float, nargs="+", default=[0.5], help="G parameters")
    ap.add_argument("--window-mb", type=int, nargs="+", default=[512])
    ap.add_argument("--megatron-wheel", default=os.environ.get("MEGATRON_WHEEL"))
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("SKIP: no CUDA device")
        return 77
    for n in a.params:
        for w in a.window_mb:
            print(f"--- {n} G params, window {w} MiB")
            G.throughput(int(n * (1 << 30)) // 8 * 8, w, a.megatron_wheel)
            torch.cuda.empty_cache()
    print("\n| check | result | target | |\n|---|---|---|---|")
    for what, value, target, ok in G.ROWS:
        print(f"| {what} | {value} | {target} | {'' if ok is None else ('pass' if ok else 'FAIL')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
