"""deferalloc.memory_saver (torch_memory_saver's API on deferalloc) against torch_memory_saver
0.0.10 in the same run: the RL stacks' pause/resume of 8 GiB of weights in 512 tensors.  One
command, a short table last:

    python3 benchmarks/pause_resume/bench_drop_in.py [--build build-gpu] [--tms-wheel W.whl] [--json F]

Each phase is a process of its own (a hook mode is fixed per process, and the preload modes
need LD_PRELOAD from the start); each prints one "RESULT {json}" line:
  pinned        torch's pinned copy of the same 512 tensors each way (D2H into one pinned
                buffer, H2D back): the baseline of the CPU-backup targets
  dfa_torch     deferalloc.memory_saver, hook_mode="torch" (per-tag regions)
  dfa_preload   deferalloc.memory_saver, hook_mode="preload" (LD_PRELOAD=libdeferalloc_preload.so)
  tms           torch_memory_saver with its defaults (hook_mode "preload", its library in
                LD_PRELOAD through its configure_subprocess; retain_cpu_backup False); where
                its preload mode fails, its hook_mode "torch" (the table says which ran)
  tms_retain    torch_memory_saver, retain_cpu_backup=True, cpu_backup_backend="pinned"
Each phase: region "h" (enable_cpu_backup=True) then region "d" (discard), each paused and
resumed 4 times (the best of cycles 2-4 is reported, the first too), memory given back at
pause (cuMemGetInfo), contents checked after each CPU-backup resume, and what the process
holds on the device while everything is paused, beyond its CUDA context.
Targets (printed as marked checks; a missed performance target does not fail the run):
  pause with CPU backup >= 0.8x the pinned D2H copy's bandwidth, resume >= 0.8x the H2D;
  pause+resume with CPU backup >= 10x faster than torch_memory_saver's defaults and >= 4x
  faster than with retain_cpu_backup + pinned; with discard >= 5x faster than its defaults.
Correctness checks (given back >= 99%, contents intact, every phase ran) set exit status 1.
About 2-3 minutes on an H200 (most of it torch_memory_saver's pinned allocations).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import bench_tms  # noqa: E402  (its TMS import, timing and free-memory helpers)

GIB, MIB = 1 << 30, 1 << 20
N_TENSORS = 512
CYCLES = 4


def _numel(gib: int) -> int:
    return (gib << 30) // N_TENSORS // 4


def _fill(ts) -> None:
    for i, t in enumerate(ts):
        t.fill_(float(i))


# ---- phases (in subprocesses) -------------------------------------------------------------------

def phase_pinned(gib: int) -> dict:
    import torch
    numel = _numel(gib)
    ts = [torch.empty(numel, device="cuda") for _ in range(N_TENSORS)]
    _fill(ts)
    host = torch.empty(numel * N_TENSORS, dtype=torch.float32, pin_memory=True)
    parts = host.split(numel)

    def d2h():
        for p, t in zip(parts, ts):
            p.copy_(t, non_blocking=True)

    def h2d():
        for p, t in zip(parts, ts):
            t.copy_(p, non_blocking=True)

    live = numel * 4 * N_TENSORS
    d = min(bench_tms._timed(d2h) for _ in range(3))
    h = min(bench_tms._timed(h2d) for _ in range(3))
    return {"phase": "pinned", "bytes": live, "d2h_s": d, "h2d_s": h, "d2h_GBps": live / d / 1e9,
            "h2d_GBps": live / h / 1e9}


def _saver(kind: str, wheel: str | None):
    if kind.startswith("dfa_"):
        from deferalloc.memory_saver import torch_memory_saver
        torch_memory_saver.hook_mode = "torch" if kind == "dfa_torch" else "preload"
        return torch_memory_saver, "deferalloc"
    mod = bench_tms._import_tms(wheel)
    s = mod.torch_memory_saver
    s.hook_mode = os.environ.get("DFA_TMS_HOOK_MODE", "preload")
    if kind == "tms_retain":
        s.retain_cpu_backup = True
    try:
        from importlib.metadata import version
        v = version("torch_memory_saver")
    except Exception:
        v = "?"
    return s, v


def phase_saver(kind: str, gib: int, wheel: str | None) -> dict:
    import torch
    s, version = _saver(kind, wheel)
    torch.empty(1, device="cuda")
    free_ctx = bench_tms._sync_free()
    numel = _numel(gib)
    live = numel * 4 * N_TENSORS
    out = {"phase": kind, "version": version, "bytes": live,
           "hook_mode": s.hook_mode if kind.startswith("dfa_") else os.environ.get("DFA_TMS_HOOK_MODE", "preload")}
    backend = "pinned" if kind == "tms_retain" else None
    for tag, keep in (("h", "host"), ("d", "discard")):
        with s.region(tag, enable_cpu_backup=keep == "host", cpu_backup_backend=backend if keep == "host" else None):
            ts = [torch.empty(numel, device="cuda") for _ in range(N_TENSORS)]
        _fill(ts)
        p, r, given, intact = [], [], [], True
        for _ in range(CYCLES):
            f0 = bench_tms._sync_free()
            p.append(bench_tms._timed(lambda: s.pause(tag)))
            given.append(bench_tms._sync_free() - f0)
            r.append(bench_tms._timed(lambda: s.resume(tag)))
            if keep == "host":
                intact = intact and bench_tms._intact(ts)
        out.update({f"{keep}_pause_s": min(p[1:]), f"{keep}_resume_s": min(r[1:]), f"{keep}_first_s": p[0] + r[0],
                    f"{keep}_given_back_frac": min(given) / live})
        if keep == "host":
            out["host_intact"] = intact
        s.pause(tag)  # paused from here on: the next tag has the memory, and the held figure counts it
    out["held_paused"] = free_ctx - bench_tms._sync_free()
    return out


# ---- driver ---------------------------------------------------------------------------------------

def _tms_env(wheel: str | None) -> dict | None:
    """PYTHONPATH and LD_PRELOAD for torch_memory_saver's preload mode (its configure_subprocess)."""
    try:
        mod = bench_tms._import_tms(wheel)
    except Exception as e:
        print(f"torch_memory_saver not available ({type(e).__name__}: {e})", flush=True)
        return None
    where = os.path.dirname(os.path.dirname(os.path.abspath(mod.__file__)))
    with mod.configure_subprocess():
        preload = os.environ["LD_PRELOAD"]
    return {"LD_PRELOAD": preload, "PYTHONPATH": where + os.pathsep + os.environ.get("PYTHONPATH", "")}


