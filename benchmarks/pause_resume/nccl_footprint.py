#!/usr/bin/env python3
"""Device memory of single-rank NCCL communicators: what a trainer of one GPU holds outside
every allocator, asleep or not, and what gives it back.

A Megatron trainer on one GPU still runs its collectives through NCCL, one communicator per
process group it uses (the data-parallel group, the model-parallel group of the grad norm,
...), each created at its first collective.  No pause of torch_memory_saver or deferalloc
covers that memory: NCCL allocates it itself.  This measures it, one process per
configuration (the device's used bytes from cuMemGetInfo, the process alone on the GPU):

  lazy            init_process_group("nccl"): each group's communicator made at its first
                  collective (what megatron-core's initialize_model_parallel gets by default)
  eager           init_process_group("nccl", device_id=...): later groups split from the
                  default communicator (ncclCommSplit)
  eager+share     eager, with NCCL_COMM_SPLIT_SHARE_RESOURCES=1: the split communicators share
                  the parent's buffers
  cumem0          lazy, NCCL_CUMEM_ENABLE=0: NCCL's buffers from cudaMalloc, not cuMem
                  (SGLang's and slime's setting): smaller?
  cumem0+preload  cumem0 with libdeferalloc_preload.so in LD_PRELOAD: how much of NCCL's
                  memory reaches a preload hook's cudaMalloc (the hook's backed bytes beyond
                  torch's reserved ones; NCCL's wheel links cudart statically, so expect none)
  small           lazy, NCCL_BUFFSIZE=1 MiB and one channel (NCCL_MIN/MAX_NCHANNELS=1)
  destroy_recreate
                  lazy, then three sleeps as slime and Miles sleep their trainer
                  (destroy_process_groups before torch_memory_saver.pause, re-created at
                  wake): the subgroups destroyed (the default group kept; measured while
                  still referenced and once not), then every group; then all re-created,
                  one collective each and the check below
  cumem0+destroy_recreate   both
  abort_reuse     lazy, then each group's NCCL backend shut down, the same group objects
                  asked for a collective again (does ProcessGroupNCCL make a new
                  communicator, so that no wrapper has to swap the groups?)
  suspend         lazy, then ncclCommSuspend(comm, NCCL_SUSPEND_MEM) of every group's
                  communicator (ProcessGroupNCCL._comm_ptr), ncclCommResume, the check:
                  NCCL >= 2.29.7 only (vLLM's and verl's way); skipped on an older NCCL
                  unless --nccl-lib names a newer libnccl.so.2, preloaded for this child
  gloo            init_process_group("gloo") and gloo groups, CUDA tensors: no NCCL at all
                  (which of the three collectives gloo serves on CUDA tensors; the CPU
                  emulation of the RL example runs megatron-core on gloo already)

    python3 benchmarks/pause_resume/nccl_footprint.py [--groups 4] [--configs lazy,cumem0,...]
        [--json OUT.json] [--nccl-lib /path/libnccl.so.2] [--preload-lib /path/libdeferalloc_preload.so]
    python3 benchmarks/pause_resume/nccl_footprint.py --selftest     # no GPU: the parsing and the rows

Each row: the MiB the process holds beyond its CUDA context (and torch's reserved bytes) after
the first collective on 1..N groups, and after destroy_process_group (the group objects still
referenced, then unreferenced and collected: the memory of a destroyed group went with its
last reference in older torch).  The configurations
added after the first three also record whether the collectives megatron-core's
DistributedOptimizer uses (all_reduce, all_gather_into_tensor, reduce_scatter_tensor) give the
right answer on every group (``works``, and ``works_after`` once released and brought back),
and NCCL's own account of its device allocations (NCCL_DEBUG_SUBSYS=ALLOC into a file: the
bytes each call site asked for, before cuMem's rounding to its granularity).  The JSON is
rewritten after every configuration, so a call cut short keeps what ran.  Needs one GPU
(exit 77 without one).

Note [Giving NCCL's memory back]
Rationale: the RL trainer's target asleep is its CUDA context + 256 MiB, and NCCL's
communicators hold several times that outside every allocator.  Stacks answer it three ways:
slime and Miles destroy their NCCL subgroups before torch_memory_saver.pause() and make them
again at wake (slime/utils/reloadable_process_group.py, wrapping dist.new_group so that the
groups megatron-core holds stay valid objects; single-rank groups and the default group are
left alone); vLLM (opt-in), SGLang and verl (proposed) call ncclCommSuspend/Resume of NCCL
2.29.7; slime and SGLang run with NCCL_CUMEM_ENABLE=0, for compatibility, not memory.
Approach: one child process per configuration, alone on the GPU, so each figure is that
configuration's own; the child writes its figures to a file after every phase, which the
parent reads even when the child fails or runs out of time.
Limits: one rank only (the colocated RL example's trainer); a real trainer destroying its
groups must re-create megatron-core's groups in place (slime's wrapper) -- this measures the
memory and the collectives, not that plumbing; timings include NCCL's init of a 1-rank
communicator, not a bootstrap across ranks.
"""
from __future__ import annotations

