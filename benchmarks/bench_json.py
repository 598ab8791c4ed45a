#!/usr/bin/env python3
"""The one JSON schema of every deferalloc benchmark, and the Google Benchmark converter.

A benchmark writes (``--json PATH``):
    {"benchmark": "<name>", "schema": 1, "device": "<GPU name or host>", "command": "<argv>",
     "results": [{"name": "...", "value": number, "unit": "...", "baseline": "<row name or null>"}],
     "extra": {...}}
``baseline`` names another result of the same file, measured in the same run, that the row
is compared with (benchmarks/plot.py prints the ratio: value / baseline for rates and
everything else, baseline / value for times, i.e. how many times faster).  ``extra`` is free;
benchmarks/plot.py reads ``extra.notes`` (a list of paragraphs, shown under the table) and
``extra.transcribed`` (a string: the figures were copied by hand, not written by a program).

    bench_json.py convert GBENCH.json [GBENCH2.json ...] --out OUT.json [--command "..."] [--device D] [--name N]

turns the output of a Google Benchmark program (``--benchmark_out=X --benchmark_out_format=json``
of bench_reservations, bench_optimizer, bench_allocation) into this schema: the figures
benchmarks/report.py prints, each against the baseline or bound measured in the same run.  A
repeated benchmark is read by its median, and ``extra.repetition_spread`` records how far its
repetitions spread; several files (one program run as separate processes) are read as one run
whose repetitions are all of theirs.

    bench_json.py missed RUN.json [--marks OTHER.json]

prints the checks (``extra.checks``: check, value, target, ok, perf) a run failed and exits 0
when its figures stand, i.e. every failed check is a performance target (a before/after
comparison keeps such a run: scripts/gpu_round.sh compare); a check without the mark takes the
other build's (--marks).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import sys

SCHEMA = 1
TIME_UNITS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def result(name: str, value: float, unit: str, baseline: str | None = None) -> dict:
    return {"name": name, "value": float(value), "unit": unit, "baseline": baseline}


def windowed(values: list[float], window: int) -> list[float]:
    """The mean of each trailing window: [mean(values[i - window + 1 .. i]) for i >= window - 1]."""
    return [statistics.fmean(values[i - window + 1:i + 1]) for i in range(window - 1, len(values))]


def this_command() -> str:
    """The running script's command line, with its path relative to the repository."""
    script = os.path.relpath(os.path.abspath(sys.argv[0]), ROOT)
    return shlex.join(["python3", script, *sys.argv[1:]])


def document(benchmark: str, results: list[dict], device: str, command: str | None = None,
             extra: dict | None = None) -> dict:
    doc = {"benchmark": benchmark, "schema": SCHEMA, "device": device, "command": command or this_command(),
           "results": results, "extra": extra or {}}
    errors = validate(doc)
    if errors:
        raise ValueError(f"{benchmark}: " + "; ".join(errors))
    return doc


def write(path: str, benchmark: str, results: list[dict], device: str, command: str | None = None,
          extra: dict | None = None) -> None:
    doc = document(benchmark, results, device, command, extra)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(f"{benchmark}: {len(results)} results written to {path}", flush=True)


def validate(doc) -> list[str]:
    """What is wrong with `doc` against schema 1 (empty: nothing)."""
    if not isinstance(doc, dict):
        return ["not a JSON object"]
    errors = []
    for key, kind in (("benchmark", str), ("device", str), ("command", str), ("results", list), ("extra", dict)):
        if not isinstance(doc.get(key), kind):
            errors.append(f"'{key}' must be a {kind.__name__}")
    if doc.get("schema") != SCHEMA:
        errors.append(f"'schema' must be {SCHEMA}, is {doc.get('schema')!r}")
    names = set()
    for i, r in enumerate(doc.get("results") or []):
        if not isinstance(r, dict) or not isinstance(r.get("name"), str) or not isinstance(r.get("unit"), str):
            errors.append(f"results[{i}] needs a string name and unit")
            continue
        v = r.get("value")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
            errors.append(f"results[{i}] ({r['name']}): value must be a number")
        if r["name"] in names:
            errors.append(f"results[{i}]: the name {r['name']!r} appears twice")
        names.add(r["name"])
    for r in doc.get("results") or []:
        if isinstance(r, dict) and r.get("baseline") is not None and r["baseline"] not in names:
            errors.append(f"{r.get('name')!r}: baseline {r['baseline']!r} is not a result of this file")
    return errors


# ---- Google Benchmark -> schema 1 -----------------------------------------------------------

