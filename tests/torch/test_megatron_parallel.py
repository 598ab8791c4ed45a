"""deferalloc.megatron under tensor and pipeline parallelism, on the CPU (gloo, cpu_emulation,
deferalloc's host driver): TP 2, PP 2 and TP 2 x DP 2.

For each layout, examples/megatron/train_gpt.py under torchrun (a 2-layer model of the
installed megatron-core's recommended class, embeddings untied (the default); PP 2 through
megatron-core's pipeline schedule and finalize_model_grads):
  1. deferalloc host tier with resident_mb=1 (the first shards resident in the device
     memory, the rest streamed) against Megatron's own DistributedOptimizer at the same
     layout (with CUDA's AdamW roundings, megatron_cuda_rounding.py), 4 steps: losses and
     the final optimizer state (a digest over every rank's main params and moments)
     bit-identical;
  2. Megatron dist-checkpointing save after step 2, a new set of processes loads it
     (all streamed):
     the loaded state equals the saved one, steps 3-4 and the final state identical to the
     uninterrupted run;
  3. TP 2 x DP 2 loads TP 2's (DP 1) checkpoint: the loaded state equals the saved one
     (dp_reshardable resharding at another data-parallel size, beside TP);
  4. the step inside backward across the next forward (``step_overlap_forward``, DDP's
     overlap_grad_reduce and overlap_param_gather, small buckets, Megatron's clipping firing:
     the buckets stepped after its clip, while the next forward runs), resident_mb=1, every
     bucket pass slowed by 40 ms (megatron_slow_steps.py), saving after step 2 while the
     steps run: losses, saved and final state equal Megatron's own with the same DDP options
     (bucketed reduction changes the bits at DP 2, so not the runs above);
  5. PP 2 with the tied embedding (``--tie-embeddings``: finalize_model_grads sums its grads
     over the two stages after their reduce-scatter), the step inside backward with
     overlap_grad_reduce, finalize's all-reduces started 300 ms late
     (megatron_slow_finalize.py), clip_grad 1e9 (speculation committed) and 0 (no
     clipping): losses and final state equal Megatron's own, and the buckets holding the
     tied embedding stepped after finalize (Note [Grads finalize changes]).
Exit 0 / 1; 77 without megatron-core.  Twenty torchrun launches (2 or 4 processes each).
"""
from __future__ import annotations

import argparse
import os
import sys

from megatron_runs import EXAMPLE, HERE, report, require_megatron, torchrun, work_dir

CUDA_ROUNDING = os.path.join(HERE, "megatron_cuda_rounding.py")
SLOW_STEPS = os.path.join(HERE, "megatron_slow_steps.py")
SLOW_FINALIZE = os.path.join(HERE, "megatron_slow_finalize.py")
OVERLAPPED_DDP = ["--overlap-grad-reduce", "--overlap-param-gather", "--bucket-size", "3000"]
FORWARD = ["--deferalloc", "host", "--resident-mb", "1", *OVERLAPPED_DDP, "--step-in-backward", "--step-overlap-forward"]
MODEL = ["--cpu-emulation", "--layers", "2", "--hidden", "32", "--heads", "4", "--vocab", "64", "--seq", "16",
         "--batch", "4", "--steps", "4", "--digest"]
LAYOUTS = {"tp2": (["--tp", "2"], 2), "pp2": (["--pp", "2"], 2), "tp2xdp2": (["--tp", "2"], 4)}


