#!/usr/bin/env python3
"""Device memory of single-rank NCCL communicators: what a trainer of one GPU holds outside
every allocator, asleep or not.

A Megatron trainer on one GPU still runs its collectives through NCCL, one communicator per
process group it uses (the data-parallel group, the model-parallel group of the grad norm,
...), each created at its first collective.  No pause of torch_memory_saver or deferalloc
covers that memory: NCCL allocates it itself.  This measures it, one process per
configuration (the device's used bytes from cuMemGetInfo, the process alone on the GPU):

  lazy            init_process_group("nccl"): each group's communicator made at its first
                  collective (what megatron-core's initialize_model_parallel gets by default)
  eager           init_process_group("nccl", device_id=...): later groups split from the
                  default communicator (ncclCommSplit)
  eager+share     eager, with NCCL_COMM_SPLIT_SHARE_RESOURCES=1: the split communicators share
                  the parent's buffers

    python3 benchmarks/pause_resume/nccl_footprint.py [--groups 4] [--json OUT.json]

Each row: the MiB the process holds beyond its CUDA context after the first collective on
1..N groups, and after destroy_process_group.  Needs one GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench_json  # noqa: E402

# Each configuration's environment (the child inits NCCL eagerly unless it is "lazy").
CONFIGS = {
    "lazy": {},
    "eager": {},
    "eager+share": {"NCCL_COMM_SPLIT_SHARE_RESOURCES": "1"},
}


def child(config: str, groups: int, port: int) -> dict:
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    torch.cuda.set_device(0)
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()

    def used() -> int:
        free, total = torch.cuda.mem_get_info(0)
        return total - free

    context = used()
    kw = {} if config == "lazy" else {"device_id": torch.device("cuda", 0)}
    dist.init_process_group("nccl", **kw)
    x = torch.ones(1 << 20, device="cuda")
    after = []
    pgs = [None] + [dist.new_group([0]) for _ in range(groups - 1)]
    for g in pgs:
        dist.all_reduce(x, group=g)
        torch.cuda.synchronize()
        after.append(used() - context - torch.cuda.memory_reserved())
    dist.destroy_process_group()
    torch.cuda.synchronize()
    return {"context": context, "after_groups": after,
            "after_destroy": used() - context - torch.cuda.memory_reserved(),
            "torch_reserved": torch.cuda.memory_reserved()}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=29611, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.groups, args.port)))
        return 0
    import torch
    if not torch.cuda.is_available():
        print("nccl_footprint: no CUDA device visible; nothing measured")
        return 77
    mib = 1 << 20
    results, runs = [], {}
    for i, (name, env) in enumerate(CONFIGS.items()):
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", name, "--groups", str(args.groups),
                            "--port", str(args.port + i)], env={**os.environ, **env}, capture_output=True, text=True,
                           timeout=300)
        if p.returncode != 0:
            print(f"{name}: failed (rc {p.returncode})\n{p.stderr[-2000:]}")
            runs[name] = {"error": p.stderr[-2000:]}
            continue
        r = json.loads(p.stdout.strip().splitlines()[-1])
        runs[name] = r
        for k, v in enumerate(r["after_groups"], 1):
            results.append(bench_json.result(f"{name}: held beyond the context, {k} group(s)", v / mib, "MiB"))
        results.append(bench_json.result(f"{name}: held beyond the context, destroyed", r["after_destroy"] / mib, "MiB"))
        print(f"{name:12s} context {r['context'] / mib:6.0f} MiB | beyond it after 1..{args.groups} groups: "
              + " ".join(f"{v / mib:6.0f}" for v in r["after_groups"])
              + f" MiB | after destroy_process_group {r['after_destroy'] / mib:6.0f} MiB")
    if args.json:
        doc = bench_json.document("nccl_footprint", results, torch.cuda.get_device_name(0),
                                  extra={"runs": runs, "nccl": ".".join(map(str, torch.cuda.nccl.version()))})
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
