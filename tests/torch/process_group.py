"""One process group for a test's work, torn down in torch's order.

A gloo group that is still referenced when the interpreter finalizes (FSDP2's states keep the
mesh's group and the Work handles of their last collectives, in reference cycles) is destroyed
then; a gloo worker that drops a tensor's last reference needs the GIL, Python ends that thread
inside a noexcept frame, and the process aborts with "terminate called without an active
exception" after a correct run (examples/megatron/train_gpt.py's Note [Teardown]).  So the work
runs in a function of its own (its locals die when it returns), every rank meets at a barrier
(on success only: a rank that failed leaves its peers inside a collective), the cycles are
collected, and only then is the group destroyed.

That is not enough for FSDP2: torch's DTensor caches (sharding propagation, redistribution plans)
keep the device mesh, and with it the group, its gloo threads and rank 0's store server, alive
until finalization whatever the test releases.  A spawned rank whose results are on disk
therefore leaves with exit_now(), without finalization, once the group is destroyed.
"""
from __future__ import annotations

import gc
import os
import socket
import sys

import torch.distributed as dist


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_in_process_group(work, backend: str, rank: int, world: int, port: int, *args):
    """init_process_group(backend) at 127.0.0.1:port, work(*args), then the teardown above."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        out = work(*args)
        if world > 1:
            dist.barrier()
        return out
    finally:
        gc.collect()
        dist.destroy_process_group()
        gc.collect()


def exit_now() -> None:
    """Ends a spawned rank that succeeded: output flushed, no interpreter finalization."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