import argparse
import gc
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench_json  # noqa: E402

MIB = 1 << 20
# Each configuration's environment; what the child does follows from its name (eager init
# for "eager*", the phases after the groups for the names that carry them).
CONFIGS = {
    "lazy": {},
    "eager": {},
    "eager+share": {"NCCL_COMM_SPLIT_SHARE_RESOURCES": "1"},
    "cumem0": {"NCCL_CUMEM_ENABLE": "0"},
    "cumem0+preload": {"NCCL_CUMEM_ENABLE": "0"},
    "small": {"NCCL_BUFFSIZE": str(1 << 20), "NCCL_MIN_NCHANNELS": "1", "NCCL_MAX_NCHANNELS": "1"},
    "destroy_recreate": {},
    "cumem0+destroy_recreate": {"NCCL_CUMEM_ENABLE": "0"},
    "abort_reuse": {},
    "suspend": {},
    "gloo": {},
}
FIRST = ("lazy", "eager", "eager+share")  # measured as before: no checks, no NCCL log
CYCLES = 3  # destroy_recreate's sleeps
PORTS_PER_CONFIG = 8  # the default group's rendezvous: one port per (re)creation
NCCL_SUSPEND_MEM = 0x01  # nccl.h (2.29.7+)
ALLOC_LINE = re.compile(r"NCCL INFO (\S+) Cuda Alloc Size (\d+) pointer")


# ---- NCCL's allocation log --------------------------------------------------------------------

def parse_alloc_log(text: str) -> dict:
    """NCCL's device allocations in an NCCL_DEBUG_SUBSYS=ALLOC log: bytes and count in all,
    and by call site (file:line as NCCL prints it; host allocations are not counted)."""
    total, count, sites = 0, 0, {}
    for m in ALLOC_LINE.finditer(text):
        site, size = m.group(1), int(m.group(2))
        total, count = total + size, count + 1
        s = sites.setdefault(site, [0, 0])
        s[0], s[1] = s[0] + size, s[1] + 1
    return {"bytes": total, "count": count, "sites": sites}


def alloc_log_env(directory: str, config: str) -> dict:
    """The environment that makes NCCL log its allocations into a file of this child's (line
    buffered: NCCL_DEBUG_FILE), unless NCCL_DEBUG is set already."""
    if os.environ.get("NCCL_DEBUG"):
        return {}
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", config)
    return {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "ALLOC",
            "NCCL_DEBUG_FILE": os.path.join(directory, f"{safe}.%p.log")}


def read_alloc_log() -> dict | None:
    path = os.environ.get("NCCL_DEBUG_FILE")
    if not path:
        return None
    path = path.replace("%p", str(os.getpid())).replace("%h", "*")
    found = glob.glob(path)
    if not found:
        return {"bytes": 0, "count": 0, "sites": {}}
    with open(found[0], errors="replace") as f:
        return parse_alloc_log(f.read())


# ---- the child --------------------------------------------------------------------------------

def nccl_library():
    """The libnccl this process loaded (torch's), by ctypes, or None."""
    import ctypes
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "libnccl" in line and "/" in line}
    for p in sorted(paths):
        try:
            return ctypes.CDLL(p)
        except OSError:
            continue
    return None


