"""GPU acceptance of pause/resume: 16 GiB in 1,000 tensors, memory really given
back, against torch_memory_saver in the same run.  One command, a short table last:

    python3 benchmarks/pause_resume/bench_tms.py [--build build-gpu] [--tms-wheel W.whl] [--gib 16] [--json F]

Each phase runs in a subprocess of its own (full replacement, MemPool regions, LD_PRELOAD
and torch_memory_saver cannot share one process) and prints one "RESULT {json}" line:
  replace  deferalloc.install() + region("w"): pause frees >= 99% of 16 GiB (cuMemGetInfo),
           10 pause/resume cycles hold <= what the tensors took at first (PyTorch rounds
           segments in pool mode) + the cache bound, pause+resume times with
           keep="discard" and keep="host", host-backup GB/s each way
  pool     the same with region("w") on per-tag MemPools (PyTorch's cache on top)
  preload  LD_PRELOAD=libdeferalloc_preload.so: torch.cuda.empty_cache() after freeing
           16 GiB returns >= 99% of what the tensors took
  tms      torch_memory_saver (hook_mode "torch") pause+resume of the same 16 GiB, without
           and with CPU backup
  pinned   (inside replace) the pinned-copy bandwidth baseline, 1 GiB each way
Times are the best of the cycles after the first (the first is listed too).  Exit status 1
when an acceptance check fails.  --json F writes the figures in the schema of
benchmarks/bench_json.py (docs/BENCHMARKS.md is generated from it).  About 1.5-2.5 minutes on an H200.
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
N_TENSORS = 1000


def cache_bound_bytes() -> int:
    """pool_cache_mb of DEFERALLOC_CONF, else the library's default (64 MiB)."""
    for item in os.environ.get("DEFERALLOC_CONF", "").split(","):
        k, _, v = item.partition(":")
        if k.strip() == "pool_cache_mb":
            return int(v) << 20
    return 64 << 20


# ---- phases (run in subprocesses) --------------------------------------------------------------

def _sync_free():
    import torch
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def _timed(f):
    import torch
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    f()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def _make_tensors(gib: int):
    import torch
    numel = (gib << 30) // N_TENSORS // 4
    ts = [torch.empty(numel, device="cuda") for _ in range(N_TENSORS)]
    for i, t in enumerate(ts):
        t.fill_(float(i))
    return ts, numel


def _intact(ts) -> bool:
    import torch
    heads = torch.stack([t[0] for t in ts]).cpu()
    tails = torch.stack([t[-1] for t in ts]).cpu()
    want = torch.arange(len(ts), dtype=torch.float32)
    return bool(torch.equal(heads, want) and torch.equal(tails, want))


def _pinned_bandwidth():
    import torch
    n = 1 << 30
    h = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    d = torch.empty(n, dtype=torch.uint8, device="cuda")
    h2d = min(_timed(lambda: d.copy_(h, non_blocking=True)) for _ in range(3))
    d2h = min(_timed(lambda: h.copy_(d, non_blocking=True)) for _ in range(3))
    del h, d
    return n / h2d / 1e9, n / d2h / 1e9


def phase_dfa(mode: str, gib: int) -> dict:
    import torch
    import deferalloc as dfa
    if mode == "replace":
        dfa.install()
    torch.empty(1, device="cuda")
    out = {"phase": mode}
    if mode == "replace":
        out["pinned_h2d_GBps"], out["pinned_d2h_GBps"] = _pinned_bandwidth()
        torch.cuda.empty_cache()
        dfa.trim()
    free0 = _sync_free()
    with dfa.region("w", keep="discard"):
        ts, numel = _make_tensors(gib)
    free1 = _sync_free()
    taken = free0 - free1
    live = numel * 4 * N_TENSORS
    out.update(taken=taken, live=live, deferalloc_allocated=dfa.memory_stats()["allocated_bytes.all.current"])
    bound = cache_bound_bytes()
    given, held, pause_t, resume_t = [], [], [], []
    for _ in range(10):
        pause_t.append(_timed(lambda: dfa.pause("w", keep="discard")))
        given.append(_sync_free() - free1)
        resume_t.append(_timed(lambda: dfa.resume("w")))
        held.append(free0 - _sync_free())
    for i, t in enumerate(ts):  # discard: contents undefined; write them again
        t.fill_(float(i))
    hpause, hresume, hgiven = [], [], []
    for _ in range(3):
        hpause.append(_timed(lambda: dfa.pause("w", keep="host")))
        hgiven.append(_sync_free() - free1)
        hresume.append(_timed(lambda: dfa.resume("w")))
    out.update(
        given_back_min=min(given), given_back_frac=min(given) / live, held_max=max(held), bound=bound,
        held_ok=max(held) <= max(taken, live) + bound,
        discard_pause_s=min(pause_t[1:]), discard_resume_s=min(resume_t[1:]),
        discard_first_s=pause_t[0] + resume_t[0],
        host_pause_s=min(hpause[1:]), host_resume_s=min(hresume[1:]), host_first_s=hpause[0] + hresume[0],
        host_given_back_frac=min(hgiven) / live, host_intact=_intact(ts))
    out["host_d2h_GBps"] = live / out["host_pause_s"] / 1e9
    out["host_h2d_GBps"] = live / out["host_resume_s"] / 1e9
    return out


