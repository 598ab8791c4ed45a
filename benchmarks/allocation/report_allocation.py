"""Prints the allocation comparison from bench_allocation's JSON: per scenario the time
per alloc/free pair (or per random run) of deferalloc, PyTorch's caching allocator and
cudaMallocAsync, deferalloc's ratio to PyTorch, and peak reserved / peak allocated.

    python report_allocation.py bench_allocation.json
"""
import json
import re
import statistics
import sys

RES = {"deferalloc_resource": "deferalloc", "torch_resource": "pytorch", "async_resource": "cudaMallocAsync"}


def main(path):
    data = json.load(open(path))
    pairs, rand, errors = {}, {}, {}
    for b in data["benchmarks"]:
        if b.get("error_occurred"):
            errors[b.get("error_message")] = errors.get(b.get("error_message"), 0) + 1
            continue
        m = re.match(r"BM_(pairs|random)<(\w+)>/(\d+)/(\d+)", b["name"])
        if not m:
            continue
        kind, res, a1, a2 = m.group(1), RES.get(m.group(2), m.group(2)), int(m.group(3)), int(m.group(4))
        if kind == "pairs":
            pairs.setdefault((a1, a2), {})[res] = 1e9 / b["items_per_second"]
            extra = {k: b.get(k + "_in_loop", 0) for k in ("device_allocs", "driver_calls", "cross_stream_reuses",
                                                               "stream_events")}
            if any(v > 0 for v in extra.values()):
                print(f"note: {b['name']} ({b['iterations']} iterations) in its timed loop: " +
                      ", ".join(f"{k} {v:.0f}" for k, v in extra.items()))
        else:
            rand.setdefault((a1, a2), {})[res] = (b["real_time"], b.get("reserved_over_allocated", 0.0),
                                                 b.get("reserved_over_live", 0.0), b.get("device_allocs", -1))
    for msg, n in errors.items():
        print(f"{n} benchmarks failed: {msg}")
    if pairs:
        print(f"{'cached alloc+free pair':<28} {'deferalloc':>11} {'pytorch':>9} {'cudaMallocAsync':>16} {'ratio':>7}")
        ratios = {1: [], 4: []}
        for (size, streams), r in sorted(pairs.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            d, t, a = r.get("deferalloc"), r.get("pytorch"), r.get("cudaMallocAsync")
            ratio = d / t if d and t else float("nan")
            ratios[streams].append(ratio)
            label = f"{size:>9} B, {streams} stream{'s' if streams > 1 else ''}"
            print(f"{label:<28} {d or 0:>9.0f}ns {t or 0:>7.0f}ns {a or 0:>14.0f}ns {ratio:>6.2f}x")
        for s, rs in ratios.items():
            if rs:
                print(f"median ratio deferalloc/pytorch, {s} stream(s): {statistics.median(rs):.2f}x (target <= 0.5x)")
    if rand:
        print(f"\n{'random allocations':<28} {'deferalloc':>20} {'pytorch':>20} {'cudaMallocAsync':>20}")
        print(f"{'(ms, reserved/allocated, reserved/asked)':<28}")
        verdicts = []
        for (ops, mib), r in sorted(rand.items()):
            cells = [f"{r[k][0]:>6.0f} {r[k][1]:>5.2f} {r[k][2]:>5.2f}" if k in r else f"{'-':>18}" for k in
                     ("deferalloc", "pytorch", "cudaMallocAsync")]
            print(f"{ops:>7} ops, <= {mib:>2} MiB       {cells[0]:>20} {cells[1]:>20} {cells[2]:>20}")
            d, t = r.get("deferalloc"), r.get("pytorch")
            if d and t:
                allocs = f"device allocations {d[3]:.0f} vs {t[3]:.0f}" if d[3] >= 0 and t[3] >= 0 else ""
                ok = d[0] <= t[0] and d[2] <= t[2]
                verdicts.append(ok)
                print(f"{'':28} time {d[0] / t[0]:.2f}x, reserved/asked {d[2]:.3f} vs {t[2]:.3f}, {allocs} "
                      f"{'PASS' if ok else 'FAIL'}")
        if verdicts:
            print(f"random allocations no slower than PyTorch, peak reserved no worse: "
                  f"{'PASS' if all(verdicts) else 'FAIL'} ({sum(verdicts)}/{len(verdicts)})")

if __name__ == "__main__":
    main(sys.argv[1])
