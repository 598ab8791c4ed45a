#!/usr/bin/env python3
"""Two builds' figures side by side: the "before" and "after" of a change that must not move them.

    compare_builds.py BEFORE.json AFTER.json [BEFORE2.json AFTER2.json ...] [--tolerance 0.05] [--json OUT]
                      [--before-label B --after-label A]

Each file is in the one schema (benchmarks/bench_json.py).  For every result of the same name in
a pair, the change is after / before for rates (GB/s, Gparams/s, ...) and before / after for times
(s, ms, us, ns) and instruction counts: above 1 the after build is faster.  Rows whose change lies outside 1 +- tolerance
are marked; a result present on one side only is listed.  Where a file was measured more than once
(the same name given again in a later pair), the median of its changes is used, so that
interleaved repetitions of before and after average the machine's drift out.  Exit 0 always:
this is a report (scripts/gpu_round.sh compare prints it last).

Beside each change stands the builds' own spread: (max - min) / median of one build's values over
its runs, or within one run over its repetitions (a file converted from a run with
--benchmark_repetitions carries them in extra.repetition_spread), the widest of these.  A change
outside the tolerance but inside that spread is marked "noise" (the machine's noise could make
it: more runs, or longer ones, are needed before the row says anything), one outside both
"outside". A file without repetitions counts as spreading 0.  --json writes the rows in the one schema
(benchmarks/bench_json.py) as benchmark "compare_builds", unit "x", with the spreads in extra.
--before-label / --after-label name the two builds (e.g. their commits): printed first, and in
--json's extra as "before", "after", "sides" ("before B / after A") and a note.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

TIMES = {"s", "ms", "us", "ns"}
LOWER_IS_BETTER = TIMES | {"instructions"}  # counted by benchmarks/reservations/count_instructions.py


def load(path: str) -> tuple[str, dict, dict]:
    """(benchmark, results by name, repetition spread by name) of one file."""
    with open(path) as f:
        doc = json.load(f)
    return (doc.get("benchmark", path), {r["name"]: r for r in doc.get("results", [])},
            doc.get("extra", {}).get("repetition_spread", {}))


def changes(before: dict, after: dict) -> dict:
    out = {}
    for name, b in before.items():
        a = after.get(name)
        if a is None or not b["value"] or not a["value"]:
            continue
        out[name] = (b["value"] / a["value"]) if b["unit"] in LOWER_IS_BETTER else (a["value"] / b["value"])
    return out


def own_spread(v: list[float]) -> float:
    """(max - min) / median of one build's runs of a figure (0 for a single run)."""
    m = statistics.median(v)
    return (max(v) - min(v)) / m if len(v) > 1 and m else 0.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+", help="BEFORE AFTER pairs")
    ap.add_argument("--tolerance", type=float, default=0.05)
    ap.add_argument("--json", help="write the rows in the one schema (benchmark compare_builds)")
    ap.add_argument("--device", default="", help="the device named in --json's document")
    ap.add_argument("--before-label", default="", help="what the before build is (e.g. its commit)")
    ap.add_argument("--after-label", default="", help="what the after build is (e.g. its commit)")
    a = ap.parse_args(argv)
    if len(a.files) % 2:
        ap.error("files come in BEFORE AFTER pairs")
    per_bench: dict[str, dict[str, list[float]]] = {}
    values: dict[tuple[str, str], tuple[list[float], list[float]]] = {}  # (before's, after's)
    units: dict[tuple[str, str], str] = {}
    within: dict[tuple[str, str], float] = {}  # the widest spread inside one run
    alone: list[str] = []
    for i in range(0, len(a.files), 2):
        (bn, before, sb), (an, after, sa) = load(a.files[i]), load(a.files[i + 1])
        if bn != an:
            print(f"compare_builds: {a.files[i]} is {bn}, {a.files[i + 1]} is {an}: not a pair", file=sys.stderr)
            return 2
        for name, c in changes(before, after).items():
            per_bench.setdefault(bn, {}).setdefault(name, []).append(c)
            units[(bn, name)] = before[name]["unit"]
            vb, va = values.setdefault((bn, name), ([], []))
            vb.append(before[name]["value"])
            va.append(after[name]["value"])
            within[(bn, name)] = max(within.get((bn, name), 0.0), sb.get(name, 0.0), sa.get(name, 0.0))
        alone += [f"{bn}: {n} (before only)" for n in before if n not in after]
        alone += [f"{bn}: {n} (after only)" for n in after if n not in before]
    outside = noisy = 0
    rows_out = []
    sides = ""
    if a.before_label or a.after_label:
        sides = f"before {a.before_label or 'unknown'} / after {a.after_label or 'unknown'}"
        print(sides)
    print(f"{'benchmark':<20} {'result':<54} {'unit':<9} {'after vs before':>15}  {'runs':>4}  own spread")
    for bench, rows in per_bench.items():
        for name, cs in rows.items():
            c = statistics.median(cs)
            spread = max([own_spread(v) for v in values[(bench, name)]] + [within[(bench, name)]])
            mark = ""
            if abs(c - 1) > a.tolerance:
                mark = "  <-- noise" if abs(c - 1) <= spread else "  <-- outside"
            outside += mark == "  <-- outside"
            noisy += mark == "  <-- noise"
            print(f"{bench:<20} {name[:54]:<54} {units[(bench, name)]:<9} {c:>14.3f}x  {len(cs):>4}  "
                  f"{100 * spread:>6.1f}%{mark}")
            rows_out.append({"name": f"{bench}: {name}", "value": c, "unit": "x", "baseline": None,
                             "runs": len(cs), "own_spread": spread})
    for line in sorted(set(alone)):
        print("  " + line)
    n = sum(len(r) for r in per_bench.values())
    print(f"compare_builds: {n} results, {outside} outside 1 +- {a.tolerance:g}, {noisy} more outside it but inside "
          f"a build's own spread (above 1: the after build is faster)")
    if a.json:
        doc = {"benchmark": "compare_builds", "schema": 1, "device": a.device,
               "command": "benchmarks/compare_builds.py " + " ".join(a.files),
               "results": [{k: r[k] for k in ("name", "value", "unit", "baseline")} for r in rows_out],
               "extra": {"tolerance": a.tolerance,
                         "runs": {r["name"]: r["runs"] for r in rows_out},
                         "own_spread": {r["name"]: r["own_spread"] for r in rows_out}}}
        if sides:
            doc["extra"].update(before=a.before_label or "unknown", after=a.after_label or "unknown", sides=sides,
                                notes=[sides])
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
