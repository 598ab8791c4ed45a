#!/usr/bin/env python3
"""Plots and tables of docs/BENCHMARKS.md from Google Benchmark JSON.

usage: plot.py [--out DIR] [--tables] [--no-plots] [--check DOC] bench_a.json [...]

Reads what the benchmark programs write with --benchmark_out=X.json
--benchmark_out_format=json (bench_reservations, bench_optimizer, bench_allocation; one
file or several), or docs/data/h200-2026-11-30.json, the figures of the README's tables
transcribed into the same names and counters.  Writes DIR/reservations.png,
DIR/optimizer.png and DIR/allocation.png (matplotlib, each only when its benchmarks are
present) and, with --tables, prints the tables in Markdown.  The optimizer's bounds are
derived from the copy and disk counters as benchmarks/report.py derives them.
"""
import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import find, load  # noqa: E402  (benchmarks/report.py)

GB = 1e9
MR = "BM_materialize_release/reservations:{n}/warm:{w}/batch:{b}/real_time"
PG = "BM_per_granule_baseline/reservations:{n}/real_time"
CM = "BM_cudaMalloc_baseline/reservations:{n}/real_time"
RESOURCES = (("deferalloc_resource", "deferalloc"), ("torch_resource", "PyTorch"),
             ("async_resource", "cudaMallocAsync"))


def gbps(rows, name):
    b = rows.get(name)
    return b["bytes_per_second"] / GB if b and "bytes_per_second" in b else None


def reservations(rows):
    """Table 1: per reservation count, GB/s of each variant."""
    out = []
    for n in (1, 64, 2048):
        out.append((n, {"deferalloc, warm": gbps(rows, MR.format(n=n, w=1, b=0)),
                        "warm, one batched call": gbps(rows, MR.format(n=n, w=1, b=1)),
                        "cold (pool trimmed)": gbps(rows, MR.format(n=n, w=0, b=0)),
                        "per-granule VMM": gbps(rows, PG.format(n=n)),
                        "cudaMalloc + cudaFree": gbps(rows, CM.format(n=n))}))
    return [(n, v) for n, v in out if any(x is not None for x in v.values())]


def optimizer(rows):
    """Table 3: (what, measured, bound, bound's name) in Gparam/s."""
    g = lambda b, k: b.get(k) if b else None  # noqa: E731
    duplex, dio = find(rows, "BM_pinned_duplex"), find(rows, "BM_direct_io")
    dev, host, fil = (find(rows, f"BM_tier/{t}") for t in ("device", "host", "file"))
    torch_b, serial = find(rows, "BM_torch_fused_adamw"), find(rows, "BM_serial_baseline")
    pcie = min(duplex["h2d_gbps"], duplex["d2h_gbps"]) / 12 if duplex else None
    disk = 1 / (12 / dio["read_gbps"] + 12 / dio["write_gbps"]) if dio else None
    lines = [("device tier step", g(dev, "gparams_per_s"), g(torch_b, "gparams_per_s"), "torch fused AdamW"),
             ("host tier step", g(host, "gparams_per_s"), pcie, "PCIe duplex copy, 12 B"),
             ("host tier step vs serial", g(host, "gparams_per_s"), g(serial, "gparams_per_s"), "serial order"),
             ("file tier step", g(fil, "gparams_per_s"), disk, "direct I/O, 12 B each way"),
             ("device tier initialize", g(dev, "init_gparams_per_s"), duplex and duplex["d2d_gbps"] / 6, "D2D copy, 6 B"),
             ("host tier initialize", g(host, "init_gparams_per_s"), duplex and duplex["d2h_alone_gbps"] / 4,
              "D2H copy, 4 B"),
             ("file tier initialize", g(fil, "init_gparams_per_s"), dio and dio["write_gbps"] / 4, "direct-I/O write, 4 B")]
    return [line for line in lines if line[1] is not None]


def allocation(rows):
    """Table 4: {(ops, MiB): {allocator: (ms, reserved/asked, device allocations)}}."""
    scale = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}
    out = {}
    for name, b in rows.items():
        m = re.match(r"BM_random<(\w+)>/(\d+)/(\d+)", name)
        if not m:
            continue
        label = dict(RESOURCES).get(m.group(1), m.group(1))
        ms = b["real_time"] * scale[b.get("time_unit", "ns")]
        out.setdefault((int(m.group(2)), int(m.group(3))), {})[label] = (
            ms, b.get("reserved_over_live"), b.get("device_allocs"))
    return dict(sorted(out.items()))


def fmt(v, digits=1):
    return "" if v is None else f"{v:,.{digits}f}"