def phase_preload(gib: int) -> dict:
    import torch
    torch.empty(1, device="cuda")
    free0 = _sync_free()
    ts, numel = _make_tensors(gib)
    free1 = _sync_free()
    del ts
    free2 = _sync_free()
    torch.cuda.empty_cache()
    free3 = _sync_free()
    return {"phase": "preload", "taken": free0 - free1, "cached_after_del": free2 - free1,
            "returned": free3 - free1, "returned_frac": (free3 - free1) / max(1, free0 - free1)}


def _import_tms(wheel: str | None):
    """torch_memory_saver, installed or extracted from `wheel`.  It imports numpy, which only
    its get_cpu_backup uses: without numpy a stub stands in during the import."""
    import types
    import torch  # noqa: F401  (first, so that torch sees the real numpy state)
    stubbed = False
    try:
        import numpy  # noqa: F401
    except ImportError:
        sys.modules["numpy"] = types.ModuleType("numpy")
        stubbed = True
    try:
        try:
            import torch_memory_saver
            return torch_memory_saver
        except ImportError:
            if not wheel:
                raise
        where = tempfile.mkdtemp(prefix="tms-")
        atexit.register(shutil.rmtree, where, True)
        with zipfile.ZipFile(wheel) as z:
            z.extractall(where)
        sys.path.insert(0, where)
        import torch_memory_saver
        return torch_memory_saver
    finally:
        if stubbed:
            del sys.modules["numpy"]


def phase_tms(gib: int, wheel: str | None) -> dict:
    import torch
    tms_mod = _import_tms(wheel)
    tms = tms_mod.torch_memory_saver
    tms.hook_mode = "torch"
    torch.empty(1, device="cuda")
    out = {"phase": "tms", "version": getattr(tms_mod, "__version__", "?")}
    try:
        from importlib.metadata import version
        out["version"] = version("torch_memory_saver")
    except Exception:
        pass
    for tag, backup in (("w", False), ("h", True)):
        free0 = _sync_free()
        with tms.region(tag=tag, enable_cpu_backup=backup):
            ts, numel = _make_tensors(gib)
        free1 = _sync_free()
        live = numel * 4 * N_TENSORS
        p, r, given = [], [], []
        for _ in range(3):
            p.append(_timed(lambda: tms.pause(tag)))
            given.append(_sync_free() - free1)
            r.append(_timed(lambda: tms.resume(tag)))
        key = "host" if backup else "discard"
        out.update({f"{key}_pause_s": min(p[1:]), f"{key}_resume_s": min(r[1:]), f"{key}_first_s": p[0] + r[0],
                    f"{key}_given_back_frac": min(given) / live, f"{key}_taken": free0 - free1})
        if backup:
            out["host_intact"] = _intact(ts)
        tms.pause(tag)  # give this tag's memory back before the next one
    return out


# ---- driver --------------------------------------------------------------------------------------

