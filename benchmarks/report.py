#!/usr/bin/env python3
"""Turns Google Benchmark JSON files into the acceptance table: each figure beside the
baseline measured in the same run, as a ratio, with the issue's target.

usage: report.py bench_a.json [bench_b.json ...]
"""
import json
import sys


def load(paths):
    rows = {}
    for p in paths:
        try:
            with open(p) as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            print(f"report: cannot read {p}: {e}")
            continue
        for b in data.get("benchmarks", []):
            if b.get("error_occurred"):
                continue
            rows[b["name"]] = b
    return rows


def rate(rows, name, key="bytes_per_second"):
    b = rows.get(name)
    return None if b is None else b.get(key)


def fmt(v, unit):
    if v is None:
        return "n/a"
    if unit == "B/s":
        return f"{v / 1e9:9.1f} GB/s"
    if unit == "x":
        return f"{v:9.2f} x"
    return f"{v:9.3g} {unit}"


def main(paths):
    rows = load(paths)
    checks = []  # (what, value, unit, baseline name, baseline value, ratio, target, ok)

    def compare(what, name, base_name, target_ratio=None, target_abs=None, key="bytes_per_second"):
        v, bv = rate(rows, name, key), rate(rows, base_name, key) if base_name else None
        ratio = v / bv if v and bv else None
        ok = None
        if v is not None:
            ok = True
            if target_ratio is not None:
                ok = ok and ratio is not None and ratio >= target_ratio
            if target_abs is not None:
                ok = ok and v >= target_abs
        target = []
        if target_abs is not None:
            target.append(f">= {target_abs / 1e12:g} TB/s")
        if target_ratio is not None:
            target.append(f">= {target_ratio:g}x base")
        checks.append((what, v, bv, ratio, " and ".join(target) or "-", ok))

    mr = "BM_materialize_release/reservations:{n}/warm:{w}/batch:{b}/real_time"
    pg = "BM_per_granule_baseline/reservations:{n}/real_time"
    cm = "BM_cudaMalloc_baseline/reservations:{n}/real_time"
    for n in (1, 64, 2048):
        for b in (0, 1):
            tgt_abs = 1e12 if n == 64 else None
            tgt_ratio = 10 if n == 64 else None
            compare(f"warm {n:>4} res{' batch' if b else ''} vs per-granule", mr.format(n=n, w=1, b=b), pg.format(n=n),
                    tgt_ratio, tgt_abs)
        compare(f"cold {n:>4} res vs per-granule", mr.format(n=n, w=0, b=0), pg.format(n=n))
        compare(f"warm {n:>4} res vs cudaMalloc+Free", mr.format(n=n, w=1, b=0), cm.format(n=n))
    compare("host backup release vs pinned D2H", "BM_host_backup/restore:0/manual_time",
            "BM_pinned_memcpy_baseline/h2d:0/manual_time", 0.8)
    compare("host backup restore vs pinned H2D", "BM_host_backup/restore:1/manual_time",
            "BM_pinned_memcpy_baseline/h2d:1/manual_time", 0.8)

    optimizer_report(rows)
    print(f"\n{'scenario':46s} {'measured':>14s} {'baseline':>14s} {'ratio':>9s}  {'target':24s} verdict")
    for what, v, bv, ratio, target, ok in checks:
        if v is None and bv is None:
            continue
        verdict = "-" if ok is None or target == "-" else ("PASS" if ok else "FAIL")
        r = f"{ratio:8.2f}x" if ratio else "      n/a"
        print(f"{what:46s} {fmt(v, 'B/s'):>14s} {fmt(bv, 'B/s'):>14s} {r}  {target:24s} {verdict}")


def find(rows, prefix):
    for name, b in rows.items():
        if name.startswith(prefix):
            return b
    return None


