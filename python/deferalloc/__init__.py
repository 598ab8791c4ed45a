"""deferalloc for PyTorch, in pure Python: ctypes over the C ABI and DLPack.

No compiled extension: the library is libdeferalloc.so ($DEFERALLOC_LIB, else the copy
that ``pip install`` put inside this package, else the dynamic linker's search path).  Three things:

* deferred tensors: ``deferred_empty(shape, dtype, device)`` returns a torch.Tensor whose
  storage is a deferalloc reservation (stable ``data_ptr()``, no physical memory until
  ``materialize``); ``release`` unbacks it (contents discarded or kept in pinned host
  memory), ``is_backed`` tells.  Freeing the last reference frees the reservation.
* tags: ``with tag("rollout"): ...`` puts the allocations made through deferalloc's
  caching allocator (MemPool or full replacement) in a tag; ``pause`` / ``resume``.
* the allocator for a whole process: ``mem_pool()`` (PyTorch's caching allocator on top,
  segments from deferalloc) or ``install()`` (full replacement, with the hooks).
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
from typing import Iterator, Sequence

import torch

from . import _logging

__all__ = [
    "DeferallocError", "library_path", "deferred_empty", "materialize", "release", "is_backed",
    "tag", "pause", "resume", "is_paused", "set_resident", "memory_stats", "reset_peak_stats",
    "empty_cache", "trim", "pluggable_allocator", "mem_pool", "install", "driver_name",
]

_STATUS = {0: "success", 1: "invalid argument", 2: "invalid state", 3: "out of memory", 4: "CUDA error",
           5: "no device", 6: "I/O error", 7: "corrupt data", 8: "internal error"}
_FILL = {"undefined": 0, "zero": 1, "restore": 2}
_KEEP = {"discard": 0, "host": 1}
# torch dtype -> DLPack (code, bits)
_DTYPES = {
    torch.float32: (2, 32), torch.float64: (2, 64), torch.float16: (2, 16), torch.bfloat16: (4, 16),
    torch.int8: (0, 8), torch.int16: (0, 16), torch.int32: (0, 32), torch.int64: (0, 64),
    torch.uint8: (1, 8), torch.bool: (6, 8),
}


class DeferallocError(RuntimeError):
    """A deferalloc call failed; ``status`` is the dfa_status code."""

    def __init__(self, status: int, message: str):
        super().__init__(f"{message} [{_STATUS.get(status, status)}]")
        self.status = status


_lib = None
_path = None


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
        raise DeferallocError(2, "libdeferalloc.so not found: install the package (pip install .) "
                                 "or set DEFERALLOC_LIB to the library's path")
    return found


def _load():
    global _lib, _path
    if _lib is not None:
        return _lib
    _path = library_path()
    lib = ctypes.CDLL(_path)
    c = ctypes
    sigs = {
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
        "dfa_set_resident": (c.c_int, [c.c_void_p, c.c_int]),
        "dfa_memory_stats": (c.c_int, [c.c_int, c.c_char_p, c.c_size_t, c.POINTER(c.c_size_t)]),
        "dfa_reset_peak_stats": (c.c_int, [c.c_int]),
        "dfa_empty_cache": (c.c_int, [c.c_int, c.POINTER(c.c_size_t)]),
        "dfa_trim": (c.c_int, [c.c_size_t, c.POINTER(c.c_size_t)]),
    }
    for name, (res, args) in sigs.items():
        fn = getattr(lib, name)
        fn.restype = res
        fn.argtypes = args
    _logging.install(lib)  # the library's messages to logging.getLogger("deferalloc")
    _lib = lib
    return lib


def _check(status: int, call: str) -> None:
    if status != 0:
        msg = _load().dfa_last_error().decode(errors="replace")
        raise DeferallocError(status, msg or call)


def driver_name() -> str:
    """'cuda' or 'host' (the host driver serves CPU tensors: tests without a GPU)."""
    out = ctypes.c_char_p()
    _check(_load().dfa_driver_name(ctypes.byref(out)), "dfa_driver_name")
    return out.value.decode()


def _stream(device: torch.device):
    if device.type == "cuda":
        return ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream)
    return None


# ---- deferred tensors --------------------------------------------------------------------

_pycapsule_new = ctypes.pythonapi.PyCapsule_New
_pycapsule_new.restype = ctypes.py_object
_pycapsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class _DLManagedTensorHead(ctypes.Structure):
    # DLTensor (48 bytes on 64-bit) then manager_ctx and deleter: only the deleter is used here.
    _fields_ = [("dl_tensor", ctypes.c_byte * 48), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.CFUNCTYPE(None, ctypes.c_void_p))]


def deferred_empty(shape: Sequence[int], dtype: torch.dtype = torch.float32,
                   device: torch.device | str = "cuda") -> torch.Tensor:
    """A tensor whose storage is a reservation: stable address, no physical memory.

    Touching it before ``materialize`` faults.  Cost: one cuMemAddressReserve.
    Raises DeferallocError (bad shape or dtype, device not served by the driver).
    """
    device = torch.device(device)
    if dtype not in _DTYPES:
        raise DeferallocError(1, f"deferred_empty: dtype {dtype} has no DLPack code here")
    want = "cuda" if driver_name() == "cuda" else "cpu"
    if device.type != want:
        raise DeferallocError(1, f"deferred_empty: the {driver_name()} driver serves {want} tensors, not {device.type}")
    shape = [int(s) for s in shape]
    if any(s < 0 for s in shape):
        raise DeferallocError(1, f"deferred_empty: negative size in shape {shape}")
    code, bits = _DTYPES[dtype]
    numel = 1
    for s in shape:
        numel *= s
    lib = _load()
    rid = ctypes.c_uint64()
    addr = ctypes.c_void_p()
    _check(lib.dfa_reserve(max(1, numel * bits // 8), ctypes.byref(rid), ctypes.byref(addr)), "dfa_reserve")
    arr = (ctypes.c_int64 * max(1, len(shape)))(*shape)
    managed = ctypes.c_void_p()
    st = lib.dfa_export_dlpack(rid, arr, len(shape), code, bits, 1, ctypes.byref(managed))
    if st != 0:
        lib.dfa_free_reservation(rid, None)
        _check(st, "dfa_export_dlpack")
    capsule = _pycapsule_new(managed, b"dltensor", None)
    try:
        return torch.utils.dlpack.from_dlpack(capsule)
    except Exception:
        head = _DLManagedTensorHead.from_address(managed.value)
        head.deleter(managed.value)  # frees the reservation
        raise


def _reservation(t: torch.Tensor) -> int:
    rid = ctypes.c_uint64()
    _check(_load().dfa_find(ctypes.c_void_p(t.untyped_storage().data_ptr()), ctypes.byref(rid)), "dfa_find")
    return rid.value


def materialize(t: torch.Tensor, fill: str = "zero") -> torch.Tensor:
    """Backs the tensor's reservation; fill is 'zero', 'undefined' or 'restore'.

    Stream-ordered on the current stream; no host synchronisation.  Returns ``t``.
    """
    if fill not in _FILL:
        raise DeferallocError(1, f"materialize: fill must be one of {sorted(_FILL)}")
    _check(_load().dfa_materialize(_reservation(t), 0, ctypes.c_size_t(-1).value, _FILL[fill], _stream(t.device)),
           "dfa_materialize")
    return t


def release(t: torch.Tensor, keep: str = "discard") -> torch.Tensor:
    """Unbacks the tensor (address kept); keep='host' keeps its contents in pinned memory.

    Waits for the current stream's work on it (events, not the device).  Returns ``t``.
    """
    if keep not in _KEEP:
        raise DeferallocError(1, f"release: keep must be one of {sorted(_KEEP)}")
    _check(_load().dfa_release(_reservation(t), 0, ctypes.c_size_t(-1).value, _KEEP[keep], _stream(t.device)),
           "dfa_release")
    return t


def is_backed(t: torch.Tensor) -> bool:
    out = ctypes.c_int()
    _check(_load().dfa_is_backed(_reservation(t), 0, ctypes.c_size_t(-1).value, ctypes.byref(out)), "dfa_is_backed")
    return bool(out.value)


# ---- tags ----------------------------------------------------------------------------------

@contextlib.contextmanager
def tag(name: str) -> Iterator[None]:
    """Allocations made by deferalloc's caching allocator on this thread belong to ``name``."""
    _check(_load().dfa_tag_begin(name.encode()), "dfa_tag_begin")
    try:
        yield
    finally:
        _check(_load().dfa_tag_end(), "dfa_tag_end")


