"""StreamedAdamW's file tier against the disk: the dd bound and the synchronous O_DIRECT baseline, one table.

Rows, all in one process on one directory (--dir, default /tmp):

  fp32:      the file tier's plain step (FP32 moments), --warm + --steps iterations of a stack
             of BF16 Linear layers (forward, backward, step), the step timed alone; its bytes
             each way are the engine's (stats(): bytes_to_device, read from the state file,
             and bytes_from_device, written to it);
  dd:        dd with direct I/O writing then reading exactly those bytes (bs 64 MiB, the target
             preallocated as the state file is, conv=fsync as a commit), and both at once.
             The bound is the faster of the two ways: write time + read time (a disk that
             serves one direction at a time) or the time of both at once (one that serves
             both); the printed ratio at-once / sum says which the disk is;
  baseline:  the synchronous per-bucket O_DIRECT step (odirect_baseline.py: one 256 MiB pinned
             staging buffer, FP32 main + exp_avg + exp_avg_sq read, torch._fused_adamw_ on the
             GPU, written back, bucket after bucket on the calling thread), same model, same
             gradients, same directory;
  bf16, int8: the file tier's plain step with compressed moments (moment_dtype);
  overlap:   the file tier with deferalloc.overlap.overlap_with_backward (FP32 moments): the
             iteration against the plain one's, and its parameters against the plain step's.

Each row starts from the same parameters and batch, so the file tier's FP32 step and the
baseline compute the same update: on CUDA their parameters after the run are compared bit for
bit (StreamedAdamW's arithmetic is torch's fused CUDA AdamW's), and the overlap's against the
plain step's everywhere.  Between rows the state files are removed; at most one state file
and its dd copies exist at a time (the sizes are printed first and checked against the free
space).  --budget-s S: a row that would end past S seconds is not run (a failed check says so),
so the table and JSON always come.  Prints a table last (ms per step, GB/s of disk traffic,
ratio to the bound and to the baseline); exit status 1 when a check fails, 2 without a GPU.
--json PATH writes the schema of benchmarks/bench_json.py.  --smoke: tiny sizes on the CPU
(host driver; ctest bench_file_tier_smoke), asserting the correctness checks only.

    DEFERALLOC_LIB=build-gpu/allocator/libdeferalloc.so \\
    DEFERALLOC_OPTIMIZER_LIB=build-gpu/optimizer/libdeferalloc_optimizer.so PYTHONPATH=python \\
      python3 benchmarks/optimizer/bench_file_tier.py --dir /tmp --json out/bench_file_tier.json
"""
import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_harness import BudgetSpent, Harness  # noqa: E402
from odirect_baseline import ALIGN, ODirectAdamW  # noqa: E402

ROWS = ("fp32", "dd", "baseline", "bf16", "int8", "overlap")
# The acceptance: plain step / dd bound, plain step against the O_DIRECT baseline (x faster),
# compressed moments against the FP32 step (x faster), overlap iteration / plain iteration.
TARGETS = dict(file_vs_dd=0.9, file_vs_baseline=1.5, bf16_speedup=1.35, int8_speedup=1.7, overlap_vs_plain=1.0)
HP = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


class Bench(Harness):
    estimate_what = "the longest row"  # estimate_s: the longest row so far

    def __init__(self, a):
        super().__init__(a, cuda=not a.smoke)
        self.dev = torch.device("cuda" if self.cuda else "cpu")
        self.extra = {"smoke": a.smoke, "targets": TARGETS, "rows": {}, "engine_log": []}
        self.finals = {}  # row -> the parameters after its last step (the comparisons)

    def now(self):
        self.sync()
        return time.perf_counter()


# ---- the model: a stack of BF16 Linear layers -----------------------------------------------------

