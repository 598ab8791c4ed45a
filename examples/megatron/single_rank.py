"""A process group of one rank whose collectives are done in place, without a communication
library: the backend "single_rank" for a trainer of one process (train_gpt.py
``--process-group single``, colocated.py ``--trainer-backend single``).

Note [A single-rank process group]
Rationale: a trainer of one rank still runs Megatron's collectives (the grad reduce-scatter,
the param all-gather, the grad norm's and the cross entropy's all-reduces), and with NCCL
each process group used makes a communicator whose buffers stay on the device outside every
allocator (benchmarks/pause_resume/nccl_footprint.py).  gloo cannot take them on CUDA
tensors: torch 2.11's ProcessGroupGloo has CUDA work for allreduce, allgather, broadcast,
reduce, gather, scatter and alltoall, but not for allgather_coalesced (AsyncAllgatherCoalescedWork
hands the CUDA tensors' pointers to gloo::allgather, which copies them with the host's memcpy),
and Megatron's param all-gather is all_gather_into_tensor inside _coalescing_manager, which
torch turns into allgather_into_tensor_coalesced, that is allgather_coalesced.
Approach: with one rank every collective's result is known without communication: an
all-reduce of any of SUM, AVG, MAX, MIN, PRODUCT, BAND, BOR, BXOR leaves the tensor as it is;
an all-gather, a reduce-scatter, a gather, a scatter, an all-to-all copy the input into the
output (nothing when they are the same memory, as in Megatron's buffers); a broadcast, a
reduce and a barrier do nothing.  These are the exact results, not approximations: a run is
bit-identical to one on NCCL or gloo (examples/rl/check_cycle.py --trainer-backend single checks
it: against NCCL on CUDA, gloo on the CPU).  The copies are enqueued on the caller's current
stream when the collective is called, so each result is ordered like any other kernel there;
the work returned is already complete and its wait() orders no stream (NCCL's makes the waiting
stream wait for its own): a consumer on another stream must wait for the caller's.  Megatron's
DDP with one distributed-optimizer instance issues and waits on the same stream.
Limits: one rank only (the backend refuses a group of more); PREMUL_SUM (a scaled sum) is
refused rather than guessed, and point-to-point operations are not implemented (one rank has
no peer: torch refuses a send to itself before a backend sees it).  Nothing is loaded for it:
torch's libtorch_cuda links libnccl, so NCCL's host library is mapped at ``import torch``, but
NCCL holds no device memory until a communicator is made, which this backend never does.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

NAME = "single_rank"


def _done():
    """A finished work (what every collective here returns)."""
    fut = torch.futures.Future()
    fut.set_result([])
    return _create_work_from_future(fut)


def _copy(out, inp) -> None:
    """out = inp (one rank's share is the whole); nothing when they are the same memory."""
    same = out.data_ptr() == inp.data_ptr() and out.numel() == inp.numel() and out.is_contiguous() \
        and inp.is_contiguous()
    if not same:
        out.copy_(inp.reshape(out.shape))


def _exact(opts) -> None:
    op = getattr(opts, "reduceOp", None)
    if op is not None and op == dist.ReduceOp.PREMUL_SUM:
        raise NotImplementedError("single_rank: PREMUL_SUM (a scaled sum) is not an identity")


class SingleRankProcessGroup(dist.ProcessGroup):
    """Note [A single-rank process group]."""

    def __init__(self, rank: int, size: int):
        if size != 1 or rank != 0:
            raise ValueError(f"single_rank: a group of one rank only (rank {rank} of {size})")
        super().__init__(rank, size)

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return NAME

    def allreduce(self, tensors, opts=None):
        """Also reduce and allreduce_coalesced: the tensors stay as they are."""
        _exact(opts)
        return _done()

    reduce = allreduce_coalesced = allreduce

    def barrier(self, *args, **kwargs):
        """Also broadcast: nothing to do."""
        return _done()

    broadcast = barrier

    def allgather(self, output_lists, inputs, opts=None):
        """Also gather: each input into its list's only output."""
        for outs, inp in zip(output_lists, inputs):
            _copy(outs[0], inp)
        return _done()

    gather = allgather

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        return self.allgather_into_tensor_coalesced(output_lists[0], inputs, opts)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        """Also the reduce-scatters and alltoall: each input into its output."""
        _exact(opts)
        for out, inp in zip(outputs, inputs):
            _copy(out, inp)
        return _done()

    reduce_scatter_tensor_coalesced = alltoall = allgather_into_tensor_coalesced

    def reduce_scatter(self, outputs, input_lists, opts=None):
        """Also scatter: each list's only input into its output."""
        return self.allgather_into_tensor_coalesced(outputs, [inps[0] for inps in input_lists], opts)

    scatter = reduce_scatter

    def _allgather_base(self, output, inp, opts=None):
        """Also _reduce_scatter_base."""
        return self.allgather_into_tensor_coalesced([output], [inp], opts)

    _reduce_scatter_base = _allgather_base

    def alltoall_base(self, output, inp, output_split_sizes, input_split_sizes, opts=None):
        return self.allgather_into_tensor_coalesced([output], [inp], opts)


def _create(store, rank: int, size: int, timeout):
    return SingleRankProcessGroup(rank, size)


def register() -> None:
    """The backend "single_rank" registered with torch.distributed (idempotent), for CPU and CUDA
    tensors.  A group of it is this Python object for every device (torch 2.11 makes a backend
    that is a ProcessGroup subclass the whole group, so "cpu:gloo,cuda:single_rank" would not
    keep gloo for CPU tensors): init_process_group("single_rank")."""
    if getattr(dist.Backend, NAME.upper(), None) is None:
        dist.Backend.register_backend(NAME, _create, devices=["cpu", "cuda"])
