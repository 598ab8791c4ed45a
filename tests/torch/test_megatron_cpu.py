"""deferalloc.megatron on a tested megatron-core without a GPU (host driver, CPU emulation).

megatron-core's DistributedDataParallel / DistributedOptimizer / GPTModel (HybridModel from
0.19 on) run on the CPU
through examples/megatron/cpu_emulation.py (CUDA device names mapped to the CPU; the
arithmetic is torch's and the engine's).  Checks:
  1. exactness: after each of 3 steps of a tiny GPTModel, the engine's main params and
     moments equal a reference AdamW with torch._fused_adamw_'s CUDA roundings
     (optim_reference.py) fed with the very gradients Megatron left on the main-param
     handles (reduce-scattered, clipped), and the BF16 model shards equal BF16(main);
     Megatron's FP32 main copies are gone (handles of a reservation);
  2. reload_model_params: main = float(model params) after the model changed;
     the engine's own checkpoint (fast path) round-trips;
  3. an optimizer that already stepped hands its state over unchanged;
  4. errors: a second call, a non-distributed optimizer;
  5. the example through subprocesses: Megatron dist-checkpointing save at step 2, load in
     a new process, continue bit-identically (host tier; dp_reshardable and
     fully_reshardable formats); a checkpoint of Megatron's own optimizer loads into the
     streamed one and continues as Megatron's own run; the file tier gives the host tier's
     losses; a checkpoint saved at data-parallel size 1 loads at 2 and back (two gloo
     processes) with every tensor unchanged.
--quick: 5's first two checks only (save, load, continue; the loaded state), for the
versions between the oldest and the newest tested one in CI.
Exit 0 / 1; 77 when megatron-core is not importable (1 when DFA_MEGATRON_CORE_EXPECTED names
another version than the one imported).
"""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tempfile
import weakref

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(HERE, "..", "..", "examples", "megatron")
sys.path.insert(0, EXAMPLE)
sys.path.insert(0, HERE)

from megatron_runs import check, failures, in_child, require_megatron  # noqa: E402

require_megatron()

import torch  # noqa: E402

TINY = ["--cpu-emulation", "--layers", "1", "--hidden", "32", "--heads", "4", "--vocab", "64", "--seq", "16",
        "--batch", "2"]