def finalized(env: dict, work: str, wall: dict) -> list:
    """Section 5: PP 2, tied embedding, the steps inside backward against finalize's changes."""
    rows = []
    for clip in ("1e9", "0"):
        args = [*MODEL, "--pp", "2", "--tie-embeddings", "--overlap-grad-reduce", "--bucket-size", "3000",
                "--clip-grad", clip]
        own = torchrun(f"pp2tied-clip{clip}-megatron", 2, args, env, work, wall, CUDA_ROUNDING)
        ins = torchrun(f"pp2tied-clip{clip}-backward", 2, [*args, "--deferalloc", "host", "--step-in-backward"],
                       env, work, wall, SLOW_FINALIZE)
        st = (ins or {}).get("backward_step") or {}
        ok = bool(own and ins) and own["losses"] == ins["losses"] and own["final_digest"] == ins["final_digest"] \
            and st.get("after_finalize", 0) > 0
        rows.append((f"pp2, tied embedding, clip_grad {clip}, finalize slowed: step inside backward == own",
                     f"identical ({st})" if ok else f"differ / failed ({st})", ok))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated subset of " + ",".join(LAYOUTS))
    args = ap.parse_args()
    version = require_megatron()
    env = dict(os.environ)
    work = work_dir("dfa_megatron_parallel_")
    wall: dict[str, float] = {}
    rows = []
    for name in args.layouts.split(","):
        layout, nproc = LAYOUTS[name]

        def run(tag: str, extra: list[str], script: str = EXAMPLE) -> dict | None:
            return torchrun(f"{name}-{tag}", nproc, [*MODEL, *layout, *extra], env, work, wall, script)

        own = run("megatron", [], CUDA_ROUNDING)
        host = run("host", ["--deferalloc", "host", "--resident-mb", "1", "--save", f"{work}/{name}", "--save-at", "2"])
        resumed = run("resumed", ["--deferalloc", "host", "--load", f"{work}/{name}"])
        ok = bool(own and host) and own["losses"] == host["losses"] and own["final_digest"] == host["final_digest"]
        rows.append((f"{name}: host tier, resident_mb=1 == Megatron's own, 4 steps (losses, final state)",
                     "bit-identical" if ok else "differ / failed", ok))
        ok = bool(host and resumed) and resumed["loaded_digest"] == host["saved_digest"] and \
            resumed["losses"] == {k: v for k, v in host["losses"].items() if int(k) > 2} and \
            resumed["final_digest"] == host["final_digest"]
        rows.append((f"{name}: dist-checkpointing save at 2, new processes load, steps 3-4 and final state",
                     "identical" if ok else "differ / failed", ok))
        own_ov = run("megatron-overlapped", [*OVERLAPPED_DDP, "--save", f"{work}/{name}-own-ov", "--save-at", "2"],
                     CUDA_ROUNDING)
        fwd = run("forward", [*FORWARD, "--save", f"{work}/{name}-forward", "--save-at", "2"], SLOW_STEPS)
        st = (fwd or {}).get("backward_step") or {}
        ok = bool(own_ov and fwd) and own_ov["losses"] == fwd["losses"] and \
            own_ov["final_digest"] == fwd["final_digest"] and fwd["saved_digest"] == own_ov["saved_digest"] and \
            st.get("buckets", 0) > 0
        rows.append((f"{name}: step_overlap_forward == Megatron's own, same DDP (losses, saved and final state)",
                     f"identical ({st})" if ok else f"differ / failed ({st})", ok))
        if name == "tp2xdp2" and "tp2" in args.layouts.split(","):
            other = run("from-tp2", ["--deferalloc", "host", "--load", f"{work}/tp2"])
            tp2_host = host_runs.get("tp2")
            ok = bool(other and tp2_host) and other["loaded_digest"] == tp2_host["saved_digest"]
            rows.append(("tp2xdp2 loads TP 2 x DP 1's checkpoint: state = saved state",
                         "equal" if ok else "differ / failed", ok))
        host_runs[name] = host
        if name == "pp2":
            rows += finalized(env, work, wall)
    print(f"megatron-core {version}; wall seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in wall.items()))
    failed = report("test_megatron_parallel", f"CPU emulation (gloo), megatron-core {version}", rows, [],
                    {"wall_seconds": wall}, None)
    return 1 if failed else 0


host_runs: dict[str, dict | None] = {}

if __name__ == "__main__":
    sys.exit(main())
