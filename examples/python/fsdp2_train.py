"""FSDP2 (``fully_shard``) training with deferalloc.optim.StreamedAdamW, checkpointed with DCP.

Each rank's StreamedAdamW holds the FP32 state of its local shards (the DTensor
parameters' ``to_local()``), streamed from pinned host memory; ``opt.state`` and
``state_dict()`` give DTensors with the parameters' placements, so
``torch.distributed.checkpoint`` saves a sharded checkpoint that loads at any world size.

    # CPU: two processes over gloo (no GPU)
    DEFERALLOC_CONF=driver:host python examples/python/fsdp2_train.py --cpu --world-size 2
    # GPUs: NCCL, BF16, the checkpoint in the folder given
    torchrun --nproc-per-node 1 examples/python/fsdp2_train.py --checkpoint /tmp/deferalloc-fsdp2

(With ``pip install .``; from a source build, prefix ``PYTHONPATH=python
DEFERALLOC_LIB=build/allocator/libdeferalloc.so``.)

--check: after the DCP save, every rank takes two more steps; then a fresh model and
optimizer load the checkpoint (set_state_dict) and take the same two steps: the weights
must agree bit for bit.  A transformers Llama when transformers is installed, else an MLP.
"""
from __future__ import annotations

import argparse
import gc
import os
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from deferalloc.optim import StreamedAdamW

VOCAB, SEQ = 256, 32


def build(device: torch.device, dtype: torch.dtype, seed: int):
    torch.manual_seed(seed)
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
        cfg = LlamaConfig(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=SEQ)
        model = LlamaForCausalLM(cfg).to(device, dtype)
        layers = list(model.model.layers)
    except ImportError:
        model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 64), torch.nn.Linear(64, 172), torch.nn.GELU(),
                                    torch.nn.Linear(172, VOCAB)).to(device, dtype)
        layers = [model[1], model[3]]
    # The mesh on the model's device type: without one, fully_shard picks CUDA whenever a GPU is
    # visible, and a --cpu run on a GPU machine would shard onto cuda:0.
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = StreamedAdamW(model.parameters(), lr=1e-3, weight_decay=0.1, window_mb=8)
    return model, opt


def loss_of(model, t: int, rank: int, world: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + t)
    ids = torch.randint(0, VOCAB, (2 * world, SEQ), generator=g)[rank::world].to(device)
    out = model(ids)
    logits = out.logits if hasattr(out, "logits") else out
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def train(model, opt, first: int, steps: int, rank: int, world: int, device) -> list[float]:
    losses = []
    for t in range(first, first + steps):
        loss = loss_of(model, t, rank, world, device)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def worker(rank: int, world: int, args, spawned: bool = True) -> None:
    cpu = args.cpu
    if spawned:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK=str(rank),
                          WORLD_SIZE=str(world))
    dist.init_process_group("gloo" if cpu else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu") if cpu else torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    if not cpu:
        torch.cuda.set_device(device)
    dtype = torch.float32 if cpu else torch.bfloat16
    # torch's shutdown order: no collective in flight (the barrier, on success only: a rank
    # that failed leaves its peers inside a collective) and nothing alive that holds the group
    # (_run's models and optimizers: FSDP2's states keep the mesh's group and the Work handles
    # of their last collectives) when the group is destroyed.
    try:
        _run(rank, world, args, device, dtype)
        dist.barrier()
    finally:
        gc.collect()
        dist.destroy_process_group()
    if spawned:
        leave()


def leave() -> None:
    """Ends a rank that finished: torch's DTensor caches still hold the device mesh, and
    through it the group's gloo threads and rank 0's store server, until the interpreter
    finalizes, and a group torn down then can abort a finished run ("terminate called without
    an active exception").  The checkpoint is written: the rank leaves without finalization."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _run(rank: int, world: int, args, device, dtype) -> None:
    model, opt = build(device, dtype, seed=0)
    losses = train(model, opt, 0, args.steps, rank, world, device)
    if rank == 0:
        print(f"fsdp2_train: world size {world}, losses", " ".join(f"{x:.4f}" for x in losses), flush=True)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=args.checkpoint)
    if not args.check:
        return
    train(model, opt, args.steps, 2, rank, world, device)
    fresh, fopt = build(device, dtype, seed=1)  # other weights: all must come from the checkpoint
    msd, osd = get_state_dict(fresh, fopt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=args.checkpoint)
    set_state_dict(fresh, fopt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    train(fresh, fopt, args.steps, 2, rank, world, device)
    same = all(torch.equal(p.to_local(), q.to_local()) for p, q in zip(model.parameters(), fresh.parameters()))
    ok = torch.tensor([int(same)])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if rank == 0:
        print("fsdp2_train: resumed from the DCP checkpoint: weights", "identical" if ok.item() else "DIFFER",
              flush=True)
    if not ok.item():
        raise SystemExit(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--checkpoint", default=None, help="DCP directory (default: a temporary one)")
    args = ap.parse_args()
    if args.cpu and torch.torch_version.TorchVersion(torch.__version__) < "2.7":
        print(f"fsdp2_train: torch {torch.__version__}'s FSDP2 cannot run on the CPU (its CPU streams lack "
              "record_event, added in torch 2.7); run it on a GPU or with torch >= 2.7", file=sys.stderr)
        sys.exit(77)  # ctest: skipped
    if "RANK" in os.environ:  # under torchrun: every rank writes to one --checkpoint
        world = int(os.environ["WORLD_SIZE"])
        if world > 1 and not args.checkpoint:
            sys.exit("fsdp2_train: under torchrun, --checkpoint DIR (one directory every rank reaches)")
        with tempfile.TemporaryDirectory() as tmp:
            args.checkpoint = args.checkpoint or os.path.join(tmp, "dcp")
            worker(int(os.environ["RANK"]), world, args, spawned=False)
        leave()
    with tempfile.TemporaryDirectory() as tmp:
        args.checkpoint = args.checkpoint or os.path.join(tmp, "dcp")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            args.port = s.getsockname()[1]
        import torch.multiprocessing as mp
        try:
            mp.spawn(worker, args=(args.world_size, args), nprocs=args.world_size, join=True)
        except mp.ProcessExitedException as e:
            print(f"fsdp2_train: a rank failed: {e}", file=sys.stderr)
            sys.exit(1)


if __name__ == "__main__":
    main()