def print_tables(rows):
    res = reservations(rows)
    if res:
        print("| reservations | deferalloc warm GB/s | batched GB/s | cold GB/s | per-granule VMM GB/s | ratio (warm) "
              "| cudaMalloc + cudaFree GB/s |\n| --- | --- | --- | --- | --- | --- | --- |")
        for n, v in res:
            w, p = v["deferalloc, warm"], v["per-granule VMM"]
            ratio = f"{w / p:.3g}x" if w and p else ""
            print(f"| {n:,} | {fmt(w)} | {fmt(v['warm, one batched call'])} | {fmt(v['cold (pool trimmed)'])} | {fmt(p)} "
                  f"| {ratio} | {fmt(v['cudaMalloc + cudaFree'])} |")
    backup = [(gbps(rows, f"BM_host_backup/restore:{r}/manual_time"), gbps(rows, f"BM_pinned_memcpy_baseline/h2d:{r}/manual_time"))
              for r in (0, 1)]
    if all(a and b for a, b in backup):
        print(f"\nhost backup: release(keep=host) {backup[0][0]:.1f} GB/s vs pinned D2H {backup[0][1]:.1f} GB/s "
              f"({backup[0][0] / backup[0][1]:.2f}); materialize(restore) {backup[1][0]:.1f} GB/s vs pinned H2D "
              f"{backup[1][1]:.1f} GB/s ({backup[1][0] / backup[1][1]:.2f})")
    opt = optimizer(rows)
    if opt:
        print("\n| Gparam/s | measured | against, same run | ratio |\n| --- | --- | --- | --- |")
        for what, v, b, bn in opt:
            print(f"| {what} | {v:.3g} | {bn}: {b:.3g} | {v / b:.2f} |" if b else f"| {what} | {v:.3g} | {bn}: n/a | |")
    alloc = allocation(rows)
    if alloc:
        print("\n| ops, sizes | deferalloc ms | PyTorch ms | cudaMallocAsync ms | peak reserved / peak asked, deferalloc vs "
              "PyTorch | device allocations |\n| --- | --- | --- | --- | --- | --- |")
        for (ops, mib), r in alloc.items():
            d, t, a = (r.get(k, (None, None, None)) for k in ("deferalloc", "PyTorch", "cudaMallocAsync"))
            print(f"| {ops:,}, <= {mib} MiB | {fmt(d[0], 0)} | {fmt(t[0], 0)} | {fmt(a[0], 0)} | {fmt(d[1], 3)} vs "
                  f"{fmt(t[1], 3)} | {fmt(d[2], 0)} vs {fmt(t[2], 0)} |")


def check(rows, doc):
    """Every measured figure of the JSON (not the ratios, which are recomputed) appears
    in `doc`: the transcription and the document agree.  Returns the missing ones."""
    text = open(doc).read()
    present = [float(x.replace(",", "")) for x in re.findall(r"\d[\d,]*(?:\.\d+)?", text)]
    figures = [(f"{n} reservations, {k}", x) for n, v in reservations(rows) for k, x in v.items()]
    figures += [(what, v) for what, v, _, _ in optimizer(rows)]
    figures += [(f"{ops} ops <= {mib} MiB, {k} {i}", x) for (ops, mib), r in allocation(rows).items()
                for k, vals in r.items() for i, x in zip(("ms", "reserved/asked", "device allocations"), vals)]
    figures += [(f"host backup {n}", gbps(rows, n)) for n in ("BM_host_backup/restore:0/manual_time",
                                                              "BM_host_backup/restore:1/manual_time")]
    return [(what, x) for what, x in figures
            if x is not None and not any(abs(x - y) <= 1e-9 + 1e-6 * abs(y) for y in present)]


def bars(ax, groups, series, values, log=True):
    """Grouped bars: values[i][j] is series j in group i (None: no bar)."""
    width = 0.8 / len(series)
    for j, s in enumerate(series):
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(groups)) if values[i][j] is not None]
        ys = [values[i][j] for i in range(len(groups)) if values[i][j] is not None]
        ax.bar(xs, ys, width, label=s)
    ax.set_xticks(range(len(groups)), groups)
    if log:
        ax.set_yscale("log")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)


def plot(rows, out, source):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(out, exist_ok=True)
    written = []

    def save(fig, ax, name, title, ylabel):
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(ylabel)
        fig.text(0.01, 0.01, f"data: {source}", fontsize=6, color="gray")
        fig.tight_layout(rect=(0, 0.03, 1, 1))
        path = os.path.join(out, name)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    res = reservations(rows)
    if res:
        series = list(res[0][1].keys())
        fig, ax = plt.subplots(figsize=(8, 4))
        bars(ax, [f"{n:,} reservation{'s' if n > 1 else ''}" for n, _ in res], series,
             [[v[s] for s in series] for _, v in res])
        save(fig, ax, "reservations.png", "Materialize + release of 4 GiB", "GB/s (log)")
    opt = optimizer(rows)
    if opt:
        fig, ax = plt.subplots(figsize=(8, 4))
        bars(ax, [w.replace(" tier ", "\n").replace(" vs serial", "\nvs serial") for w, *_ in opt],
             ["deferalloc", "against (same run)"], [[v, b] for _, v, b, _ in opt])
        save(fig, ax, "optimizer.png", "Streamed AdamW: measured against its bound or baseline", "Gparam/s (log)")
    alloc = allocation(rows)
    if alloc:
        series = [label for _, label in RESOURCES]
        fig, ax = plt.subplots(figsize=(8, 4))
        bars(ax, [f"{ops:,} ops\n<= {mib} MiB" for ops, mib in alloc], series,
             [[r.get(s, (None,))[0] for s in series] for r in alloc.values()], log=False)
        save(fig, ax, "allocation.png", "Random allocations, one stream (lower is better)", "ms")
    return written


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", nargs="+")
    ap.add_argument("--out", default="docs/plots")
    ap.add_argument("--tables", action="store_true", help="print the tables in Markdown")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--check", metavar="DOC", help="fail unless every measured figure appears in DOC")
    a = ap.parse_args(argv)
    rows = load(a.json)
    if not rows:
        print("plot: no benchmark results in " + " ".join(a.json), file=sys.stderr)
        return 1
    if a.tables:
        print_tables(rows)
    if a.check:
        missing = check(rows, a.check)
        for what, x in missing:
            print(f"plot: {what} = {x:g} is not in {a.check}")
        if missing:
            return 1
        print(f"plot: every measured figure of {', '.join(a.json)} is in {a.check}")
    if not a.no_plots:
        for path in plot(rows, a.out, ", ".join(os.path.basename(j) for j in a.json)):
            print(f"plot: wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