def optimizer_report(rows):
    """The optimizer's figures against bounds measured in the same run."""
    duplex, dio = find(rows, "BM_pinned_duplex"), find(rows, "BM_direct_io")
    tiers = {t: find(rows, f"BM_tier/{t}") for t in ("device", "host", "file")}
    torch_b, serial = find(rows, "BM_torch_fused_adamw"), find(rows, "BM_serial_baseline")
    if not any(tiers.values()):
        return
    out = []

    def line(what, value, bound, bound_name, target):
        ratio = value / bound if value and bound else None
        verdict = "-" if ratio is None or target is None else ("PASS" if ratio >= target else "FAIL")
        out.append((what, value, bound, bound_name, ratio, target, verdict))

    g = lambda b, k: b.get(k) if b else None
    pcie = min(g(duplex, "h2d_gbps"), g(duplex, "d2h_gbps")) * 1e9 / 12 / 1e9 if duplex else None
    # Reads and writes share the disk: 12 B/param read at R plus 12 B/param written at W.
    disk = 1 / (12 / g(dio, "read_gbps") + 12 / g(dio, "write_gbps")) if dio else None
    line("device tier step", g(tiers["device"], "gparams_per_s"), g(torch_b, "gparams_per_s"), "torch fused AdamW", 1.0)
    line("host tier step", g(tiers["host"], "gparams_per_s"), pcie, "PCIe duplex bound", 0.85)
    line("host tier step vs serial order", g(tiers["host"], "gparams_per_s"), g(serial, "gparams_per_s"), "serial baseline",
         None)
    line("file tier step", g(tiers["file"], "gparams_per_s"), disk, "direct-I/O bound", 0.85)
    line("device tier init", g(tiers["device"], "init_gparams_per_s"), g(duplex, "d2d_gbps") / 6 if duplex else None,
         "D2D copy, 6 B/param", 0.85)
    line("device tier BF16 sync (warm)", g(tiers["device"], "downcast_gparams_per_s"),
         g(duplex, "d2d_gbps") / 6 if duplex else None, "D2D copy, 6 B/param", None)
    line("host tier init", g(tiers["host"], "init_gparams_per_s"), g(duplex, "d2h_alone_gbps") / 4 if duplex else None,
         "D2H copy, 4 B/param", 0.85)
    line("file tier init", g(tiers["file"], "init_gparams_per_s"), g(dio, "write_gbps") / 4 if dio else None,
         "direct-I/O write, 4 B/param", 0.85)
    print(f"\n{'optimizer (Gparam/s)':32s} {'measured':>9s} {'bound/base':>10s} {'ratio':>7s}  {'against':28s} verdict")
    for what, v, b, bn, r, t, verdict in out:
        fv = f"{v:9.2f}" if v else "      n/a"
        fb = f"{b:10.2f}" if b else "       n/a"
        fr = f"{r:6.2f}x" if r else "    n/a"
        tgt = f" (>= {t:g}x)" if t else ""
        print(f"{what:32s} {fv} {fb} {fr}  {bn + tgt:28s} {verdict}")
    if duplex:
        print(f"pinned copy: H2D {duplex['h2d_gbps']:.1f} GB/s and D2H {duplex['d2h_gbps']:.1f} GB/s at once, "
              f"D2H alone {duplex['d2h_alone_gbps']:.1f} GB/s, D2D {duplex['d2d_gbps']:.0f} GB/s")
    ft = find(rows, "BM_first_touch")
    if ft:
        print(f"D2D copy of 2 GiB into fresh memory: cudaMalloc {ft['cudamalloc_first_gbps']:.0f} GB/s first, "
              f"{ft['cudamalloc_second_gbps']:.0f} second; deferred reservation {ft['vmm_first_gbps']:.0f} first, "
              f"{ft['vmm_second_gbps']:.0f} second")
    if dio:
        print(f"direct I/O: write {dio['write_gbps']:.2f} GB/s, read {dio['read_gbps']:.2f} GB/s")
    for t in ("host", "file"):
        b = tiers[t]
        if b and "peak_state_hbm" in b:
            peak, window, gran = b["peak_state_hbm"], b["window"], b["granule"]
            verdict = "PASS" if peak <= window + gran else "FAIL"
            print(f"{t} tier, {b['params'] / 1e9:.2f} G params: peak state HBM {peak / 2**20:.1f} MiB "
                  f"(window {window / 2**20:.0f} MiB + granule {gran / 2**20:.0f} MiB) {verdict}")


if __name__ == "__main__":
    main(sys.argv[1:])
