#!/usr/bin/env python3
"""Two builds' figures side by side: the "before" and "after" of a change that must not move them.

    compare_builds.py BEFORE.json AFTER.json [BEFORE2.json AFTER2.json ...] [--tolerance 0.05]

Each file is in the one schema (benchmarks/bench_json.py).  For every result of the same name in
a pair, the change is after / before for rates (GB/s, Gparams/s, ...) and before / after for times
(s, ms, us, ns): above 1 the after build is faster.  Rows whose change lies outside 1 +- tolerance
are marked; a result present on one side only is listed.  Where a file was measured more than once
(the same name given again in a later pair), the median of its changes is used, so that
interleaved repetitions of before and after average the machine's drift out.  Exit 0 always:
this is a report (scripts/gpu_round.sh compare prints it last).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

TIMES = {"s", "ms", "us", "ns"}


def load(path: str) -> dict:
    with open(path) as f:
        doc = json.load(f)
    return doc.get("benchmark", path), {r["name"]: r for r in doc.get("results", [])}


def changes(before: dict, after: dict) -> dict:
    out = {}
    for name, b in before.items():
        a = after.get(name)
        if a is None or not b["value"] or not a["value"]:
            continue
        out[name] = (b["value"] / a["value"]) if b["unit"] in TIMES else (a["value"] / b["value"])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+", help="BEFORE AFTER pairs")
    ap.add_argument("--tolerance", type=float, default=0.05)
    a = ap.parse_args(argv)
    if len(a.files) % 2:
        ap.error("files come in BEFORE AFTER pairs")
    per_bench: dict[str, dict[str, list[float]]] = {}
    units: dict[tuple[str, str], str] = {}
    alone: list[str] = []
    for i in range(0, len(a.files), 2):
        (bn, before), (an, after) = load(a.files[i]), load(a.files[i + 1])
        if bn != an:
            print(f"compare_builds: {a.files[i]} is {bn}, {a.files[i + 1]} is {an}: not a pair", file=sys.stderr)
            return 2
        for name, c in changes(before, after).items():
            per_bench.setdefault(bn, {}).setdefault(name, []).append(c)
            units[(bn, name)] = before[name]["unit"]
        alone += [f"{bn}: {n} (before only)" for n in before if n not in after]
        alone += [f"{bn}: {n} (after only)" for n in after if n not in before]
    outside = 0
    print(f"{'benchmark':<20} {'result':<58} {'unit':<10} {'after vs before':>15}  runs")
    for bench, rows in per_bench.items():
        for name, cs in rows.items():
            c = statistics.median(cs)
            mark = "" if abs(c - 1) <= a.tolerance else "  <-- outside"
            outside += bool(mark)
            print(f"{bench:<20} {name[:58]:<58} {units[(bench, name)]:<10} {c:>14.3f}x  {len(cs)}{mark}")
    for line in sorted(set(alone)):
        print("  " + line)
    n = sum(len(r) for r in per_bench.values())
    print(f"compare_builds: {n} results, {outside} outside 1 +- {a.tolerance:g} (above 1: the after build is faster)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
