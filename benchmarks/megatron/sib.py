"""Why the step inside Megatron's backward costs more than the plain step: a diagnosis matrix.

Runs examples/megatron/train_gpt.py's model, DDP and optimizer (its ``build``; megatron-core
0.19's HybridModel at 0.54 G params with test_megatron_gpu's timing model, batch and sequence)
in one process per variant, the same model, batch and window in each, host tier:

    resident        Megatron's own optimizer (FP32 state in HBM)
    plain           deferalloc, the streamed step after backward
    inside          step_in_backward=True (the configuration measured slower than plain)
    inside_keep     inside with DEFERALLOC_CONF keep_window:1 (the window stays backed between passes)
    inside_b160m    inside with DDP bucket_size 160000000 (fewer, larger bucket passes)
    inside_noclip   inside with clip_grad 0 (no clipping: no speculation, no second pinned copy)
    auto            step_in_backward="auto" (16 iterations: 2 warm-up, a 6-iteration probe, then its choice)
    inside_after    inside with clip_policy "after" (every bucket pass after Megatron's clip: per-bucket
                    passes without any overlap)
    inside_nosync   inside without train_gpt's device synchronisation between backward and the step
    plain_pg        plain with DDP's overlap_param_gather (the param all-gathers in the next forward)
    inside_fwd      inside with overlap_param_gather and step_overlap_forward=True (the step also
                    overlaps the next forward; the window kept backed)
    auto_fwd        step_in_backward="auto" with inside_fwd's options (16 iterations; whole iterations timed)

Every run but inside_noclip clips at a norm never reached (1e9) and every run reduces with
DDP's overlap_grad_reduce: test_megatron_gpu's timing settings of the deferalloc runs (its
resident run kept Megatron's defaults; here it has the same settings as the others).  Each run's
iterations are timed whole (median of the last ``--median-of``), split into three phases
by the host clock: ``wait`` (``zero_grad_buffer``, which waits for the previous iteration's
bucket passes), ``fb`` (forward, backward, grad sync, up to train_gpt's device
synchronisation) and ``step`` (Megatron's ``optimizer.step()``; inside_nosync splits fb and
step where the host calls it, ahead of the device: only its iteration compares).  Every engine pass is
recorded (host clock around the engine call, which returns when the pass's state is home,
and the engine's bytes each way), and the pass time falling in each phase is summed: where
the link work ran (hidden under fb, or exposed in wait and step), how many passes an
iteration made, and at what rate against the duplex pinned-copy bound of the same bytes
(tests/torch/test_megatron_gpu.py's measurement, in a process of its own first).  The
engine's counters (BackwardOverlap.stats(): buckets, passes, speculative steps,
speculations, redos, commits; speculation discards counted at the engine call) and peak
HBM (train_gpt's sampler, cuMemGetInfo) per variant.  A table last; ``--json`` the schema
of benchmarks/bench_json.py.

    PYTHONPATH=python:/tmp/site-mc DEFERALLOC_LIB=... DEFERALLOC_OPTIMIZER_LIB=... \\
      python3 benchmarks/megatron/sib.py [--json OUT] [--budget-s 400] [--variants a,b,...]
    python3 benchmarks/megatron/sib.py --smoke     # CPU: tiny model (train_gpt's --cpu-emulation), 3 iterations

How to read it (the table's last lines say which of these the figures show):
  inside_noclip close to plain or below, inside far above it: the speculation (its second
  pinned copy, speculative writes, or redos when clipping fires) costs it;
  inside_after far above plain: per-bucket passes cost more than one pass (fill and drain
  per pass, window mapping), and inside_b160m / inside_keep should then move it;
  inside's fb phase far longer than plain's: the passes slow backward down (contention on
  SMs, copy engines or NCCL), or the device synchronisation waits for passes
  (inside_nosync then differs);
  inside's step + wait phases long with pass time in them: the passes run after backward
  anyway (buckets ready late, or the worker idle during backward).
Exit 0 when every variant ran, 1 otherwise (--smoke: 77 without megatron-core).
"""
from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import _runner  # noqa: E402  (the child process, the analysis, the driver: shared with bench_megatron.py)
import bench_json  # noqa: E402

