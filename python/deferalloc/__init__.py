"""deferalloc for PyTorch, in pure Python: ctypes over the C ABI and DLPack.

No compiled extension: the library is libdeferalloc.so ($DEFERALLOC_LIB, else the copy
that ``pip install`` put inside this package, else the dynamic linker's search path).  Three things:

* deferred tensors: ``deferred_empty(shape, dtype, device)`` returns a torch.Tensor whose
  storage is a deferalloc reservation (stable ``data_ptr()``, no physical memory until
  ``materialize``); ``release`` unbacks it (contents discarded or kept in pinned host
  memory), ``is_backed`` tells.  Freeing the last reference frees the reservation.
* regions: ``with region("rollout", keep="host"): ...`` puts the tensors allocated inside
  in the tag "rollout"; ``pause("rollout")`` gives their physical memory back (addresses
  kept, contents in pinned host memory with keep="host") and ``resume`` brings it back;
  ``pause()`` / ``resume()`` without a tag act on every tag.  See Note [One MemPool per tag].
  (The older ``tag()`` + ``mem_pool()`` pair still works, but one MemPool shared by two
  tags lets PyTorch's cache hand one tag's freed segment to the other.)
* the allocator for a whole process: ``install()`` (full replacement, with the hooks), or
  PyTorch's caching allocator on top with segments from deferalloc (``region`` does this
  per tag; ``mem_pool()`` gives one such pool).

Errors: one exception class per dfa_status (deferalloc.errors), all DeferallocError, with
dfa_last_error() as the message; arguments are checked here first (TypeError, or
InvalidArgument which is a ValueError) so that C never sees a float, a negative or a
wrapped size.

Note [One MemPool per tag]: PyTorch's caching allocator keeps freed blocks and hands them
to the next request of the same pool, whatever deferalloc tag is current then.  With one
MemPool for two tags, a segment allocated under tag "a" and freed can come back for a
tensor allocated under "b"; pausing "a" then unmaps b's tensor.  So ``region(tag)`` owns
one MemPool per (tag, device), as torch_memory_saver does: a pool only ever holds segments
of its tag.  Pausing a tag also gives back the segments PyTorch keeps cached-but-free in
the tag's pool: a live MemPool keeps them (torch.cuda.empty_cache skips the private pools
still in use), so ``pause`` drops the region's MemPool (its destructor releases the pool
and empties its cache; blocks still in use keep the old pool alive until they are freed)
and calls torch.cuda.empty_cache(), which also collects the pools of earlier cycles; the
next ``region(tag)`` makes a fresh pool.  Under full replacement (``install()``) there is
no PyTorch cache in between: deferalloc's caching allocator already keeps each tag in
segments of its own, and ``region`` only opens the tag.
Limits: pause refuses inside a region of the calling thread, and allocating in a paused
tag fails; a thread that is inside ``region(tag)`` while another pauses that tag keeps the
pool alive (its cached segments are then paused with the rest).  ``pause()`` of every tag
stops at the first failure (the tags paused before it stay paused).
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import operator
import os
from typing import Iterator, Sequence

import torch

from . import _logging
from .errors import (CorruptData, CudaError, DeferallocError, InternalError, InvalidArgument, InvalidState,
                     IoError, NoDevice, OutOfMemory, from_status)

__all__ = [
    "DeferallocError", "InvalidArgument", "InvalidState", "OutOfMemory", "CudaError", "NoDevice", "IoError",
    "CorruptData", "InternalError", "library_path", "deferred_empty", "materialize", "release", "is_backed",
    "region", "tag", "tags", "pause", "resume", "is_paused", "set_resident", "memory_stats", "reset_peak_stats",
    "empty_cache", "trim", "pluggable_allocator", "mem_pool", "install", "driver_name", "__version__",
]

# The package's version: pyproject.toml's [project] version (a test keeps the two equal).
__version__ = "0.1.0"

_SIZE_MAX = (1 << 64) - 1
_FILL = {"undefined": 0, "zero": 1, "restore": 2}
_KEEP = {"discard": 0, "host": 1}
# torch dtype -> DLPack (code, bits)
_DTYPES = {
    torch.float32: (2, 32), torch.float64: (2, 64), torch.float16: (2, 16), torch.bfloat16: (4, 16),
    torch.int8: (0, 8), torch.int16: (0, 16), torch.int32: (0, 32), torch.int64: (0, 64),
    torch.uint8: (1, 8), torch.bool: (6, 8),
}


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
        raise DeferallocError("libdeferalloc.so not found: install the package (pip install .) "
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
        "dfa_tag_names": (c.c_int, [c.c_char_p, c.c_size_t, c.POINTER(c.c_size_t)]),
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
        raise _error(status, call)


def _error(status: int, call: str) -> DeferallocError:
    """The exception for `status`, with this thread's dfa_last_error() (read it before any
    other deferalloc call: a success clears it)."""
    msg = _load().dfa_last_error().decode(errors="replace")
    return from_status(status, msg or f"{call} failed")


# ---- argument checks (before anything reaches C) --------------------------------------------

def _int(value, what: str, lo: int = 0, hi: int = _SIZE_MAX) -> int:
    """`value` as an int in [lo, hi]; TypeError for a float, a bool or a non-integer."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{what} must be an integer, not {type(value).__name__} ({value!r})")
    v = operator.index(value)
    if v < lo or v > hi:
        raise InvalidArgument(f"{what} = {v} is outside [{lo}, {hi}]")
    return v


