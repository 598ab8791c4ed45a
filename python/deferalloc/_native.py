"""The package's native libraries through ctypes: the loader, and the allocator's binding.

``Library`` opens a library once, on first use, with every entry point's signature set;
``<library>.check(status, call)`` raises the package's exception for a failed status with
that library's thread-local message.  ``allocator`` is libdeferalloc (the allocator's C ABI,
``include/deferalloc/deferalloc.h``), which the allocator face (``deferalloc``) calls; the
optimizer's library and every call of it live in ``deferalloc._engine``.
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
from .errors import DeferallocError, InvalidArgument, from_status


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
        "dfa_release_many": (c.c_int, [c.POINTER(c.c_uint64), c.c_size_t, c.c_int, c.c_void_p]),
        "dfa_materialize_many": (c.c_int, [c.POINTER(c.c_uint64), c.c_size_t, c.c_int, c.c_void_p]),
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
        "dfa_spill_save": (c.c_int, [c.c_char_p, c.c_int, c.c_size_t, c.POINTER(c.c_void_p), c.POINTER(c.c_size_t),
                                     c.c_size_t, c.c_void_p]),
        "dfa_spill_load": (c.c_int, [c.c_char_p, c.c_int, c.c_size_t, c.POINTER(c.c_void_p), c.POINTER(c.c_size_t),
                                     c.c_size_t, c.c_void_p]),
        "dfa_spill_check_dir": (c.c_int, [c.c_char_p, c.POINTER(c.c_int)]),
    }


# The library's messages go to logging.getLogger("deferalloc") once it is open.
allocator = Library(library_path, _allocator_signatures, "dfa_last_error", on_load=_logging.install)


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
