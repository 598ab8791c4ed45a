"""deferalloc.megatron with compressed moments and resident shards on the CPU (gloo,
cpu_emulation, deferalloc's host driver): ``stream_optimizer_state(moment_dtype=, resident_mb=)``
at DP 1, DP 2, TP 2 and PP 2.

Two sets of processes (torchrun, this file with --worker): one for DP 1, one for DP 2,
TP 2 and PP 2 in turn (Megatron's model-parallel groups made again between layouts).  Per
layout, the tiny 2-layer model of test_megatron_parallel.py is built five times, host tier:
  fp32:     FP32 moments, all streamed, 4 steps (the reference; test_megatron_cpu,
            test_megatron_dp2_cpu and test_megatron_parallel check it bit-identical to
            Megatron's own optimizer);
  resident: FP32 moments, resident_mb=1 (the first shards resident, the rest streamed):
            losses and final state bit-identical to fp32's; at DP 1 also the same with clipping
            never firing, the plain step and the step inside backward (bit-identical; clip policy
            auto: the buckets with a resident shard wait for the clip coefficient, the others
            speculate, no state is copied out);
  bf16:     BF16 moments: losses within a relative TOLERANCE of fp32's; a dist-checkpoint
            saved after step 2;
  fp32 <- bf16: that checkpoint loaded with FP32 moments: the loaded state equals the saved
            one bit for bit (Megatron's checkpoints hold FP32 values whatever the format);
  int8 <- bf16: loaded with int8 moments, steps 3-4: losses within TOLERANCE of fp32's.
The DP 1 set also checks resident_budgets' split over a chain and the file tier's refusal
of resident_mb.  Newest tested megatron-core only (ctest test_megatron_moments_<version>).
Exit 0 / 1; 77 without megatron-core.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

# Relative loss difference allowed against FP32 moments over 4 steps of the tiny model (the
# measured one is printed; BF16 and int8 moments round m and v, the arithmetic stays FP32).
TOLERANCE = 1e-3
MODEL = ["--cpu-emulation", "--layers", "2", "--hidden", "32", "--heads", "4", "--vocab", "64", "--seq", "16",
         "--batch", "4", "--steps", "4"]
LAYOUTS = {"dp1": ([], 1, (1, 1)), "dp2": ([], 2, (1, 1)), "tp2": (["--tp", "2"], 2, (2, 1)),
           "pp2": (["--pp", "2"], 2, (1, 2))}  # example arguments, processes, (TP, PP)
LAUNCHES = (("dp1",), ("dp2", "tp2", "pp2"))  # one set of processes each


def worker(argv: list[str]) -> int:
    sys.path.insert(0, os.path.join(HERE, "..", "..", "examples", "megatron"))
    import cpu_emulation
    import torch
    import train_gpt

    ap = argparse.ArgumentParser()
    ap.add_argument("--layouts", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--summary", required=True)
    mine = ap.parse_args(argv)
    out: dict = {}
    for k, name in enumerate(mine.layouts.split(",")):
        layout = LAYOUTS[name][0]
        if k == 0:
            train_gpt.setup(train_gpt.parse_args(MODEL + layout))
        else:  # the same processes, another model-parallel layout
            from megatron.core import parallel_state  # (after setup's cpu_emulation.enable())
            parallel_state.destroy_model_parallel()
            parallel_state.initialize_model_parallel(*LAYOUTS[name][2])
            cpu_emulation.after_model_parallel_init()
        out[name] = layout_runs(train_gpt, layout, os.path.join(mine.work, name))
    if "dp1" in out:
        out["unit"] = unit_checks(mine.work)
    if torch.distributed.get_rank() == 0:
        with open(mine.summary, "w") as f:
            json.dump(out, f)
    torch.distributed.barrier()
    train_gpt.teardown()
    return 0


def layout_runs(train_gpt, layout: list[str], work: str) -> dict:
    """The layout's runs (the module's docstring); what each gave."""
    import torch
    device = torch.device("cpu")
    out: dict = {}

    def run(name: str, extra: list[str], steps=range(1, 5), save_at=None, load=None) -> None:
        args = train_gpt.parse_args(MODEL + layout + ["--deferalloc", "host", *extra])
        gpt, ddp, optimizer, streamed = train_gpt.build(args)
        r = out[name] = {"losses": {}}
        if load:
            train_gpt.load(gpt, optimizer, load)
            r["loaded_digest"] = train_gpt.state_digest(optimizer)
        for step in steps:
            r["losses"][step] = train_gpt.train_step(args, ddp, optimizer, step, device)[0]
            if step == save_at:
                train_gpt.save(gpt, optimizer, os.path.join(work, name), step)
                r["saved_digest"] = train_gpt.state_digest(optimizer)
        if steps:
            r["final_digest"] = train_gpt.state_digest(optimizer)
        if streamed[0].backward_step is not None:
            streamed[0].backward_step.synchronize()
            r["counts"] = streamed[0].backward_step.stats()
        if args.resident_mb:  # (a resident shard cannot speculate; a streamed one on the host tier can)
            held = [(s, p) for s in streamed for p in s.held_params]
            resident = sum(not s.can_speculate(p) for s, p in held)
            counts = torch.tensor([resident, len(held) - resident])
            torch.distributed.all_reduce(counts)
            r["resident_shards"] = counts.tolist()

    run("fp32", [])
    run("resident", ["--resident-mb", "1"])
    if not layout:  # DP 1: the step inside backward with resident shards, clipping never firing
        never = ["--resident-mb", "1", "--clip-grad", "1e9", "--overlap-grad-reduce", "--bucket-size", "2000"]
        run("resident_noclip", never)
        run("resident_inside", never + ["--step-in-backward"])
    run("bf16", ["--moment-dtype", "bf16"], save_at=2)
    run("fp32_from_bf16", [], steps=(), load=os.path.join(work, "bf16"))
    run("int8_from_bf16", ["--moment-dtype", "int8"], steps=(3, 4), load=os.path.join(work, "bf16"))
    return out


def unit_checks(work: str) -> dict:
    """resident_budgets (Note [resident_mb="auto"]); the file tier takes resident_mb with fp32
    moments and refuses it with compressed ones."""
    import torch

    from deferalloc.optim import InvalidArgumentError, StreamedAdamW, resident_budgets
    cpu = torch.device("cpu")
    out = {"split": resident_budgets(8, "host", 4, cpu, [300, 100]) == [6, 2] and
           resident_budgets(None, "host", 4, cpu, [1, 1]) == [None, None] and
           resident_budgets("auto", "host", 4, cpu, [1, 1]) == [0, 0]}
    try:
        resident_budgets(1.5, "host", 4, cpu, [1])
        out["bad_refused"] = False
    except InvalidArgumentError:
        out["bad_refused"] = True
    out["split"] = out["split"] and resident_budgets("auto", "file", 4, cpu, [1], moment_dtype="int8") == [0]
    os.makedirs(os.path.join(work, "file"), exist_ok=True)
    try:
        StreamedAdamW([torch.zeros(4, requires_grad=True)], tier="file", directory=os.path.join(work, "file"),
                      window_mb=4, resident_mb=1, moment_dtype="bf16")
        out["file_refused"] = "not refused"
    except InvalidArgumentError as e:
        out["file_refused"] = str(e)
    try:
        StreamedAdamW([torch.zeros(4, requires_grad=True)], tier="file", directory=os.path.join(work, "file"),
                      window_mb=4, resident_mb=1, overwrite=True)
        out["file_taken"] = "ok"
    except Exception as e:  # noqa: BLE001 (reported)
        out["file_taken"] = f"{type(e).__name__}: {e}"
    return out


def close(a: dict, b: dict, steps) -> tuple[bool, float]:
    worst = max(abs(a[str(s)] - b[str(s)]) / abs(b[str(s)]) for s in steps)
    return worst <= TOLERANCE, worst


def main() -> int:
    from megatron_runs import report, require_megatron, torchrun, work_dir
    version = require_megatron()
    work = work_dir("dfa_megatron_moments_")
    env = dict(os.environ)
    wall: dict[str, float] = {}
    rows = []
    for names in LAUNCHES:
        tag = "+".join(names)
        worker_args = ["--worker", "--layouts", ",".join(names), "--work", work]
        if LAYOUTS[names[0]][1] == 1:
            out = single(tag, worker_args, env, work, wall)
        else:
            out = torchrun(tag, LAYOUTS[names[0]][1], worker_args, env, work, wall, __file__)
        if out is None:
            rows.append((f"{tag}: the runs", "failed", False))
            continue
        for name in names:
            rows += layout_rows(name, out[name])
        if "unit" in out:
            u = out["unit"]
            rows.append(("resident_budgets: a chain shares the budget by elements; auto is 0 on the CPU",
                         "ok" if u["split"] else "wrong", u["split"]))
            rows.append(("resident_budgets: resident_mb=1.5 refused", "ok" if u["bad_refused"] else "accepted",
                         u["bad_refused"]))
            ok = "resident_mb" in u["file_refused"] and "fp32 moments" in u["file_refused"]
            rows.append(("file tier, bf16 moments: resident_mb refused (InvalidArgumentError naming both)",
                         u["file_refused"], ok))
            rows.append(("file tier, fp32 moments: resident_mb=1 taken", u["file_taken"], u["file_taken"] == "ok"))
    print(f"megatron-core {version}; wall seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in wall.items()))
    failed = report("test_megatron_moments", f"CPU emulation (gloo), megatron-core {version}", rows, [],
                    {"wall_seconds": wall}, None)
    return 1 if failed else 0


def single(tag: str, worker_args: list[str], env: dict, work: str, wall: dict) -> dict | None:
    """One worker process without torchrun (its agent's start is most of a small run)."""
    summary = os.path.join(work, f"{tag}.json")
    env = dict(env, MASTER_PORT=str(29600 + os.getpid() % 300))
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, __file__, *worker_args, "--summary", summary], env=env,
                       capture_output=True, text=True, timeout=600)
    wall[tag] = time.perf_counter() - t0
    print(f"--- {tag} (1 process, {wall[tag]:.0f} s, rc {r.returncode})", flush=True)
    if r.returncode != 0:
        print(r.stdout[-2000:], r.stderr[-4000:], flush=True)
        return None
    with open(summary) as f:
        return json.load(f)