GB = 1e9
MR = "BM_materialize_release/reservations:{n}/warm:{w}/batch:{b}/real_time"
PG = "BM_per_granule_baseline/reservations:{n}/real_time"
CM = "BM_cudaMalloc_baseline/reservations:{n}/real_time"
RESOURCES = (("deferalloc_resource", "deferalloc"), ("torch_resource", "PyTorch"),
             ("async_resource", "cudaMallocAsync"))


def _find(rows: dict, prefix: str):
    return next((b for name, b in rows.items() if name.startswith(prefix)), None)


def _reservations(rows: dict) -> list[dict]:
    out = []

    def rate(name):
        b = rows.get(name)
        return b["bytes_per_second"] / GB if b and "bytes_per_second" in b else None

    for n in (1, 64, 2048):
        what = f"{n:,} reservation{'s' if n > 1 else ''}"
        base = f"per-granule VMM, {what}"
        for label, name, baseline in ((f"{what}, warm", MR.format(n=n, w=1, b=0), base),
                                      (f"{what}, warm, one batched call", MR.format(n=n, w=1, b=1), base),
                                      (f"{what}, cold (pool trimmed)", MR.format(n=n, w=0, b=0), base),
                                      (base, PG.format(n=n), None),
                                      (f"cudaMalloc + cudaFree, {what}", CM.format(n=n), None)):
            v = rate(name)
            if v is not None:
                out.append(result(label, v, "GB/s", baseline if rate(PG.format(n=n)) is not None else None))
    for restore, what, way in ((0, "release(keep=host)", "D2H"), (1, "materialize(restore)", "H2D")):
        ours, pinned = (rate(f"BM_host_backup/restore:{restore}/manual_time"),
                        rate(f"BM_pinned_memcpy_baseline/h2d:{restore}/manual_time"))
        if pinned is not None:
            out.append(result(f"pinned cudaMemcpyAsync {way}", pinned, "GB/s"))
        if ours is not None:
            out.append(result(f"host backup, {what}", ours, "GB/s",
                              f"pinned cudaMemcpyAsync {way}" if pinned is not None else None))
    return out


def _optimizer(rows: dict) -> list[dict]:
    """The optimizer's figures against bounds derived as benchmarks/report.py derives them."""
    g = lambda b, k: b.get(k) if b else None  # noqa: E731
    duplex, dio = _find(rows, "BM_pinned_duplex"), _find(rows, "BM_direct_io")
    dev, host, fil = (_find(rows, f"BM_tier/{t}") for t in ("device", "host", "file"))
    torch_b, serial = _find(rows, "BM_torch_fused_adamw"), _find(rows, "BM_serial_baseline")
    bounds = [("torch fused AdamW step", g(torch_b, "gparams_per_s")),
              ("PCIe duplex pinned copy over 12 B/param", duplex and min(duplex["h2d_gbps"], duplex["d2h_gbps"]) / 12),
              ("serial order (read, step, write per bucket)", g(serial, "gparams_per_s")),
              ("direct I/O, 12 B/param each way", dio and 1 / (12 / dio["read_gbps"] + 12 / dio["write_gbps"])),
              ("D2D copy over 6 B/param", duplex and duplex["d2d_gbps"] / 6),
              ("D2H pinned copy over 4 B/param", duplex and duplex["d2h_alone_gbps"] / 4),
              ("direct-I/O write over 4 B/param", dio and dio["write_gbps"] / 4)]
    have = {name for name, v in bounds if v is not None}
    out = [result(name, v, "Gparam/s") for name, v in bounds if v is not None]
    for name, v, base in (("device tier step", g(dev, "gparams_per_s"), "torch fused AdamW step"),
                          ("host tier step", g(host, "gparams_per_s"), "PCIe duplex pinned copy over 12 B/param"),
                          ("file tier step", g(fil, "gparams_per_s"), "direct I/O, 12 B/param each way"),
                          ("device tier initialize", g(dev, "init_gparams_per_s"), "D2D copy over 6 B/param"),
                          ("device tier BF16 sync (warm)", g(dev, "downcast_gparams_per_s"), "D2D copy over 6 B/param"),
                          ("host tier initialize", g(host, "init_gparams_per_s"), "D2H pinned copy over 4 B/param"),
                          ("file tier initialize", g(fil, "init_gparams_per_s"), "direct-I/O write over 4 B/param")):
        if v is not None:
            out.append(result(name, v, "Gparam/s", base if base in have else None))
    if g(host, "gparams_per_s") is not None and "serial order (read, step, write per bucket)" in have:
        out.append(result("host tier step, against the serial order", host["gparams_per_s"], "Gparam/s",
                          "serial order (read, step, write per bucket)"))
    for t, b in (("host", host), ("file", fil)):
        if b and "peak_state_hbm" in b:
            out.append(result(f"{t} tier peak state HBM", b["peak_state_hbm"] / 2**20, "MiB", f"{t} tier window"))
            out.append(result(f"{t} tier window", b["window"] / 2**20, "MiB"))
    return out


