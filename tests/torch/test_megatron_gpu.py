"""GPU acceptance of deferalloc.megatron on one GPU, in three parts of about 2-3 minutes each
per megatron-core version on an H100 (a device call runs at most 10 minutes, build included).

Runs examples/megatron/train_gpt.py under torchrun (1 GPU, the model class the installed
megatron-core recommends, local specs, BF16 params, DistributedOptimizer), eleven runs in all,
and checks:
  (a) Megatron's own run steps with torch.optim.AdamW(fused=True) (torch._fused_adamw_, the
      arithmetic the engine reproduces), and 20 steps give losses bit-identical with
      deferalloc (host and file tiers) to it (deterministic settings);
  (b) peak HBM (cuMemGetInfo sampled through the steps after the first, see train_gpt.py's
      Note [HBM sampling]) lower by at least 12 B/param x params - window, and the same
      bound for HBM in use between steps; the deferalloc runs of (a), (b), (d) use
      release_torch_cache (deferalloc/megatron.py, Note [The window and torch's cache]);
  (c) optimizer-phase time (optimizer.step(), Megatron's whole step) >= 5x faster than
      megatron-core's HybridDeviceOptimizer(offload_fraction=1.0), both on a larger model
      (--timing-model, 0.54 G params: the 168 M model's step is dominated by per-piece
      costs), first step not timed; beside it the link's bound (12 B/param each way over the
      duplex pinned-copy bandwidth measured here) and what that bound allows against HDO;
  (d) Megatron dist-checkpointing save at step 10 (host tier), load in a new process,
      steps 11-20 identical and the loaded optimizer state equal to the saved one;
  (e) whole-iteration times (forward, backward, grad sync, step; median after the first):
      Megatron's own (resident), HDO(offload_fraction=1.0), deferalloc plain, and deferalloc
      with the step inside Megatron's backward (``step_in_backward``, clip policy auto; its
      losses bit-identical to the plain timing run's, its counts of speculations and redos
      printed).  Both deferalloc timing runs use DDP overlap_grad_reduce and a clip_grad
      never reached (1e9), the resident and HDO runs Megatron's defaults of the example.  Targets (reported): step inside backward
      <= 1.2x resident, HDO >= 2x deferalloc's iteration; and the step across the next forward
      (``step_overlap_forward``, with overlap_param_gather): losses bit-identical to the plain
      timing run's, its iteration <= the plain run's (reported);
  (f) ``step_in_backward="auto"`` (Note [Stepping aside]) on the timing model, --auto-steps
      steps with the same settings: its losses bit-identical to the plain timing run's for the
      steps both ran, its choice and probe times printed, and the median of its iterations
      after the probe (steps 9 on) <= 1.1x the faster of the plain and inside-backward runs'
      (reported);
  (g) BF16 grad buffers (``--bf16-grads``) on the device tier, the step across the next
      forward with every bucket held for Megatron's clip (policy after: the passes read
      Megatron's ``.float()`` copies of the grads), on the timing model: losses bit-identical
      to the plain step's at the same settings.
--part picks the runs and their checks (PARTS; a check comparing two runs is in the part that
does both, and a part reports only the checks of its runs; Megatron's own 20-step run is in
each, as the reference of (a) and (b) and the resident iteration of (e)):
  exact   (a), (b) host tier, (d), (g): Megatron's own, host, host resumed, the BF16-grads
          pair (about 150 s on an H100, estimated from the whole run's);
  file    (a), (b) file tier: Megatron's own, file (90-190 s, estimated: the file run's steps
          take 2-6 s each, as the disk goes);
  timing  (c), (e), (f): Megatron's own, the host, HDO, inside-backward, across-the-forward
          and auto timing runs (about 170 s, estimated);
  all     every run and check in one process (the default; 400-450 s on an H100).
The model is the one each megatron-core recommends (GPTModel; HybridModel from 0.19 on) at
0.54 G params for every run (--model, --timing-model).  One megatron-core per invocation:
--megatron-wheel installs that wheel alone into a directory of its own.

    DEFERALLOC_LIB=build/allocator/libdeferalloc.so PYTHONPATH=python:/tmp/site \\
      python tests/torch/test_megatron_gpu.py [--part exact|file|timing] [--json out.json] \\
      [--megatron-wheel megatron_core-0.16.1-*.whl]

(--megatron-wheel installs the wheel with --no-deps into a temporary directory; without
it megatron-core must be importable.)  --json writes the figures as {"benchmark":
"test_megatron_gpu", "schema": 1, "device", "command", "results": [{"name", "value", "unit",
"baseline"}], "extra"} (``extra.part``: the part; benchmarks/plot.py merges the parts' files
by file name).  Exit 0 when every check passes, 1 when one fails, 77 without a GPU or
megatron-core.  Prints a table last.
"""
from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import time