MODEL, SMOKE_MODEL = _runner.MODEL_054, _runner.SMOKE_MODEL
TIMING = ["--overlap-grad-reduce", "--clip-grad", "1e9"]
HOST = ["--deferalloc", "host"]
INSIDE = HOST + ["--step-in-backward"]
# name: (train_gpt.py's options, what DEFERALLOC_CONF gets added, the driver's options)
VARIANTS = {
    "resident": (TIMING, None, {}),
    "plain": (TIMING + HOST, None, {}),
    "inside": (TIMING + INSIDE, None, {}),
    "inside_noclip": (["--overlap-grad-reduce", "--clip-grad", "0"] + INSIDE, None, {}),
    "inside_keep": (TIMING + INSIDE, "keep_window:1", {}),
    "inside_b160m": (TIMING + INSIDE + ["--bucket-size", "160000000"], None, {}),
    "auto": (TIMING + HOST + ["--step-in-backward", "auto"], None, {"steps": 16}),
    "inside_after": (TIMING + INSIDE + ["--clip-policy", "after"], None, {}),
    "inside_nosync": (TIMING + INSIDE, None, {"nosync": True}),
    "plain_pg": (TIMING + HOST + ["--overlap-param-gather"], None, {}),
    "inside_fwd": (TIMING + INSIDE + ["--overlap-param-gather", "--step-overlap-forward"], None, {}),
    "auto_fwd": (TIMING + HOST + ["--step-in-backward", "auto", "--overlap-param-gather", "--step-overlap-forward"],
                 None, {"steps": 16}),
}
SMOKE_VARIANTS = ["resident", "plain", "inside", "inside_noclip", "inside_keep", "inside_nosync", "inside_fwd"]


def verdicts(a: dict, bound_s: float | None) -> list[str]:
    """Which causes the figures point at (the module docstring's reading), one line each."""
    def it(name):
        return a.get(name, {}).get("iteration")
    out = []
    resident, plain, inside = it("resident"), it("plain"), it("inside")
    if resident and plain:
        out.append(f"plain - resident {(plain - resident) * 1e3:.0f} ms"
                   + (f" vs the transfer bound {bound_s * 1e3:.0f} ms" if bound_s else ""))
    if plain and inside:
        out.append(f"inside / plain {inside / plain:.2f}x" + (" (inside slower)" if inside > 1.05 * plain else "")
                   + (f"; inside / resident {inside / resident:.2f}x" if resident else ""))
    early = a.get("inside", {}).get("per_iteration_ms", [])[1:4]
    if inside and len(early) == 3:
        # test_megatron_gpu's timing runs: 4 steps, the median of steps 2-4.
        e = statistics.median(early) / 1e3
        out.append(f"inside, median of iterations 2-4 (test_megatron_gpu's window) {e * 1e3:.0f} ms vs the last ones' "
                   f"{inside * 1e3:.0f} ms" + (": the earlier figure was warm-up" if e > 1.2 * inside else ""))
    noclip, after, b160, keep, nosync = it("inside_noclip"), it("inside_after"), it("inside_b160m"), \
        it("inside_keep"), it("inside_nosync")
    if inside and noclip and plain:
        c = a["inside"]["counts"]
        if noclip < 0.9 * inside:
            out.append(f"CLIPPING / SPECULATION: inside_noclip {noclip * 1e3:.0f} ms vs inside {inside * 1e3:.0f} ms "
                       f"(plain {plain * 1e3:.0f}; inside's redos {c.get('redos')}, discards {c.get('discards')})")
        else:
            out.append(f"speculation not the cause: inside_noclip / inside {noclip / inside:.2f}x")
    if after and plain:
        out.append(f"per-bucket passes after backward (inside_after) / plain {after / plain:.2f}x"
                   + (": PER-BUCKET PASSES cost more than one pass" if after > 1.1 * plain else ""))
    for what, v, cause in (("bucket 160M", b160, "PER-BUCKET OVERHEAD"), ("keep_window", keep, "WINDOW CHURN"),
                           ("no device sync", nosync, "THE SYNC BEFORE THE STEP waits for passes")):
        if inside and v:
            out.append(f"{what} / inside {v / inside:.2f}x" + (f": {cause}" if v < 0.9 * inside else
                                                                " (slower)" if v > 1.1 * inside else " (no change)"))
    auto = a.get("auto", {})
    if auto.get("iteration") and plain and inside:
        best = min(plain, inside)
        out.append(f"auto after its probe / the faster of plain and inside {auto['iteration'] / best:.2f}x "
                   f"(chose {(auto.get('step_aside') or {}).get('chosen')})")
    fwd, pg = it("inside_fwd"), it("plain_pg")
    if fwd and plain:
        # The target of the step across the next forward: never slower than plain, and within
        # 15 % of max(resident, the state's transfer at the duplex bound).
        floor = max(resident or 0.0, bound_s or 0.0)
        out.append(f"inside_fwd / plain {fwd / plain:.2f}x" + (f", / plain_pg {fwd / pg:.2f}x" if pg else "")
                   + (f", / max(resident, transfer) {fwd / floor:.2f}x (target <= 1.15)" if floor else "")
                   + (f", / inside {fwd / inside:.2f}x" if inside else ""))
    ai, ap = a.get("inside", {}), a.get("plain", {})
    if ai.get("iteration") and ap.get("iteration"):
        def rate(m):
            return m["bytes"] / 2 / m["pass_seconds"] / 1e9 if m["pass_seconds"] else 0.0
        out.append(f"inside phases wait/fb/step {ai['wait'] * 1e3:.0f}/{ai['fb'] * 1e3:.0f}/{ai['step'] * 1e3:.0f} ms "
                   f"vs plain {ap['wait'] * 1e3:.0f}/{ap['fb'] * 1e3:.0f}/{ap['step'] * 1e3:.0f}: fb "
                   f"{ai['fb'] / ap['fb']:.2f}x plain's" + (" (BACKWARD SLOWED by the passes, or the sync waits)"
                                                          if ai["fb"] > 1.2 * ap["fb"] else ""))
        out.append(f"inside passes {ai['passes']:.0f} an iteration, {ai['pass_seconds'] * 1e3:.0f} ms in all at "
                   f"{rate(ai):.1f} GB/s vs plain's one, {ap['pass_seconds'] * 1e3:.0f} ms at {rate(ap):.1f} GB/s"
                   + (f" (bound {bound_s * 1e3:.0f} ms)" if bound_s else "") + f"; hidden under fb "
                   f"{ai['pass_in_fb'] * 1e3:.0f} ms, exposed in wait+step "
                   f"{(ai['pass_in_wait'] + ai['pass_in_step']) * 1e3:.0f} ms")
    return out


