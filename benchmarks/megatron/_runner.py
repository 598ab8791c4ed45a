"""What the Megatron benchmarks (sib.py, bench_megatron.py) share: one variant of
examples/megatron/train_gpt.py in a process of its own, timed iteration by iteration with every
engine pass recorded; the bounds (the duplex pinned copy, dd on the state's disk); the driver
that runs variants one after the other under a time budget.

A variant's process is this file:

    python3 benchmarks/megatron/_runner.py --child NAME OUT OPTIONS_JSON train_gpt.py's options...
    python3 benchmarks/megatron/_runner.py --bound OUT [MIB]

OPTIONS_JSON: {"steps": iterations, "nosync": no device synchronisation between backward and
the step, "digest": the final state's digest (train_gpt.state_digest; test-sized models),
"loop": no device synchronisation in the loop at all (Note [The iteration's time]),
"streamed_fraction": (CUDA) HBM taken by a ballast before the optimizer is built so that
resident_mb="auto" finds room for about 1 - fraction of the FP32 state (Note [The auto budget's
ballast]), "profile": N more iterations under torch.profiler after the timed ones, where the
link idled (benchmarks/link_profile.py) in the result's "link_profile" and the trace beside OUT
(OUT's name with .trace.json.gz); not with "digest"}.  The child writes its raw figures as JSON to OUT: per iteration its
host-clock marks (start, zero_grad_buffer done, forward+backward done, end), loss, the
step-inside-backward counters; per engine pass its interval, bytes each way, engine seconds.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
EXAMPLE_DIR = os.path.join(ROOT, "examples", "megatron")
MIB = 1 << 20
sys.path.insert(0, os.path.dirname(HERE))  # benchmarks/: bench_json
# test_megatron_gpu's timing model (0.54 G params under megatron-core 0.19's HybridModel), and
# the CPU smokes' model (train_gpt's --cpu-emulation).
MODEL_054 = "--layers 8 --hidden 2048 --heads 16 --vocab 32768 --seq 512 --batch 2"
SMOKE_MODEL = "--cpu-emulation --layers 1 --hidden 32 --heads 4 --vocab 64 --seq 16 --batch 2 --bucket-size 3000"


# ---- one variant, in its own process ----------------------------------------------------------

class PassLog:
    """Every engine pass of the streamed optimizers: host-clock interval, bytes each way,
    the engine's own seconds, speculative or not (wraps each Engine's ``step``); under
    train_gpt.py --odirect-baseline each synchronous step is one pass, its bytes the disk's."""

    def __init__(self, streamed, odirect=None):
        self.passes: list[dict] = []
        self.discards = 0
        for opt in streamed:
            self._wrap(opt._engine)
        if odirect is not None:
            self._wrap_odirect(odirect)

    def _wrap_odirect(self, opt) -> None:
        step = opt.step

        def timed_step():
            t0 = time.perf_counter()
            step()
            t1 = time.perf_counter()
            read, written = opt.bytes_per_step()
            self.passes.append({"t0": t0, "t1": t1, "speculative": False, "seconds": t1 - t0,
                                "bytes": read + written, "to": read, "from": written, "host": 0.0,
                                "pieces": len(opt.buckets)})
        opt.step = timed_step

    def _wrap(self, engine) -> None:
        step, discard = engine.step, engine.discard_speculation

        def timed_step(grads, scale, stream, speculative=False):
            t0 = time.perf_counter()
            step(grads, scale, stream, speculative)
            t1 = time.perf_counter()
            st = engine.stats()
            self.passes.append({"t0": t0, "t1": t1, "speculative": bool(speculative), "seconds": st["seconds"],
                                "bytes": st["bytes_to_device"] + st["bytes_from_device"],
                                "to": st["bytes_to_device"], "from": st["bytes_from_device"],
                                "host": st["map_seconds"] + st["retire_seconds"], "pieces": st["pieces"]})

        def counted_discard():
            self.discards += 1
            discard()
        engine.step, engine.discard_speculation = timed_step, counted_discard


