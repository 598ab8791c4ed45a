"""Runs megatron-core's GPU-only code paths on the CPU, for CI machines without a GPU.

megatron-core 0.16.1 is written for CUDA: DistributedDataParallel allocates its buffers on
``torch.cuda.current_device()``, MixedPrecisionOptimizer makes ``device='cuda'`` scalars,
DistributedOptimizer accepts only ``torch.cuda.*Tensor`` types, and the attention forks the
CUDA RNG tracker.  ``enable()`` makes a CPU-only process look like one GPU to those four
places and nothing else: factory calls with a CUDA device get the CPU, ``Tensor.type()`` of
a CPU tensor answers the CUDA name, ``torch.cuda.current_device`` answers the CPU device,
``torch.cuda.synchronize`` does nothing, and the RNG tracker's fork is a no-op (dropout must
be 0).  The arithmetic is torch's CPU kernels; the optimizer engine runs on deferalloc's
host driver.  Test-and-example use only: never in a process with a GPU.
"""
from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_enabled = False


class _CudaDeviceToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        d = kwargs.get("device")
        if d is not None and (d == "cuda" or isinstance(d, int) or (isinstance(d, str) and d.startswith("cuda"))
                              or (isinstance(d, torch.device) and d.type == "cuda")):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def enable() -> None:
    """Installs the emulation (idempotent).  Call before importing megatron.core."""
    global _enabled
    if _enabled:
        return
    if torch.cuda.is_available():
        raise RuntimeError("cpu_emulation: a GPU is present; run the real thing")
    _enabled = True
    _CudaDeviceToCpu().__enter__()
    original_type = torch.Tensor.type

    def type_(self, *args, **kwargs):
        if args or kwargs:
            return original_type(self, *args, **kwargs)
        name = original_type(self)
        if self.device.type == "cpu" and not name.startswith("torch.cuda."):
            return name.replace("torch.", "torch.cuda.", 1)
        return name

    torch.Tensor.type = type_
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *a, **k: None
    # (the tied embedding's set-up moves its last-stage copy with ``.cuda()``)
    torch.Tensor.cuda = lambda self, *a, **k: self
    # megatron-core >= 0.19 waits on the current stream's events before a grad reduction.
    torch.cuda.current_stream = lambda *a, **k: _NoStream()


class _NoStream:
    """The CPU's "current stream": every wait is already satisfied."""

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass


def after_model_parallel_init() -> None:
    """The RNG tracker's fork, a no-op (after parallel_state.initialize_model_parallel)."""
    from megatron.core import tensor_parallel
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