from megatron_runs import probe_megatron, report, torchrun, work_dir

MIB = 2**20

# The runs in the order they go (deferalloc-host-resumed loads deferalloc-host's checkpoint),
# and the runs of each part.  tests/test_bench_tools.py evaluates each part on made-up summaries:
# its checks and figures are the whole run's, and the parts together give all of them.
RUNS = ("megatron", "deferalloc-host", "deferalloc-file", "deferalloc-host-resumed", "deferalloc-host-timing",
        "megatron-hdo-timing", "deferalloc-backward-timing", "deferalloc-forward-timing",
        "deferalloc-bf16grads-plain", "deferalloc-bf16grads-forward", "deferalloc-auto-timing")
PARTS = {
    "exact": ("megatron", "deferalloc-host", "deferalloc-host-resumed", "deferalloc-bf16grads-plain",
              "deferalloc-bf16grads-forward"),
    "file": ("megatron", "deferalloc-file"),
    "timing": ("megatron", "deferalloc-host-timing", "megatron-hdo-timing", "deferalloc-backward-timing",
               "deferalloc-forward-timing", "deferalloc-auto-timing"),
}


def runs_of(part: str) -> tuple[str, ...]:
    """The runs of ``part`` ("all": every one) in the order they go."""
    return RUNS if part == "all" else tuple(r for r in RUNS if r in PARTS[part])