def build_model(B):
    a = B.a
    h = a.hidden
    layers = max(2, round(a.params / (h * h)))
    torch.manual_seed(0)
    dtype = dict(bf16=torch.bfloat16, fp32=torch.float32)[a.param_dtype]
    with torch.device(B.dev):
        model = torch.nn.Sequential(*[torch.nn.Linear(h, h, bias=False) for _ in range(layers)])
        # Weights of std 1/sqrt(h) keep the activations' scale through the stack, so that the
        # gradients stay far above eps and each step moves the BF16 parameters by an ulp or so
        # (the comparisons between rows then compare updates, not unchanged values).
        for layer in model:
            torch.nn.init.normal_(layer.weight, std=h ** -0.5)
        model = model.to(dtype)
    g = torch.Generator(device=B.dev).manual_seed(1)
    x = torch.randn(a.tokens, h, generator=g, device=B.dev).to(dtype)
    init = snapshot(model)
    return model, x, init


def restore(model, init):
    with torch.no_grad():
        for p, s in zip(model.parameters(), init):
            p.copy_(s)
            p.grad = None


def forward_backward(model, x):
    loss = model(x).float().square().mean()
    loss.backward()
    return loss.detach()


def snapshot(model):
    return [p.detach().clone() for p in model.parameters()]


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def close(a, b):
    """Within two BF16 ulps or so (the host driver's arithmetic against torch's CPU kernel)."""
    return all(torch.allclose(x.float(), y.float(), rtol=1e-2, atol=1e-5) for x, y in zip(a, b))


def max_diff(a, b):
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b))


# ---- rows ------------------------------------------------------------------------------------------

def engine_settings(B):
    s = ["keep_window:1"]
    if B.a.smoke:
        s.append("host_granularity_kb:64")
    return ",".join(s)


def run_streamed(B, name, moment_dtype="fp32", overlap=False):
    """The file tier's iterations; returns the row's figures (step and iteration ms, bytes
    each way from the engine's stats)."""
    from deferalloc.optim import StreamedAdamW
    from deferalloc.overlap import overlap_with_backward
    a = B.a
    model, x, init = B.model
    restore(model, init)
    d = tempfile.mkdtemp(prefix="dfa-filetier-", dir=a.dir)
    opt = ov = None
    try:
        opt = StreamedAdamW(model.parameters(), tier="file", directory=d, window_mb=a.window_mb,
                            moment_dtype=moment_dtype, settings=engine_settings(B), **HP)
        if overlap:
            ov = overlap_with_backward(model, opt, bucket_mb=a.bucket_mb)
        step_s, stats, t0 = [], None, None
        for it in range(a.warm + a.steps):
            if it == a.warm:
                if ov is not None:
                    ov.synchronize()  # the warm-up's last buckets
                t0 = B.now()
            forward_backward(model, x)
            if ov is not None:
                ov.step()
            else:
                s0 = B.now()
                opt.step()
                step_s.append(B.now() - s0)
            opt.zero_grad(set_to_none=True)
        if ov is not None:
            ov.synchronize()
        iteration_s = (B.now() - t0) / a.steps
        if moment_dtype == "fp32":  # (the rows compared)
            B.finals[name] = snapshot(model)
        stats = opt.stats()  # the last step's pass
        row = dict(iteration_ms=iteration_s * 1e3, state_bytes=stats["state_bytes"])
        if ov is not None:
            row["overlap_stats"] = ov.stats()
        else:
            timed = step_s[a.warm:]
            row.update(step_ms=sum(timed) / len(timed) * 1e3, step_ms_all=[t * 1e3 for t in timed],
                       bytes_read=stats["bytes_to_device"], bytes_written=stats["bytes_from_device"],
                       io_wait_s=stats["io_wait_seconds"], engine_seconds=stats["seconds"])
        return row
    finally:
        if ov is not None:
            ov.remove()
        del opt, ov
        B.free()
        shutil.rmtree(d, ignore_errors=True)


