"""deferalloc.megatron's step inside Megatron's backward (``step_in_backward=True``) on the CPU
(gloo, cpu_emulation, deferalloc's host driver).

examples/megatron/train_gpt.py under torchrun, DDP with ``overlap_grad_reduce`` and small
buckets (several bucket groups, each stepped when its reduce-scatter has finished), at data-
parallel size 1 and 2, with Megatron's clipping never firing (clip_grad 1000) and always
firing (clip_grad 1.0; the tiny model's grad norm is about 1.7):
  1. Megatron's own DistributedOptimizer (CUDA's AdamW roundings, megatron_cuda_rounding.py)
     and the plain streamed step (host tier): losses and final state (a digest over every
     rank's main params and moments) bit-identical;
  2. the step inside backward, bit-identical to both:
       never firing, clip policy "auto" (the first iteration holds its buckets, then every
       bucket is stepped speculatively during backward and committed), with
       overlap_param_gather (each bucket group's all-gather waits for its own bucket);
       always firing, clip policy "speculate" (every speculation discarded and redone);
       always firing, clip policy "auto" (buckets held, stepped after Megatron's clip; DP 1);
     and the counts show which path ran (3 steps each);
  3. the step across the next forward (``step_overlap_forward=True`` with overlap_param_gather;
     never firing: clip policy "auto", always firing: "speculate"), every bucket pass slowed
     by 40 ms before the worker takes its grads (megatron_slow_steps.py) so that the next
     iteration starts while the steps run, and passes are taken after Megatron's clip (gloo's
     handles must not be waited there: Note [A reduce-scatter waited twice]):
     bit-identical to both, and some bucket groups' grads zeroed behind their step; also with
     gradient accumulation (DP 2, 2 micro-batches, clipping always firing, policy "auto": the
     buckets held and stepped after Megatron's clip) against Megatron's own and the plain step;
     and with coalesced bucket passes (``coalesce``: train_gpt.py --coalesce 2 at DP 1, never
     firing; --coalesce 0, every done bucket group in one pass, at DP 2, always firing, so the
     redos coalesce too): bit-identical to both, with fewer engine passes than bucket steps;
  4. Megatron's clip rule as the inner step reads it (a NaN norm counts as fired); what
     cannot be made exact is refused (a grad scaler, grad_norm_skip_threshold, several
     distributed-optimizer instances, an unknown clip policy; step_overlap_forward without
     overlap_param_gather or with a chain of two; reduce_scatter_with_fp32_accumulation), and so
     is a bad ``coalesce`` (negative, not a bool or an int, or without step_in_backward);
  5. (megatron-core 0.19 on) DDP's offload_grad_buffers / restore_grad_buffers after each
     step while the slowed steps across the next forward still read the grad buffers (DP 1,
     never firing): they wait for the steps, bit-identical to the plain step.
Exit 0 / 1; 77 without megatron-core.  Twenty-three torchrun launches (1 or 2 processes each).
"""
from __future__ import annotations

import os
import sys

from megatron_runs import EXAMPLE, HERE, report, require_megatron, torchrun, work_dir

CUDA_ROUNDING = os.path.join(HERE, "megatron_cuda_rounding.py")
SLOW_STEPS = os.path.join(HERE, "megatron_slow_steps.py")
MODEL = ["--cpu-emulation", "--layers", "1", "--hidden", "32", "--heads", "4", "--vocab", "64", "--seq", "16",
         "--batch", "2", "--steps", "3", "--digest", "--overlap-grad-reduce", "--bucket-size", "3000"]
CLIPS = {"never": ["--clip-grad", "1000"], "always": ["--clip-grad", "1.0"]}
STEPS = 3