def duplex_bandwidth(torch, mib: int = 512, reps: int = 5) -> float:
    """Bytes/s each way with a pinned H2D and a D2H copy running at once (two streams)."""
    n = mib * MIB
    host_in = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    host_out = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev_in = torch.empty(n, dtype=torch.uint8, device="cuda")
    dev_out = torch.empty(n, dtype=torch.uint8, device="cuda")
    up, down = torch.cuda.Stream(), torch.cuda.Stream()
    best = 0.0
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.cuda.stream(up):
            dev_in.copy_(host_in, non_blocking=True)
        with torch.cuda.stream(down):
            host_out.copy_(dev_out, non_blocking=True)
        torch.cuda.synchronize()
        best = max(best, n / (time.perf_counter() - t0))
    return best


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--megatron-wheel")
    ap.add_argument("--part", default="all", choices=["all", *PARTS],
                    help="the runs and checks of one part (the module's docstring says which), or all of them")
    ap.add_argument("--json", help="write the figures here (schema 1)")
    ap.add_argument("--perf-targets", default="fail", choices=["fail", "report"],
                    help="report: performance targets are printed but do not fail (ctest: targets live in benchmarks)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--save-at", type=int, default=10)
    ap.add_argument("--timing-steps", type=int, default=4, help="steps of the timing runs (the first is not timed)")
    ap.add_argument("--auto-steps", type=int, default=14,
                    help="steps of the step_in_backward='auto' timing run (f); 0: no such run")
    ap.add_argument("--window-mb", type=int, default=512)
    ap.add_argument("--model", default="--layers 8 --hidden 2048 --heads 16 --vocab 32768 --seq 512 --batch 2",
                    help="train_gpt.py's model options for (a), (b), (d), one string")
    ap.add_argument("--timing-model", default="--layers 8 --hidden 2048 --heads 16 --vocab 32768 --seq 512 --batch 2",
                    help="train_gpt.py's model options for (c), one string")
    args = ap.parse_args()

    import torch
    if not torch.cuda.is_available():
        print("SKIP: no CUDA device")
        return 77
    work = work_dir("dfa_megatron_")
    env = dict(os.environ)
    env.pop("DEFERALLOC_CONF", None)
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if args.megatron_wheel:
        site = os.path.join(work, "site")
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile",
                        "--target", site, args.megatron_wheel], check=True)
        # First on the path: a megatron-core installed elsewhere (/tmp/site) must not shadow it.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (site, env.get("PYTHONPATH")) if p)
    version = probe_megatron(env)
    if version is None:
        return 77

    wall = {}
    plan = planned_runs(args, work)
    runs = {}
    for name in runs_of(args.part):
        if name in plan:
            opts, extra = plan[name]
            runs[name] = torchrun(name, 1, [*opts, "--window-mb", str(args.window_mb), *extra], env, work, wall)
    # This process touches the GPU only now: cuMemGetInfo is device-wide.
    link = duplex_bandwidth(torch) if "deferalloc-host-timing" in runs else None
    device = f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    rows, results = evaluate(args, runs, link)
    n, n_t = (runs.get("megatron") or {}).get("params"), (runs.get("deferalloc-host-timing") or {}).get("params")
    model_class = (runs.get("megatron") or {}).get("model_class", "?")
    print(f"\nmegatron-core {version} {model_class}, {(n or 0) / 1e9:.2f} G params"
          + (f" ({n_t / 1e9:.2f} G for timing)" if n_t else "") + f", window {args.window_mb} MiB, part {args.part}, "
          f"{device}")
    extra = {"megatron_core": version, "part": args.part, "model_class": model_class, "model": args.model,
             "timing_model": args.timing_model, "params": n, "timing_params": n_t, "window_mb": args.window_mb, "steps": args.steps, "wall_seconds": wall,
             "runs": {k: ({kk: vv for kk, vv in v.items() if kk not in ("saved_digest", "loaded_digest")}
                          if v else None) for k, v in runs.items()}}
    return 1 if report("test_megatron_gpu", device, rows, results, extra, args.json) else 0