def run_baseline(B):
    a = B.a
    model, x, init = B.model
    restore(model, init)
    d = tempfile.mkdtemp(prefix="dfa-odirect-", dir=a.dir)
    opt = None
    try:
        opt = ODirectAdamW(model.parameters(), os.path.join(d, "state.bin"), staging_bytes=a.staging_mb << 20, **HP)
        step_s, t0 = [], None
        for it in range(a.warm + a.steps):
            if it == a.warm:
                t0 = B.now()
            forward_backward(model, x)
            s0 = B.now()
            opt.step()
            step_s.append(B.now() - s0)
            for p in model.parameters():
                p.grad = None
        iteration_s = (B.now() - t0) / a.steps
        B.finals["baseline"] = snapshot(model)
        r, w = opt.bytes_per_step()
        timed = step_s[a.warm:]
        return dict(step_ms=sum(timed) / len(timed) * 1e3, step_ms_all=[t * 1e3 for t in timed],
                    iteration_ms=iteration_s * 1e3, bytes_read=r, bytes_written=w, direct=opt.direct,
                    direct_refused=opt.reason, buckets=len(opt.buckets), staging_bytes=opt.staging_bytes)
    finally:
        if opt is not None:
            opt.close()
        del opt
        B.free()
        shutil.rmtree(d, ignore_errors=True)


# ---- dd: the disk's bound ------------------------------------------------------------------------

def _dd(args):
    t0 = time.perf_counter()
    subprocess.run(["dd", *args, "status=none"], check=True)
    return time.perf_counter() - t0


def _preallocate(path, nbytes):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    finally:
        os.close(fd)