def pause(name: str, keep: str = "discard", stream=None) -> None:
    """Releases the tag's physical memory, addresses kept (keep='host': contents kept)."""
    if keep not in _KEEP:
        raise DeferallocError(1, f"pause: keep must be one of {sorted(_KEEP)}")
    s = stream if stream is not None else (torch.cuda.current_stream().cuda_stream if torch.cuda.is_available() else None)
    _check(_load().dfa_tag_pause(name.encode(), _KEEP[keep], s), "dfa_tag_pause")


def resume(name: str, stream=None) -> None:
    s = stream if stream is not None else (torch.cuda.current_stream().cuda_stream if torch.cuda.is_available() else None)
    _check(_load().dfa_tag_resume(name.encode(), s), "dfa_tag_resume")


def is_paused(name: str) -> bool:
    out = ctypes.c_int()
    _check(_load().dfa_tag_is_paused(name.encode(), ctypes.byref(out)), "dfa_tag_is_paused")
    return bool(out.value)


def set_resident(t, resident: bool = True) -> None:
    """Keeps an allocation (a tensor or a pointer) backed when its tag pauses."""
    ptr = t.data_ptr() if isinstance(t, torch.Tensor) else int(t)
    _check(_load().dfa_set_resident(ctypes.c_void_p(ptr), int(resident)), "dfa_set_resident")