def _choice(value, what: str, table: dict) -> int:
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a string, one of {sorted(table)}, not {type(value).__name__}")
    if value not in table:
        raise InvalidArgument(f"{what} must be one of {sorted(table)}, not {value!r}")
    return table[value]


def _tag_name(name) -> bytes:
    if not isinstance(name, str):
        raise TypeError(f"a tag is a string, not {type(name).__name__}")
    if not name:
        raise InvalidArgument("a tag must not be empty")
    return name.encode()


def _device_index(device) -> int:
    return _int(device, "device", lo=-1, hi=(1 << 31) - 1)


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
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"deferred_empty: dtype must be a torch.dtype, not {type(dtype).__name__}")
    if dtype not in _DTYPES:
        raise InvalidArgument(f"deferred_empty: dtype {dtype} has no DLPack code here")
    device = torch.device(device)
    want = "cuda" if driver_name() == "cuda" else "cpu"
    if device.type != want:
        raise InvalidArgument(f"deferred_empty: the {driver_name()} driver serves {want} tensors, not {device.type}")
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        shape = [shape]  # one dimension given as a number
    shape = [_int(s, f"deferred_empty: shape[{i}]", hi=(1 << 63) - 1) for i, s in enumerate(shape)]
    code, bits = _DTYPES[dtype]
    nbytes = bits // 8
    for s in shape:
        nbytes *= s
    if nbytes > (1 << 63) - 1:
        raise InvalidArgument(f"deferred_empty: shape {shape} of {dtype} needs {nbytes} bytes, more than any "
                              "reservation can hold (2**63 - 1)")
    lib = _load()
    rid = ctypes.c_uint64()
    addr = ctypes.c_void_p()
    _check(lib.dfa_reserve(max(1, nbytes), ctypes.byref(rid), ctypes.byref(addr)), "dfa_reserve")
    arr = (ctypes.c_int64 * max(1, len(shape)))(*shape)
    managed = ctypes.c_void_p()
    st = lib.dfa_export_dlpack(rid, arr, len(shape), code, bits, 1, ctypes.byref(managed))
    if st != 0:
        err = _error(st, "dfa_export_dlpack")  # before the cleanup's success clears the message
        lib.dfa_free_reservation(rid, None)
        raise err
    capsule = _pycapsule_new(managed, b"dltensor", None)
    try:
        return torch.utils.dlpack.from_dlpack(capsule)
    except Exception:
        head = _DLManagedTensorHead.from_address(managed.value)
        head.deleter(managed.value)  # frees the reservation
        raise


def _reservation(t: torch.Tensor) -> int:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor made by deferred_empty, not {type(t).__name__}")
    rid = ctypes.c_uint64()
    _check(_load().dfa_find(ctypes.c_void_p(t.untyped_storage().data_ptr()), ctypes.byref(rid)), "dfa_find")
    return rid.value


def materialize(t: torch.Tensor, fill: str = "zero") -> torch.Tensor:
    """Backs the tensor's reservation; fill is 'zero', 'undefined' or 'restore'.

    Stream-ordered on the current stream; no host synchronisation.  Returns ``t``.
    """
    f = _choice(fill, "materialize: fill", _FILL)
    _check(_load().dfa_materialize(_reservation(t), 0, _SIZE_MAX, f, _stream(t.device)), "dfa_materialize")
    return t