def run_phase(name: str, args, env_extra: dict | None) -> dict | None:
    """bench_tms.run_phase on this script; None (not run) without its environment."""
    if env_extra is None:
        print(f"phase {name}: not run", flush=True)
        return None
    if "PYTHONPATH" in env_extra:  # the package's python/ first, as bench_tms puts it
        env_extra = dict(env_extra, PYTHONPATH=os.path.join(ROOT, "python") + os.pathsep + env_extra["PYTHONPATH"])
    env_extra.setdefault("LD_PRELOAD", "")
    return bench_tms.run_phase(name, args, env_extra, script=__file__)


LABELS = {"dfa_torch": "deferalloc drop-in, hook_mode torch", "dfa_preload": "deferalloc drop-in, hook_mode preload",
          "tms": "torch_memory_saver defaults", "tms_retain": "torch_memory_saver retain_cpu_backup + pinned"}


def checks_of(res: dict) -> list:
    """(criterion, value, ok, performance target?)"""
    out = []
    pin, tms, tmr = res["pinned"], res["tms"], res["tms_retain"]
    for name in ("pinned", "dfa_torch", "dfa_preload", "tms", "tms_retain"):
        if res[name] is None:
            out.append((f"{name}: phase ran", "failed", False, False))
    for name in ("dfa_torch", "dfa_preload"):
        r = res[name]
        if r is None:
            continue
        for keep in ("host", "discard"):
            out.append((f"{name}: pause gives back >= 99% ({keep})", f"{r[f'{keep}_given_back_frac']:.4f}",
                        r[f"{keep}_given_back_frac"] >= 0.99, False))
        out.append((f"{name}: CPU backup contents intact", str(r["host_intact"]), r["host_intact"], False))
        out.append((f"{name}: held on the device while paused <= 256 MiB", f"{r['held_paused'] / MIB:.0f} MiB",
                    r["held_paused"] <= 256 * MIB, True))
        if pin is not None:
            for way, key, base in (("pause", "host_pause_s", "d2h_s"), ("resume", "host_resume_s", "h2d_s")):
                ratio = pin[base] / r[key]
                out.append((f"{name}: {way} with CPU backup >= 0.8x pinned {base[:3].upper()}",
                            f"{r[key] * 1e3:.0f} ms vs {pin[base] * 1e3:.0f} ms = {ratio:.2f}x", ratio >= 0.8, True))
        ours_h = r["host_pause_s"] + r["host_resume_s"]
        ours_d = r["discard_pause_s"] + r["discard_resume_s"]
        for other, key, want in ((tms, "host", 10.0), (tmr, "host", 4.0), (tms, "discard", 5.0)):
            if other is None:
                continue
            theirs = other[f"{key}_pause_s"] + other[f"{key}_resume_s"]
            ours = ours_h if key == "host" else ours_d
            out.append((f"{name}: pause+resume {key} >= {want:g}x faster than {other['phase']}",
                        f"{ours * 1e3:.0f} ms vs {theirs * 1e3:.0f} ms = {theirs / ours:.1f}x", theirs / ours >= want,
                        True))
    return out