# Note [The auto budget's ballast]
# Rationale: resident_mb="auto" takes the device's free HBM less a tenth of it and the window
# (Note [resident_mb="auto"] in deferalloc/optim.py); on an 80 GiB card the 0.54 G model's
# whole FP32 state (6.5 GB) fits, so "auto" alone never shows partial residency.
# Approach: after the model and DDP are built and torch's cache is emptied, a tensor takes
# free - device/10 - window - (1 - fraction) x 12 B x params of HBM and is kept for the whole
# run, so that "auto" finds room for about 1 - fraction of the state (the engine picks whole
# shards within it).  The link bytes measured per iteration say what was streamed.
# Limits: CUDA only (off CUDA "auto" is 0: all streamed); the ballast also leaves activations
# only the tenth of the device that "auto" keeps back.
def hbm_ballast(torch, args, ddp, fraction: float):
    params = sum(p.numel() for p in ddp.parameters())
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    keep = int((1.0 - fraction) * 12 * params)
    n = free - total // 10 - args.window_mb * MIB - keep
    if n <= 0:
        return None, {"ballast_bytes": 0, "resident_target_bytes": keep}
    return torch.empty(n, dtype=torch.uint8, device="cuda"), {"ballast_bytes": n, "resident_target_bytes": keep}


def child(argv: list[str]) -> int:
    """``--child NAME OUT OPTIONS_JSON train_gpt.py's options...``: one variant, its raw
    figures as JSON in OUT."""
    name, out, opts, argv = argv[1], argv[2], json.loads(argv[3]), argv[4:]
    steps, nosync, loop = int(opts["steps"]), bool(opts.get("nosync")), bool(opts.get("loop"))
    sys.path.insert(0, EXAMPLE_DIR)
    import torch
    import train_gpt as tg
    t_begin = time.perf_counter()
    args = tg.parse_args(argv + ["--steps", str(steps)])
    if args.directory:
        os.makedirs(args.directory, exist_ok=True)  # the file tier's directory must exist
    tg.setup(args)
    grad_norm = megatron_grad_norm(torch, opts.get("grad_norm", "megatron"))
    _, ddp = tg.build_model_and_ddp(args)
    cuda = not args.cpu_emulation
    ballast, ballast_info = None, {}
    if opts.get("streamed_fraction") is not None and cuda:
        ballast, ballast_info = hbm_ballast(torch, args, ddp, float(opts["streamed_fraction"]))
    optimizer, streamed = tg.build_optimizer(args, ddp)
    device = torch.device("cpu") if not cuda else torch.device("cuda", torch.cuda.current_device())
    odirect = isinstance(optimizer, tg.ODirectBaseline)
    log = PassLog(streamed, optimizer.odirect if odirect else None)
    backward_step = streamed[0].backward_step if streamed else None
    marks = {}  # the current iteration's host-clock marks
    zero = ddp.zero_grad_buffer

    def timed_zero(*a, **k):
        out_ = zero(*a, **k)
        marks["zeroed"] = time.perf_counter()
        return out_
    ddp.zero_grad_buffer = timed_zero
    sampler = tg.HbmSampler()
    build_s = time.perf_counter() - t_begin
    iters = []

    def clocked_step(step):
        """One iteration under the clock (Note [The iteration's time]): its start, loss and
        optimizer seconds."""
        if cuda and not loop:
            torch.cuda.synchronize()
        t = time.perf_counter()
        loss_, _, opt_s_ = tg.train_step(args, ddp, optimizer, step, device, sync_before_step=not (nosync or loop),
                                         sync_after_step=not loop)
        return t, loss_, opt_s_

    for step in range(1, steps + 1):
        if step == 2:  # as train_gpt's, after one step (its Note [HBM sampling])
            tg.start_sampling(sampler)
        t_start, loss, opt_s = clocked_step(step)
        t_end = time.perf_counter()
        it = {"start": t_start, "zeroed": marks.get("zeroed", t_start), "fb_end": t_end - opt_s, "end": t_end}
        if cuda and not loop:
            torch.cuda.synchronize()  # what the next start waits for is this iteration's (Note [The iteration's time])
            it["done"] = time.perf_counter()
        iters.append({**it, "loss": loss, "counts": dict(backward_step.stats()) if backward_step is not None else {}})
    profiled = None
    if opts.get("profile") and opts.get("digest"):
        print("profile: not with a digest (its steps would change the final state)", flush=True)
    elif opts.get("profile"):
        profiled = profile_link(torch, clocked_step, steps, cuda, int(opts["profile"]),
                                out[:-5] + ".trace.json.gz" if out.endswith(".json") else out + ".trace.json.gz")
    if backward_step is not None:
        backward_step.synchronize()  # the last iteration's passes (the next forward would wait for them)
    sampler.stop()
    result = {"name": name, "argv": argv, "iterations": iters, "passes": log.passes, "discards": log.discards,
              "peak_hbm": sampler.peak, "params": sum(p.numel() for p in ddp.parameters()),
              "state_bytes": sum(s.stats()["state_bytes"] for s in streamed) if streamed else None,
              "build_s": build_s, "grad_norm": grad_norm, **ballast_info}
    if profiled is not None:
        result["link_profile"] = profiled
    if backward_step is not None and backward_step.aside is not None:
        result["step_aside"] = backward_step.aside.stats()
    if opts.get("digest"):
        result["final_digest"] = tg.state_digest(optimizer)
    if odirect:
        result["odirect"] = optimizer.describe()  # direct I/O or not (and why), buckets, file bytes
    with open(out, "w") as f:
        json.dump(result, f)
    del ddp, optimizer, streamed, backward_step, ballast
    tg.teardown()
    return 0