def refusals() -> list:
    """stream_optimizer_state(step_in_backward=True)'s refusals, on stand-ins of a
    DistributedOptimizer's attributes (checked before anything changes)."""
    from types import SimpleNamespace as NS

    from deferalloc.megatron import _refuse_backward_step
    from deferalloc.optim import InvalidArgumentError

    def dopt(**kw):
        d = dict(grad_scaler=None, ddp_config=NS(num_distributed_optimizer_instances=1, overlap_param_gather=True),
                 config=NS(grad_norm_skip_threshold=float("inf")))
        d.update(kw)
        return NS(**d)

    def refused(chain, policy="auto", overlap_forward=False) -> bool:
        try:
            _refuse_backward_step(chain, policy, overlap_forward)
            return False
        except InvalidArgumentError:
            return True
    cases = {"a grad scaler": refused([dopt(grad_scaler=object())]),
             "grad_norm_skip_threshold": refused([dopt(config=NS(grad_norm_skip_threshold=10.0))]),
             "two distributed-optimizer instances": refused([dopt(ddp_config=NS(
                 num_distributed_optimizer_instances=2))]),
             "clip policy 'sometimes'": refused([dopt()], "sometimes"),
             "step_overlap_forward without overlap_param_gather": refused([dopt(ddp_config=NS(
                 num_distributed_optimizer_instances=1, overlap_param_gather=False))], overlap_forward=True),
             "step_overlap_forward with a chain of two": refused([dopt(), dopt()], overlap_forward=True),
             "reduce_scatter_with_fp32_accumulation": refused([dopt(ddp_config=NS(
                 num_distributed_optimizer_instances=1, reduce_scatter_with_fp32_accumulation=True))])}
    rows = [(f"refused: {k}", "refused" if v else "accepted", v) for k, v in cases.items()]
    ok = not refused([dopt(), dopt()])
    rows.append(("accepted: BF16 without a scaler (a chain of two)", "accepted" if ok else "refused", ok))
    ok = not refused([dopt()], overlap_forward=True)
    rows.append(("accepted: step_overlap_forward with overlap_param_gather", "accepted" if ok else "refused", ok))
    return rows + coalesce_refusals()


def clip_rule() -> list:
    """Whether Megatron clipped, by its rule clip_grad / (norm + 1e-6) < 1.0, on stand-ins: a
    norm above clip_grad fired, one below did not, a NaN norm (or one not seen) counts as
    fired (0.17's tensor path multiplies every grad by NaN: only a redo is exact)."""
    import math
    from types import SimpleNamespace as NS

    import torch

    from deferalloc.megatron import _BackwardStep
    rows = []
    for what, norm, fired in (("norm 2.0", 2.0, True), ("norm 0.5", 0.5, False), ("norm NaN", math.nan, True),
                              ("norm NaN (a tensor)", torch.tensor(math.nan), True),
                              ("norm 0.5 (a tensor)", torch.tensor(0.5), False), ("no norm seen", None, True)):
        st = NS(norm=norm, max_grad_norm=1.0, norm_owner=None)
        got = _BackwardStep._megatron_clipped(st)
        rows.append((f"clip_grad 1.0, {what}: counted as {'fired' if fired else 'not fired'}",
                     "fired" if got else "not fired", got == fired and st.norm is None))
    return rows


def coalesce_refusals() -> list:
    """stream_optimizer_state's refusals of a bad ``coalesce``, before it reads the optimizer
    (a stand-in object here)."""
    from deferalloc.megatron import stream_optimizer_state
    from deferalloc.optim import InvalidArgumentError

    rows = []
    for what, kw in {"coalesce -1": dict(step_in_backward=True, coalesce=-1),
                     "coalesce 2.0 (not an int)": dict(step_in_backward=True, coalesce=2.0),
                     "coalesce '2' (not an int)": dict(step_in_backward=True, coalesce="2"),
                     "coalesce 2 without step_in_backward": dict(coalesce=2),
                     "coalesce True without step_in_backward": dict(coalesce=True)}.items():
        try:
            stream_optimizer_state(object(), **kw)
            got = "accepted"
        except InvalidArgumentError as e:
            got = "refused" if "coalesce" in str(e) else f"refused for another reason: {e}"
        except Exception as e:  # noqa: BLE001 - reached the optimizer: not refused early
            got = f"not refused early: {type(e).__name__}: {e}"
        rows.append((f"refused: {what}", got, got == "refused"))
    return rows


def accumulation(env: dict, work: str, wall: dict) -> list:
    """DP 2, 2 micro-batches (DDP's no_sync for the first), clipping always firing, policy
    auto: Megatron's own, the plain step and the step across the next forward (slowed)."""
    args = [*MODEL, *CLIPS["always"], "--batch", "4", "--microbatches", "2"]
    own = torchrun("accum-megatron", 2, args, env, work, wall, CUDA_ROUNDING)
    plain = torchrun("accum-plain", 2, [*args, "--deferalloc", "host"], env, work, wall)
    fwd = torchrun("accum-forward", 2, [*args, "--deferalloc", "host", "--step-in-backward", "--clip-policy", "auto",
                                        "--overlap-param-gather", "--step-overlap-forward"], env, work, wall, SLOW_STEPS)
    st = (fwd or {}).get("backward_step") or {}
    same = bool(own and plain and fwd) and own["losses"] == plain["losses"] == fwd["losses"] and \
        own["final_digest"] == plain["final_digest"] == fwd["final_digest"]
    path = st.get("speculations") == 0 and st.get("buckets", 0) > 0 and st.get("zeroed_behind_steps", 0) > 0
    return [("DP 2, 2 micro-batches, clipping always: step across the next forward == plain == own",
             "bit-identical" if same else "differ / failed", same),
            ("DP 2, 2 micro-batches, the path taken (held, zeroed behind the steps)", str(st), path)]


