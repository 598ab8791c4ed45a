"""The package's two native libraries through ctypes: one loader, one binding of each.

``allocator`` is libdeferalloc (the allocator's C ABI, ``include/deferalloc/deferalloc.h``);
``optimizer`` is libdeferalloc_optimizer (the optimizer's, ``include/deferalloc/optimizer.h``).
Each is opened once, on first use, with every entry point's signature set;
``<library>.check(status, call)`` raises the package's exception for a failed status with that
library's thread-local message.  ``deferalloc`` (the allocator face), ``deferalloc.optim``,
``deferalloc.overlap`` and ``deferalloc.megatron`` all call the libraries through here.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import math
import os
import threading
from typing import Callable

import torch

from . import _logging
from .errors import DeferallocError, InvalidArgument, NoDevice, from_status


class Library:
    """A native library opened on first call, with the signatures of its entry points."""

    def __init__(self, locate: Callable[[], str], signatures: Callable[[], dict], last_error: str,
                 on_load: Callable[[ctypes.CDLL], None] | None = None):
        self._locate, self._signatures, self._last_error, self._on_load = locate, signatures, last_error, on_load
        self._lib: ctypes.CDLL | None = None
        self._lock = threading.Lock()
        self.path: str | None = None

    def __call__(self) -> ctypes.CDLL:
        lib = self._lib
        if lib is not None:
            return lib
        with self._lock:
            if self._lib is None:
                path = self._locate()
                lib = ctypes.CDLL(path)
                for name, (res, args) in self._signatures().items():
                    fn = getattr(lib, name)
                    fn.restype = res
                    fn.argtypes = args
                if self._on_load is not None:
                    self._on_load(lib)
                self.path, self._lib = path, lib
            return self._lib

    def error(self, status: int, call: str) -> DeferallocError:
        """The exception for `status`, with this thread's last error message of the library
        (read it before any other call into the library: a success clears it)."""
        msg = getattr(self(), self._last_error)().decode(errors="replace")
        return from_status(status, msg or f"{call} failed")

    def check(self, status: int, call: str) -> None:
        if status != 0:
            raise self.error(status, call)


# ---- libdeferalloc ------------------------------------------------------------------------

def library_path() -> str:
    """Path of libdeferalloc.so: $DEFERALLOC_LIB, else the one installed inside this package
    (``pip install``: deferalloc/lib), else what the dynamic linker finds."""
    env = os.environ.get("DEFERALLOC_LIB")
    if env:
        return env
    bundled = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib", "libdeferalloc.so")
    if os.path.exists(bundled):
        return bundled
    found = ctypes.util.find_library("deferalloc")
    if found is None:
        raise DeferallocError("libdeferalloc.so not found: install the package (pip install .) "
                              "or set DEFERALLOC_LIB to the library's path")
    return found


def _allocator_signatures() -> dict:
    c = ctypes
    return {
        "dfa_last_error": (c.c_char_p, []),
        "dfa_driver_name": (c.c_int, [c.POINTER(c.c_char_p)]),
        "dfa_granularity": (c.c_int, [c.POINTER(c.c_size_t)]),
        "dfa_reserve": (c.c_int, [c.c_size_t, c.POINTER(c.c_uint64), c.POINTER(c.c_void_p)]),
        "dfa_materialize": (c.c_int, [c.c_uint64, c.c_size_t, c.c_size_t, c.c_int, c.c_void_p]),
        "dfa_release": (c.c_int, [c.c_uint64, c.c_size_t, c.c_size_t, c.c_int, c.c_void_p]),
        "dfa_record_stream": (c.c_int, [c.c_uint64, c.c_void_p]),
        "dfa_free_reservation": (c.c_int, [c.c_uint64, c.c_void_p]),
        "dfa_is_backed": (c.c_int, [c.c_uint64, c.c_size_t, c.c_size_t, c.POINTER(c.c_int)]),
        "dfa_find": (c.c_int, [c.c_void_p, c.POINTER(c.c_uint64)]),
        "dfa_export_dlpack": (c.c_int, [c.c_uint64, c.POINTER(c.c_int64), c.c_int, c.c_uint8, c.c_uint8,
                                        c.c_uint16, c.POINTER(c.c_void_p)]),
        "dfa_tag_begin": (c.c_int, [c.c_char_p]),
        "dfa_tag_end": (c.c_int, []),
        "dfa_tag_pause": (c.c_int, [c.c_char_p, c.c_int, c.c_void_p]),
        "dfa_tag_resume": (c.c_int, [c.c_char_p, c.c_void_p]),
        "dfa_tag_is_paused": (c.c_int, [c.c_char_p, c.POINTER(c.c_int)]),
        "dfa_tag_names": (c.c_int, [c.c_char_p, c.c_size_t, c.POINTER(c.c_size_t)]),
        "dfa_set_resident": (c.c_int, [c.c_void_p, c.c_int]),
        "dfa_memory_stats": (c.c_int, [c.c_int, c.c_char_p, c.c_size_t, c.POINTER(c.c_size_t)]),
        "dfa_reset_peak_stats": (c.c_int, [c.c_int]),
        "dfa_empty_cache": (c.c_int, [c.c_int, c.POINTER(c.c_size_t)]),
        "dfa_trim": (c.c_int, [c.c_size_t, c.POINTER(c.c_size_t)]),
        "dfa_last_refusal": (c.c_char_p, []),
        "dfa_clear_last_refusal": (None, []),
        "dfa_memory_snapshot": (c.c_int, [c.c_char_p, c.c_size_t, c.POINTER(c.c_size_t)]),
        "dfa_record_memory_history": (c.c_int, [c.c_size_t]),
    }


# The library's messages go to logging.getLogger("deferalloc") once it is open.
allocator = Library(library_path, _allocator_signatures, "dfa_last_error", on_load=_logging.install)


# ---- libdeferalloc_optimizer ----------------------------------------------------------------

class AdamwParams(ctypes.Structure):
    """dfa_adamw_params."""
    _fields_ = [("lr", ctypes.c_double), ("beta1", ctypes.c_double), ("beta2", ctypes.c_double),
                ("eps", ctypes.c_double), ("weight_decay", ctypes.c_double)]


class OptimizerStats(ctypes.Structure):
    """dfa_opt_stats."""
    _fields_ = [("steps", ctypes.c_uint64), ("shards", ctypes.c_size_t), ("piece_elements", ctypes.c_size_t),
                ("seconds", ctypes.c_double), ("params", ctypes.c_size_t), ("pieces", ctypes.c_size_t),
                ("bytes_to_device", ctypes.c_size_t), ("bytes_from_device", ctypes.c_size_t),
                ("peak_backed_bytes", ctypes.c_size_t), ("map_seconds", ctypes.c_double),
                ("retire_seconds", ctypes.c_double), ("io_wait_seconds", ctypes.c_double)]


# dfa_progress_fn: phase, done, total, seconds, user.
PROGRESS_FN = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_double,
                               ctypes.c_void_p)


def optimizer_library_path() -> str:
    """$DEFERALLOC_OPTIMIZER_LIB, else libdeferalloc_optimizer.so beside libdeferalloc.so, else the linker's search."""
    env = os.environ.get("DEFERALLOC_OPTIMIZER_LIB")
    if env:
        return env
    try:
        base = library_path()
    except DeferallocError:
        base = None
    if base and os.path.sep in base:
        d = os.path.dirname(base)
        for cand in (os.path.join(d, "libdeferalloc_optimizer.so"),
                     os.path.join(d, "..", "optimizer", "libdeferalloc_optimizer.so")):
            if os.path.exists(cand):
                return os.path.normpath(cand)
    found = ctypes.util.find_library("deferalloc_optimizer")
    if found is None:
        raise NoDevice("libdeferalloc_optimizer.so not found: set DEFERALLOC_OPTIMIZER_LIB to its path")
    return found