def megatron_grad_norm(torch, which: str) -> str:
    """Megatron's grad norm in this process: "device" puts an on-device L2 norm in the place
    of megatron-core's local fallback (Note [Megatron's grad norm in the benchmark]); what
    computes it, returned.

    Note [Megatron's grad norm in the benchmark]
    Rationale: megatron-core computes the grad norm with Transformer Engine's or apex's
    multi_tensor_l2norm, one reduction on the device and at most one host read; with neither
    installed (the GPU machine has neither, and cannot build them) it falls back to
    ``local_multi_tensor_l2_norm``, whose ``torch.tensor(list of CUDA norms)`` reads each
    grad's norm to the host: one D2H copy and one host wait per grad tensor (about 80 an
    iteration on the 0.54 G model), each queued on the copy engine behind the step's
    write-backs in flight.  Those waits hold the training loop's host back in a way a
    Megatron with TE or apex (what its users install) does not, and they change the rows'
    figures (the step across the next forward is faster with them: docs/BENCHMARKS.md).
    Approach: ``--grad-norm device`` (bench_megatron's default) replaces the fallback (only the
    fallback: with TE or apex present theirs stays) by the same norm on the device:
    torch._foreach_norm of the grads, the norm of those norms, one tensor, which Megatron's
    code then reads once (``.item()``), as with apex.  Every row of a run (resident,
    HybridDeviceOptimizer, deferalloc) computes the norm the same way.
    Limits: the two differ in the last bits of the norm (device against host reductions), so
    a row whose clipping fires is comparable only within one run; ``--grad-norm megatron``
    keeps the fallback (the runs before this option used it).  Why the step across the next
    forward is slower when the host is not held back there is not yet known.
    """
    from megatron.core.optimizer import clip_grads
    from megatron.core.utils import local_multi_tensor_l2_norm
    if clip_grads.l2_norm_impl is not local_multi_tensor_l2_norm:
        return "fused (Transformer Engine or apex)"
    if which != "device":
        return "megatron-core fallback (a host read per grad)"

    def device_l2norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
        norms = torch._foreach_norm(tensor_lists[0], 2.0)
        return torch.linalg.vector_norm(torch.stack(norms), 2.0).reshape(1), None
    clip_grads.l2_norm_impl = device_l2norm
    return "device (bench_megatron --grad-norm device)"


