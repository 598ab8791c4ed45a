"""Where the link idles: the copy engines' timeline of a profiled stretch of a run.

A streamed step is at its bound when both directions of the link (pinned H2D and D2H) are
busy from the first piece's fetch to the last piece's write-back.  When an overlapped
iteration is slower than its bound, the iteration's time alone does not say whether the
passes ran below the link's rate (per-piece costs) or the link waited (for gradients, for
the host to issue the next pass).  ``analyse`` answers from a torch.profiler Chrome trace
(CUPTI's device timestamps of every copy and kernel, the engine's included): per
direction the busy time, bytes and rate while busy, and every gap of at least ``gap_ms``
with the kernels that ran during it (the engine's kernels' time apart: a gap with none of
them waits for gradients or for the host, not for a kernel); and the gaps of the model's own
kernels (all but the engine's: the GPU's compute idle) with the host events during each (its
ops and CUDA calls, per thread: a synchronisation shows; Python only when the trace was taken
with_stack); and the host's small reads from the device (an ``.item()``): how long each made
the host wait, and how much of it its copy sat behind other copies on the copy engine (a
D2H copy queues behind the write-backs queued before it).  Device events of every GPU in the
trace count as one timeline.

    python3 benchmarks/link_profile.py TRACE.json[.gz] [--gap-ms 1]

prints the analysis; bench_overlap.py --profile-mode NAME profiles two iterations of that
mode and stores the analysis in its JSON (extra.link_profile).
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import sys

ENGINE_KERNELS = re.compile(r"deferalloc::")  # the engine's kernels (optimizer/kernels: deferalloc::optim::detail)
HOST_CATS = ("cpu_op", "cuda_runtime", "cuda_driver", "user_annotation", "python_function")


def load(path: str) -> list[dict]:
    """The trace's events (a Chrome trace, plain or gzip)."""
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        d = json.load(f)
    return d["traceEvents"] if isinstance(d, dict) else d


def _direction(e: dict) -> str | None:
    if e.get("cat") != "gpu_memcpy":
        return None
    n = e.get("name", "")
    return "h2d" if "HtoD" in n else "d2h" if "DtoH" in n else None