def run_phase(name: str, args, env_extra: dict, script: str = __file__) -> dict | None:
    """`script --phase name` in a process of its own (bench_drop_in.py runs its phases here too)."""
    env = dict(os.environ)
    env.setdefault("DEFERALLOC_CONF", "driver:cuda")
    env["DEFERALLOC_LIB"] = os.path.join(args.build, "allocator", "libdeferalloc.so")
    env["PYTHONPATH"] = os.path.join(ROOT, "python") + os.pathsep + env.get("PYTHONPATH", "")
    env.update(env_extra)
    cmd = [sys.executable, os.path.abspath(script), "--phase", name, "--gib", str(args.gib)]
    if args.tms_wheel:
        cmd += ["--tms-wheel", args.tms_wheel]
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired as e:
        print(f"phase {name} timed out after {args.timeout} s:\n{(e.stdout or b'')[-2000:]}", flush=True)
        return None
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        print(f"phase {name} failed (exit {r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}", flush=True)
        return None
    res = json.loads(lines[-1][len("RESULT "):])
    res["wall_s"] = time.perf_counter() - t0
    # torch_memory_saver 0.0.10 prints an error and exits 1 at interpreter exit
    # ("only support interesting region ... tms_torch_free") after its phase completed:
    # the result stands, the exit status is reported.
    res["exit_status"] = r.returncode
    print(f"phase {name}: {json.dumps(res)}", flush=True)
    return res


LABELS = {"replace": "deferalloc, full replacement", "pool": "deferalloc, per-tag MemPool regions",
          "replace_pinned": "deferalloc, full replacement, pinned_cache_mb:20480", "tms": "torch_memory_saver"}


