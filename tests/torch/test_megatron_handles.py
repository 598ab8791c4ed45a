"""deferalloc.megatron with Megatron's own main-param handles (OptimizerConfig.
defer_main_param_initialization) and the version gate, on the CPU (cpu_emulation, host driver).

No megatron-core release up to 0.19.2 carries ``defer_main_param_initialization``; where the
installed one lacks it, megatron_defer_standin.py installs a faithful stand-in (its
docstring says what it reproduces) and the test says so.  Checks:
  1. Megatron's handles: before stream_optimizer_state each FP32 main param has the
     shard's shape, float32, the model's device and no storage, and is the object in
     model_param.main_param and in the inner optimizer's groups; after it the very same
     objects (ids) are the engine's torch-side parameters, model_param.main_param and
     Megatron's shard lists, still without storage, also after steps;
  2. the same bits on both routes: 4 steps of the example with Megatron's handles and with
     deferred_main_params() give losses and a final state digest (every main param and
     moment) identical to each other and to Megatron's own optimizer (CUDA's AdamW
     roundings, megatron_cuda_rounding.py);
  3. refusals: the option set but a main param holding storage; an untested megatron-core
     version (the message lists the tested ones); every tested version is accepted, and
     they are megatron_versions.txt's (what setup.sh unpacks and CI runs).
Exit 0 / 1; 77 when megatron-core is not importable.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(HERE, "..", "..", "examples", "megatron")
sys.path.insert(0, EXAMPLE)
sys.path.insert(0, HERE)

from megatron_runs import check, failures, in_child, require_megatron  # noqa: E402

require_megatron()

import megatron.core  # noqa: E402
import torch  # noqa: E402

TINY = ["--cpu-emulation", "--layers", "2", "--hidden", "32", "--heads", "4", "--vocab", "64", "--seq", "16",
        "--batch", "2"]


def in_process() -> None:
    import megatron_defer_standin
    import train_gpt

    import deferalloc.megatron as dm
    from deferalloc.optim import InvalidStateError

    args = train_gpt.parse_args(TINY + ["--deferalloc", "host", "--main-params", "megatron", "--steps", "2"])
    train_gpt.setup(args)
    standin = megatron_defer_standin.install()
    print(f"     defer_main_param_initialization: {'stand-in (megatron-core ' + dm.megatron_core_version() + ' lacks it)' if standin else 'megatron-core its own'}")
    gpt, ddp = train_gpt.build_model_and_ddp(args)
    optimizer, _ = train_gpt.build_optimizer(args, ddp, stream=False)
    (dopt,) = dm.streamed_optimizers(optimizer)
    pairs = [(mp, main, shard) for mps, mains, shards in zip(dopt.model_float16_groups,
                                                            dopt.shard_fp32_from_float16_groups,
                                                            dopt.shard_float16_groups)
             for mp, main, shard in zip(mps, mains, shards)]
    ids = [id(main) for _, main, _ in pairs]
    inner_ids = {id(p) for g in dopt.optimizer.param_groups for p in g["params"]}
    check(bool(pairs) and all(main.shape == shard.shape and main.dtype == torch.float32 and
                              main.device == shard.device and main.untyped_storage().nbytes() == 0 and
                              mp.main_param is main and id(main) in inner_ids for mp, main, shard in pairs),
          f"Megatron's {len(pairs)} main-param handles: shard shape, float32, device, no storage, in main_param and "
          f"the inner groups")
    streamed = dm.stream_optimizer_state(optimizer, tier="host")
    inner = streamed[0]
    engine_ids = {id(p) for g in inner.param_groups for p in g["params"]}

    def same_objects() -> bool:
        now = [main for g in dopt.shard_fp32_from_float16_groups for main in g]
        return ([id(m) for m in now] == ids and all(id(m) in engine_ids for m in now) and
                all(mp.main_param is m for (mp, _, _), m in zip(pairs, now)) and
                all(m.untyped_storage().nbytes() == 0 and not dm._is_handle(m) for m in now))

    check(same_objects(), "after stream_optimizer_state: the same objects are the engine's parameters, "
                          "model_param.main_param and Megatron's shard lists; storage still released")
    for step in (1, 2):
        train_gpt.train_step(args, ddp, optimizer, step, torch.device("cpu"))
    check(same_objects() and inner.state_dict()["state"] and
          all(int(s["step"]) == 2 for s in inner.state_dict()["state"].values()),
          "after 2 steps: identities and released storage unchanged, the engine stepped")

    # The option set, yet a main param holding storage: refused before anything changes.
    gpt2, ddp2 = train_gpt.build_model_and_ddp(args)
    opt2, _ = train_gpt.build_optimizer(args, ddp2, stream=False)
    (dopt2,) = dm.streamed_optimizers(opt2)
    some = dopt2.shard_fp32_from_float16_groups[0][0]
    some.untyped_storage().resize_(some.numel() * 4)
    try:
        dm.stream_optimizer_state(opt2, tier="host")
        check(False, "option set but a main param with storage: refused")
    except InvalidStateError as e:
        check("holds storage" in str(e) and type(dopt2.optimizer) is not dm.StreamedMegatronAdamW,
              "option set but a main param with storage: refused, nothing changed")

    # The version gate.
    real = megatron.core.__version__
    try:
        accepted = []
        for v in dm.TESTED_VERSIONS:
            megatron.core.__version__ = v
            accepted.append(dm._adapter().version == v)
        check(all(accepted) and len(accepted) >= 4, f"every tested version accepted: {', '.join(dm.TESTED_VERSIONS)}")
        with open(os.path.join(HERE, "megatron_versions.txt")) as f:
            listed = tuple(line.strip() for line in f if line.strip() and not line.startswith("#"))
        check(listed == dm.TESTED_VERSIONS, "megatron_versions.txt (setup.sh's and CI's list) = TESTED_VERSIONS")
        megatron.core.__version__ = "0.19.2+0123abc"
        check(dm._adapter().version == "0.19.2", "a release with a local part (+<commit>, megatron-core's git "
                                                 "suffix) is that release")
        megatron.core.__version__ = "0.15.3"
        os.environ.pop("DEFERALLOC_MEGATRON_UNTESTED", None)
        try:
            dm._adapter()
            check(False, "an untested version is refused")
        except InvalidStateError as e:
            check(all(v in str(e) for v in dm.TESTED_VERSIONS), f"an untested version is refused: {e}")
    finally:
        megatron.core.__version__ = real
    train_gpt.teardown()


def run(script: str, extra: list[str], work: str, name: str) -> dict:
    summary = os.path.join(work, f"{name}.json")
    r = subprocess.run([sys.executable, script, *TINY, "--steps", "4", "--digest", "--summary", summary, *extra],
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        print(r.stdout[-2000:], r.stderr[-4000:])
        raise RuntimeError(f"{name} failed")
    with open(summary) as f:
        return json.load(f)


def subprocesses() -> None:
    with tempfile.TemporaryDirectory() as work:
        own = run(os.path.join(HERE, "megatron_cuda_rounding.py"), [], work, "own")
        ours = run(os.path.join(EXAMPLE, "train_gpt.py"), ["--deferalloc", "host", "--main-params", "deferalloc"],
                   work, "deferred_main_params")
        megatrons = run(os.path.join(HERE, "megatron_defer_standin.py"),
                        ["--deferalloc", "host", "--main-params", "megatron"], work, "megatron_handles")
    check(megatrons["losses"] == ours["losses"] and megatrons["final_digest"] == ours["final_digest"],
          "Megatron's handles and deferred_main_params(): 4 steps, losses and final state bit-identical")
    check(ours["losses"] == own["losses"] and ours["final_digest"] == own["final_digest"],
          "both routes bit-identical to Megatron's own optimizer (losses and final state)")


def main() -> int:
    os.environ.setdefault("MASTER_PORT", str(29300 + os.getpid() % 300))
    in_child(in_process)
    os.environ["MASTER_PORT"] = str(int(os.environ["MASTER_PORT"]) + 1)
    subprocesses()
    print(f"{len(failures)} failure(s)" if failures else "all checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