def layout_rows(name: str, r: dict) -> list:
    rows = []
    fp32 = r["fp32"]
    ok = r["resident"]["losses"] == fp32["losses"] and r["resident"]["final_digest"] == fp32["final_digest"]
    rows.append((f"{name}: fp32 + resident_mb=1 == fp32 all streamed, 4 steps (losses, final state)",
                 "bit-identical" if ok else "differ", ok))
    resident, streamed = r["resident"]["resident_shards"]
    rows.append((f"{name}: resident_mb=1 keeps some shards resident, streams the rest",
                 f"{resident} resident, {streamed} streamed", resident > 0 and streamed > 0))
    if "resident_inside" in r:
        a, b = r["resident_inside"], r["resident_noclip"]
        ok = a["losses"] == b["losses"] and a["final_digest"] == b["final_digest"]
        rows.append((f"{name}: resident_mb=1, step inside backward == plain (clip never firing; losses, final state)",
                     "bit-identical" if ok else "differ", ok))
        c = a.get("counts", {})
        ok = c.get("kept_copies") == 0 and c.get("speculative_steps", 0) > 0
        rows.append((f"{name}: resident_mb=1, inside backward, clip policy auto: the buckets with a resident shard "
                     "wait for the clip coefficient (no state copied out), the others speculate",
                     f"kept_copies {c.get('kept_copies')}, speculative steps {c.get('speculative_steps')}, "
                     f"buckets {c.get('buckets')}", ok))
    ok, worst = close(r["bf16"]["losses"], fp32["losses"], range(1, 5))
    rows.append((f"{name}: bf16 moments, losses vs fp32 (relative, <= {TOLERANCE:g})", f"{worst:.2e}", ok))
    ok = r["fp32_from_bf16"]["loaded_digest"] == r["bf16"]["saved_digest"]
    rows.append((f"{name}: bf16 checkpoint loaded with fp32 moments: state = saved", "equal" if ok else "differ", ok))
    ok, worst = close(r["int8_from_bf16"]["losses"], fp32["losses"], (3, 4))
    rows.append((f"{name}: bf16 checkpoint loaded with int8 moments, steps 3-4 vs fp32", f"{worst:.2e}", ok))
    return rows


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        sys.exit(worker(sys.argv[2:]))
    sys.exit(main())