def capture(run, cuda: bool, trace_gz: str, gap_ms: float = 1.0) -> dict:
    """``run()`` under torch.profiler (host events, and on a GPU CUDA's device timestamps);
    ``analyse`` of its trace, which is kept gzipped in ``trace_gz`` (its directory made)."""
    import shutil
    import tempfile

    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        run()
    os.makedirs(os.path.dirname(os.path.abspath(trace_gz)), exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        res = analyse(load(path), gap_ms)
        with open(path, "rb") as f, gzip.open(trace_gz, "wb") as g:
            shutil.copyfileobj(f, g)
    return res


def merge(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of intervals, sorted and disjoint."""
    out: list[list[float]] = []
    for s, e in sorted(iv):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _length(iv: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in iv)


def _intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _gaps(iv: list[tuple[float, float]], gap_ms: float) -> list[tuple[float, float]]:
    """The holes of at least gap_ms between disjoint sorted intervals (microseconds)."""
    return [(a, b) for (_, a), (b, _) in zip(iv, iv[1:]) if (b - a) / 1e3 >= gap_ms]


def _overlaps(items: list[tuple[float, float, str]], a: float, b: float) -> dict[str, float]:
    """Per name, the microseconds its (start, end, name) items overlap [a, b)."""
    over: dict[str, float] = {}
    for s, e, n in items:
        o = min(e, b) - max(s, a)
        if o > 0:
            over[n] = over.get(n, 0.0) + o
    return over


def _top(over: dict[str, float], top: int) -> list[tuple[str, float]]:
    return sorted(over.items(), key=lambda kv: kv[1], reverse=True)[:top]


def analyse(events: list[dict], gap_ms: float = 1.0, top: int = 4) -> dict:
    """Per direction ("h2d", "d2h"): busy ms, bytes, GB/s while busy, and the gaps of at
    least gap_ms between its first and last copy (start offset from the window's start,
    length, the kernels overlapping it by time, the engine's kernels' ms in it); both
    directions busy at once and either; the window (first to last device event); "compute":
    the model's kernels' busy ms and gaps, each with the host events overlapping it."""
    dev = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("gpu_memcpy", "kernel", "gpu_memset")]
    if not dev:
        return {"events": 0}
    t0 = min(e["ts"] for e in dev)
    t1 = max(e["ts"] + e.get("dur", 0) for e in dev)
    kernels = [(e["ts"], e["ts"] + e.get("dur", 0), e.get("name", "")) for e in dev if e.get("cat") == "kernel"]
    out: dict = {"events": len(dev), "window_ms": (t1 - t0) / 1e3}
    busy = {}
    for d in ("h2d", "d2h"):
        cp = [e for e in dev if _direction(e) == d]
        iv = merge([(e["ts"], e["ts"] + e.get("dur", 0)) for e in cp])
        busy[d] = iv
        nbytes = sum(int((e.get("args") or {}).get("bytes", 0)) for e in cp)
        ms = _length(iv) / 1e3
        gaps = []
        for a, b in _gaps(iv, gap_ms):
            over = _overlaps(kernels, a, b)
            engine = 0.0
            for n, us in over.items():
                if ENGINE_KERNELS.search(n):
                    engine += us
            gaps.append({"at_ms": (a - t0) / 1e3, "ms": (b - a) / 1e3, "engine_kernel_ms": engine / 1e3,
                         "kernels": [[n[:80], us / 1e3] for n, us in _top(over, top)]})
        out[d] = {"copies": len(cp), "busy_ms": ms, "bytes": nbytes, "gbps_busy": nbytes / ms / 1e6 if ms else 0.0,
                  "first_ms": (iv[0][0] - t0) / 1e3 if iv else None, "last_ms": (iv[-1][1] - t0) / 1e3 if iv else None,
                  "gaps": gaps, "gap_ms": sum(g["ms"] for g in gaps)}
    out["both_busy_ms"] = _length(_intersect(busy["h2d"], busy["d2h"])) / 1e3
    out["either_busy_ms"] = _length(merge(busy["h2d"] + busy["d2h"])) / 1e3
    # The model's kernels (all but the engine's): where the GPU's compute idled, and what the
    # host was in then (its ops and CUDA calls overlapping the gap, per thread).
    host = [(e["ts"], e["ts"] + e.get("dur", 0), f"{e.get('name', '')[:60]} [tid {e.get('tid')}]") for e in events
            if e.get("ph") == "X" and e.get("cat") in HOST_CATS]
    model = merge([(s, e) for s, e, n in kernels if not ENGINE_KERNELS.search(n)])
    gaps = [{"at_ms": (a - t0) / 1e3, "ms": (b - a) / 1e3, "host": [[n, us / 1e3] for n, us in _top(_overlaps(host, a, b), top)]}
            for a, b in _gaps(model, gap_ms)]
    out["compute"] = {"busy_ms": _length(model) / 1e3, "gaps": gaps, "gap_ms": sum(g["ms"] for g in gaps)}
    out["host_reads"] = host_reads(events, dev, t0, top)
    return out


def host_reads(events: list[dict], dev: list[dict], t0: float, top: int = 4) -> dict:
    """The small D2H copies (64 KiB at most) a host thread issued through the CUDA runtime (an
    ``.item()``, a ``.cpu()``), each matched to its call by the correlation id: how long the
    host waited for each (the call's start to the copy's end), and how much of that the copy
    waited behind something other than its own stream's earlier work (the copy's start after
    both the call and its stream's previous device event: another stream's copies queued
    before it on the copy engine, or an event its stream waits for)."""
    calls = {(e.get("args") or {}).get("correlation"): e for e in events
             if e.get("ph") == "X" and e.get("cat") == "cuda_runtime" and "Memcpy" in e.get("name", "")}
    by_stream: dict = {}
    for e in sorted(dev, key=lambda x: x["ts"]):
        by_stream.setdefault(e.get("tid"), []).append(e)
    reads = []
    for stream, evs in by_stream.items():
        prev_end = float("-inf")  # the end of the stream's device events so far
        for e in evs:
            args = e.get("args") or {}
            c = calls.get(args.get("correlation")) if args.get("correlation") is not None else None
            if c is not None and _direction(e) == "d2h" and int(args.get("bytes", 0)) <= 65536:
                reads.append({"at_ms": (c["ts"] - t0) / 1e3, "ms": (e["ts"] + e.get("dur", 0) - c["ts"]) / 1e3,
                              "behind_ms": max(0.0, e["ts"] - max(c["ts"], prev_end)) / 1e3})
            prev_end = max(prev_end, e["ts"] + e.get("dur", 0))
    return {"count": len(reads), "wait_ms": sum(r["ms"] for r in reads),
            "behind_ms": sum(r["behind_ms"] for r in reads),
            "longest": sorted(reads, key=lambda r: r["behind_ms"], reverse=True)[:top]}


def report(a: dict, bound_gbps: float | None = None) -> str:
    """The analysis as lines of text."""
    if not a.get("events"):
        return "no device events in the trace"
    lines = [f"window {a['window_ms']:.1f} ms; both directions busy {a['both_busy_ms']:.1f} ms, "
             f"either {a['either_busy_ms']:.1f} ms"]
    for d in ("h2d", "d2h"):
        x = a[d]
        rate = f"{x['gbps_busy']:.1f} GB/s while busy" + (f" ({x['gbps_busy'] / bound_gbps:.2f}x the bound)"
                                                          if bound_gbps else "")
        lines.append(f"{d}: {x['copies']} copies, {x['bytes'] / 1e9:.2f} GB, busy {x['busy_ms']:.1f} ms, {rate}; "
                     f"{len(x['gaps'])} gaps >= the threshold, {x['gap_ms']:.1f} ms")
        for g in x["gaps"]:
            ks = ", ".join(f"{n} {ms:.2f}" for n, ms in g["kernels"])
            lines.append(f"   gap at {g['at_ms']:7.1f} ms: {g['ms']:6.2f} ms (engine kernels {g['engine_kernel_ms']:.2f} ms) "
                         f"{ks}")
    c = a.get("compute")
    if c:
        lines.append(f"model kernels: busy {c['busy_ms']:.1f} ms; {len(c['gaps'])} gaps >= the threshold, "
                     f"{c['gap_ms']:.1f} ms")
        for g in c["gaps"]:
            hs = ", ".join(f"{n} {ms:.2f}" for n, ms in g["host"])
            lines.append(f"   gap at {g['at_ms']:7.1f} ms: {g['ms']:6.2f} ms; the host in: {hs}")
    r = a.get("host_reads")
    if r and r["count"]:
        lines.append(f"host reads (small D2H copies a host thread waited for): {r['count']}, {r['wait_ms']:.1f} ms, "
                     f"{r['behind_ms']:.1f} ms of it queued behind other copies or events")
        for x in r["longest"]:
            lines.append(f"   read at {x['at_ms']:7.1f} ms: {x['ms']:6.2f} ms, {x['behind_ms']:.2f} ms behind")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--gap-ms", type=float, default=1.0)
    ap.add_argument("--bound-gbps", type=float, default=None, help="the duplex bound each way, for the rate's ratio")
    a = ap.parse_args()
    print(report(analyse(load(a.trace), a.gap_ms), a.bound_gbps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