def in_process() -> None:
    import train_gpt
    from optim_reference import ReferenceAdamW

    import deferalloc
    import deferalloc.megatron as dm
    from deferalloc.optim import InvalidArgumentError, InvalidStateError

    args = train_gpt.parse_args(TINY + ["--deferalloc", "host", "--steps", "3"])
    train_gpt.setup(args)
    gpt, ddp, optimizer, streamed = train_gpt.build(args)
    (dopt,) = dm.streamed_optimizers(optimizer)
    inner = streamed[0]
    handles = [p for g in inner.param_groups for p in g["params"]]
    check(all(dm._is_handle(h) and not deferalloc.is_backed(h) for h in handles),
          "main params: deferalloc handles made at construction (deferred_main_params), unbacked")
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    check("clone" not in torch.Tensor.__dict__ and DistributedOptimizer.__dict__[
        "_build_model_and_main_param_groups"].__func__.__name__ == "_build_model_and_main_param_groups",
          "deferred_main_params restored Tensor.clone and Megatron's classmethod")
    check(all(mp.main_param is h for g, hs in zip(dopt.model_float16_groups, dopt.shard_fp32_from_float16_groups)
              for mp, h in zip(g, hs)), "model_param.main_param is the handle")
    shards = [inner.engine_tensor(h) for h in handles]
    ref = ReferenceAdamW(shards)
    group_of = [g for g in inner.param_groups for _ in g["params"]]
    exact = True
    for step in range(1, 4):
        train_gpt.train_step(args, ddp, optimizer, step, torch.device("cpu"))
        for i, (h, g) in enumerate(zip(handles, group_of)):
            ref.step(i, h.grad, g["lr"], g["betas"][0], g["betas"][1], g["eps"], g["weight_decay"])
            st = inner.read_shard(h)
            for key, name in (("param", "main"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
                if not torch.equal(st[key], ref.tensor(name, i, h)):
                    exact = False
            if not torch.equal(shards[i], ref.tensor("main", i, h).to(shards[i].dtype)):
                exact = False
    check(exact, "3 Megatron steps: main params, moments and BF16 model shards bit-identical to the reference "
                 "AdamW on Megatron's clipped main grads")
    check(len({int(s["step"]) for s in inner.state_dict()["state"].values()}) == 1 and
          int(next(iter(inner.state_dict()["state"].values()))["step"]) == 3, "inner state_dict: step 3")

    # reload_model_params: the model changes behind the optimizer's back.
    with torch.no_grad():
        for p in gpt.parameters():
            p.mul_(0.5)
    optimizer.reload_model_params()
    check(all(torch.equal(inner.read_shard(h)["param"], s.float()) for h, s in zip(handles, shards)),
          "reload_model_params: main = float(model shard)")

    # The engine's checkpoint (fast path).
    before = train_gpt.state_digest(optimizer)
    with tempfile.TemporaryDirectory() as d:
        dm.save_engine_checkpoint(optimizer, d)
        train_gpt.train_step(args, ddp, optimizer, 4, torch.device("cpu"))
        changed = train_gpt.state_digest(optimizer) != before
        dm.load_engine_checkpoint(optimizer, d)
    check(changed and train_gpt.state_digest(optimizer) == before, "engine checkpoint round trip")

    # Errors.
    try:
        dm.stream_optimizer_state(optimizer)
        check(False, "a second call is refused")
    except InvalidStateError:
        check(True, "a second call is refused")
    try:
        dm.stream_optimizer_state(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(4))]))
        check(False, "a non-distributed optimizer is refused")
    except (InvalidArgumentError, AttributeError) as e:
        check(isinstance(e, InvalidArgumentError), f"a non-distributed optimizer is refused ({type(e).__name__})")

    # A step that is not a whole number is refused by load_state_dict, the state as it was.
    before = train_gpt.state_digest(optimizer)
    sd = inner.state_dict()
    pid = next(iter(sd["state"]))
    steps = [int(st["step"]) for st in sd["state"].values()]
    bad = {**sd, "state": {**sd["state"], pid: {**sd["state"][pid], "step": torch.tensor(2.5)}}}
    try:
        inner.load_state_dict(bad)
        check(False, "load_state_dict refuses step 2.5")
    except InvalidArgumentError as e:
        check("2.5" in str(e) and train_gpt.state_digest(optimizer) == before and
              [int(st["step"]) for st in inner.state_dict()["state"].values()] == steps,
              f"load_state_dict refuses step 2.5, the state unchanged ({e})")

    # A Megatron optimizer that already stepped hands its state over.
    args2 = train_gpt.parse_args(TINY + ["--steps", "2", "--seed", "7"])
    gpt2, ddp2, opt2, _ = train_gpt.build(args2)
    for step in (1, 2):
        train_gpt.train_step(args2, ddp2, opt2, step, torch.device("cpu"))
    before = train_gpt.state_digest(opt2)
    (dopt2,) = dm.streamed_optimizers(opt2)
    old_mains = [weakref.ref(t) for g in dopt2.shard_fp32_from_float16_groups for t in g]
    old_inner = weakref.ref(dopt2.optimizer)
    inner2 = dm.stream_optimizer_state(opt2, tier="host")[0]
    h2 = [p for g in inner2.param_groups for p in g["params"]]
    check(all(h.untyped_storage().data_ptr() == h2[0].untyped_storage().data_ptr() for h in h2),
          "without deferred_main_params: handles are views of one reservation")
    check(train_gpt.state_digest(opt2) == before, "existing Adam state moved into the engine unchanged")
    gc.collect()
    check(old_inner() is None and old_mains and all(r() is None for r in old_mains),
          "Megatron's FP32 main copies and its torch AdamW are freed")
    torch.distributed.destroy_process_group()