def _allocation(rows: dict) -> list[dict]:
    found = {}
    for name, b in rows.items():
        m = re.match(r"BM_random<(\w+)>/(\d+)/(\d+)", name)
        if m:
            found[(int(m.group(2)), int(m.group(3)), [r for r, _ in RESOURCES].index(m.group(1))
                   if m.group(1) in dict(RESOURCES) else len(RESOURCES), m.group(1))] = b
    out = []
    for (ops, mib, _, resource), b in sorted(found.items()):
        label = dict(RESOURCES).get(resource, resource)
        case = f"{ops:,} ops, <= {mib} MiB"
        ms = b["real_time"] * TIME_UNITS[b.get("time_unit", "ns")] * 1e3
        base = None if label == "PyTorch" else f"{case}, PyTorch"
        out.append(result(f"{case}, {label}", ms, "ms", base))
        if b.get("reserved_over_live") is not None:
            out.append(result(f"{case}, {label}, peak reserved / peak asked", b["reserved_over_live"], "",
                              None if label == "PyTorch" else f"{case}, PyTorch, peak reserved / peak asked"))
        if b.get("device_allocs") is not None:
            out.append(result(f"{case}, {label}, device allocations", b["device_allocs"], "",
                              None if label == "PyTorch" else f"{case}, PyTorch, device allocations"))
    names = {r["name"] for r in out}
    for r in out:
        if r["baseline"] not in names:
            r["baseline"] = None
    return out


def _generic(rows: dict) -> list[dict]:
    out = []
    for name, b in rows.items():
        if "bytes_per_second" in b:
            out.append(result(name, b["bytes_per_second"] / GB, "GB/s"))
        else:
            out.append(result(name, b["real_time"], b.get("time_unit", "ns")))
    return out


def _rows(data: dict, repetition: int | None = None) -> dict:
    """Google Benchmark's rows by name.  A benchmark run repeated (--benchmark_repetitions) is
    its median aggregate, under the run's own name: the median of several short runs is what a
    noisy figure (the VMM-bound rows) can be compared by.  With `repetition`, a repeated
    benchmark is instead its row of that repetition (absent if that one failed)."""
    ok = [b for b in data.get("benchmarks", []) if not b.get("error_occurred")]
    rows = {b["name"]: b for b in ok if b.get("run_type") != "aggregate" and
            (repetition is None or b.get("repetitions", 1) == 1 or b.get("repetition_index") == repetition)}
    if repetition is None:
        rows.update({b["run_name"]: b for b in ok
                     if b.get("run_type") == "aggregate" and b.get("aggregate_name") == "median"})
    return rows


def _results(rows: dict) -> list[dict]:
    results = []
    for f in (_reservations, _optimizer, _allocation):
        results += f(rows)
    return results or _generic(rows)


def _repetition_spread(data: dict) -> dict:
    """{result name: (max - min) / median over the repetitions} of a run with
    --benchmark_repetitions: the figures computed from each repetition's rows alone (a row run
    once serves every repetition; a repetition that failed is left out, two are enough), so that
    one run says how far its own figure wanders."""
    n = max((b.get("repetitions", 1) for b in data.get("benchmarks", [])), default=1)
    if n < 2:
        return {}
    values: dict[str, list[float]] = {}
    for k in range(n):
        for r in _results(_rows(data, k)):
            values.setdefault(r["name"], []).append(r["value"])
    out = {}
    for name, v in values.items():
        m = statistics.median(v)
        if len(v) >= 2 and m:
            out[name] = (max(v) - min(v)) / abs(m)
    return out


def merge(runs: list[dict]) -> dict:
    """Several runs of one program (separate processes) as one run whose repetitions are all of
    theirs: each benchmark's rows renumbered across the runs, its median aggregate recomputed
    (each numeric field's median over the rows that have it, as Google Benchmark's own), so that
    the figure is the median over every repetition and the spread counts how far processes
    differ, not only repetitions inside one process.  An odd count of rows keeps the median a
    value some repetition measured."""
    if len(runs) == 1:
        return runs[0]
    reps: dict[str, list[dict]] = {}
    for data in runs:
        for b in data.get("benchmarks", []):
            if b.get("run_type") != "aggregate":
                reps.setdefault(b.get("run_name", b["name"]), []).append(b)
    out = []
    for run_name, rows in reps.items():
        for k, b in enumerate(rows):
            out.append(dict(b, run_name=run_name, repetitions=len(rows), repetition_index=k))
        ran = [b for b in rows if not b.get("error_occurred")]
        if not ran:
            continue
        med = dict(ran[0], name=f"{run_name}_median", run_name=run_name, run_type="aggregate",
                   aggregate_name="median", repetitions=len(rows), repetition_index=0)
        for key in {k for b in ran for k, v in b.items()
                    if isinstance(v, (int, float)) and not isinstance(v, bool)} - {"repetitions", "repetition_index"}:
            med[key] = statistics.median(b[key] for b in ran if isinstance(b.get(key), (int, float)))
        out.append(med)
    return dict(runs[0], benchmarks=out)