def child(config: str, groups: int, port: int, out: str, cpu: bool = False) -> dict:
    """One configuration's phases, its figures saved to ``out`` after each.  ``cpu``: gloo on
    CPU tensors, every memory figure 0 (the selftest's run of the phases' logic)."""
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dev = torch.device("cpu") if cpu else torch.device("cuda", 0)
    backend = "gloo" if cpu or config == "gloo" else "nccl"
    if not cpu:
        torch.cuda.set_device(0)
        torch.empty(1, device=dev)
    r: dict = {}
    checked = config not in FIRST

    def sync() -> None:
        if not cpu:
            torch.cuda.synchronize()

    def reserved() -> int:
        return 0 if cpu else torch.cuda.memory_reserved()

    def used() -> int:
        if cpu:
            return 0
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info(0)
        return total - free

    def beyond() -> int:
        return used() - r["context"] - reserved()

    def save() -> None:
        if out:
            with open(out + ".tmp", "w") as f:
                json.dump(r, f)
            os.replace(out + ".tmp", out)

    def note(key: str, value) -> None:
        r[key] = value
        save()

    def log_now(key: str) -> None:
        if checked:
            log = read_alloc_log()
            if log is not None:
                r.setdefault("nccl_logged", {})[key] = {"bytes": log["bytes"], "count": log["count"]}
                save()

    dfa = None
    if config.endswith("+preload"):
        import deferalloc
        dfa = deferalloc

    def through_hook() -> int:
        """The preload hook's backed bytes beyond torch's reserved ones."""
        st = dfa.memory_stats()
        return st.get("deferalloc.backed_bytes", 0) - reserved()

    note("context", used())
    kw = {"device_id": dev} if config.startswith("eager") and not cpu else {}
    x = torch.ones(1 << 20, device=dev)

    def make_groups(p: int) -> list:
        os.environ["MASTER_PORT"] = str(p)
        dist.init_process_group(backend, **kw)
        return [None] + [dist.new_group([0]) for _ in range(groups - 1)]

    def works(pgs: list) -> tuple[bool, str]:
        """all_reduce, all_gather_into_tensor and reduce_scatter_tensor on every group: on one
        rank each gives its input back.  The answer, and what failed (each collective once)."""
        n = 1 << 16
        src = torch.arange(n, device=dev, dtype=torch.float32)
        ops = {"all_reduce": lambda o, g: (o.copy_(src), dist.all_reduce(o, group=g)),
               "all_gather_into_tensor": lambda o, g: dist.all_gather_into_tensor(o, src, group=g),
               "reduce_scatter_tensor": lambda o, g: dist.reduce_scatter_tensor(o, src, group=g)}
        failed = {}
        for op, fn in ops.items():
            for g in pgs:
                try:
                    o = torch.full((n,), -1.0, device=dev)
                    fn(o, g)
                    sync()
                    if not torch.equal(o, src):
                        failed[op] = "a wrong answer"
                except Exception as e:  # noqa: BLE001 - the check's answer
                    failed[op] = f"{type(e).__name__}: {e}"[:300]
                if op in failed:
                    break
        return not failed, "; ".join(f"{op}: {why}" for op, why in failed.items())

    t0 = time.perf_counter()
    pgs = make_groups(port)
    after = []
    for k, g in enumerate(pgs, 1):
        dist.all_reduce(x, group=g)
        after.append(beyond())
        note("after_groups", after)
        log_now(f"{k} group(s)")
        if dfa is not None:
            r.setdefault("through_hook", []).append(through_hook())
            save()
    r["init_s"] = time.perf_counter() - t0
    if checked:
        ok, why = works(pgs)
        r["works"], r["works_error"] = ok, why
        note("after_checks", beyond())
        log_now("checks")

    if "destroy_recreate" in config:
        r["cycles"] = []
        for c in range(CYCLES):
            row: dict = {}
            t0 = time.perf_counter()
            for g in pgs[1:]:
                dist.destroy_process_group(g)
            spent = time.perf_counter() - t0  # the destroy calls alone, not the measuring
            row["after_destroy_subgroups_held"] = beyond()  # the group objects still referenced
            pgs, g = pgs[:1], None
            gc.collect()
            row["after_destroy_subgroups"] = beyond()
            t0 = time.perf_counter()
            dist.destroy_process_group()
            row["destroy_s"] = spent + time.perf_counter() - t0
            pgs = None
            gc.collect()
            row["after_destroy"] = beyond()
            t0 = time.perf_counter()
            pgs = make_groups(port + 1 + c)
            for g in pgs:
                dist.all_reduce(x, group=g)
            sync()
            row["recreate_s"] = time.perf_counter() - t0
            row["works_after"], row["works_error"] = works(pgs)
            row["after_recreate"] = beyond()
            r["cycles"].append(row)
            save()
        r["works_after"] = all(row["works_after"] for row in r["cycles"])
        log_now("cycles")
    elif config == "abort_reuse":
        t0 = time.perf_counter()
        errors = []
        for g in pgs:
            try:
                (g or dist.group.WORLD)._get_backend(dev).shutdown()
            except Exception as e:  # noqa: BLE001 - recorded
                errors.append(f"shutdown: {type(e).__name__}: {e}"[:300])
        r["shutdown_s"] = time.perf_counter() - t0
        r["shutdown_errors"] = errors
        note("after_shutdown", beyond())
        ok, why = works(pgs)
        r["works_after"], r["works_error_after"] = ok, why
        note("after_reuse", beyond())
    elif config == "suspend":
        lib = nccl_library()
        if cpu or lib is None or not hasattr(lib, "ncclCommSuspend"):
            version = "none" if cpu else ".".join(map(str, torch.cuda.nccl.version()))
            note("skipped", f"NCCL {version} has no ncclCommSuspend (NCCL 2.29.7+; --nccl-lib names a newer one)")
        else:
            import ctypes
            lib.ncclCommSuspend.argtypes, lib.ncclCommSuspend.restype = [ctypes.c_void_p, ctypes.c_int], ctypes.c_int
            lib.ncclCommResume.argtypes, lib.ncclCommResume.restype = [ctypes.c_void_p], ctypes.c_int
            comms = [(g or dist.group.WORLD)._get_backend(dev)._comm_ptr() for g in pgs]
            sync()
            t0 = time.perf_counter()
            rcs = [lib.ncclCommSuspend(ctypes.c_void_p(cm), NCCL_SUSPEND_MEM) for cm in comms]
            r["suspend_s"], r["suspend_rc"] = time.perf_counter() - t0, rcs
            note("after_suspend", beyond())
            t0 = time.perf_counter()
            r["resume_rc"] = [lib.ncclCommResume(ctypes.c_void_p(cm)) for cm in comms]
            r["resume_s"] = time.perf_counter() - t0
            note("after_resume", beyond())
            ok, why = works(pgs)
            r["works_after"], r["works_error_after"] = ok, why
            save()
    if config == "abort_reuse":
        # Its groups were shut down: destroy_process_group may refuse, which is not a result.
        try:
            dist.destroy_process_group()
        except Exception as e:  # noqa: BLE001 - recorded
            r["destroy_error"] = f"{type(e).__name__}: {e}"[:300]
    else:
        dist.destroy_process_group()
    r["after_destroy"] = beyond()
    # destroy_process_group with the group objects still referenced, then without them: a
    # group's memory went with its last reference in older torch.
    pgs = g = None
    gc.collect()
    r["after_destroy_dropped"] = beyond()
    r["torch_reserved"] = reserved()
    log_now("destroyed")
    if checked:
        log = read_alloc_log()
        if log is not None:
            top = sorted(log["sites"].items(), key=lambda kv: -kv[1][0])[:16]
            r["nccl_logged_sites"] = {site: {"bytes": b, "count": n} for site, (b, n) in top}
    save()
    return r