def write_json(path: str, res: dict, checks: list, device: str) -> None:
    """The figures of the table, each against its baseline of the same run (bench_json schema)."""
    sys.path.insert(0, os.path.dirname(HERE))
    from bench_json import result, write
    out = []
    rep, tms = res["replace"], res["tms"]
    if rep is not None:
        out += [result("pinned copy H2D", rep["pinned_h2d_GBps"], "GB/s"),
                result("pinned copy D2H", rep["pinned_d2h_GBps"], "GB/s")]
    for key in ("replace", "pool", "replace_pinned", "tms"):
        r, label = res[key], LABELS[key]
        if r is None:
            continue
        for keep, what in (("discard", "discard"), ("host", "host backup")):
            out += [result(f"{label}: pause, {what}", r[f"{keep}_pause_s"] * 1e3, "ms"),
                    result(f"{label}: resume, {what}", r[f"{keep}_resume_s"] * 1e3, "ms")]
        for keep, what in (("discard", "discard"), ("host", "host backup")):
            base = f"{LABELS['tms']}: pause + resume, {what}" if tms is not None and key != "tms" else None
            out.append(result(f"{label}: pause + resume, {what}", (r[f"{keep}_pause_s"] + r[f"{keep}_resume_s"]) * 1e3,
                              "ms", base))
        out.append(result(f"{label}: memory given back at pause",
                          100 * r.get("given_back_frac", r.get("discard_given_back_frac", float("nan"))), "%"))
        if key != "tms" and rep is not None:
            for way, pin in (("D2H", "pinned copy D2H"), ("H2D", "pinned copy H2D")):
                out.append(result(f"{label}: host backup {way}", r[f"host_{way.lower()}_GBps"], "GB/s", pin))
    if res["preload"] is not None:
        out.append(result("LD_PRELOAD: torch.cuda.empty_cache() gives back", 100 * res["preload"]["returned_frac"], "%"))
    write(path, "bench_tms", out, device, extra={
        "tms_version": tms["version"] if tms else None,
        "checks": [{"check": c, "value": v, "ok": bool(ok)} for c, v, ok in checks],
        "notes": [f"{sum(ok for *_, ok in checks)} of {len(checks)} acceptance checks pass"
                  + "".join(f"; failing: {c} ({v})" for c, v, ok in checks if not ok) + "."]})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phase", choices=["replace", "pool", "preload", "tms"])
    ap.add_argument("--build", default=os.environ.get("DFA_BUILD_DIR", os.path.join(ROOT, "build-gpu")))
    ap.add_argument("--tms-wheel", default=os.environ.get("DFA_TMS_WHEEL"),
                    help="torch_memory_saver wheel to use when the package is not installed")
    ap.add_argument("--gib", type=int, default=16)
    ap.add_argument("--timeout", type=int, default=240)
    ap.add_argument("--json", help="write the figures here (schema of benchmarks/bench_json.py)")
    args = ap.parse_args()
    if args.phase:
        if args.phase in ("replace", "pool"):
            res = phase_dfa(args.phase, args.gib)
        elif args.phase == "preload":
            res = phase_preload(args.gib)
        else:
            res = phase_tms(args.gib, args.tms_wheel)
        print("RESULT " + json.dumps(res), flush=True)
        return 0

    import torch
    if not torch.cuda.is_available():
        print("SKIPPED: bench_tms needs a GPU")
        return 77
    args.build = os.path.abspath(args.build)
    preload = os.path.join(args.build, "allocator", "libdeferalloc_preload.so")
    res = {
        "replace": run_phase("replace", args, {}),
        "pool": run_phase("pool", args, {}),
        # The same with the pinned backups kept cached (pinned_cache_mb above the paused
        # size): no re-pinning on each pause, as a user who pauses often would set it.
        "replace_pinned": run_phase("replace", args, {"DEFERALLOC_CONF": "driver:cuda,pinned_cache_mb:20480"}),
        "preload": run_phase("preload", args, {"LD_PRELOAD": preload}),
        "tms": run_phase("tms", args, {}),
    }
    checks = []  # (criterion, value, ok)
    rep, pool, pre, tms = res["replace"], res["pool"], res["preload"], res["tms"]
    for name, r in (("replace", rep), ("pool", pool), ("replace_pinned", res["replace_pinned"])):
        if r is None:
            checks.append((f"{name}: phase ran", "failed", False))
            continue
        checks.append((f"{name}: pause frees >= 99% of {args.gib} GiB", f"{r['given_back_frac']:.4f}",
                       r["given_back_frac"] >= 0.99))
        checks.append((f"{name}: 10 cycles held <= taken + bound", f"{r['held_max'] / 2**30:.3f} GiB "
                       f"(taken {r['taken'] / 2**30:.3f} + {r['bound'] >> 20} MiB)", r["held_ok"]))
        checks.append((f"{name}: keep=host contents intact", str(r["host_intact"]), r["host_intact"]))
        if rep is not None:
            for way, pin in (("d2h", "pinned_d2h_GBps"), ("h2d", "pinned_h2d_GBps")):
                ratio = r[f"host_{way}_GBps"] / rep[pin]
                checks.append((f"{name}: host backup {way} >= 0.9x pinned", f"{r[f'host_{way}_GBps']:.1f} GB/s "
                               f"= {ratio:.2f}x", ratio >= 0.9))
        if tms is not None:
            for keep in ("discard", "host"):
                ours = r[f"{keep}_pause_s"] + r[f"{keep}_resume_s"]
                theirs = tms[f"{keep}_pause_s"] + tms[f"{keep}_resume_s"]
                checks.append((f"{name}: pause+resume keep={keep} vs tms >= 10x",
                               f"{ours * 1e3:.1f} ms vs {theirs * 1e3:.1f} ms = {theirs / ours:.1f}x",
                               theirs / ours >= 10))
    if pre is not None:
        checks.append(("preload: empty_cache returns >= 99%", f"{pre['returned_frac']:.4f}",
                       pre["returned_frac"] >= 0.99))
    else:
        checks.append(("preload: phase ran", "failed", False))
    if tms is None:
        checks.append(("tms: phase ran (wheel carried? --tms-wheel)", "failed", False))

    print("\n| phase | pause discard ms | resume discard ms | pause host ms | resume host ms | given back |")
    print("|---|---|---|---|---|---|")
    for name in ("replace", "pool", "replace_pinned", "tms"):
        r = res[name]
        if r is None:
            print(f"| {name} | failed | | | | |")
            continue
        gb = r.get("given_back_frac", r.get("discard_given_back_frac", float("nan")))
        print(f"| {name} | {r['discard_pause_s'] * 1e3:.1f} | {r['discard_resume_s'] * 1e3:.1f} | "
              f"{r['host_pause_s'] * 1e3:.1f} | {r['host_resume_s'] * 1e3:.1f} | {gb:.4f} |")
    if rep is not None:
        print(f"\npinned copy: h2d {rep['pinned_h2d_GBps']:.1f} GB/s, d2h {rep['pinned_d2h_GBps']:.1f} GB/s; "
              f"tms {tms['version'] if tms else '-'}")
    print("\n| check | value | ok |\n|---|---|---|")
    for c, v, ok in checks:
        print(f"| {c} | {v} | {'PASS' if ok else 'FAIL'} |")
    if args.json:
        write_json(args.json, res, checks, torch.cuda.get_device_name())
    return 0 if all(ok for _, _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