def _optimizer_signatures() -> dict:
    c = ctypes
    P = c.c_void_p
    return {
        "dfa_opt_last_error": (c.c_char_p, []),
        "dfa_opt_create": (c.c_int, [c.c_char_p, c.POINTER(P)]),
        "dfa_opt_destroy": (c.c_int, [P]),
        "dfa_opt_add_shard": (c.c_int, [P, P, c.c_size_t, c.c_int, c.c_int, c.c_char_p, c.POINTER(c.c_size_t)]),
        "dfa_opt_set_group": (c.c_int, [P, c.c_int, c.POINTER(AdamwParams)]),
        "dfa_opt_initialize": (c.c_int, [P, P]),
        "dfa_opt_step": (c.c_int, [P, c.POINTER(P), c.c_size_t, c.POINTER(c.c_int), c.c_float, P]),
        "dfa_opt_step_speculative": (c.c_int, [P, c.POINTER(P), c.c_size_t, c.POINTER(c.c_int), c.c_float, P]),
        "dfa_opt_commit_speculation": (c.c_int, [P]),
        "dfa_opt_discard_speculation": (c.c_int, [P]),
        "dfa_opt_speculation_pending": (c.c_int, [P, c.POINTER(c.c_size_t)]),
        "dfa_opt_can_speculate": (c.c_int, [P, c.c_size_t, c.POINTER(c.c_int)]),
        "dfa_opt_sync_model_params": (c.c_int, [P, P]),
        "dfa_opt_read_state": (c.c_int, [P, c.c_size_t, c.c_int, c.c_size_t, c.c_size_t, P]),
        "dfa_opt_write_state": (c.c_int, [P, c.c_size_t, c.c_int, c.c_size_t, c.c_size_t, P]),
        "dfa_opt_get_shard_step": (c.c_int, [P, c.c_size_t, c.POINTER(c.c_uint64)]),
        "dfa_opt_set_shard_step": (c.c_int, [P, c.c_size_t, c.c_uint64]),
        "dfa_opt_begin_state_write": (c.c_int, [P]),
        "dfa_opt_end_state_write": (c.c_int, [P, c.c_int]),
        "dfa_opt_set_shard_param": (c.c_int, [P, c.c_size_t, P]),
        "dfa_opt_save_checkpoint": (c.c_int, [P, c.c_char_p]),
        "dfa_opt_load_checkpoint": (c.c_int, [P, c.c_char_p]),
        "dfa_opt_set_progress": (c.c_int, [P, PROGRESS_FN, P]),
        "dfa_opt_get_stats": (c.c_int, [P, c.POINTER(OptimizerStats)]),
    }


