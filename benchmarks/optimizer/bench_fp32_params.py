"""StreamedAdamW's host-tier step with FP32 parameters beside the pinned duplex copy of its bytes.

The step streams per parameter what its tier holds: with FP32 parameters the parameter is the
master copy and only the moments travel (8 bytes each way), where a separate FP32 main copy
made it 12.  Run with the library build under test (DEFERALLOC_LIB / PYTHONPATH of the build
and the package to measure: a before and an after build run this same script in one call).
Prints one JSON line: ms per step (median of --steps after a warm-up), the bytes each way from
stats(), the pinned duplex copy of those bytes (two streams, concurrent H2D and D2H of pinned
buffers: the bound) and of 12 bytes per parameter.

    python benchmarks/optimizer/bench_fp32_params.py --params 500e6 --steps 5 --label after
"""
import argparse
import json
import statistics
import time

import torch

from deferalloc.optim import StreamedAdamW


def duplex_ms(h2d_bytes: int, d2h_bytes: int, reps: int = 3) -> float:
    """Median ms of a concurrent pinned H2D copy of h2d_bytes and D2H copy of d2h_bytes."""
    n = max(h2d_bytes, d2h_bytes)
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    host2 = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    dev2 = torch.empty(n, dtype=torch.uint8, device="cuda")
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    out = []
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.cuda.stream(s1):
            dev[:h2d_bytes].copy_(host[:h2d_bytes], non_blocking=True)
        with torch.cuda.stream(s2):
            host2[:d2h_bytes].copy_(dev2[:d2h_bytes], non_blocking=True)
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
    del host, host2, dev, dev2
    return statistics.median(out[1:])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=float, default=500e6)
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--window-mb", type=int, default=512)
    ap.add_argument("--label", default="")
    a = ap.parse_args()
    n = int(a.params) // a.tensors
    params = [torch.full((n,), 0.5, device="cuda", requires_grad=True) for _ in range(a.tensors)]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    opt = StreamedAdamW(params, lr=1e-4, tier="host", window_mb=a.window_mb)
    opt.step()  # the first step reads no moments
    times = []
    for _ in range(a.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    st = opt.stats()
    del opt
    total = n * a.tensors
    row = {"label": a.label, "params": total, "step_ms": statistics.median(times), "step_ms_all": times,
           "bytes_to_device": st["bytes_to_device"], "bytes_from_device": st["bytes_from_device"],
           "bytes_per_param_in": st["bytes_to_device"] / total, "bytes_per_param_out": st["bytes_from_device"] / total}
    row["duplex_ms_same_bytes"] = duplex_ms(st["bytes_to_device"], st["bytes_from_device"])
    row["duplex_ms_12_bytes"] = duplex_ms(12 * total, 12 * total)
    row["step_vs_bound"] = row["duplex_ms_same_bytes"] / row["step_ms"]
    print(json.dumps(row))


if __name__ == "__main__":
    main()