def _chunks(nbytes, jobs):
    """(offset, length) of `jobs` consecutive pieces of nbytes, each a multiple of ALIGN."""
    step = -(-nbytes // jobs // ALIGN) * ALIGN
    return [(o, min(step, nbytes - o)) for o in range(0, nbytes, step)]


def _all_at_once(cmds):
    """Wall seconds of the dd commands run side by side."""
    t0 = time.perf_counter()
    procs = [subprocess.Popen(["dd", *c, "status=none"]) for c in cmds]
    if any([p.wait() for p in procs]):
        raise RuntimeError("dd failed: " + "; ".join(" ".join(c) for c in cmds))
    return time.perf_counter() - t0


def dd_bound(B, read_bytes, write_bytes):
    """Seconds of dd writing write_bytes (into a preallocated file, as the state file is,
    fsynced as a commit is) and reading read_bytes, with direct I/O: one after the other
    and both at once.  The bound: the faster of the two.  --dd-jobs N: each direction as N
    dd processes on consecutive ranges (more requests in flight)."""
    a = B.a
    bs = (1 << 20) if a.smoke else (64 << 20)
    rb, wb = (-(-n // ALIGN) * ALIGN for n in (read_bytes, write_bytes))
    d = tempfile.mkdtemp(prefix="dfa-dd-", dir=a.dir)
    src, dst = os.path.join(d, "read"), os.path.join(d, "write")
    direct, refused = "direct,", None
    try:
        try:
            _dd(["if=/dev/zero", f"of={src}", f"bs={ALIGN}", "count=1", "oflag=direct"])
        except (subprocess.CalledProcessError, FileNotFoundError) as e:
            refused = f"dd with oflag=direct failed in {a.dir} ({e}); buffered dd instead"
            print(f"  {refused}", flush=True)
            direct = ""

        def writes(path, nbytes):
            _preallocate(path, nbytes)
            return [["if=/dev/zero", f"of={path}", f"bs={bs}", f"count={n}", f"seek={o}", "iflag=count_bytes",
                     f"oflag={direct}seek_bytes", "conv=notrunc,fsync"] for o, n in _chunks(nbytes, a.dd_jobs)]

        def reads(path):
            return [[f"if={path}", "of=/dev/null", f"bs={bs}", f"count={n}", f"skip={o}",
                     f"iflag={direct}count_bytes,skip_bytes"] for o, n in _chunks(rb, a.dd_jobs)]

        write_s = _all_at_once(writes(src, wb))
        if rb > wb:  # the source must hold what is read (not timed)
            _all_at_once(writes(src, rb))
        read_s = _all_at_once(reads(src))
        at_once_s = _all_at_once(writes(dst, wb) + reads(src))
    finally:
        shutil.rmtree(d, ignore_errors=True)
    seq = write_s + read_s
    return dict(read_bytes=rb, write_bytes=wb, write_s=write_s, read_s=read_s, sequential_s=seq,
                at_once_s=at_once_s, bound_s=min(seq, at_once_s), at_once_over_sequential=at_once_s / seq,
                direct=refused is None, refused=refused, bs=bs, jobs=a.dd_jobs)


# ---- the run ---------------------------------------------------------------------------------------

def sizes(B):
    a = B.a
    model, _, _ = B.model
    n = sum(p.numel() for p in model.parameters())
    main = 0 if a.param_dtype == "fp32" else 4  # an FP32 parameter is its own main: not read
    per_slot = 12 * n
    s = dict(params=n, layers=len(model), hidden=a.hidden, param_dtype=a.param_dtype,
             expected_read_bytes=(8 + main) * n, expected_write_bytes=12 * n, state_file_bytes=2 * per_slot,
             baseline_file_bytes=12 * n)
    s["peak_disk_bytes"] = max(s["state_file_bytes"], s["expected_read_bytes"] + s["expected_write_bytes"],
                               s["baseline_file_bytes"])
    free = shutil.disk_usage(a.dir).free
    s["free_disk_bytes"] = free
    print(f"[sizes] {n / 1e9:.3f} G params ({len(model)} Linear layers {a.hidden}x{a.hidden}, {a.param_dtype}); "
          f"a step moves about {s['expected_read_bytes'] / 1e9:.2f} GB in, {s['expected_write_bytes'] / 1e9:.2f} GB "
          f"out (FP32 moments); state file {s['state_file_bytes'] / 1e9:.2f} GB (two slots), dd "
          f"{(s['expected_read_bytes'] + s['expected_write_bytes']) / 1e9:.2f} GB, baseline "
          f"{s['baseline_file_bytes'] / 1e9:.2f} GB, one at a time; {free / 1e9:.1f} GB free in {a.dir}", flush=True)
    return s


def dd_note(dd):
    """How the bound combines the read and the write, from the measured times."""
    r = dd["at_once_over_sequential"]
    if r >= 0.9:
        kind = ("the disk serves about one direction at a time (both at once took "
                f"{r:.2f}x the sum), so a step that reads and writes cannot beat the sum")
    else:
        kind = (f"the disk serves both directions at once (both at once took {r:.2f}x the sum of "
                "write and read), so the bound is the time of both at once")
    jobs = "" if dd["jobs"] == 1 else f" ({dd['jobs']} dd processes each way)"
    return (f"dd bound{jobs}: write {size(dd['write_bytes'])} in {dd['write_s']:.2f} s, read "
            f"{size(dd['read_bytes'])} in {dd['read_s']:.2f} s (sum {dd['sequential_s']:.2f} s), both at once "
            f"{dd['at_once_s']:.2f} s; the bound is the faster of the two, {dd['bound_s']:.2f} s: {kind}. "
            "The BF16 and int8 rows' bound is this one scaled by their bytes (the same disk rates).")


def size(nbytes):
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"


def summarize(B):
    """Results, checks and the table from the rows measured."""
    R = B.extra["rows"]
    fp32, dd, base = R.get("fp32"), R.get("dd"), R.get("baseline")
    table = []

    def gbps(row):
        return (row["bytes_read"] + row["bytes_written"]) / (row["step_ms"] / 1e3) / 1e9

    if dd:
        moved = dd["read_bytes"] + dd["write_bytes"]
        for key, what in (("write_s", f"dd write {size(dd['write_bytes'])}"),
                          ("read_s", f"dd read {size(dd['read_bytes'])}"),
                          ("sequential_s", "dd write then read"), ("at_once_s", "dd write and read at once")):
            B.result(what, dd[key] * 1e3, "ms")
            nb = dd["write_bytes"] if key == "write_s" else dd["read_bytes"] if key == "read_s" else moved
            table.append((what, dd[key] * 1e3, nb / dd[key] / 1e9, None, None))
        how = "write then read" if dd["sequential_s"] <= dd["at_once_s"] else "at once"
        B.extra.setdefault("notes", []).append(dd_note(dd))
        B.result("dd bound (the faster way)", dd["bound_s"] * 1e3, "ms")
        table.append((f"dd bound ({how}; at once / sum {dd['at_once_over_sequential']:.2f})", dd["bound_s"] * 1e3,
                      moved / dd["bound_s"] / 1e9, 1.0, None))
    if base:
        B.result("synchronous O_DIRECT baseline step", base["step_ms"], "ms",
                 "dd bound (the faster way)" if dd else None)
    for fmt in ("fp32", "bf16", "int8"):
        row = R.get(fmt)
        if not row:
            continue
        name = f"file tier step, {fmt} moments"
        B.result(name, row["step_ms"], "ms", "file tier step, fp32 moments" if fmt != "fp32" and fp32 else
                 "dd bound (the faster way)" if dd else None)
        B.result(f"{name}: disk traffic", gbps(row), "GB/s")
        bound_ratio = None
        if dd:
            # The bound for this row's bytes at the dd rates (the FP32 bytes' bound, scaled).
            scale = (row["bytes_read"] + row["bytes_written"]) / (dd["read_bytes"] + dd["write_bytes"])
            bound_ratio = dd["bound_s"] * scale / (row["step_ms"] / 1e3)
        table.append((name, row["step_ms"], gbps(row), bound_ratio,
                      base["step_ms"] / row["step_ms"] if base else None))
    if base:
        table.append(("synchronous O_DIRECT baseline step", base["step_ms"], gbps(base),
                      dd["bound_s"] / (base["step_ms"] / 1e3) if dd else None, 1.0))
    if fp32 and dd:
        q = dd["bound_s"] / (fp32["step_ms"] / 1e3)
        B.check("file tier plain step / dd bound (same bytes)", f"{q:.2f}x ({fp32['step_ms']:.0f} ms vs "
                f"{dd['bound_s'] * 1e3:.0f} ms)", f">= {TARGETS['file_vs_dd']}x", q >= TARGETS["file_vs_dd"], perf=True)
        B.check("dd bytes = the step's bytes (stats)", f"{dd['read_bytes']} in, {dd['write_bytes']} out",
                "rounded up to 4 KiB", dd["read_bytes"] - fp32["bytes_read"] < ALIGN and
                dd["write_bytes"] - fp32["bytes_written"] < ALIGN)
        B.check("dd with direct I/O", "yes" if dd["direct"] else dd["refused"], "yes", dd["direct"] or B.a.smoke)
    if fp32 and base:
        B.result("file tier step, fp32 moments, against the O_DIRECT baseline", fp32["step_ms"], "ms",
                 "synchronous O_DIRECT baseline step")
        q = base["step_ms"] / fp32["step_ms"]
        B.check("file tier plain step vs synchronous O_DIRECT baseline", f"{q:.2f}x faster ({fp32['step_ms']:.0f} "
                f"vs {base['step_ms']:.0f} ms)", f">= {TARGETS['file_vs_baseline']}x", q >= TARGETS["file_vs_baseline"],
                perf=True)
        B.check("baseline with direct I/O", "yes" if base["direct"] else base["direct_refused"], "yes",
                base["direct"] or B.a.smoke)
        changed = sum(not torch.equal(p, q) for p, q in zip(B.finals["fp32"], B.model[2]))
        B.check("parameters changed by the steps (file tier fp32)", f"{changed} of {len(B.model[2])} tensors",
                "all", changed == len(B.model[2]))
        ok = same(B.finals["fp32"], B.finals["baseline"])
        diff = max_diff(B.finals["fp32"], B.finals["baseline"])
        # Bit for bit on CUDA (torch's fused CUDA AdamW arithmetic); the host driver's CPU
        # arithmetic differs from torch's CPU kernel by a few ulp (docs/OPTIM.md).
        B.check("parameters: file tier fp32 == O_DIRECT baseline (torch fused AdamW)",
                "bit-identical" if ok else f"max |diff| {diff:.3g}", "bit-identical" if B.cuda else "within rtol 1e-2",
                ok if B.cuda else close(B.finals["fp32"], B.finals["baseline"]))
    for fmt, key in (("bf16", "bf16_speedup"), ("int8", "int8_speedup")):
        if fp32 and R.get(fmt):
            s = fp32["step_ms"] / R[fmt]["step_ms"]
            B.check(f"file tier step, {fmt} moments vs fp32", f"{s:.2f}x faster", f">= {TARGETS[key]}x",
                    s >= TARGETS[key], perf=True)
    ov = R.get("overlap")
    if ov and fp32:
        B.result("file tier iteration, fp32 plain", fp32["iteration_ms"], "ms")
        B.result("file tier iteration, fp32 + overlap", ov["iteration_ms"], "ms", "file tier iteration, fp32 plain")
        q = ov["iteration_ms"] / fp32["iteration_ms"]
        B.check("file tier: overlap / plain iteration", f"{q:.2f}x ({ov['iteration_ms']:.0f} vs "
                f"{fp32['iteration_ms']:.0f} ms)", f"<= {TARGETS['overlap_vs_plain']}x",
                q <= TARGETS["overlap_vs_plain"], perf=True)
        table.append(("file tier iteration, fp32 plain", fp32["iteration_ms"], None, None, None))
        table.append(("file tier iteration, fp32 + overlap", ov["iteration_ms"], None, None, None))
        ok = same(B.finals["fp32"], B.finals["overlap"])
        B.check("parameters: overlap == plain step", "bit-identical" if ok else "DIFFER", "bit-identical", ok)
        commits = ov.get("overlap_stats", {}).get("commits")
        B.check("overlap: commits", f"{commits} in {B.a.warm + B.a.steps} steps", "one per step",
                commits == B.a.warm + B.a.steps)
    return table


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=None, help="the directory on the disk to measure (default /tmp; --smoke: the "
                    "temp directory)")
    ap.add_argument("--params", type=float, default=None, help="parameters (default 0.5e9; --smoke 1e5)")
    ap.add_argument("--hidden", type=int, default=None, help="Linear layers' width (default 4096; --smoke 64)")
    ap.add_argument("--tokens", type=int, default=None, help="rows of the batch (default 512; --smoke 8)")
    ap.add_argument("--param-dtype", choices=("bf16", "fp32"), default="bf16",
                    help="the model's parameters (bf16: an FP32 main in the state, as Megatron's)")
    ap.add_argument("--warm", type=int, default=1, help="iterations before the timed ones (the first step "
                    "reads no moments)")
    ap.add_argument("--steps", type=int, default=2, help="timed iterations per row")
    ap.add_argument("--window-mb", type=int, default=None, help="StreamedAdamW's window (default 1024; --smoke "
                    "16: int8 moments on the file tier move pieces of 2^20 elements)")
    ap.add_argument("--bucket-mb", type=int, default=None, help="the overlap's buckets (default 256; --smoke 1)")
    ap.add_argument("--staging-mb", type=int, default=None, help="the baseline's staging buffer (default 256; "
                    "--smoke 1)")
    ap.add_argument("--dd-jobs", type=int, default=1, help="dd processes per direction, on consecutive ranges "
                    "(default 1: one 64 MiB request in flight each way)")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"of {', '.join(ROWS)} (dd needs fp32's bytes)")
    ap.add_argument("--budget-s", type=float, default=None, help="seconds for the whole run: a row that would end "
                    "later is not run (the table and JSON still come)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (host driver)")
    a = ap.parse_args()
    for k, full, smoke in (("params", 0.5e9, 1e5), ("hidden", 4096, 64), ("tokens", 512, 8), ("window_mb", 1024, 16),
                           ("bucket_mb", 256, 1), ("staging_mb", 256, 1)):
        if getattr(a, k) is None:
            setattr(a, k, smoke if a.smoke else full)
    a.dir = a.dir or (tempfile.gettempdir() if a.smoke else "/tmp")
    rows = [r for r in a.rows.split(",") if r]
    for r in rows:
        if r not in ROWS:
            print(f"unknown row {r!r} (rows: {', '.join(ROWS)})")
            return 2
    if not a.smoke and not torch.cuda.is_available():
        print("ERROR: bench_file_tier needs a CUDA device (--smoke runs tiny sizes on the CPU)", flush=True)
        return 2
    if not os.path.isdir(a.dir):
        print(f"ERROR: --dir {a.dir} is not a directory", flush=True)
        return 2
    # The engine says at INFO when the directory refuses O_DIRECT: kept with the results.
    log = logging.getLogger("deferalloc")
    log.setLevel(logging.INFO)

    class Keep(logging.Handler):
        def emit(self, record):
            msg = record.getMessage()
            if "O_DIRECT" in msg or "file tier" in msg:
                B.extra["engine_log"].append(msg)
                print(f"  engine: {msg}", flush=True)
    B = Bench(a)
    log.addHandler(Keep())
    t0 = time.perf_counter()
    B.model = build_model(B)
    B.extra["sizes"] = sz = sizes(B)
    if sz["peak_disk_bytes"] * 1.05 > sz["free_disk_bytes"]:
        print(f"ERROR: {a.dir} has {sz['free_disk_bytes'] / 1e9:.1f} GB free, the run needs "
              f"{sz['peak_disk_bytes'] / 1e9:.1f} GB at once (use --params)", flush=True)
        return 2
    R = B.extra["rows"]
    runs = dict(fp32=lambda: run_streamed(B, "fp32"), baseline=lambda: run_baseline(B),
                bf16=lambda: run_streamed(B, "bf16", moment_dtype="bf16"),
                int8=lambda: run_streamed(B, "int8", moment_dtype="int8"),
                overlap=lambda: run_streamed(B, "overlap", overlap=True))
    for key in ROWS:
        if key not in rows:
            continue
        t1 = time.perf_counter()
        print(f"[{key}]", flush=True)
        try:
            B.budget(key)
            if key == "dd":
                if "fp32" not in R:
                    B.check("row dd", "not run: it measures the fp32 row's bytes", "runs", False)
                    continue
                R["dd"] = dd_bound(B, R["fp32"]["bytes_read"], R["fp32"]["bytes_written"])
                print(f"  {dd_note(R['dd'])}", flush=True)
            else:
                R[key] = runs[key]()
            print("  " + json.dumps({k: v for k, v in R[key].items() if not isinstance(v, (list, dict))}), flush=True)
        except BudgetSpent as e:
            B.check(f"row {key}", f"cut short: {e}", "runs", False)
        except Exception as e:  # noqa: BLE001 (a failing row leaves the others' figures and the table)
            traceback.print_exc()
            B.check(f"row {key}", f"{type(e).__name__}: {str(e)[:160]}", "runs", False)
        took = time.perf_counter() - t1
        B.estimate_s = max(B.estimate_s, took)
        B.extra.setdefault("row_seconds", {})[key] = took
        print(f"[{key}] {took:.0f} s", flush=True)
    table = summarize(B)
    device = torch.cuda.get_device_name() if B.cuda else "cpu (host driver)"
    if a.json:
        B.extra.update(seconds=time.perf_counter() - t0,
                       table=[dict(row=n, ms=ms, gbps=gb, bound_over_row=rb, baseline_over_row=rbase)
                              for n, ms, gb, rb, rbase in table])
        B.write_json(a.json, "bench_file_tier", device, B.extra)
    print(f"\n{device}, {time.perf_counter() - t0:.0f} s, directory {a.dir}")
    B.print_checks()
    print("\n| row | ms per step | GB/s (disk, both ways) | bound / row | x faster than the baseline |\n"
          "|---|---|---|---|---|")
    f = lambda v, spec: "" if v is None else format(v, spec)  # noqa: E731
    for name, ms, gb, rb, rbase in table:
        print(f"| {name} | {ms:.0f} | {f(gb, '.2f')} | {f(rb, '.2f')} | {f(rbase, '.2f')} |")
    return 0 if B.passed() else 1


if __name__ == "__main__":
    sys.exit(main())