def profile_link(torch, clocked_step, steps: int, cuda: bool, n: int, trace: str) -> dict:
    """``n`` more iterations (steps + 1, ...) as the timed ones ran, under torch.profiler
    (CUDA activity on a GPU), after them: where the link idled (benchmarks/link_profile.py),
    printed, returned, the trace gzipped into ``trace``.  Their passes come after the last
    timed iteration's end, so the analysis counts none of them."""
    import link_profile

    def run():
        for step in range(steps + 1, steps + 1 + n):
            clocked_step(step)
        if cuda:
            torch.cuda.synchronize()
    res = link_profile.capture(run, cuda, trace)
    print(f"profile, {n} iterations after the timed ones (trace {trace}):\n" + link_profile.report(res), flush=True)
    return dict(iterations=n, trace=os.path.basename(trace), **res)


def bound_child(argv: list[str]) -> int:
    """The duplex pinned-copy rate each way (test_megatron_gpu's measurement; ``MIB`` each
    way, default its 512), in its own process so that the variants' cuMemGetInfo sees no
    other context.  ``--bound OUT [MIB]``."""
    out = argv[1]
    mib = int(argv[2]) if len(argv) > 2 else 512
    import torch
    sys.path.insert(0, os.path.join(ROOT, "tests", "torch"))
    from test_megatron_gpu import duplex_bandwidth
    rate = duplex_bandwidth(torch, mib=mib) if torch.cuda.is_available() else None
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    with open(out, "w") as f:
        json.dump({"duplex_bytes_per_s": rate, "duplex_mib": mib, "device": f"{name}, torch {torch.__version__}"}, f)
    return 0


# ---- the analysis -----------------------------------------------------------------------------

