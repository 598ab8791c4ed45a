"""Diagnostic: how the host tier's pass speed depends on the shards' shapes.

No model, no forward: BF16 parameters of a given list of shapes with BF16 gradients, one
StreamedAdamW (host tier, window 1 GiB, keep_window as bench_overlap) per engine setting.
For each: the whole-state step and the bucket passes of a BackwardOverlap (the shards cut
every --bucket-mb of FP32 state, stepped one bucket at a time in backward's order, back
to back), as a fraction of the duplex pinned-copy bound measured in the same run; and
the raw link for the same shapes (each shard's 12 B/param copied H2D and D2H at once,
no kernel, no slots): what plain copies of these sizes reach.

    DEFERALLOC_LIB=build-gpu/allocator/libdeferalloc.so \\
    DEFERALLOC_OPTIMIZER_LIB=build-gpu/optimizer/libdeferalloc_optimizer.so PYTHONPATH=python \\
      python3 benchmarks/optimizer/pass_shapes.py --settings depth:3 default depth:12
"""
import argparse
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "torch"))


def llama_shapes(layers, hidden=2048, inter=5632, kv=256, vocab=32000):
    """model.parameters() order of bench_overlap's Llama (TinyLlama's shape)."""
    s = [vocab * hidden]
    for _ in range(layers):
        s += [hidden * hidden, kv * hidden, kv * hidden, hidden * hidden, inter * hidden, inter * hidden,
              inter * hidden, hidden, hidden]
    return s + [hidden, vocab * hidden]


def buckets_of(shapes, bucket_mb):
    """BackwardOverlap's cut: in parameter order, a bucket closes at >= bucket_mb of FP32."""
    out, cur, size = [], [], 0
    for i, n in enumerate(shapes):
        cur.append(i)
        size += 4 * n
        if size >= bucket_mb << 20:
            out.append(cur)
            cur, size = [], 0
    if cur:
        out.append(cur)
    return out[::-1]  # backward completes the last layers first


def timed(fn, warm=1, reps=3):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--shapes", nargs="+", default=["llama", "uniform"])
    ap.add_argument("--settings", nargs="+", default=["depth:3", "default"],
                    help="engine settings per run ('default': none)")
    ap.add_argument("--bucket-mb", type=int, default=256)
    ap.add_argument("--window-mb", type=int, default=1024)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("SKIP: no CUDA device")
        return 77
    from deferalloc.optim import StreamedAdamW
    from test_optim_gpu import duplex_bound, duplex_seconds
    bps = duplex_bound()
    print(f"duplex pinned-copy bound: {bps / 1e9:.1f} GB/s each way", flush=True)
    rows = []
    ll = llama_shapes(a.layers)
    for shape in a.shapes:
        shapes = ll if shape == "llama" else [sum(ll) // 24 // 256 * 256] * 24
        total = sum(shapes)
        bound = total * 12 / bps
        link = duplex_seconds([n * 12 for n in shapes], reps=2)  # each shard's 12 B/param each way
        rows.append((shape, "raw copies (no kernel)", link * 1e3, bound / link, "", ""))
        g = torch.Generator(device="cuda").manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)) for n in shapes]
        grads = [(torch.randn(n, device="cuda", generator=g) * 1e-2).to(torch.bfloat16) for n in shapes]
        bks = buckets_of(shapes, a.bucket_mb)
        for st in a.settings:
            for p, gr in zip(params, grads):
                p.grad = gr
            opt = StreamedAdamW(params, lr=1e-4, tier="host", window_mb=a.window_mb,
                                settings=",".join(x for x in ("keep_window:1", st) if x != "default"))
            whole = timed(opt.step)
            s = opt.stats()
            per = []

            def passes():
                per.clear()
                for b in bks:
                    inb = set(b)
                    for i, p in enumerate(params):
                        p.grad = grads[i] if i in inb else None
                    t0 = time.perf_counter()
                    opt.step()
                    torch.cuda.synchronize()
                    per.append(time.perf_counter() - t0)
            bp = timed(passes, warm=1, reps=2)
            s2 = opt.stats()
            rows.append((shape, f"step [{st}]", whole * 1e3, bound / whole,
                         f"{s['pieces']} pieces, retire {s['retire_seconds'] * 1e3:.0f} ms", ""))
            rows.append((shape, f"{len(bks)} bucket passes [{st}]", bp * 1e3, bound / bp,
                         f"last: {s2['pieces']} pieces, retire {s2['retire_seconds'] * 1e3:.1f} ms",
                         f"per pass {min(per) * 1e3:.1f}-{max(per) * 1e3:.1f} ms"))
            print(rows[-2], rows[-1], flush=True)
            del opt
            gc.collect()
            torch.cuda.empty_cache()
        del params, grads
        gc.collect()
        torch.cuda.empty_cache()
    print(f"\n{a.layers}-layer Llama shapes ({sum(ll) / 1e9:.2f} G params) vs 24 uniform shards; "
          f"bound {bps / 1e9:.1f} GB/s each way, 12 B/param")
    print("| shapes | what | ms | x bound | engine | |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]:.1f} | {r[3]:.2f} | {r[4]} | {r[5]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
