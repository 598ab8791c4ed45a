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

    print(f"\n{'scenario':46s} {'measured':>14s} {'baseline':>14s} {'ratio':>9s}  {'target':24s} verdict")
    for what, v, bv, ratio, target, ok in checks:
        if v is None and bv is None:
            continue
        verdict = "-" if ok is None or target == "-" else ("PASS" if ok else "FAIL")
        r = f"{ratio:8.2f}x" if ratio else "      n/a"
        print(f"{what:46s} {fmt(v, 'B/s'):>14s} {fmt(bv, 'B/s'):>14s} {r}  {target:24s} {verdict}")


if __name__ == "__main__":
    main(sys.argv[1:])