def planned_runs(args, work: str) -> dict[str, tuple[list[str], list[str]]]:
    """Each run's train_gpt.py options (its model's, the others but --window-mb), in RUNS' order;
    the 'auto' run only with --auto-steps."""
    model, timing_model = shlex.split(args.model), shlex.split(args.timing_model)
    # The 168 M runs: the window takes what torch keeps cached (Note [The window and torch's
    # cache] in deferalloc/megatron.py); the timing runs: the plain step.
    steps = ["--steps", str(args.steps)]
    dfa = ["--release-torch-cache"]
    timing = ["--steps", str(args.timing_steps)]
    # The two deferalloc timing runs differ only in --step-in-backward: both reduce with
    # overlap_grad_reduce and clip at a norm never reached (the step inside backward then
    # speculates and commits from its second iteration: its best case; a clip that fires every
    # iteration makes it the plain step after backward, deferalloc.overlap's "after" mode).
    unclipped = ["--overlap-grad-reduce", "--clip-grad", "1e9"]
    # BF16 grad buffers, the device tier, every bucket held for Megatron's clip (policy after):
    # each pass reads Megatron's .float() copies of the grads, made on the compute stream, while
    # the next forward allocates (Note [Grads freed behind a queued pass]).
    bf16 = timing + ["--overlap-grad-reduce", "--bf16-grads", "--deferalloc", "device"]
    plan = {
        "megatron": (model, steps),
        "deferalloc-host": (model, steps + dfa + ["--deferalloc", "host", "--save", f"{work}/ckpt_host",
                                                  "--save-at", str(args.save_at)]),
        "deferalloc-file": (model, steps + dfa + ["--deferalloc", "file", "--directory", f"{work}/state"]),
        "deferalloc-host-resumed": (model, steps + dfa + ["--deferalloc", "host", "--load", f"{work}/ckpt_host"]),
        "deferalloc-host-timing": (timing_model, timing + unclipped + ["--deferalloc", "host"]),
        "megatron-hdo-timing": (timing_model, timing + ["--hdo"]),
        "deferalloc-backward-timing": (timing_model, timing + unclipped + ["--deferalloc", "host",
                                                                           "--step-in-backward"]),
        "deferalloc-forward-timing": (timing_model, timing + unclipped + [
            "--deferalloc", "host", "--step-in-backward", "--overlap-param-gather", "--step-overlap-forward"]),
        "deferalloc-bf16grads-plain": (timing_model, bf16),
        "deferalloc-bf16grads-forward": (timing_model, bf16 + [
            "--step-in-backward", "--clip-policy", "after", "--overlap-param-gather", "--step-overlap-forward"]),
        "deferalloc-auto-timing": (timing_model, ["--steps", str(args.auto_steps), *unclipped, "--deferalloc", "host",
                                                  "--step-in-backward", "auto"]),
    }
    if not args.auto_steps:
        del plan["deferalloc-auto-timing"]
    return plan