def release(t: torch.Tensor, keep: str = "discard") -> torch.Tensor:
    """Unbacks the tensor (address kept); keep='host' keeps its contents in pinned memory.

    Waits for the current stream's work on it (events, not the device).  Returns ``t``.
    """
    k = _choice(keep, "release: keep", _KEEP)
    _check(_load().dfa_release(_reservation(t), 0, _SIZE_MAX, k, _stream(t.device)), "dfa_release")
    return t


def is_backed(t: torch.Tensor) -> bool:
    out = ctypes.c_int()
    _check(_load().dfa_is_backed(_reservation(t), 0, _SIZE_MAX, ctypes.byref(out)), "dfa_is_backed")
    return bool(out.value)


# ---- tags and regions ------------------------------------------------------------------------

_pools: dict = {}        # (tag, device index) -> torch.cuda.MemPool; Note [One MemPool per tag]
_region_keep: dict = {}  # tag -> keep mode of its latest region()
_installed = False       # install() replaced PyTorch's allocator
_pluggable = None


def _current_stream(stream):
    if stream is not None:
        return stream.cuda_stream if hasattr(stream, "cuda_stream") else stream
    return torch.cuda.current_stream().cuda_stream if torch.cuda.is_available() else None


@contextlib.contextmanager
def tag(name: str) -> Iterator[None]:
    """Allocations made by deferalloc's caching allocator on this thread belong to ``name``.

    Lower level than ``region``: with a MemPool shared by several tags, PyTorch's cache
    can give one tag's freed segment to another (Note [One MemPool per tag])."""
    raw = _tag_name(name)
    _check(_load().dfa_tag_begin(raw), "dfa_tag_begin")
    try:
        yield
    finally:
        _check(_load().dfa_tag_end(), "dfa_tag_end")


@contextlib.contextmanager
def region(name: str, keep: str = "discard", device=None) -> Iterator[None]:
    """Tensors allocated inside belong to the tag ``name``: ``pause(name)`` gives their
    physical memory back (addresses kept) and ``resume(name)`` backs them again, with their
    contents when ``keep="host"`` (kept in pinned host memory), undefined with "discard".

    On CUDA, allocations go to this tag's own torch.cuda.MemPool on ``device`` (current
    device by default), with segments from deferalloc; after ``install()`` they go to
    deferalloc directly.  On the host driver (no CUDA) only the tag is opened.  Cost: the
    first region of a tag and device creates its MemPool; then a dict lookup.
    Raises TypeError / InvalidArgument for a bad name or keep.  Allocating while the tag is
    paused fails (deferalloc refuses; PyTorch reports it as out of memory).
    """
    raw = _tag_name(name)
    _choice(keep, "region: keep", _KEEP)
    _region_keep[name] = keep
    if _installed or not torch.cuda.is_available():
        with tag(name):
            yield
        return
    d = None if device is None else torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    dev = torch.cuda.current_device() if d is None or d.index is None else d.index
    key = (name, dev)
    pool = _pools.get(key)
    if pool is None:
        with torch.cuda.device(dev):
            pool = mem_pool()
        _pools[key] = pool
    _check(_load().dfa_tag_begin(raw), "dfa_tag_begin")
    try:
        with torch.cuda.use_mem_pool(pool, device=dev):
            yield
    finally:
        del pool  # the frame must not keep the pool alive past a pause
        _check(_load().dfa_tag_end(), "dfa_tag_end")


def tags() -> list:
    """Every tag known to deferalloc (made by ``region``, ``tag`` or the C ABI)."""
    lib = _load()
    needed = ctypes.c_size_t()
    _check(lib.dfa_tag_names(None, 0, ctypes.byref(needed)), "dfa_tag_names")
    buf = ctypes.create_string_buffer(needed.value + 4096)
    _check(lib.dfa_tag_names(buf, len(buf), ctypes.byref(needed)), "dfa_tag_names")
    return [t for t in buf.value.decode().split("\n") if t]