def report(a: dict, bound: dict, state_bytes: int | None) -> tuple[list, float | None]:
    rate = bound.get("duplex_bytes_per_s")
    bound_s = state_bytes / rate if rate and state_bytes else None
    head = (f"{'variant':<14} {'iter ms':>8} {'wait':>6} {'fb':>6} {'step':>6} {'passes':>6} {'pass ms':>8} "
            f"{'hid/exp':>9} {'GB/s':>6} {'spec':>5} {'redo':>5} {'disc':>5} {'peak GiB':>8}")
    lines = [head]
    for name, m in a.items():
        if "iteration" not in m:
            lines.append(f"{name:<14} {m.get('error', 'failed')}")
            continue
        c = m["counts"]
        gbs = m["bytes"] / 2 / m["pass_seconds"] / 1e9 if m["pass_seconds"] else 0.0
        lines.append(f"{name:<14} {m['iteration'] * 1e3:8.1f} {m['wait'] * 1e3:6.0f} {m['fb'] * 1e3:6.0f} "
                     f"{m['step'] * 1e3:6.0f} {m['passes']:6.0f} {m['pass_seconds'] * 1e3:8.1f} "
                     f"{m['pass_in_fb'] * 1e3:4.0f}/{(m['pass_in_wait'] + m['pass_in_step']) * 1e3:<4.0f} {gbs:6.1f} "
                     f"{c.get('speculations', '-'):>5} {c.get('redos', '-'):>5} {c.get('discards', '-'):>5} "
                     f"{(m['peak_hbm'] or 0) / 2**30:8.2f}")
    if rate:
        lines.append(f"bound: {state_bytes or 0} state bytes each way at the duplex pinned copy "
                     f"{rate / 1e9:.1f} GB/s each way = {bound_s * 1e3:.1f} ms" if bound_s else
                     f"bound: duplex {rate / 1e9:.1f} GB/s each way (no state bytes: plain did not run)")
    lines.append("(wait / fb / step: phase medians; pass ms: engine passes per iteration; hid/exp: pass ms under "
                 "fb / in wait+step; GB/s: pass bytes each way / pass time; spec, redo: speculations and redos over "
                 "the run; disc: speculations discarded)")
    for name, m in a.items():
        if m.get("per_iteration_ms"):
            lines.append(f"{name} per iteration (ms): {m['per_iteration_ms']}"
                         + (f" step_aside {m['step_aside']}" if m.get("step_aside") else ""))
    return lines + verdicts(a, bound_s), bound_s


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", help="comma-separated, in this order (default: all; --smoke: "
                                       + ",".join(SMOKE_VARIANTS) + "); choices: " + ",".join(VARIANTS))
    ap.add_argument("--model", default=MODEL, help="train_gpt.py's model options, one string")
    ap.add_argument("--window-mb", type=int, default=512)
    ap.add_argument("--steps", type=int, default=12, help="iterations per variant (auto: 16)")
    ap.add_argument("--median-of", type=int, default=8, help="the last iterations the medians are over")
    ap.add_argument("--timeout", type=float, default=100, help="seconds one variant's process may take")
    ap.add_argument("--budget-s", type=float, default=400,
                    help="a variant is started only when, at the longest variant's time so far, it ends within this")
    ap.add_argument("--json", help="write the figures here (benchmarks/bench_json.py's schema)")
    ap.add_argument("--logs", help="keep each process's output here (default: a temporary directory)")
    ap.add_argument("--smoke", action="store_true", help="CPU: a tiny model, 3 iterations (CI)")
    args = ap.parse_args(argv)
    if args.smoke:
        if not _runner.megatron_importable():
            print("SKIP: megatron-core not importable")
            return 77
        args.model, args.steps, args.median_of, args.window_mb = SMOKE_MODEL, 3, 2, 4
    names = args.variants.split(",") if args.variants else (SMOKE_VARIANTS if args.smoke else list(VARIANTS))
    bad = [n for n in names if n not in VARIANTS]
    if bad:
        ap.error(f"unknown variants {bad} (choices: {', '.join(VARIANTS)})")
    logs = args.logs or tempfile.mkdtemp(prefix="dfa_sib_")
    os.makedirs(logs, exist_ok=True)
    drv = _runner.Driver("sib", logs, args.budget_s, args.timeout)
    if args.smoke:
        bound = {}
        print("[sib] bound: not measured (smoke)", flush=True)
    else:
        bound = drv.bound()
    for i, name in enumerate(names):
        opts, conf, extra = VARIANTS[name]
        steps = args.steps if args.smoke else extra.get("steps", args.steps)
        last = 8 if name in ("auto", "auto_fwd") and not args.smoke else args.median_of
        drv.run(name, shlex.split(args.model) + ["--window-mb", str(args.window_mb)] + opts,
                {"steps": steps, "nosync": bool(extra.get("nosync"))}, last, conf=conf,
                estimate=max(drv.longest, 1.0) * (1.4 if name in ("auto", "auto_fwd") else 1.1), port=29600 + i)
    analysed, raw, failed, t_begin = drv.analysed, drv.raw, drv.failed, drv.t_begin
    state_bytes = next((r["state_bytes"] for r in raw.values() if r.get("state_bytes")), None)
    params = next((r["params"] for r in raw.values()), None)
    lines, bound_s = report(analysed, bound, state_bytes)
    print(f"\nstep inside backward diagnosis: {(params or 0) / 1e9:.3f} G params, window {args.window_mb} MiB, "
          f"{bound.get('device', 'CPU')}, median of the last {args.median_of} of {args.steps} iterations"
          + (" (auto: 8 of 16)" if "auto" in names and not args.smoke else "")
          + f", {time.perf_counter() - t_begin:.0f} s")
    print("\n".join(lines), flush=True)
    if args.json:
        res = bench_json.result
        results = []
        if bound.get("duplex_bytes_per_s"):
            results.append(res("pinned copy duplex (each way)", bound["duplex_bytes_per_s"] / 1e9, "GB/s"))
        if bound_s:
            results.append(res("FP32 state transfer at the duplex bound", bound_s * 1e3, "ms"))
        for name, m in analysed.items():
            if "iteration" not in m:
                continue
            base = "plain: iteration" if name not in ("resident", "plain") and "iteration" in analysed.get("plain", {}) \
                else None
            results += _runner.variant_results(name, m, base)
        device = bound.get("device") or ("CPU (cpu_emulation)" if args.smoke else "unknown")
        bench_json.write(args.json, "sib", results, device,
                         extra={"analysed": analysed, "bound": bound, "state_bytes": state_bytes, "params": params,
                                "model": args.model, "steps": args.steps, "median_of": args.median_of,
                                "table": lines, "raw": raw})
    # The last line (scripts/gpu_round.sh's summary row): each variant's iteration.
    print("sib iteration ms: " + ", ".join(f"{n} {m['iteration'] * 1e3:.0f}" if "iteration" in m else f"{n} -"
                                          for n, m in analysed.items()), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