# ---- the parent -------------------------------------------------------------------------------

def rows(name: str, r: dict) -> list[dict]:
    """The bench_json results of one configuration's run (the first three configurations'
    rows as they always were)."""
    res = bench_json.result
    out = [res(f"{name}: held beyond the context, {k} group(s)", v / MIB, "MiB")
           for k, v in enumerate(r.get("after_groups", []), 1)]
    if "after_destroy" in r:
        out.append(res(f"{name}: held beyond the context, destroyed", r["after_destroy"] / MIB, "MiB"))
    if "after_destroy_dropped" in r:
        out.append(res(f"{name}: held beyond the context, destroyed and unreferenced",
                       r["after_destroy_dropped"] / MIB, "MiB"))
    if name in FIRST:
        return out
    logged = r.get("nccl_logged", {})
    n = len(r.get("after_groups", []))
    if f"{n} group(s)" in logged:
        out.append(res(f"{name}: NCCL's logged device allocations, {n} group(s)",
                       logged[f"{n} group(s)"]["bytes"] / MIB, "MiB"))
    if r.get("through_hook"):
        out.append(res(f"{name}: through the preload hook beyond torch's reserved, {n} group(s)",
                       r["through_hook"][-1] / MIB, "MiB"))
    for c, row in enumerate(r.get("cycles", []), 1):
        out += [res(f"{name}: held beyond the context, subgroups destroyed, still referenced, sleep {c}",
                    row["after_destroy_subgroups_held"] / MIB, "MiB"),
                res(f"{name}: held beyond the context, subgroups destroyed (default kept), sleep {c}",
                    row["after_destroy_subgroups"] / MIB, "MiB"),
                res(f"{name}: held beyond the context, all destroyed, sleep {c}", row["after_destroy"] / MIB, "MiB"),
                res(f"{name}: held beyond the context, re-created, wake {c}", row["after_recreate"] / MIB, "MiB"),
                res(f"{name}: destroy every group, sleep {c}", 1e3 * row["destroy_s"], "ms"),
                res(f"{name}: re-create + first collectives, wake {c}", 1e3 * row["recreate_s"], "ms")]
    for key, what in (("after_shutdown", "backends shut down"), ("after_suspend", "suspended"),
                      ("after_resume", "resumed")):
        if key in r:
            out.append(res(f"{name}: held beyond the context, {what}", r[key] / MIB, "MiB"))
    for key, what in (("suspend_s", "suspend every communicator"), ("resume_s", "resume every communicator")):
        if key in r:
            out.append(res(f"{name}: {what}", 1e3 * r[key], "ms"))
    return out