def overlap_seconds(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def iteration_seconds(its: list[dict], i: int) -> float | None:
    """Iteration ``i``'s time (Note [The iteration's time]): to its ``done`` mark, or, in a run
    that recorded none, to the next iteration's start (None for its last iteration)."""
    it = its[i]
    if "done" in it:
        return it["done"] - it["start"]
    return its[i + 1]["start"] - it["start"] if i + 1 < len(its) else None


def analyse(r: dict, last: int) -> dict:
    """Medians over the last ``last`` iterations: the iteration, its phases, the pass time in
    each phase, passes and bytes per iteration (both ways, and each way: ``to_bytes`` read
    into HBM, ``from_bytes`` written back); the counters' totals.

    Note [The iteration's time]
    Rationale: an iteration's time is what a training loop pays for it: the loop's period.  A
    device synchronisation between iterations (the earlier clock, below) waits for every
    engine stream, so the step across the next forward could not overlap that forward at all
    (on an H100, the 0.54 G model's forward ran 32-35 ms an iteration with the link idle, the
    synchronisation after the step waiting for the passes), while Megatron's own training
    loop synchronises only on the loss and grad norm it reads (the compute stream).
    Approach: the "loop" clock (bench_megatron's default): no device synchronisation in the
    loop, train_step's host reads of the loss and the grad norm pace the host as Megatron's
    do; an iteration runs from its start to the next one's, the window moved back by one
    iteration (the last has no next start).  The "sync" clock (sib.py, bench_megatron
    --clock sync): the device synchronised before each start and after the step, an
    iteration from its start to ``done`` (the sync after the step), so that it covers its
    own GPU work and no more.
    Limits: under the loop clock the phases (``wait``, ``fb``, ``step``) are the host's marks,
    ahead of the device by what the host has queued; the sync clock's synchronisation keeps
    the next forward from starting beside the passes still in flight."""
    all_its = r["iterations"]
    n = len(all_its) if not all_its or "done" in all_its[-1] else len(all_its) - 1
    rows = []
    for i in range(max(0, n - last), n):
        it = all_its[i]
        # A pass after the last iteration's end (the step carried across a next forward that never
        # came, run when the process drains) belongs to no timed iteration.
        nxt = all_its[i + 1]["start"] if i + 1 < len(all_its) else it["end"]
        phases = {"wait": (it["start"], it["zeroed"]), "fb": (it["zeroed"], it["fb_end"]),
                  "step": (it["fb_end"], it["end"])}
        # Counted in the iteration they start in; their time in each phase they overlap.
        mine = [p for p in r["passes"] if it["start"] <= p["t0"] < nxt]
        near = [p for p in r["passes"] if p["t1"] > it["start"] and p["t0"] < it["end"]]
        row = {"iteration": iteration_seconds(all_its, i), "passes": len(mine),
               "bytes": sum(p["bytes"] for p in mine), "to_bytes": sum(p.get("to", 0) for p in mine),
               "from_bytes": sum(p.get("from", 0) for p in mine),
               "pass_seconds": sum(p["t1"] - p["t0"] for p in mine),
               "engine_host": sum(p["host"] for p in mine)}
        for k, (a, b) in phases.items():
            row[k] = max(0.0, b - a)
            row[f"pass_in_{k}"] = sum(overlap_seconds(a, b, p["t0"], p["t1"]) for p in near)
        rows.append(row)
    med = {k: statistics.median(x[k] for x in rows) for k in rows[0]} if rows else {}
    counts = r["iterations"][-1]["counts"] if r["iterations"] else {}
    med.update(counts={**counts, "discards": r.get("discards", 0)}, peak_hbm=r.get("peak_hbm"),
               per_iteration_ms=[round(t * 1e3, 1) for t in (iteration_seconds(all_its, i) for i in range(n))],
               step_aside=r.get("step_aside"))
    if r.get("link_profile") is not None:
        med["link_profile"] = r["link_profile"]
    return med


def variant_results(name: str, m: dict, base: str | None = None) -> list[dict]:
    """benchmarks/bench_json.py's rows of one analysed variant: the iteration (against
    ``base``), its phases, passes, bytes, peak HBM and the engine's counters."""
    import bench_json
    res = bench_json.result
    out = [res(f"{name}: iteration", m["iteration"] * 1e3, "ms", base),
           res(f"{name}: optimizer step", m["step"] * 1e3, "ms"),
           res(f"{name}: zero_grad_buffer wait", m["wait"] * 1e3, "ms"),
           res(f"{name}: forward+backward", m["fb"] * 1e3, "ms"),
           res(f"{name}: engine passes", m["passes"], "count"),
           res(f"{name}: engine pass time", m["pass_seconds"] * 1e3, "ms"),
           res(f"{name}: pass time under forward+backward", m["pass_in_fb"] * 1e3, "ms"),
           res(f"{name}: link bytes", m["bytes"], "B"),
           res(f"{name}: peak HBM", (m["peak_hbm"] or 0) / 2**20, "MiB")]
    return out + [res(f"{name}: {k}", v, "count") for k, v in m["counts"].items() if isinstance(v, (int, float))]


# ---- the bounds -------------------------------------------------------------------------------

def dd_bound(directory: str, read_bytes: int, write_bytes: int, smoke: bool = False, jobs: int = 1) -> dict:
    """benchmarks/optimizer/bench_file_tier.py's dd bound (direct I/O; write into a
    preallocated file fsynced, read, and both at once; the faster way) of these bytes in
    ``directory``."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks", "optimizer"))
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_file_tier
    harness = types.SimpleNamespace(a=types.SimpleNamespace(smoke=smoke, dir=directory, dd_jobs=jobs))
    return bench_file_tier.dd_bound(harness, read_bytes, write_bytes)


# ---- the driver -------------------------------------------------------------------------------

def run_child(cmd: list[str], env: dict, timeout: float, log: str) -> str:
    """'' when the process ended with status 0, else why not (its output in ``log``)."""
    with open(log, "w") as f:
        try:
            p = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
        except subprocess.TimeoutExpired:
            return f"timed out after {timeout:.0f} s"
    return "" if p.returncode == 0 else f"rc {p.returncode}"


class Driver:
    """Runs variants one process each, one after the other, under ``budget_s`` (a variant is
    started only where, at its estimate, it ends within the budget), each process under
    ``timeout``; keeps ``analysed`` (name -> analyse()'s medians, or {"error"}), ``raw`` and
    ``failed``.  ``tag`` prefixes its printed lines."""

    ME = [sys.executable, os.path.abspath(__file__)]

    def __init__(self, tag: str, logs: str, budget_s: float, timeout: float):
        self.tag, self.logs, self.budget_s, self.timeout = tag, logs, budget_s, timeout
        self.t_begin = time.perf_counter()
        self.longest = 0.0
        self.took: dict[str, float] = {}
        self.analysed: dict[str, dict] = {}
        self.raw: dict[str, dict] = {}
        self.failed: list[str] = []

    def spent(self) -> float:
        return time.perf_counter() - self.t_begin

    def bound(self, mib: int = 512) -> dict:
        """The duplex pinned-copy rate (bound_child), {} where it failed."""
        out = f"{self.logs}/bound.json"
        why = run_child(self.ME + ["--bound", out, str(mib)], dict(os.environ), 90, f"{self.logs}/bound.log")
        bound = {}
        if not why:
            with open(out) as f:
                bound = json.load(f)
        print(f"[{self.tag}] bound: {bound or why}", flush=True)
        return bound

    def run(self, name: str, train_argv: list[str], opts: dict, last: int, conf: str | None = None,
            estimate: float | None = None, port: int = 29600, key: str | None = None) -> dict:
        """One variant: train_gpt.py's options ``train_argv``, the child's ``opts``, medians of
        the ``last`` iterations; ``conf`` added to DEFERALLOC_CONF; ``estimate``: seconds it is
        expected to take (default 1.1x the longest so far); ``key`` (default ``name``): its
        files' and results' name (a variant run again: bench_megatron's --repeat)."""
        key = key or name
        spent = self.spent()
        expect = estimate if estimate is not None else max(self.longest, 1.0) * 1.1
        if spent + expect > self.budget_s:
            self.analysed[key] = {"error": f"not started: {spent:.0f} s spent, {expect:.0f} s expected, "
                                           f"budget {self.budget_s:.0f} s"}
            print(f"[{self.tag}] {key}: {self.analysed[key]['error']}", flush=True)
            self.failed.append(key)
            return self.analysed[key]
        env = dict(os.environ)
        env["MASTER_PORT"] = str(port)
        if conf:
            env["DEFERALLOC_CONF"] = ",".join(x for x in (os.environ.get("DEFERALLOC_CONF"), conf) if x)
        out = f"{self.logs}/{key}.json"
        cmd = self.ME + ["--child", name, out, json.dumps(opts)] + train_argv
        t0 = time.perf_counter()
        why = run_child(cmd, env, min(self.timeout, max(10.0, self.budget_s - spent)), f"{self.logs}/{key}.log")
        took = time.perf_counter() - t0
        self.longest = max(self.longest, took)
        self.took[key] = took
        if os.path.exists(out):
            with open(out) as f:
                self.raw[key] = json.load(f)
            last = min(last, max(1, len(self.raw[key]["iterations"]) - 1))
            self.analysed[key] = analyse(self.raw[key], last)
        else:
            with open(f"{self.logs}/{key}.log") as f:
                print(f.read()[-3000:], flush=True)
            self.analysed[key] = {"error": f"failed ({why or 'no result'}); log {self.logs}/{key}.log"}
            self.failed.append(key)
        m = self.analysed[key]
        print(f"[{self.tag}] {key}: {took:.0f} s, " + (f"iteration {m['iteration'] * 1e3:.1f} ms, per iteration "
                                                      f"{m['per_iteration_ms']}" if "iteration" in m else m["error"]),
              flush=True)
        return m


def megatron_importable() -> bool:
    import importlib.util
    return importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        sys.exit(child(sys.argv[1:]))
    if sys.argv[1:2] == ["--bound"]:
        sys.exit(bound_child(sys.argv[1:]))
    sys.exit(f"usage: {sys.argv[0]} --child NAME OUT OPTIONS_JSON ARGS... | --bound OUT [MIB]")