def write_json(path: str, res: dict, checks: list, device: str) -> None:
    sys.path.insert(0, os.path.dirname(HERE))
    from bench_json import result, write
    out = []
    pin = res["pinned"]
    if pin is not None:
        out += [result("pinned copy D2H, 512 tensors", pin["d2h_GBps"], "GB/s"),
                result("pinned copy H2D, 512 tensors", pin["h2d_GBps"], "GB/s")]
    for key in ("dfa_torch", "dfa_preload", "tms", "tms_retain"):
        r = res[key]
        if r is None:
            continue
        label = LABELS[key]
        for keep, what in (("host", "CPU backup"), ("discard", "discard")):
            base = f"{LABELS['tms']}: pause + resume, {what}" if key != "tms" and res["tms"] is not None else None
            out += [result(f"{label}: pause, {what}", r[f"{keep}_pause_s"] * 1e3, "ms"),
                    result(f"{label}: resume, {what}", r[f"{keep}_resume_s"] * 1e3, "ms"),
                    result(f"{label}: pause + resume, {what}", (r[f"{keep}_pause_s"] + r[f"{keep}_resume_s"]) * 1e3,
                           "ms", base)]
        out.append(result(f"{label}: held on the device while paused", r["held_paused"] / MIB, "MiB"))
    write(path, "bench_drop_in", out, device, extra={
        "tms_version": res["tms"]["version"] if res["tms"] else None,
        "checks": [{"check": c, "value": v, "ok": bool(ok), "perf": perf} for c, v, ok, perf in checks]})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phase", choices=["pinned", "dfa_torch", "dfa_preload", "tms", "tms_retain"])
    ap.add_argument("--build", default=os.environ.get("DFA_BUILD_DIR", os.path.join(ROOT, "build-gpu")))
    ap.add_argument("--tms-wheel", default=os.environ.get("DFA_TMS_WHEEL"))
    ap.add_argument("--gib", type=int, default=8)
    ap.add_argument("--timeout", type=int, default=240, help="seconds per phase")
    ap.add_argument("--json", help="write the figures here (schema of benchmarks/bench_json.py)")
    args = ap.parse_args()
    import torch
    if args.phase:  # one phase, in its own process
        one = phase_pinned(args.gib) if args.phase == "pinned" else phase_saver(args.phase, args.gib, args.tms_wheel)
        print("RESULT " + json.dumps(one), flush=True)
    elif torch.cuda.is_available():
        return drive(args)
    else:
        print("SKIPPED: bench_drop_in needs a GPU")
        return 77
    return 0


def drive(args) -> int:
    """Every phase, the checks, the JSON and the table."""
    import torch
    args.build = os.path.abspath(args.build)
    t0 = time.perf_counter()
    tms_env = _tms_env(args.tms_wheel)
    res = {
        "pinned": run_phase("pinned", args, {}),
        "dfa_torch": run_phase("dfa_torch", args, {}),
        "dfa_preload": run_phase("dfa_preload", args,
                                 {"LD_PRELOAD": os.path.join(args.build, "allocator", "libdeferalloc_preload.so")}),
        "tms": run_phase("tms", args, tms_env),
        "tms_retain": run_phase("tms_retain", args, tms_env),
    }
    for name in ("tms", "tms_retain"):  # its preload mode failed here: its torch mode instead, said in the table
        if res[name] is None and tms_env is not None:
            res[name] = run_phase(name, args, dict(tms_env, LD_PRELOAD="", DFA_TMS_HOOK_MODE="torch"))
    checks = checks_of(res)
    device = torch.cuda.get_device_name(0)
    if args.json:
        write_json(args.json, res, checks, device)
    print()
    for c, v, ok, perf in checks:
        print(f"CHECK {'ok    ' if ok else ('MISSED' if perf else 'FAIL  ')} {'[perf] ' if perf else ''}{c}: {v}")
    print(f"\nbench_drop_in: {args.gib} GiB in {N_TENSORS} tensors on {device}, {time.perf_counter() - t0:.0f} s "
          "(best of cycles 2-4)")
    print("| phase | pause host ms | resume host ms | pause discard ms | resume discard ms | held paused MiB |")
    print("|---|---|---|---|---|---|")
    pin = res["pinned"]
    if pin is not None:
        print(f"| pinned copy (D2H / H2D) | {pin['d2h_s'] * 1e3:.0f} | {pin['h2d_s'] * 1e3:.0f} | | | |")
    for key in ("dfa_torch", "dfa_preload", "tms", "tms_retain"):
        r = res[key]
        if r is None:
            print(f"| {LABELS[key]} | failed | | | | |")
            continue
        label = LABELS[key] + (f" (hook_mode {r['hook_mode']})" if key.startswith("tms") else "")
        print(f"| {label} | {r['host_pause_s'] * 1e3:.0f} | {r['host_resume_s'] * 1e3:.0f} | "
              f"{r['discard_pause_s'] * 1e3:.0f} | {r['discard_resume_s'] * 1e3:.0f} | {r['held_paused'] / MIB:.0f} |")
    n_fail = sum(1 for *_, ok, perf in checks if not ok and not perf)
    n_missed = sum(1 for *_, ok, perf in checks if not ok and perf)
    print(f"{len(checks) - n_fail - n_missed} of {len(checks)} checks ok, {n_missed} performance targets missed, "
          f"{n_fail} failed")
    return 1 if n_fail else 0


if __name__ == "__main__":
    sys.exit(main())