# ---- statistics ------------------------------------------------------------------------------

def memory_stats(device: int = -1) -> dict:
    """deferalloc's caching allocator statistics, with PyTorch's key names."""
    lib = _load()
    needed = ctypes.c_size_t()
    _check(lib.dfa_memory_stats(device, None, 0, ctypes.byref(needed)), "dfa_memory_stats")
    buf = ctypes.create_string_buffer(needed.value + 4096)
    _check(lib.dfa_memory_stats(device, buf, len(buf), ctypes.byref(needed)), "dfa_memory_stats")
    out = {}
    for line in buf.value.decode().splitlines():
        k, v = line.rsplit(" ", 1)
        out[k] = int(v)
    return out


def reset_peak_stats(device: int = -1) -> None:
    _check(_load().dfa_reset_peak_stats(device), "dfa_reset_peak_stats")


def trim(keep_bytes: int = 0) -> int:
    """Gives cached chunks of the pool back to the device; returns the bytes released."""
    out = ctypes.c_size_t()
    _check(_load().dfa_trim(keep_bytes, ctypes.byref(out)), "dfa_trim")
    return out.value


def empty_cache(device: int = -1) -> int:
    """Releases cached granules and trims the pool; returns the bytes given back."""
    out = ctypes.c_size_t()
    _check(_load().dfa_empty_cache(device, ctypes.byref(out)), "dfa_empty_cache")
    return out.value


# ---- the allocator for a whole process -------------------------------------------------------

def pluggable_allocator():
    """torch.cuda.memory.CUDAPluggableAllocator on dfa_malloc/dfa_free, with every hook set
    (init, empty_cache, memory fraction, base allocation, record_stream)."""
    _load()
    alloc = torch.cuda.memory.CUDAPluggableAllocator(_path, "dfa_malloc", "dfa_free")
    hooks = alloc.allocator()
    lib = ctypes.CDLL(_path)

    def addr(name):
        return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value

    hooks.set_init_fn(addr("dfa_init_hook"))
    hooks.set_reset_fn(addr("dfa_empty_cache_hook"))
    hooks.set_memory_fraction_fn(addr("dfa_memory_fraction_hook"))
    hooks.set_base_alloc_fn(addr("dfa_base_alloc_hook"))
    hooks.set_record_stream_fn(addr("dfa_record_stream_hook"))
    return alloc


def mem_pool():
    """A torch.cuda.MemPool whose segments come from deferalloc (PyTorch's caching allocator
    stays on top, so its stats and snapshots keep working).  Use with
    ``with torch.cuda.use_mem_pool(pool): ...``."""
    return torch.cuda.MemPool(allocator=pluggable_allocator().allocator())


def install():
    """Replaces PyTorch's CUDA allocator by deferalloc's (before any CUDA allocation).

    PyTorch's own memory_stats/snapshots do not work in this mode: use
    ``deferalloc.memory_stats()``.  Raises RuntimeError if PyTorch's allocator is in use.
    """
    alloc = pluggable_allocator()
    torch.cuda.memory.change_current_allocator(alloc)
    return alloc