def evaluate(args, runs: dict, link: float | None) -> tuple[list, list]:
    """The checks (what, value, ok: True / False / None for a figure shown beside them) and
    the JSON results of the runs' summaries; ``runs``: the part's runs only (None: one that
    failed), so that a check of a run the part did not do is left out; ``link``: duplex
    bytes/s each way (None: not measured, the part has no (c))."""
    did = runs.__contains__
    own, host, file_ = runs.get("megatron"), runs.get("deferalloc-host"), runs.get("deferalloc-file")
    resumed, host_t, hdo_t = (runs.get(k) for k in ("deferalloc-host-resumed", "deferalloc-host-timing",
                                                    "megatron-hdo-timing"))
    tiers = [(name, runs[k]) for name, k in (("host", "deferalloc-host"), ("file", "deferalloc-file")) if did(k)]
    rows: list[tuple[str, str, bool | None]] = []
    results: list[dict] = []

    def check(what: str, value: str, ok: bool | None, perf: bool = False) -> None:
        if perf and args.perf_targets == "report" and ok is not None:  # targets live in benchmarks
            value, ok = f"{value} ({'met' if ok else 'MISSED'}: performance target, reported only)", None
        rows.append((what, value, ok))

    def figure(name: str, value, unit: str, baseline: str | None = None) -> None:
        if value is not None:
            results.append({"name": name, "value": value, "unit": unit, "baseline": baseline})

    def same_losses(a, b, first=1):
        if a is None or b is None:
            return False
        return {k: v for k, v in a["losses"].items() if int(k) >= first} == \
               {k: v for k, v in b["losses"].items() if int(k) >= first}

    def first_difference(a, b):
        if a is None or b is None:
            return None
        return next((int(k) for k in sorted(a["losses"], key=int) if b["losses"].get(k) != a["losses"][k]), None)

    # (a) what Megatron's own run stepped with, and the losses.
    if did("megatron"):
        ref = (own or {}).get("reference", [{}])
        torch_fused = bool(own) and all(d.get("inner") == "torch.optim.adamw.AdamW" and d.get("fused") == ["True"]
                                        and d.get("param_dtypes") == ["torch.float32"] for d in ref)
        check("Megatron's reference: torch.optim.AdamW(fused=True) on FP32 main params",
              ", ".join(f"{d.get('inner')} fused={d.get('fused')} lr {d.get('lr_type')}" for d in ref) or "run failed",
              torch_fused)
    for name, r in tiers:
        ok = same_losses(r, own)
        diff = first_difference(r, own)
        check(f"losses {name} == Megatron FP32 ({args.steps} steps)",
              "bit-identical" if ok else f"first differ at step {diff}" if diff else "failed", ok)
        figure(f"losses_identical_{name}", int(ok), "bool")  # against Megatron's own optimizer
        if diff:
            figure(f"first_differing_step_{name}", diff, "step")

    # (b) HBM: against the part's first tier (host when it has one), as the figures' baseline.
    n = own["params"] if own else None
    if own and tiers and tiers[0][1]:
        bound = 12 * n - args.window_mb * MIB
        figure("hbm_saving_required", bound / MIB, "MiB")
        figure("peak_hbm_megatron", own["peak_hbm"] / MIB, "MiB")
        figure("between_hbm_megatron", own["between_hbm"] / MIB, "MiB")
        for name, r in tiers:
            if r is None:
                continue
            saved = own["peak_hbm"] - r["peak_hbm"]
            check(f"peak HBM saved, {name} (>= {bound / 2**30:.2f} GiB)",
                  f"{saved / 2**30:.2f} GiB ({own['peak_hbm'] / 2**30:.2f} -> {r['peak_hbm'] / 2**30:.2f})",
                  saved >= bound)
            saved_between = own["between_hbm"] - r["between_hbm"]
            check(f"HBM between steps saved, {name} (>= {bound / 2**30:.2f} GiB)",
                  f"{saved_between / 2**30:.2f} GiB", saved_between >= bound)
            figure(f"peak_hbm_{name}", r["peak_hbm"] / MIB, "MiB", "peak_hbm_megatron")
            figure(f"between_hbm_{name}", r["between_hbm"] / MIB, "MiB", "between_hbm_megatron")
        for name, r in (("megatron", own), *tiers):
            if r and "hbm" in r:
                b = r["hbm"]["between"]
                check(f"  HBM between steps, {name}: used / torch reserved / allocated / other",
                      f"{b['used'] / MIB:.0f} / {b['torch_reserved'] / MIB:.0f} / {b['torch_allocated'] / MIB:.0f} / "
                      f"{r['hbm']['non_torch_between'] / MIB:.0f} MiB", None)
                figure(f"non_torch_hbm_between_{name}", r["hbm"]["non_torch_between"] / MIB, "MiB",
                       None if name == "megatron" else "non_torch_hbm_between_megatron")
        if host:
            check("engine peak state HBM <= window", f"{host.get('engine_peak_backed', 0) / MIB:.0f} MiB",
                  host.get("engine_peak_backed", 1 << 62) <= args.window_mb * MIB)
            figure("engine_peak_state_hbm", host.get("engine_peak_backed", 0) / MIB, "MiB")

    # (c) step time on the timing model; the first step (first touch of pinned memory) untimed.
    def timed(r):
        return statistics.median(r["optimizer_seconds"][1:]) if r and len(r["optimizer_seconds"]) > 1 else None

    t_host, t_hdo = timed(host_t), timed(hdo_t)
    t_own_small, t_host_small = timed(own), timed(host)
    n_t = (host_t or hdo_t or {}).get("params")
    figure("link_duplex_each_way", link and link / 1e9, "GB/s")
    figure("optimizer_step_megatron_small", t_own_small and t_own_small * 1e3, "ms")
    figure("optimizer_step_host_small", t_host_small and t_host_small * 1e3, "ms", "optimizer_step_megatron_small")
    if t_host and t_hdo:
        bound_s = 12 * n_t / link
        check(f"optimizer step, {n_t / 1e9:.2f} G params: HDO / deferalloc host (>= 5)",
              f"{t_hdo / t_host:.2f}x ({t_hdo * 1e3:.0f} / {t_host * 1e3:.0f} ms)", t_hdo / t_host >= 5, perf=True)
        check("  link bound: 12 B/param each way at the duplex copy rate",
              f"{bound_s * 1e3:.0f} ms ({link / 1e9:.1f} GB/s each way): at best {t_hdo / bound_s:.2f}x HDO", None)
        e = host_t["engine"][-1]
        check("  deferalloc host: engine pass / host time mapping + retiring / pieces / Python",
              f"{e['seconds'] * 1e3:.0f} / {(e['map_seconds'] + e['retire_seconds']) * 1e3:.0f} ms / "
              f"{e['pieces']} / {e['python_seconds'] * 1e3:.1f} ms", None)
        hdo_ref = hdo_t["reference"][0].get("hdo", {})
        check("  HDO: CPU optimizers / fused / param dtypes / pinned / param_update_in_fp32",
              f"{hdo_ref.get('cpu_optimizers')} {hdo_ref.get('cpu_classes')} / {hdo_ref.get('cpu_fused')} / "
              f"{hdo_ref.get('cpu_param_dtypes')} / {hdo_ref.get('cpu_params_pinned')} / "
              f"{hdo_ref.get('param_update_in_fp32')}", None)
        figure("optimizer_step_hdo", t_hdo * 1e3, "ms")
        figure("optimizer_step_host", t_host * 1e3, "ms", "optimizer_step_hdo")
        figure("optimizer_step_link_bound", bound_s * 1e3, "ms")
        figure("throughput_hdo", n_t / t_hdo / 1e9, "Gparam/s")
        figure("throughput_host", n_t / t_host / 1e9, "Gparam/s", "throughput_hdo")
        figure("engine_pass_host", e["seconds"] * 1e3, "ms")
        figure("engine_map_retire_host", (e["map_seconds"] + e["retire_seconds"]) * 1e3, "ms")
    elif did("deferalloc-host-timing") or did("megatron-hdo-timing"):
        check("optimizer step: HDO / deferalloc host (>= 5)", "a timing run failed", False)  # not a target: it failed

    # (e), (f): the timing part's.
    if did("deferalloc-host-timing"):
        evaluate_iterations(args, runs, check, figure)

    # (d) checkpoint.
    if did("deferalloc-host-resumed"):
        ok = same_losses(resumed, host, args.save_at + 1) and resumed is not None \
            and resumed.get("loaded_digest") == host.get("saved_digest")
        check(f"save at {args.save_at}, load in a new process, continue to {args.steps}",
              "identical" if ok else "differ / failed", ok)
        figure("checkpoint_resume_identical", int(ok), "bool")

    # (g) BF16 grads.
    if did("deferalloc-bf16grads-plain"):
        a, b = runs.get("deferalloc-bf16grads-plain"), runs.get("deferalloc-bf16grads-forward")
        ok = bool(a and b) and a["losses"] == b["losses"]
        check("BF16 grads, device tier, held buckets across the next forward: losses == plain",
              "bit-identical" if ok else f"differ / failed ({(b or {}).get('backward_step')})", ok)
    return rows, results


