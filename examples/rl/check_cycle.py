"""The colocated RL cycle's acceptance (examples/rl/colocated.py), one command, a table last:

    python examples/rl/check_cycle.py --device cpu                    # ctest test_rl_cycle_cpu
    python examples/rl/check_cycle.py --device cuda --json rl_cycle.json [--png rl_step.png]

Runs colocated.py (each run three processes) as:
  deferalloc   --saver deferalloc: both sides sleep between their turns
  none         --saver none: nobody sleeps (the reference)
  killed       --saver deferalloc, SIGKILL of both sides after step --kill-after
  resumed      --saver deferalloc --resume in the killed run's --directory, to the last step
  tms          (CUDA) --saver torch_memory_saver: the real package, same example, its preload
               mode (where that fails, its torch mode, whose CUDA graphs are not pauseable)
  none_nccl    (--trainer-backend single) --saver none with the trainer on NCCL (gloo on the CPU)
Checks (exit status 1 when one fails):
  * losses of every step bit-identical, deferalloc vs none (and tms vs none on CUDA);
  * rollouts identical (a digest of every step's sequences), deferalloc vs none;
  * the inference side's model: its logits close to the trainer's for the same tokens (the
    weight conversion), its cached greedy decode equal to Hugging Face's uncached forward
    (on the CPU; on CUDA each cached token the uncached forward's argmax or within
    rollout.DECODE_TOLERANCE of a tie: Note [Cached decode against the uncached forward]);
  * killed + resumed == deferalloc: losses, rollouts and the final optimizer state digest
    (main params, moments: Megatron's own accessor) bit for bit;
  * CUDA: sleep + wake per step (mean of the steps after the first, both sides) at least
    --speedup times faster than torch_memory_saver's; while one side works, the other holds
    at most its CUDA context + 256 MiB: each side asleep alone after the last step (its
    context measured as it started), and both asleep together at every hand-off (at most
    twice that).
The model's size: --model-args (colocated.py's options), a tiny one on the CPU, 68 M
parameters on CUDA (its file-tier state, 0.8 GB, is read, written and fdatasync'ed at every
step: a step of about a second on an H200 machine's disk).  --nccl-cumem-off runs every
trainer with NCCL_CUMEM_ENABLE=0, --nccl-small with 1 MiB NCCL buffers and one channel (both
off by default; Note [The trainer's NCCL setting] in colocated.py), checked in each run's report.
--trainer-backend single runs every trainer's process groups on the single-rank backend (no
NCCL; Note [A single-rank process group] in examples/megatron/single_rank.py), checked in each
run's report (no NCCL group), and the none_nccl run's losses, rollouts and final optimizer state
must equal the none run's bit for bit.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MIB = 1 << 20
HELD_LIMIT = 256 * MIB
# Seconds for one colocated.py run and for each of its sides' messages (building, a turn):
# the CPU's are for a loaded 2-core CI machine; CUDA's let a hung run fail while the GPU
# call has time for the others.
RUN_TIMEOUT = {"cpu": 900, "cuda": 300}
MESSAGE_TIMEOUT = {"cpu": 600, "cuda": 150}
LOGIT_TOLERANCE = 0.05  # BF16 models computed by two implementations: relative to the largest logit
MODELS = {"cpu": "--layers 2 --hidden 64 --heads 4 --vocab 128 --batch 4 --prompt-len 8 --gen-len 8 --window-mb 4",
          "cuda": "--layers 6 --hidden 768 --heads 12 --vocab 16384 --batch 8 --prompt-len 128 --gen-len 128 "
                  "--window-mb 256"}


def start(name: str, argv: list[str], work: str):
    out = os.path.join(work, f"{name}.json")
    cmd = [sys.executable, os.path.join(HERE, "colocated.py"), *argv, "--json", out]
    timeout = RUN_TIMEOUT["cuda" if "cuda" in argv else "cpu"]
    return (name, argv, out, time.perf_counter(), timeout,
            subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))


def finish(started, wall: dict) -> dict | None:
    name, argv, out, t0, timeout, proc = started
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
    wall[name] = time.perf_counter() - t0
    print(f"--- {name} ({wall[name]:.0f} s, rc {proc.returncode}): {' '.join(argv)}", flush=True)
    print("\n".join(line for line in stdout.splitlines() if line.startswith(("step", "memory", "mean"))), flush=True)
    if proc.returncode != 0:
        print(stdout[-3000:], stderr[-6000:], flush=True)
        return None
    with open(out) as f:
        return json.load(f)


def execute(args, cuda: bool, common: list, kill: int, work: str, runs: dict, wall: dict) -> None:
    """Every run into ``runs``.  The CPU runs but the resumed one side by side (their
    processes mostly wait); CUDA's one after another (one GPU, timed, its memory measured).
    CUDA, where a saver's preload mode fails (said in the checks, the failure kept): the
    deferalloc runs go on in deferalloc's torch mode; torch_memory_saver's run again in its
    torch mode (no pauseable CUDA graph there)."""
    dfa = ["--saver", "deferalloc"] + (["--hook-mode", args.hook_mode] if args.hook_mode else [])

    def extra_of(name: str) -> list:
        return {"deferalloc": dfa, "none": ["--saver", "none"], "killed": dfa + ["--kill-after-step", str(kill)],
                "resumed": dfa + ["--resume"], "tms": ["--saver", "torch_memory_saver", "--hook-mode", "preload"],
                "none_nccl": ["--saver", "none", "--trainer-backend", "nccl"]}[name]

    names = ["deferalloc", "none", "killed"] + (["none_nccl"] if args.trainer_backend == "single" else []) + \
        ["resumed"] + (["tms"] if cuda and not args.no_tms else [])
    pending = []
    for name in names:
        d = os.path.join(work, "killed" if name == "resumed" else name)
        if not cuda and name != "resumed":
            pending.append(start(name, common + extra_of(name) + ["--directory", d], work))
            continue
        for p in pending:
            runs[p[0]] = finish(p, wall)
        pending = []
        runs[name] = finish(start(name, common + extra_of(name) + ["--directory", d], work), wall)
        if runs[name] is None and cuda and name in ("deferalloc", "tms") and not (name == "deferalloc"
                                                                                 and args.hook_mode):
            print(f"{name}: its preload mode failed; its torch hook mode instead", flush=True)
            runs[f"{name}_preload"] = None
            if name == "deferalloc":
                dfa = ["--saver", "deferalloc", "--hook-mode", "torch"]
                extra = dfa
            else:
                extra = ["--saver", "torch_memory_saver", "--hook-mode", "torch"]
            runs[name] = finish(start(name, common + extra + ["--directory", d + "_torch"], work), wall)


def missing(device: str) -> str | None:
    """Why the cycle cannot run here (None: it can): megatron-core and transformers importable,
    DFA_MEGATRON_CORE_DIR (the tests' megatron-core directory) present where it is set, a GPU
    for --device cuda."""
    import importlib.util
    if device == "cuda":
        import torch
        if not torch.cuda.is_available():
            return "--device cuda: no CUDA device visible"
    where = os.environ.get("DFA_MEGATRON_CORE_DIR")
    if where and not os.path.isdir(os.path.join(where, "megatron", "core")):
        return f"no megatron-core in {where}; scripts/setup.sh unpacks the tested versions there"
    for name in ("megatron.core", "transformers"):
        try:
            found = importlib.util.find_spec(name) is not None
        except ImportError:
            found = False
        if not found:
            return f"{name} is not importable"
    return None


def by_step(report: dict, key: str) -> dict:
    return {r["step"]: r[key] for r in report["steps"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--steps", type=int, default=None, help="default: 3 on the CPU, 5 on CUDA")
    ap.add_argument("--kill-after", type=int, default=None, help="default: steps - 2 (at least 1)")
    ap.add_argument("--model-args", help="colocated.py's model options (default: MODELS[device])")
    ap.add_argument("--speedup", type=float, default=5.0, help="CUDA: sleep + wake at least this much faster than TMS")
    ap.add_argument("--no-tms", action="store_true", help="CUDA: skip the torch_memory_saver run")
    ap.add_argument("--hook-mode", choices=["preload", "torch"],
                    help="deferalloc.memory_saver's hook mode (default: colocated.py's, preload on CUDA); "
                         "torch_memory_saver runs in preload mode, the one where it pauses CUDA graphs")
    ap.add_argument("--nccl-cumem-off", action="store_true",
                    help="every run's trainer with NCCL_CUMEM_ENABLE=0 (colocated.py's option; default: NCCL's own)")
    ap.add_argument("--nccl-small", action="store_true",
                    help="every run's trainer with NCCL_BUFFSIZE=1 MiB, NCCL_MIN/MAX_NCHANNELS=1 (colocated.py's "
                         "option; default: NCCL's own)")
    ap.add_argument("--trainer-backend", choices=["nccl", "single"], default="nccl",
                    help="every run's trainer on this process-group backend (colocated.py's option)")
    ap.add_argument("--pool-cache-mb", type=int,
                    help="every run's sides with deferalloc's pool_cache_mb (colocated.py's option)")
    ap.add_argument("--json", help="every run's report and the checks")
    ap.add_argument("--png", help="the deferalloc run's last step as a timeline (plot_timeline.py)")
    args = ap.parse_args()
    why = missing(args.device)
    if why:
        print(f"SKIP: {why}")
        return 77
    cuda = args.device == "cuda"
    steps = args.steps or (5 if cuda else 3)
    kill = args.kill_after or max(1, steps - 2)
    model = (args.model_args or MODELS[args.device]).split()
    work = tempfile.mkdtemp(prefix="dfa_rl_")
    wall: dict = {}
    common = ["--device", args.device, "--steps", str(steps), "--message-timeout", str(MESSAGE_TIMEOUT[args.device]),
              *model] + (["--nccl-cumem-off"] if args.nccl_cumem_off else []) + \
        (["--nccl-small"] if args.nccl_small else []) + ["--trainer-backend", args.trainer_backend] + \
        ([] if args.pool_cache_mb is None else ["--pool-cache-mb", str(args.pool_cache_mb)])
    runs: dict = {}
    try:
        execute(args, cuda, common, kill, work, runs, wall)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = [launcher_environment(), trainer_nccl_setting()] + checks(runs, steps, kill, cuda, args.speedup)
    table(runs, cuda)
    width = max(len(r[0]) for r in rows)
    for what, value, ok in rows:
        print(f"{'    ' if ok is None else 'PASS' if ok else 'FAIL'}  {what:<{width}}  {value}")
    failed = sum(ok is False for _, _, ok in rows)
    print(f"{sum(ok is True for _, _, ok in rows)}/{sum(ok is not None for _, _, ok in rows)} checks passed; "
          f"wall seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in wall.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(document(runs, rows, wall, device_name(cuda)), f, indent=1)
    if args.png and runs.get("deferalloc"):
        import plot_timeline
        plot_timeline.plot(runs["deferalloc"], args.png, others={"torch_memory_saver": runs.get("tms")})
    return 1 if failed else 0


def document(runs: dict, rows: list, wall: dict, device: str) -> dict:
    """The run in benchmarks/bench_json.py's schema (benchmarks/plot.py renders it): each
    saver's sleep + wake per step (the steps after the first: both sides, and each side),
    the step and its share, and what each side held asleep beyond its context (and how much
    of it no allocator holds); deferalloc's rows name torch_memory_saver's as baseline.
    extra: the checks, every run's report, the wall seconds."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "benchmarks"))
    import bench_json
    label = {}
    for key, name in (("tms", "torch_memory_saver 0.0.10"), ("deferalloc", "deferalloc.memory_saver")):
        r = runs.get(key)
        if r and "summary" in r:
            nccl = (", NCCL_CUMEM_ENABLE=0" if r["args"].get("nccl_cumem_off") else "") + \
                (", NCCL 1 MiB buffers, 1 channel" if r["args"].get("nccl_small") else "") + \
                (", single-rank process groups" if r["args"].get("trainer_backend") == "single" else "")
            label[key] = f"{name} (hook_mode {r['args']['hook_mode']}{nccl})"
    results = []
    for key, who in label.items():
        r, sm = runs[key], runs[key]["summary"]
        base = label.get("tms") if key == "deferalloc" else None
        results += [bench_json.result(f"{who}: trainer sleep + wake per step", 1e3 * sm["trainer_sleep_wake_s"], "ms"),
                    bench_json.result(f"{who}: inference sleep + wake per step", 1e3 * sm["inference_sleep_wake_s"], "ms"),
                    bench_json.result(f"{who}: sleep + wake per step", 1e3 * sm["sleep_wake_s"], "ms",
                                      base and f"{base}: sleep + wake per step"),
                    bench_json.result(f"{who}: RL step", 1e3 * sm["wall_s"], "ms", base and f"{base}: RL step"),
                    bench_json.result(f"{who}: share of the step in sleep + wake", 100 * sm["share"], "%")]
        for side in ("trainer", "inference"):
            v = r.get("memory", {}).get(f"{side}_held_asleep")
            if v is not None:
                results.append(bench_json.result(f"{who}: {side} asleep, held beyond its CUDA context", v / MIB, "MiB"))
            rest = r.get("held_items", {}).get(side, {}).get("rest")
            if rest is not None:
                results.append(bench_json.result(f"{who}: {side} asleep, of it held by no allocator", rest / MIB, "MiB"))
    return bench_json.document("rl_cycle", results, device,
                               extra={"checks": [{"what": w, "value": v, "ok": o} for w, v, o in rows],
                                      "runs": runs, "wall_seconds": wall})


def checks(runs: dict, steps: int, kill: int, cuda: bool, speedup: float) -> list:
    rows = []
    for name, r in runs.items():
        mode = f" (hook_mode {r['args']['hook_mode']})" if r and r["args"]["saver"] != "none" else ""
        rows.append((f"{name}: ran{mode}", "ok" if r else "failed", r is not None))
        want = r and trainer_nccl_wanted(r["args"])
        if want:  # --nccl-cumem-off and --nccl-small: what the trainer's NCCL saw
            seen = r.get("trainer_built", {}).get("nccl_environment", {})
            flags = " ".join(f for f in ("--nccl-cumem-off", "--nccl-small") if r["args"].get(f[2:].replace("-", "_")))
            rows.append((f"{name}: its trainer ran with {', '.join(f'{k}={v}' for k, v in want.items())} ({flags})",
                         repr({k: seen.get(k) for k in want}), all(seen.get(k) == v for k, v in want.items())))
        if r and r["args"].get("trainer_backend") == "single":  # no NCCL communicator can exist
            groups = r.get("trainer_built", {}).get("process_groups", [])
            rows.append((f"{name}: its trainer's process groups (--trainer-backend single): single_rank, none NCCL",
                         ", ".join(groups) or "none reported",
                         "single_rank" in groups and not any("nccl" in g for g in groups)))
    d, n, k, res = (runs.get(x) for x in ("deferalloc", "none", "killed", "resumed"))
    if d:
        slept = all(r[side][key] > 0 for r in d["steps"] for side in ("trainer", "inference")
                    for key in ("sleep_s", "wake_s"))
        rows.append(("deferalloc: both sides slept and woke in every step", "yes" if slept else "no", slept))
        c = d["inference_built"]["conversion"]
        ok = c["cached_equals_uncached"]
        if not cuda:  # exact on the CPU
            rows.append(("inference: cached greedy decode == Hugging Face's uncached forward",
                         "equal" if ok else "differ", ok))
        # Note [Cached decode against the uncached forward] (rollout.py): BF16 GEMMs of other
        # shapes on a GPU, so every cached token is the uncached argmax or a near-tie.
        tol = c["decode_tolerance"]
        rows.append((f"inference: cached decode's tokens == uncached forward's argmax (or a tie within {tol:g} x "
                     f"the largest |logit|)", f"{c['decode_argmax_differ']} of {c['decode_positions']} differ, "
                     f"largest gap {c['decode_max_gap']:.3g}; sequences {'equal' if ok else 'differ'}",
                     c["decode_within_tolerance"] and (ok or cuda)))
        ok = c["max_abs_logit_diff"] <= LOGIT_TOLERANCE * max(1.0, c["max_abs_logit"]) and c["argmax_agree"] >= 0.9
        rows.append((f"inference: converted GPT-2's logits vs Megatron's (BF16; <= {LOGIT_TOLERANCE:g} x max, "
                     f"argmax >= 90%)", f"{c['max_abs_logit_diff']:.3g} of {c['max_abs_logit']:.3g}, argmax "
                     f"{100 * c['argmax_agree']:.0f}%", ok))
    if d and n:
        same = by_step(d, "loss") == by_step(n, "loss") and len(d["steps"]) == steps
        rows.append((f"losses, {steps} steps: sleeping == nobody sleeping", "bit-identical" if same else
                     f"differ {by_step(d, 'loss')} {by_step(n, 'loss')}", same))
        same = by_step(d, "rollout_digest") == by_step(n, "rollout_digest")
        rows.append(("rollouts: inference paused between steps == never paused", "identical" if same else "differ",
                     same))
        same = d.get("final_digest") == n.get("final_digest")
        rows.append(("final optimizer state: sleeping == nobody sleeping", "equal" if same else "differ", same))
    ref = runs.get("none_nccl")
    if n and ref:  # --trainer-backend single: its in-place collectives give what NCCL's (gloo's) do
        same = (by_step(n, "loss") == by_step(ref, "loss") and by_step(n, "rollout_digest") == by_step(
            ref, "rollout_digest") and n.get("final_digest") == ref.get("final_digest"))
        rows.append(("nobody sleeping, single-rank process groups == NCCL's (gloo on the CPU): losses, rollouts, "
                     "final optimizer state", "identical" if same else
                     f"differ {by_step(n, 'loss')} {by_step(ref, 'loss')}", same))
    if d and k and res:
        joined = {**by_step(k, "loss"), **by_step(res, "loss")}
        ok = (k.get("killed_after_step") == kill and res["trainer_built"]["first_step"] == kill + 1
              and joined == by_step(d, "loss"))
        rows.append((f"killed after step {kill}, resumed from the file tier: losses == uninterrupted",
                     "bit-identical" if ok else f"differ {joined}", ok))
        joined = {**by_step(k, "rollout_digest"), **by_step(res, "rollout_digest")}
        ok = joined == by_step(d, "rollout_digest")
        rows.append(("resumed: rollouts == uninterrupted", "identical" if ok else "differ", ok))
        ok = res.get("final_digest") == d.get("final_digest")
        rows.append(("resumed: final optimizer state == uninterrupted", "equal" if ok else "differ", ok))
    t = runs.get("tms")
    if cuda and t and n:
        same = by_step(t, "loss") == by_step(n, "loss")
        rows.append(("torch_memory_saver: losses == nobody sleeping", "bit-identical" if same else "differ", same))
    if cuda and d:
        sd = d["summary"]
        if t:
            st = t["summary"]
            ratio = st["sleep_wake_s"] / sd["sleep_wake_s"] if sd["sleep_wake_s"] else float("inf")
            rows.append((f"sleep + wake per step vs torch_memory_saver (>= {speedup:g}x faster)",
                         f"{sd['sleep_wake_s'] * 1e3:.1f} ms vs {st['sleep_wake_s'] * 1e3:.1f} ms: {ratio:.1f}x",
                         ratio >= speedup))
        m = d["memory"]
        for side in ("trainer", "inference"):
            v = m.get(f"{side}_held_asleep")
            rows.append((f"{side} asleep after the last step: held beyond its CUDA context (<= 256 MiB)",
                         "?" if v is None else f"{v / MIB:.0f} MiB{held_by(d, side)}", v is not None and v <= HELD_LIMIT))
        held = sd["held_both_asleep_max"]
        rows.append(("both asleep at each hand-off: held beyond both contexts together (most)",
                     f"{held / MIB:.0f} MiB", held <= 2 * HELD_LIMIT))
        rows.append(("share of a step in sleep + wake (deferalloc)", f"{100 * sd['share']:.1f}%", None))
        if t:
            rows.append(("share of a step in sleep + wake (torch_memory_saver)", f"{100 * t['summary']['share']:.1f}%",
                         None))
    return rows


def held_by(report: dict, side: str) -> str:
    """colocated.itemise's row for ``side``, short: torch's default pool (reserved /
    allocated), deferalloc's backed and cached bytes, the rest."""
    h = report.get("held_items", {}).get(side)
    if not h:
        return ""
    text = (f" (torch outside regions {h['torch_default_pool_reserved'] / MIB:.0f} reserved / "
            f"{h['torch_default_pool_allocated'] / MIB:.0f} allocated")
    if "deferalloc_backed" in h:
        text += (f", deferalloc {h['deferalloc_backed'] / MIB:.0f} backed / "
                 f"{h.get('deferalloc_pool_cached', 0) / MIB:.0f} cached")
    return text + (f", rest {h['rest'] / MIB:.0f})" if "rest" in h else ")")


def device_name(cuda: bool) -> str:
    if cuda:
        import torch
        return torch.cuda.get_device_name(0)
    return "cpu"


def launcher_environment() -> tuple:
    """A check row: colocated.py's child environment (its saver's one-shot
    configure_subprocess) entered once per child: two in a row, each setting the preload
    library and restoring LD_PRELOAD (the preload form, reachable without a GPU)."""
    sys.path.insert(0, HERE)
    import colocated
    args = colocated.parse_args(["--device", "cuda", "--saver", "deferalloc", "--hook-mode", "preload",
                                 "--directory", "unused"])
    before = os.environ.get("LD_PRELOAD")
    try:
        seen = []
        for _ in range(2):
            with colocated.child_environment(args):
                seen.append("deferalloc_preload" in os.environ.get("LD_PRELOAD", ""))
        ok, value = all(seen) and os.environ.get("LD_PRELOAD") == before, f"{seen}"
    except Exception as e:  # noqa: BLE001 - the check's value
        ok, value = False, f"{type(e).__name__}: {e}"
    return ("launcher: each child started in its own saver environment (preload form, twice)", value, ok)


def trainer_nccl_wanted(run_args: dict) -> dict:
    """The NCCL variables a run's trainer must have run with (its --nccl-* flags)."""
    import colocated
    return colocated.trainer_environment(argparse.Namespace(nccl_cumem_off=run_args.get("nccl_cumem_off", False),
                                                            nccl_small=run_args.get("nccl_small", False)))


def trainer_nccl_setting() -> tuple:
    """A check row: --nccl-cumem-off gives the trainer NCCL_CUMEM_ENABLE=0, --nccl-small
    NCCL_BUFFSIZE=1 MiB and one channel, both together all four, and nothing is set without
    them (Note [The trainer's NCCL setting] in colocated.py)."""
    import colocated
    base = ["--device", "cpu", "--directory", "unused"]
    env = {flags: colocated.trainer_environment(colocated.parse_args(base + list(flags)))
           for flags in ((), ("--nccl-cumem-off",), ("--nccl-small",), ("--nccl-cumem-off", "--nccl-small"))}
    cumem, small = {"NCCL_CUMEM_ENABLE": "0"}, {"NCCL_BUFFSIZE": "1048576", "NCCL_MIN_NCHANNELS": "1",
                                                "NCCL_MAX_NCHANNELS": "1"}
    want = {(): {}, ("--nccl-cumem-off",): cumem, ("--nccl-small",): small,
            ("--nccl-cumem-off", "--nccl-small"): {**cumem, **small}}
    ok = env == want
    value = f"{env[('--nccl-small',)]}; the other 3 combinations as expected" if ok else \
        " / ".join(f"{' '.join(k) or 'none'}: {v}" for k, v in env.items())
    return ("trainer: --nccl-cumem-off sets NCCL_CUMEM_ENABLE=0, --nccl-small NCCL_BUFFSIZE=1 MiB and one "
            "channel, nothing without them", value, ok)


def table(runs: dict, cuda: bool) -> None:
    """Per step: each side's sleep + wake (ms) for each saver, their ratio, the step's share."""
    d, t = runs.get("deferalloc"), runs.get("tms")
    if not d:
        return
    print("step | trainer s+w ms | inference s+w ms | step ms | share"
          + (" | TMS trainer s+w | TMS inference s+w | TMS step ms | ratio" if t else ""))
    tsteps = {r["step"]: r for r in t["steps"]} if t else {}
    for r in d["steps"]:
        tr = r["trainer"]["sleep_s"] + r["trainer"]["wake_s"]
        inf = r["inference"]["sleep_s"] + r["inference"]["wake_s"]
        line = f"{r['step']:4d} | {tr * 1e3:14.1f} | {inf * 1e3:16.1f} | {r['wall_s'] * 1e3:7.0f} | {100 * r['share']:4.1f}%"
        o = tsteps.get(r["step"])
        if o:
            ttr = o["trainer"]["sleep_s"] + o["trainer"]["wake_s"]
            tin = o["inference"]["sleep_s"] + o["inference"]["wake_s"]
            ratio = o["sleep_wake_s"] / r["sleep_wake_s"] if r["sleep_wake_s"] else float("inf")
            line += f" | {ttr * 1e3:15.1f} | {tin * 1e3:17.1f} | {o['wall_s'] * 1e3:11.0f} | {ratio:5.1f}x"
        print(line)
    if cuda:
        for name, r in (("deferalloc", d), ("torch_memory_saver", t)):
            if r:
                print(f"memory, {name} (MiB): " + ", ".join(f"{k} {v / MIB:.0f}" for k, v in r["memory"].items()))


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    sys.exit(main())
