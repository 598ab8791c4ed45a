#!/usr/bin/env python3
"""Instructions per range that the library spends in materialize and release, counted by
valgrind's callgrind: a figure that does not drift, for comparing two builds' own cost where the
timed VMM-bound rows of bench_reservations spread by tens of percent from run to run.

    count_instructions.py BUILD/benchmarks/bench_reservations --out OUT.json [--label before]

Runs bench_reservations' BM_materialize_release in each of its twelve configurations (1, 64 and
2,048 reservations; warm or cold; one range per call or one batched call) with no GPU visible, so
on the host driver, for one iteration each (a warm-up cycle and a timed one: the same work in
every build), under callgrind. From the call graph it takes the inclusive instructions of
`reservation_manager::materialize` and `::release` as called by the benchmark, divided by the
ranges they were given. The result is one document of the schema of benchmarks/bench_json.py
(benchmark "bench_reservations_instructions", unit "instructions"): two builds' documents go to
benchmarks/compare_builds.py as a pair. The host driver's own work is counted with the library's;
the CUDA driver's thin wrappers over cuMem* are not (they are only reached on a GPU).
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_json import write  # noqa: E402  (benchmarks/bench_json.py)

CONFIGS = [(n, warm, batch) for n in (1, 64, 2048) for warm in (1, 0) for batch in (0, 1)]
ENTRY = re.compile(r"reservation_manager::(materialize|release)\(")


def inclusive_per_call(callgrind_out: str) -> dict[str, tuple[int, int]]:
    """{"materialize" | "release": (calls, inclusive instructions)} of the calls that
    BM_materialize_release makes itself (callgrind's cfn= / calls= records)."""
    names: dict[str, str] = {}
    calls: collections.Counter = collections.Counter()
    cost: collections.Counter = collections.Counter()
    fn = cfn = None
    pending = None
    with open(callgrind_out) as f:
        for line in f:
            m = re.match(r"^(c?)fn=\((\d+)\)(?: (.*))?$", line.rstrip("\n"))
            if m:
                if m.group(3):
                    names[m.group(2)] = m.group(3)
                if m.group(1):
                    cfn = names.get(m.group(2))
                else:
                    fn = names.get(m.group(2))
                continue
            m = re.match(r"^calls=(\d+)", line)
            if m:
                pending = int(m.group(1))
                continue
            if pending is not None:
                e = ENTRY.search(cfn or "")
                if e and fn and "BM_materialize_release" in fn:
                    calls[e.group(1)] += pending
                    cost[e.group(1)] += int(line.split()[-1])
                pending = None
    return {k: (calls[k], cost[k]) for k in calls}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench", help="a build's bench_reservations")
    ap.add_argument("--out", required=True)
    ap.add_argument("--label", default="", help="named in the document's command (before, after)")
    a = ap.parse_args(argv)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    results, extra_calls = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for n, warm, batch in CONFIGS:
            out = os.path.join(tmp, f"{n}-{warm}-{batch}.out")
            cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", a.bench,
                   f"--benchmark_filter=BM_materialize_release/reservations:{n}/warm:{warm}/batch:{batch}/",
                   "--benchmark_min_time=0.000000001"]
            r = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if r.returncode != 0:
                print(r.stdout[-2000:], r.stderr[-2000:], file=sys.stderr)
                return 1
            what = (f"{n:,} reservation{'s' if n > 1 else ''}, {'warm' if warm else 'cold'}, "
                    f"{'batched' if batch else 'one range per call'}")
            for op, (ncalls, ir) in sorted(inclusive_per_call(out).items()):
                ranges = ncalls * (n if batch else 1)
                results.append({"name": f"{what}: {op}", "value": ir / ranges, "unit": "instructions",
                                "baseline": None})
                extra_calls[f"{what}: {op}"] = ncalls
                print(f"{what + ': ' + op:<58} {ir / ranges:>10.0f} instructions per range ({ncalls} calls)")
    if not results:
        print("count_instructions: no calls of materialize / release found", file=sys.stderr)
        return 1
    command = " ".join(["benchmarks/reservations/count_instructions.py", a.bench, "--out", a.out] +
                       (["--label", a.label] if a.label else []))
    write(a.out, "bench_reservations_instructions", results, "valgrind callgrind, host driver", command,
          {"calls": extra_calls,
           "notes": ["Inclusive instructions per range of reservation_manager::materialize / release as "
                     "called by BM_materialize_release (one warm-up and one timed cycle), host driver."]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