def summary_line(name: str, r: dict) -> str:
    if "skipped" in r:
        return f"{name:24s} skipped: {r['skipped']}"
    text = f"{name:24s} context {r.get('context', 0) / MIB:5.0f} MiB | beyond it, 1..N groups: " + " ".join(
        f"{v / MIB:5.0f}" for v in r.get("after_groups", []))
    if "after_destroy" in r:
        text += f" | destroyed {r['after_destroy'] / MIB:5.0f}"
    if "after_destroy_dropped" in r:
        text += f", unreferenced {r['after_destroy_dropped'] / MIB:5.0f}"
    text += " MiB"
    if "works" in r:
        text += f" | collectives {'right' if r['works'] else 'WRONG: ' + r.get('works_error', '')}"
    if "works_after" in r:
        text += f", after release {'right' if r['works_after'] else 'WRONG'}"
    for c, row in enumerate(r.get("cycles", []), 1):
        text += (f"\n{'':24s} sleep {c}: subgroups destroyed {row['after_destroy_subgroups_held'] / MIB:5.0f}, "
                 f"unreferenced {row['after_destroy_subgroups'] / MIB:5.0f}, all gone "
                 f"{row['after_destroy'] / MIB:5.0f}, re-created {row['after_recreate'] / MIB:5.0f} MiB; destroy "
                 f"{1e3 * row['destroy_s']:.0f} ms, re-create {1e3 * row['recreate_s']:.0f} ms")
    for key in ("after_shutdown", "after_suspend", "after_resume"):
        if key in r:
            text += f" | {key[6:]} {r[key] / MIB:5.0f} MiB"
    n = len(r.get("after_groups", []))
    logged = r.get("nccl_logged", {}).get(f"{n} group(s)")
    if logged:
        text += f" | NCCL logged {logged['bytes'] / MIB:.0f} MiB in {logged['count']} allocations"
    if r.get("through_hook"):
        text += f" | through the hook {r['through_hook'][-1] / MIB:.0f} MiB"
    if "error" in r:
        text += f" | FAILED: {r['error'][-300:]}"
    return text


def preload_library(explicit: str | None) -> str | None:
    """libdeferalloc_preload.so: --preload-lib, else beside $DEFERALLOC_LIB."""
    if explicit:
        return explicit if os.path.isfile(explicit) else None
    lib = os.environ.get("DEFERALLOC_LIB")
    if lib:
        p = os.path.join(os.path.dirname(lib), "libdeferalloc_preload.so")
        if os.path.isfile(p):
            return p
    return None