def run_example(extra: list[str], env_extra: dict | None = None, nproc: int = 1) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        summary = f.name
    env = dict(os.environ, **(env_extra or {}))
    launch = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                   "--nproc-per-node", str(nproc)]
    r = subprocess.run([*launch, os.path.join(EXAMPLE, "train_gpt.py"), *TINY, "--summary", summary, *extra],
                       env=env, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        print(r.stdout[-3000:], r.stderr[-6000:])
        raise RuntimeError(f"train_gpt.py {' '.join(extra)} failed")
    with open(summary) as f:
        out = json.load(f)
    os.unlink(summary)
    return out


_PLAIN_EQUAL = """
import os, sys, torch
os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1")
torch.distributed.init_process_group("gloo")
from megatron.core import dist_checkpointing
def flat(d, p=""):
    out = {}
    for k, v in (d.items() if isinstance(d, dict) else enumerate(d)):
        if isinstance(v, (dict, list)):
            out.update(flat(v, f"{p}{k}/"))
        elif isinstance(v, torch.Tensor):
            out[f"{p}{k}"] = v
    return out
a, b = (flat(dist_checkpointing.load_plain_tensors(d)) for d in sys.argv[1:3])
bad = [k for k in a if k not in b or not torch.equal(a[k], b[k])]
print(len(a), "tensors,", len(bad), "differ", bad[:3])
sys.exit(1 if bad or len(a) != len(b) or not a else 0)
"""


def same_checkpoint(a: str, b: str) -> bool:
    """Every tensor of two dist-checkpoints equal (model and optimizer state)."""
    env = dict(os.environ, MASTER_PORT=str(int(os.environ["MASTER_PORT"]) + 50))
    r = subprocess.run([sys.executable, "-c", _PLAIN_EQUAL, a, b], env=env, capture_output=True, text=True,
                       timeout=300)
    print("     ", r.stdout.strip() or r.stderr[-500:])
    return r.returncode == 0


def resharding(d: str) -> None:
    """Save at DP 1, load at DP 2 and save, load that at DP 1: the same optimizer state
    (gloo, two processes).  Compared through the state digest (every parameter's main, exp_avg,
    exp_avg_sq) and, for the model-space format, tensor by tensor (dp_reshardable's files
    hold Megatron's uninitialised padding between parameters)."""
    for fmt in ("fully_reshardable", "dp_reshardable"):
        env = {"DFA_MEGATRON_CKPT_FORMAT": fmt}
        two = ["--steps", "2", "--save-at", "2", "--deferalloc", "host"]
        first = run_example(two + ["--save", f"{d}/{fmt}_dp1"], env)
        run_example(two + ["--load", f"{d}/{fmt}_dp1", "--save", f"{d}/{fmt}_dp2"], env, nproc=2)
        back = run_example(two + ["--load", f"{d}/{fmt}_dp2"], env)
        ok = back["loaded_digest"] == first["saved_digest"]
        if fmt == "fully_reshardable":
            ok = ok and same_checkpoint(f"{d}/{fmt}_dp2", f"{d}/{fmt}_dp1")
        check(ok, f"{fmt}: state saved at DP 1, loaded at DP 2, saved, loaded at DP 1: unchanged")


def subprocesses(quick: bool) -> None:
    with tempfile.TemporaryDirectory() as d:
        steps = ["--steps", "4", "--save-at", "2"]
        host = run_example(steps + ["--deferalloc", "host", "--save", f"{d}/host"])
        resumed = run_example(["--steps", "4", "--deferalloc", "host", "--load", f"{d}/host"])
        check(resumed["losses"] == {k: v for k, v in host["losses"].items() if int(k) > 2},
              "dist-checkpointing save at step 2, load in a new process, steps 3-4 identical (host tier)")
        check(resumed["loaded_digest"] == host["saved_digest"], "loaded optimizer state = saved state")
        if quick:
            return
        own = run_example(steps + ["--save", f"{d}/own"])
        cross = run_example(["--steps", "4", "--deferalloc", "host", "--load", f"{d}/own"])
        check(cross["loaded_digest"] == own["saved_digest"] and
              cross["losses"] == {k: v for k, v in own["losses"].items() if int(k) > 2},
              "Megatron's own checkpoint loads into the streamed optimizer and continues as Megatron's run")
        fr = {"DFA_MEGATRON_CKPT_FORMAT": "fully_reshardable"}
        run_example(steps + ["--deferalloc", "host", "--save", f"{d}/fr"], fr)
        fr_resumed = run_example(["--steps", "4", "--deferalloc", "host", "--load", f"{d}/fr"], fr)
        check(fr_resumed["losses"] == {k: v for k, v in host["losses"].items() if int(k) > 2},
              "fully_reshardable format: save, load, continue identically")
        file_tier = run_example(["--steps", "4", "--deferalloc", "file", "--directory", f"{d}/state"])
        check(file_tier["losses"] == host["losses"], "file tier losses = host tier losses")
        resharding(d)


def main() -> int:
    quick = "--quick" in sys.argv[1:]
    os.environ.setdefault("MASTER_PORT", str(29600 + os.getpid() % 300))
    in_child(in_process)
    os.environ["MASTER_PORT"] = str(int(os.environ["MASTER_PORT"]) + 1)
    subprocesses(quick)
    print(f"{len(failures)} failure(s)" if failures else "all megatron checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