def main() -> int:
    version = require_megatron()
    env = dict(os.environ)
    work = work_dir("dfa_megatron_backward_step_")
    wall: dict[str, float] = {}
    rows = refusals() + clip_rule()
    # 0.19's colocation API (DDP's offload_grad_buffers / restore_grad_buffers)
    colocation = tuple(int(x) for x in version.split(".")[:2]) >= (0, 19)
    for dp in (1, 2):
        for clip, clip_args in CLIPS.items():
            def run(tag: str, extra: list[str], script: str = EXAMPLE) -> dict | None:
                return torchrun(f"dp{dp}-{clip}-{tag}", dp, [*MODEL, *clip_args, *extra], env, work, wall, script)

            own = run("megatron", [], CUDA_ROUNDING)
            plain = run("plain", ["--deferalloc", "host"])
            ok = bool(own and plain) and own["losses"] == plain["losses"] and \
                own["final_digest"] == plain["final_digest"]
            rows.append((f"DP {dp}, clipping {clip}: plain streamed step == Megatron's own (losses, final state)",
                         "bit-identical" if ok else "differ / failed", ok))
            variants = {"auto": ["--clip-policy", "auto"]}
            if clip == "never":
                variants["auto"] += ["--overlap-param-gather"]
            else:  # (the held path of auto once, at DP 1: the CI budget)
                variants = {"speculate": ["--clip-policy", "speculate"], **(variants if dp == 1 else {})}
            # The step across the next forward, its passes slowed (the waits exercised).
            variants["forward"] = ["--clip-policy", "auto" if clip == "never" else "speculate",
                                   "--overlap-param-gather", "--step-overlap-forward"]
            if dp == 1 and clip == "never" and colocation:  # offload / restore while the steps run
                variants["forward-offload"] = [*variants["forward"], "--offload-grads"]
            # Coalesced passes: at most 2 bucket groups a pass (DP 1, committed speculations),
            # every done one in a pass (DP 2, every speculation redone); two launches (the CI budget).
            if (dp, clip) in ((1, "never"), (2, "always")):
                variants["forward-coalesce"] = [*variants["forward"], "--coalesce", "2" if dp == 1 else "0"]
            for name, extra in variants.items():
                r = run(f"backward-{name}", ["--deferalloc", "host", "--step-in-backward", *extra],
                        SLOW_STEPS if name.startswith("forward") else EXAMPLE)
                same = bool(r and plain) and r["losses"] == plain["losses"] and \
                    r["final_digest"] == plain["final_digest"]
                st = (r or {}).get("backward_step") or {}
                if clip == "never":  # the first iteration holds, the others speculate and commit
                    path = st.get("speculations") == STEPS - 1 and st.get("commits") == STEPS - 1 and \
                        st.get("redos") == 0
                elif name in ("speculate", "forward", "forward-coalesce"):  # every speculation discarded, redone
                    path = st.get("speculations") == STEPS and st.get("redos") == STEPS and st.get("commits") == 0
                else:  # clipping fires: auto never speculates
                    path = st.get("speculations") == 0 and st.get("speculative_steps") == 0
                if name in ("forward", "forward-coalesce"):  # the next iteration started while steps ran
                    path = path and st.get("zeroed_behind_steps", 0) > 0
                if name == "forward-coalesce":  # some passes stepped more than one bucket group
                    path = path and 0 < st.get("passes", 0) < st.get("buckets", 0)
                if name == "forward-offload":  # (the offload waited for every step: nothing left to zero behind)
                    path = path and (r or {}).get("grad_offloads") == STEPS
                what = f"DP {dp}, clipping {clip}: step inside backward ({' '.join(extra)}) == plain == own"
                rows.append((what, "bit-identical" if same else "differ / failed", same))
                rows.append((f"DP {dp}, clipping {clip}, {name}: the path taken", str(st), path))
    rows += accumulation(env, work, wall)
    print(f"megatron-core {version}; wall seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in wall.items()))
    failed = report("test_megatron_backward_step", f"CPU emulation (gloo), megatron-core {version}", rows, [],
                    {"wall_seconds": wall}, None)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