def config_env(name: str, args, logs: str) -> tuple[dict | None, str]:
    """The child's environment, or (None, why it is skipped)."""
    env = {**os.environ, **CONFIGS[name]}
    if name not in FIRST:
        env.update(alloc_log_env(logs, name))
    if name.endswith("+preload"):
        lib = preload_library(args.preload_lib)
        if lib is None:
            return None, "no libdeferalloc_preload.so (--preload-lib, or DEFERALLOC_LIB's directory)"
        env["LD_PRELOAD"] = lib + (":" + env["LD_PRELOAD"] if env.get("LD_PRELOAD") else "")
        env.setdefault("DEFERALLOC_CONF", "driver:cuda")
    if name == "suspend" and not args.nccl_lib and args.nccl_version < (2, 29, 7):
        return None, (f"NCCL {'.'.join(map(str, args.nccl_version))} has no ncclCommSuspend (2.29.7+); "
                      "--nccl-lib names a newer libnccl.so.2")
    if name == "suspend" and args.nccl_lib:
        env["LD_PRELOAD"] = args.nccl_lib + (":" + env["LD_PRELOAD"] if env.get("LD_PRELOAD") else "")
    return env, ""


def run_config(name: str, index: int, args, logs: str) -> dict:
    env, why = config_env(name, args, logs)
    if env is None:
        return {"skipped": why}
    out = os.path.join(logs, f"run{index}.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--groups", str(args.groups),
           "--port", str(args.port + PORTS_PER_CONFIG * index), "--out", out]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.child_timeout)
        rc, err = p.returncode, p.stderr
    except subprocess.TimeoutExpired as e:
        rc, err = "timeout", (e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr or "")
    r = {}
    if os.path.exists(out):
        with open(out) as f:
            r = json.load(f)
    r["wall_s"] = time.perf_counter() - t0
    if rc != 0:
        r["error"] = f"rc {rc}: {err[-2000:]}"
    return r


def document(results: list, runs: dict, device: str, nccl: str) -> dict:
    return bench_json.document("nccl_footprint", results, device, extra={"runs": runs, "nccl": nccl})


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated, of: " + ", ".join(CONFIGS))
    ap.add_argument("--json")
    ap.add_argument("--nccl-lib", help="the suspend configuration: a libnccl.so.2 of NCCL 2.29.7+, preloaded")
    ap.add_argument("--preload-lib", help="cumem0+preload: libdeferalloc_preload.so (default: beside $DEFERALLOC_LIB)")
    ap.add_argument("--child-timeout", type=float, default=120.0, help="seconds for one configuration's process")
    ap.add_argument("--selftest", action="store_true", help="no GPU: the log parser and the rows")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--cpu", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=29611, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.groups, args.port, args.out, cpu=args.cpu)))
        return 0
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown or not names:
        ap.error(f"--configs: unknown {unknown} (known: {', '.join(CONFIGS)})")
    if args.selftest:
        return selftest()
    import torch
    if not torch.cuda.is_available():
        print("nccl_footprint: no CUDA device visible; nothing measured")
        return 77
    args.nccl_version = tuple(torch.cuda.nccl.version())
    nccl = ".".join(map(str, args.nccl_version))
    device = torch.cuda.get_device_name(0)
    results, runs = [], {}
    with tempfile.TemporaryDirectory(prefix="nccl_footprint_") as logs:
        for name in names:
            r = run_config(name, list(CONFIGS).index(name), args, logs)
            runs[name] = r
            results += rows(name, r)
            print(summary_line(name, r), flush=True)
            if args.json:  # after every configuration: a call cut short keeps what ran
                with open(args.json, "w") as f:
                    json.dump(document(results, runs, device, nccl), f, indent=1)
    return 0