def evaluate_iterations(args, runs: dict, check, figure) -> None:
    """(e) and (f): whole iterations (forward, backward, grad sync, step), the first untimed,
    and the 'auto' run; the resident one is Megatron's own run's when --model and
    --timing-model agree (the default)."""
    def iteration(r):
        return statistics.median(r["step_seconds"][1:]) if r and len(r.get("step_seconds", [])) > 1 else None

    own, host_t, hdo_t = runs.get("megatron"), runs.get("deferalloc-host-timing"), runs.get("megatron-hdo-timing")
    same_model = args.model == args.timing_model
    backward_t = runs.get("deferalloc-backward-timing")
    it = {"resident": iteration(own) if same_model else None, "hdo": iteration(hdo_t),
          "deferalloc plain": iteration(host_t), "step inside backward": iteration(backward_t)}
    check("iteration time: resident / HDO(offload 1.0) / deferalloc plain / step inside backward",
          " / ".join(f"{v * 1e3:.0f} ms" if v else "-" for v in it.values()), None)
    if backward_t:
        check("  step inside backward: engine counts", str(backward_t.get("backward_step")), None)
    ok = bool(backward_t and host_t) and backward_t["losses"] == host_t["losses"]
    check("  step inside backward: losses == deferalloc plain (the same settings)",
          "bit-identical" if ok else "differ / failed", ok)
    if it["resident"] and it["step inside backward"]:
        ratio = it["step inside backward"] / it["resident"]
        check("iteration: step inside backward / resident (<= 1.2)", f"{ratio:.2f}x", ratio <= 1.2, perf=True)
    if it["hdo"] and it["step inside backward"]:
        ratio = it["hdo"] / it["step inside backward"]
        check("iteration: HDO / step inside backward (>= 2)", f"{ratio:.2f}x", ratio >= 2, perf=True)
    forward_t = runs.get("deferalloc-forward-timing")
    it_fwd = iteration(forward_t)
    ok = bool(forward_t and host_t) and forward_t["losses"] == host_t["losses"]
    check("  step across the next forward: losses == deferalloc plain", "bit-identical" if ok else "differ / failed", ok)
    if forward_t:
        check("  step across the next forward: iteration, engine counts",
              f"{it_fwd * 1e3:.0f} ms, {forward_t.get('backward_step')}" if it_fwd else "-", None)
    if it_fwd and it["deferalloc plain"]:
        ratio = it_fwd / it["deferalloc plain"]
        check("iteration: step across the next forward / deferalloc plain (<= 1.0)", f"{ratio:.2f}x", ratio <= 1.0,
              perf=True)
    figure("iteration_step_across_next_forward", it_fwd and it_fwd * 1e3, "ms")
    for name, v in it.items():
        figure(f"iteration_{name.replace(' ', '_')}", v and v * 1e3, "ms")
    if it["hdo"] and it["deferalloc plain"]:
        ratio = it["hdo"] / it["deferalloc plain"]
        check("iteration: HDO / deferalloc plain (>= 2)", f"{ratio:.2f}x", ratio >= 2, perf=True)
    if it["resident"] and it["deferalloc plain"]:
        check("  iteration: deferalloc plain / resident", f"{it['deferalloc plain'] / it['resident']:.2f}x", None)

    # (f) step_in_backward="auto": 2 warm-up + 6 probe iterations, then the chosen mode.
    auto_t = runs.get("deferalloc-auto-timing")
    if args.auto_steps and "deferalloc-auto-timing" in runs:
        n = min(len(host_t["losses"]) if host_t else 0, args.auto_steps)
        ok = bool(auto_t and host_t) and all(auto_t["losses"][k] == host_t["losses"][k] for k in host_t["losses"]
                                             if int(k) <= n)
        check(f"step_in_backward='auto': losses == deferalloc plain (steps 1-{n})",
              "bit-identical" if ok else "differ / failed", ok)
        aside = ((auto_t or {}).get("backward_step") or {}).get("step_aside")
        check("  step_in_backward='auto': its choice", str(aside), None)
        after = auto_t["step_seconds"][8:] if auto_t else []
        best = min((v for v in (it["deferalloc plain"], it["step inside backward"]) if v), default=None)
        if after and best:
            ratio = statistics.median(after) / best
            check("iteration: 'auto' after its probe / the faster of plain and inside (<= 1.1)",
                  f"{statistics.median(after) * 1e3:.0f} ms, {ratio:.2f}x", ratio <= 1.1, perf=True)
            figure("iteration_step_in_backward_auto", statistics.median(after) * 1e3, "ms")
        elif args.auto_steps > 8:
            check("iteration: 'auto' after its probe", "a timing run failed", False)


if __name__ == "__main__":
    sys.exit(main())