def _give_back_cached_segments(name: str) -> None:
    """Drops the tag's MemPools so that PyTorch returns their cached-but-free segments to
    deferalloc (Note [One MemPool per tag])."""
    keys = [k for k in _pools if k[0] == name]
    for k in keys:
        del _pools[k]
    if keys and not _installed and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def pause(name: str | None = None, keep: str | None = None, stream=None) -> None:
    """Gives back the physical memory of the tag's tensors, addresses kept; without a tag,
    of every tag not paused yet.  keep: "host" keeps contents in pinned host memory,
    "discard" drops them; None takes the keep of the tag's region (else "discard").
    Waits for the streams that used the memory (events), not for the device.
    Raises InvalidArgument (unknown tag, bad keep), InvalidState (inside a region, already
    paused), OutOfMemory (host backup; nothing paused)."""
    if keep is not None:
        _choice(keep, "pause: keep", _KEEP)
    s = _current_stream(stream)
    if name is None:
        names = [t for t in tags() if not is_paused(t)]
    else:
        _tag_name(name)
        names = [name]
    for t in names:
        k = keep if keep is not None else _region_keep.get(t, "discard")
        _give_back_cached_segments(t)
        _check(_load().dfa_tag_pause(t.encode(), _KEEP[k], s), "dfa_tag_pause")


def resume(name: str | None = None, stream=None) -> None:
    """Backs the tag's tensors again at the same addresses (contents restored when paused
    with keep="host"); without a tag, every paused tag.  ``stream`` (default: the current
    one) waits for the restore copies.  Raises InvalidArgument (unknown tag), InvalidState
    (not paused), OutOfMemory (nothing resumed)."""
    s = _current_stream(stream)
    if name is None:
        names = [t for t in tags() if is_paused(t)]
    else:
        _tag_name(name)
        names = [name]
    for t in names:
        _check(_load().dfa_tag_resume(t.encode(), s), "dfa_tag_resume")


def is_paused(name: str) -> bool:
    out = ctypes.c_int()
    _check(_load().dfa_tag_is_paused(_tag_name(name), ctypes.byref(out)), "dfa_tag_is_paused")
    return bool(out.value)


def set_resident(t, resident: bool = True) -> None:
    """Keeps an allocation (a tensor or a pointer) backed when its tag pauses."""
    ptr = t.data_ptr() if isinstance(t, torch.Tensor) else _int(t, "set_resident: pointer")
    _check(_load().dfa_set_resident(ctypes.c_void_p(ptr), int(bool(resident))), "dfa_set_resident")


# ---- statistics ------------------------------------------------------------------------------

def memory_stats(device: int = -1) -> dict:
    """deferalloc's caching allocator statistics, with PyTorch's key names."""
    device = _device_index(device)
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
    _check(_load().dfa_reset_peak_stats(_device_index(device)), "dfa_reset_peak_stats")


def trim(keep_bytes: int = 0) -> int:
    """Gives cached chunks of the pool back to the device until at most ``keep_bytes`` stay
    cached, and frees the cached pinned backup buffers; returns the device bytes released.  Raises TypeError / InvalidArgument for a bad size."""
    keep_bytes = _int(keep_bytes, "trim: keep_bytes")
    out = ctypes.c_size_t()
    _check(_load().dfa_trim(keep_bytes, ctypes.byref(out)), "dfa_trim")
    return out.value


def empty_cache(device: int = -1) -> int:
    """Releases cached granules and trims the pool; returns the bytes given back."""
    out = ctypes.c_size_t()
    _check(_load().dfa_empty_cache(_device_index(device), ctypes.byref(out)), "dfa_empty_cache")
    return out.value


# ---- the allocator for a whole process -------------------------------------------------------

def pluggable_allocator():
    """torch.cuda.memory.CUDAPluggableAllocator on dfa_malloc/dfa_free, with every hook set
    (init, empty_cache, memory fraction, base allocation, record_stream).  One per process."""
    global _pluggable
    if _pluggable is not None:
        return _pluggable
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
    _pluggable = alloc
    return alloc


def mem_pool():
    """A torch.cuda.MemPool whose segments come from deferalloc (PyTorch's caching allocator
    stays on top, so its stats and snapshots keep working).  Use with
    ``with torch.cuda.use_mem_pool(pool): ...``; for tags prefer ``region``, which keeps
    one pool per tag (Note [One MemPool per tag])."""
    return torch.cuda.MemPool(allocator=pluggable_allocator().allocator())


def install():
    """Replaces PyTorch's CUDA allocator by deferalloc's (before any CUDA allocation).

    PyTorch's own memory_stats/snapshots do not work in this mode: use
    ``deferalloc.memory_stats()``.  Raises RuntimeError if PyTorch's allocator is in use.
    """
    global _installed
    alloc = pluggable_allocator()
    torch.cuda.memory.change_current_allocator(alloc)
    _installed = True
    return alloc
