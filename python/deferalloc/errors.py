"""Exceptions of the Python face: one class per dfa_status, all DeferallocError.

The mirror of include/deferalloc/core/errors.hpp: status_of() there maps each C++ class to
the status whose class is here (InvalidArgument <-> invalid_argument, NoDevice <->
no_device, ..., InternalError <-> any other exception), throw_status() maps back.

The message is dfa_last_error() of the failed call ("dfa_<call>: <cause>"), or, for the
checks this package makes before calling C, a sentence naming the argument.
InvalidArgument is also a ValueError; OutOfMemory is also torch.OutOfMemoryError (so
code that catches PyTorch's out-of-memory catches ours), or MemoryError without torch.
"""
from __future__ import annotations

try:
    from torch import OutOfMemoryError as _TorchOOM
except ImportError:  # torch missing or too old
    _TorchOOM = MemoryError


class DeferallocError(RuntimeError):
    """A deferalloc call failed; ``status`` is its dfa_status code."""

    status = 8

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        if status is not None:
            self.status = status


class InvalidArgument(DeferallocError, ValueError):
    """Bad input (DFA_ERROR_INVALID_ARGUMENT); nothing changed."""
    status = 1


class InvalidState(DeferallocError):
    """Wrong state for the call (DFA_ERROR_INVALID_STATE); nothing changed."""
    status = 2


class OutOfMemory(DeferallocError, _TorchOOM):
    """Memory ran out (DFA_ERROR_OUT_OF_MEMORY); the call was rolled back."""
    status = 3


class CudaError(DeferallocError):
    """A CUDA driver call failed (DFA_ERROR_CUDA)."""
    status = 4


class NoDevice(CudaError):
    """No usable CUDA driver or device (DFA_ERROR_NO_DEVICE), or no libdeferalloc.so."""
    status = 5


class IoError(DeferallocError, OSError):
    """A file operation failed (DFA_ERROR_IO)."""
    status = 6


class CorruptData(DeferallocError):
    """Stored data failed verification (DFA_ERROR_CORRUPT)."""
    status = 7


class InternalError(DeferallocError):
    """A bug or an unexpected exception inside deferalloc (DFA_ERROR_INTERNAL)."""
    status = 8


BY_STATUS = {c.status: c for c in (InvalidArgument, InvalidState, OutOfMemory, CudaError, NoDevice, IoError,
                                   CorruptData, InternalError)}


def from_status(status: int, message: str) -> DeferallocError:
    """The exception for a dfa_status code (an unknown code: DeferallocError with that status)."""
    cls = BY_STATUS.get(status)
    return cls(message) if cls is not None else DeferallocError(message, status)