def from_gbench(data: dict, command: str | None = None, name: str | None = None) -> dict:
    rows = _rows(data)
    ctx = data.get("context", {})
    program = name or os.path.basename(ctx.get("executable", "")) or None
    results = _results(rows)
    if program is None:
        program = ("bench_reservations" if _find(rows, "BM_materialize_release") else
                   "bench_optimizer" if _find(rows, "BM_tier/") else
                   "bench_allocation" if _find(rows, "BM_random<") else "gbench")
    extra = {"gbench_context": {k: ctx[k] for k in ("date", "host_name", "num_cpus", "library_build_type")
                                if k in ctx}}
    if "transcribed" in ctx:
        extra["transcribed"] = ctx["transcribed"]
    spread = _repetition_spread(data)
    if spread:
        extra["repetition_spread"] = spread
    device = ctx.get("device") or ctx.get("host_name") or "unknown"
    return document(program, results, device, command or ctx.get("command") or program, extra)


def missed(doc: dict, marks: dict | None = None) -> tuple[bool, list[str]]:
    """The checks (extra.checks) a run failed, and whether its figures still stand: they do when
    every failed check is a performance target (perf), as bench_overlap marks them.  A check
    without the mark (a script older than the mark) takes it from `marks`, the other build's run
    of the same benchmark, where a check of that name has one.  A failed correctness check or a
    part cut short leaves the run unmeasured."""
    other = {c.get("check"): c.get("perf") for c in (marks or {}).get("extra", {}).get("checks", [])}
    failed = [dict(c, perf=c["perf"] if "perf" in c else other.get(c.get("check")))
              for c in doc.get("extra", {}).get("checks", []) if c.get("ok") is False]
    names = [f"{c.get('check')} {c.get('value')}" +
             ("" if c["perf"] else " (not a performance target)" if c["perf"] is False else " (unmarked)")
             for c in failed]
    return all(c["perf"] is True for c in failed), names


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    c = sub.add_parser("convert", help="Google Benchmark JSON -> schema 1 (several: one program's runs in "
                       "separate processes, read as one run)")
    c.add_argument("gbench", nargs="+")
    c.add_argument("--out", required=True)
    c.add_argument("--command", help="the command that ran the benchmark (default: its context)")
    c.add_argument("--device", help="the device it ran on (default: the context's host_name)")
    c.add_argument("--name", help="the benchmark's name (default: the program's), e.g. for a run on another driver")
    v = sub.add_parser("validate", help="check files against schema 1")
    v.add_argument("files", nargs="+")
    m = sub.add_parser("missed", help="the checks a run failed, on one line; exit 0 when its figures stand "
                       "(only performance targets missed), 1 when not")
    m.add_argument("file")
    m.add_argument("--marks", help="the other build's run: the perf marks of checks this run has none for")
    a = ap.parse_args(argv)
    if a.what == "missed":
        def load(path):
            with open(path) as f:
                doc = json.load(f)
            if not isinstance(doc, dict):
                raise ValueError("not a JSON object")
            return doc
        try:
            doc = load(a.file)
        except (OSError, ValueError) as e:
            print(f"no figures ({type(e).__name__}: {getattr(e, 'strerror', None) or e})")
            return 1
        try:
            marks = load(a.marks) if a.marks else None
        except (OSError, ValueError):
            marks = None  # no marks to borrow: the run stands on its own
        stands, names = missed(doc, marks)
        print("; ".join(names) or "none")
        return 0 if stands else 1
    if a.what == "validate":
        bad = 0
        for p in a.files:
            with open(p) as f:
                errors = validate(json.load(f))
            for e in errors:
                print(f"{p}: {e}")
            bad += bool(errors)
        return 1 if bad else 0
    runs = []
    for p in a.gbench:
        with open(p) as f:
            runs.append(json.load(f))
        if not runs[-1].get("benchmarks"):
            print(f"bench_json: no benchmarks in {p}")
            return 1
    doc = from_gbench(merge(runs), a.command, a.name)
    if a.device:
        doc["device"] = a.device
    write(a.out, doc["benchmark"], doc["results"], doc["device"], doc["command"], doc["extra"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