optimizer = Library(optimizer_library_path, _optimizer_signatures, "dfa_opt_last_error")

# dfa_dtype of the parameter and gradient types the optimizer takes.
DTYPE_CODES = {torch.bfloat16: 0, torch.float32: 1, torch.float16: 2}


def stream_ptr(stream, device: torch.device):
    """The cudaStream_t argument for `stream` on `device` (None: the current stream; a CPU
    device: a null stream)."""
    if device.type != "cuda":
        return None
    if stream is None:
        stream = torch.cuda.current_stream(device)
    if isinstance(stream, torch.cuda.Stream):
        return ctypes.c_void_p(stream.cuda_stream)
    return ctypes.c_void_p(int(stream))


# Steps are whole numbers that a double (and so torch's float step tensors) holds exactly.
MAX_STEP = 1 << 53


def checked_step(v, where: str) -> int:
    """A step count from outside (a state dict, ``opt.state[p]``, Megatron's checkpoint): a whole
    number in [0, 2**53), as a number or a one-element tensor; anything else raises
    InvalidArgument naming `where`."""
    if isinstance(v, torch.Tensor):
        if v.numel() != 1:
            raise InvalidArgument(f"{where}: step is a tensor of {v.numel()} elements (one expected)")
        v = v.item()
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise InvalidArgument(f"{where}: step {v!r} is not a number")
    if not (math.isfinite(v) and v == int(v) and 0 <= v < MAX_STEP):
        raise InvalidArgument(f"{where}: step {v!r} is not a whole number in [0, 2**53)")
    return int(v)