def selftest() -> int:
    """The parser on NCCL's log lines, every configuration's rows from a made-up run (valid
    bench_json, unique names), the summary lines; no GPU, no torch."""
    failures = []

    def check(what: str, ok: bool) -> None:
        print(f"{'ok  ' if ok else 'FAIL'} {what}")
        if not ok:
            failures.append(what)

    log = ("h:1:2 [0] NCCL INFO channel.cc:40 Cuda Alloc Size 4096 pointer 0x7f00\n"
           "h:1:2 [0] NCCL INFO init.cc:1670 Cuda Host Alloc Size 4 pointer 0x204a00000\n"
           "h:1:2 [0] NCCL INFO channel.cc:40 Cuda Alloc Size 8192 pointer 0x7f01\n"
           "h:1:2 [0] NCCL INFO proxy.cc:9 Cuda Alloc Size 2097152 pointer 0x7f02\n")
    p = parse_alloc_log(log)
    check("alloc log: device bytes and count, host allocations left out",
          p["bytes"] == 4096 + 8192 + 2097152 and p["count"] == 3)
    check("alloc log: by call site", p["sites"].get("channel.cc:40") == [12288, 2] and len(p["sites"]) == 2)
    env = alloc_log_env("/tmp/x", "cumem0+preload")
    check("alloc log: one file per child, %p kept for NCCL",
          not env or (env["NCCL_DEBUG_SUBSYS"] == "ALLOC" and env["NCCL_DEBUG_FILE"].endswith("cumem0_preload.%p.log")))
    groups = [600 * MIB, 1000 * MIB]
    cycle = {"after_destroy_subgroups_held": 900 * MIB, "after_destroy_subgroups": 600 * MIB,
             "after_destroy": 260 * MIB, "after_recreate": 1000 * MIB, "destroy_s": 0.01,
             "recreate_s": 0.4, "works_after": True, "works_error": ""}
    made_up = {"context": 500 * MIB, "after_groups": groups, "after_destroy": 268 * MIB, "torch_reserved": 0,
               "after_destroy_dropped": 260 * MIB,
               "works": True, "works_error": "", "nccl_logged": {"2 group(s)": {"bytes": 90 * MIB, "count": 40}},
               "through_hook": [0, 0], "cycles": [cycle, cycle], "after_shutdown": 300 * MIB,
               "after_suspend": 270 * MIB, "after_resume": 1000 * MIB, "suspend_s": 0.001, "resume_s": 0.002,
               "works_after": True}
    results, runs = [], {}
    for name in CONFIGS:
        results += rows(name, made_up)
        runs[name] = made_up
        line = summary_line(name, made_up)
        check(f"{name}: a summary line", line.startswith(name))
    first = rows("lazy", made_up)
    check("the first configurations' rows as before (groups, destroyed)",
          [r["name"] for r in first][:3] == ["lazy: held beyond the context, 1 group(s)",
                                             "lazy: held beyond the context, 2 group(s)",
                                             "lazy: held beyond the context, destroyed"])
    try:
        document(results, runs, "cpu", "0.0.0")
        check(f"{len(results)} rows of every configuration: a valid bench_json document", True)
    except ValueError as e:
        print(e)
        check("a valid bench_json document", False)
    skipped = {"skipped": "no"}
    check("a skipped configuration: one line saying why",
          summary_line("suspend", skipped).endswith("skipped: no") and rows("suspend", skipped) == [])
    phases_on_cpu(check)
    print(f"nccl_footprint selftest: {len(failures)} failed")
    return 1 if failures else 0


def phases_on_cpu(check) -> None:
    """The children's phases on gloo and CPU tensors (where torch imports): the collectives'
    check passes, destroy_recreate's three sleeps re-create working groups, abort_reuse
    records its answer either way, suspend says why it is skipped."""
    try:
        import torch  # noqa: F401
    except ImportError:
        print("skip the phases on the CPU: torch is not importable")
        return
    import socket
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        port = so.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="nccl_footprint_selftest_") as d:
        for i, name in enumerate(("destroy_recreate", "abort_reuse", "suspend")):
            out = os.path.join(d, f"{i}.json")
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", name, "--cpu", "--groups", "2",
                                "--port", str(port + PORTS_PER_CONFIG * i), "--out", out],
                               capture_output=True, text=True, timeout=300)
            r = {}
            if os.path.exists(out):
                with open(out) as f:
                    r = json.load(f)
            if p.returncode != 0:
                print(p.stderr[-3000:])
            check(f"{name} on the CPU: ran, two groups, the collectives right",
                  p.returncode == 0 and len(r.get("after_groups", [])) == 2 and r.get("works") is True)
            if name == "destroy_recreate":
                check("destroy_recreate on the CPU: three sleeps, each wake's groups right",
                      len(r.get("cycles", [])) == CYCLES and r.get("works_after") is True)
            elif name == "abort_reuse":
                check("abort_reuse on the CPU: the reuse's answer recorded",
                      "works_after" in r and "after_shutdown" in r)
            else:
                check("suspend on the CPU: skipped, with the reason", "ncclCommSuspend" in r.get("skipped", ""))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
