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
import functools
import operator
import pickle
import unicodedata
from typing import Iterator, Sequence

import torch

from . import _native, _snapshot
from ._logging import logger as _log
from .errors import (CorruptData, CudaError, DeferallocError, InternalError, InvalidArgument, InvalidState,
                     IoError, NoDevice, OutOfMemory)

__all__ = [
    "DeferallocError", "InvalidArgument", "InvalidState", "OutOfMemory", "CudaError", "NoDevice", "IoError",
    "CorruptData", "InternalError", "library_path", "deferred_empty", "materialize", "release", "is_backed",
    "region", "tag", "tags", "pause", "resume", "is_paused", "set_resident", "memory_stats", "reset_peak_stats",
    "empty_cache", "trim", "pluggable_allocator", "mem_pool", "install", "driver_name", "last_error",
    "memory_snapshot", "record_memory_history", "dump_snapshot", "__version__",
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


# The allocator's C ABI (deferalloc._native: the package's one loader of its libraries).
_load = _native.allocator        # libdeferalloc with its signatures set, opened on first call
_check = _native.allocator.check  # a failed dfa_status -> the package's exception
_error = _native.allocator.error
library_path = _native.library_path


# ---- argument checks (before anything reaches C) --------------------------------------------
# What Python alone knows (types, ctypes widths, NULs); the rest is the library's to check
# (Note [Arguments are checked where they enter] in docs/DESIGN.md).

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
    """The tag as bytes for C.  A control character is refused here: a NUL would cut the
    name short in C (aliasing the tag before it) and a newline would split dfa_tag_names'
    list (C refuses them too)."""
    if not isinstance(name, str):
        raise TypeError(f"a tag is a string, not {type(name).__name__}")
    if not name:
        raise InvalidArgument("a tag must not be empty")
    for i, ch in enumerate(name):
        # C0 and C1 controls, and the line and paragraph separators (U+2028, U+2029), which
        # Python's str.splitlines() splits at as it does at a newline.
        if unicodedata.category(ch) in ("Cc", "Zl", "Zp"):
            raise InvalidArgument(f"the tag {name!r} contains the control character U+{ord(ch):04X} at offset {i}; "
                                  "a tag name is printable text (a line break would split the list of tags and "
                                  "the memory snapshot, a NUL cut the name)")
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


_arena_contains = []  # [the preload library's dfa_preload_arena_contains, or None], looked up once


def _in_preload_arena(ptr: int) -> bool:
    """Whether ``ptr`` lies in an arena of libdeferalloc_preload.so (Note [Preload arenas] in
    allocator/abi/preload_arena.cpp): a block of 64 GiB that holds many segments."""
    if not _arena_contains:
        fn = getattr(ctypes.CDLL(None), "dfa_preload_arena_contains", None)
        if fn is not None:
            fn.argtypes = [ctypes.c_void_p]
            fn.restype = ctypes.c_int
        _arena_contains.append(fn)
    return _arena_contains[0] is not None and _arena_contains[0](ctypes.c_void_p(ptr)) == 1


def _reservation(t: torch.Tensor) -> int:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor made by deferred_empty, not {type(t).__name__}")
    ptr = t.untyped_storage().data_ptr()
    if _in_preload_arena(ptr):
        raise InvalidArgument(
            f"the tensor at {ptr:#x} lies in a preload arena (a memory_saver region in hook_mode='preload'), whose "
            "reservation is a whole block of many segments: release / materialize / is_backed would act on all of "
            "them. Pause and resume it with memory_saver")
    rid = ctypes.c_uint64()
    _check(_load().dfa_find(ctypes.c_void_p(ptr), ctypes.byref(rid)), "dfa_find")
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


_no_gpu_said = False


def _say_no_gpu_once() -> None:
    """region() without a GPU: a warning, once (Note [Region without a GPU])."""
    global _no_gpu_said
    if not _no_gpu_said:
        _no_gpu_said = True
        _log.warning(
            "deferalloc.region(): there is no CUDA GPU (torch.cuda.is_available() is False), so PyTorch's "
            "CPU tensors made inside are not deferalloc's and pause()/resume() leave them alone; only "
            "tensors deferalloc makes (deferalloc.deferred_empty(..., device='cpu'), host driver) join the tag. "
            "On the CPU, use deferred_empty with materialize / release.")


# Note [Region without a GPU]
# Rationale: on a CPU machine a region opens only the tag: PyTorch's CPU tensors made inside are
# not deferalloc's, so pause() moves none of their memory, and a user trying an RL loop there
# would see it "work" while nothing moved.  Approach: a warning, once per
# process, not an error: the tag still applies to deferalloc's own tensors on the host driver
# (the CPU tests use regions so), so the call is not wrong, only less than it looks.
# install(), which has nothing to replace without CUDA, raises NoDevice instead.
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
    _load().dfa_clear_last_refusal()
    if not _installed and not torch.cuda.is_available():
        _say_no_gpu_once()
    if _installed or not torch.cuda.is_available():
        with tag(name), _refusal_note():
            yield
        return
    _hook_torch_empty_cache()
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
        with torch.cuda.use_mem_pool(pool, device=dev), _refusal_note():
            yield
    finally:
        del pool  # the frame must not keep the pool alive past a pause
        _check(_load().dfa_tag_end(), "dfa_tag_end")


@contextlib.contextmanager
def _refusal_note() -> Iterator[None]:
    """Adds deferalloc's reason (Note [Refusals]) to an out-of-memory error raised by
    PyTorch for an allocation deferalloc refused: PyTorch's message has only its own
    numbers."""
    try:
        yield
    except torch.cuda.OutOfMemoryError as e:
        why = last_error()
        if why and why not in getattr(e, "__notes__", ()):
            e.add_note(why)
        raise


def last_error() -> str:
    """Why this thread's last deferalloc allocation failed, "" when it succeeded (or none was
    made): "deferalloc refused <N> bytes (<size>)[ in tag 'T']: <reason>. Fix: <what to
    do>." (the same line is logged at warn).  PyTorch's allocator interface reports a
    refusal as its own out-of-memory error (or, under ``install()``, not at all): this says
    why.  Per thread, valid until this thread's next allocation through deferalloc (frees
    keep it); entering a ``region`` clears it."""
    return _load().dfa_last_refusal().decode(errors="replace")


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
        (_torch_empty_cache or torch.cuda.memory.empty_cache)()  # PyTorch's own: this tag's pools only


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
    """Gives back every byte freed: the regions' cached segments (PyTorch's MemPools,
    Note [Regions give freed memory back]), then deferalloc's free granules, the pool's
    cached chunks and pinned buffers.  Live tensors of every region stay.  Returns the
    device bytes deferalloc gave back to the driver."""
    device = _device_index(device)
    _release_region_pools()
    out = ctypes.c_size_t()
    _check(_load().dfa_empty_cache(device, ctypes.byref(out)), "dfa_empty_cache")
    return out.value


# Note [Regions give freed memory back]
# Rationale: a region's tensors live in its tag's torch.cuda.MemPool (Note [One MemPool
# per tag]).  PyTorch's empty_cache releases the cached segments of the default pool and
# of pools no longer in use, never of a live MemPool: a region's freed memory stayed
# cached in PyTorch and backed in deferalloc until a pause.
# Approach: empty_cache drops the regions' MemPools (the next region() of a tag makes a
# fresh one; a region open on a thread keeps its pool until it exits), so that PyTorch's
# empty_cache releases their free segments, with deferalloc's dfa_free under them; then
# deferalloc's own empty_cache gives the chunks back to the device.  Live tensors stay
# where they are: a dropped pool with live blocks lives on until they are freed, and its
# segments are released by the next empty_cache.  torch.cuda.empty_cache() does the same
# once a region has made a MemPool: region() wraps it (_hook_torch_empty_cache).
# Limits: torch._C._cuda_emptyCache called directly skips the regions; a pool with live
# blocks keeps their segments' free parts cached until those blocks are freed.
_torch_empty_cache = None


def _release_region_pools() -> None:
    if _installed or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return
    _pools.clear()
    (_torch_empty_cache or torch.cuda.memory.empty_cache)()


def _hook_torch_empty_cache() -> None:
    global _torch_empty_cache
    if _torch_empty_cache is not None:
        return
    original = torch.cuda.memory.empty_cache

    @functools.wraps(original)
    def empty_cache_with_regions() -> None:
        _release_region_pools()
        _check(_load().dfa_empty_cache(-1, None), "dfa_empty_cache")

    _torch_empty_cache = original
    torch.cuda.memory.empty_cache = empty_cache_with_regions
    torch.cuda.empty_cache = empty_cache_with_regions


# ---- snapshots (PyTorch's format, for torch.cuda._memory_viz) ---------------------------------

def record_memory_history(enabled: bool = True, max_entries: int = 100_000, stacks: str = "python") -> None:
    """Records allocator events (alloc, free, segment map/unmap, oom) for the trace of
    ``memory_snapshot()`` (``torch.cuda._memory_viz.trace_plot``), the newest
    ``max_entries``; ``enabled=False`` stops and drops them.  Outside ``install()`` on CUDA
    it also turns on PyTorch's own history (with stack frames: ``stacks``), which the
    regions' MemPool segments show."""
    n = _int(max_entries, "record_memory_history: max_entries", lo=1) if enabled else 0
    _check(_load().dfa_record_memory_history(n), "dfa_record_memory_history")
    if not _installed and torch.cuda.is_available():
        torch.cuda.memory._record_memory_history("all" if enabled else None, max_entries=max(n, 1), stacks=stacks)


def memory_snapshot() -> dict:
    """The memory in PyTorch's snapshot format (what ``torch.cuda.memory._snapshot()``
    returns), for ``torch.cuda._memory_viz.segment_plot`` / ``trace_plot`` and the online
    viewer (``dump_snapshot``).  See docs/MEMORY.md.

    * Under ``install()``, on the host driver and for the C ABI: deferalloc's caching
      allocator as PyTorch would show expandable segments: one segment per backed run,
      its blocks (active_allocated, active_pending_free, inactive) clipped to it;
      ``segment_pool_id`` (1, n) and ``deferalloc_tag`` name a tag's segments;
      ``device_traces`` holds the events recorded since ``record_memory_history()``.
    * Regions over PyTorch's allocator (CUDA, no ``install()``): PyTorch's own snapshot
      (its MemPool segments, with stack frames when recorded), each segment annotated
      with its ``deferalloc_tag``, plus one ``deferalloc_cache`` segment per free backed
      range that deferalloc holds below PyTorch.
    * Deferred tensors' backed ranges are segments of type "deferred".
    * ``snapshot["deferalloc"]``: per tag paused / keep / paused ranges / allocated and
      backed bytes, the deferred reservations with their backed ranges (the rest of each
      is deferred: address space only), the live StreamedAdamW optimizers' stats (window
      and state bytes), per device the memory limit, backed bytes and refusals.
    """
    return _snapshot.build(_installed, driver_name())


def dump_snapshot(path: str) -> None:
    """Writes ``memory_snapshot()`` as a pickle for https://pytorch.org/memory_viz (and
    ``python -m torch.cuda._memory_viz``)."""
    with open(path, "wb") as f:
        pickle.dump(memory_snapshot(), f)


# ---- the allocator for a whole process -------------------------------------------------------

def pluggable_allocator():
    """torch.cuda.memory.CUDAPluggableAllocator on dfa_malloc/dfa_free, with every hook set
    (init, empty_cache, memory fraction, base allocation, record_stream).  One per process."""
    global _pluggable
    if _pluggable is not None:
        return _pluggable
    lib = _load()
    alloc = torch.cuda.memory.CUDAPluggableAllocator(_native.allocator.path, "dfa_malloc", "dfa_free")
    hooks = alloc.allocator()

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

    PyTorch's own memory_stats do not work in this mode: use ``deferalloc.memory_stats()``.
    ``torch.cuda.memory._snapshot`` / ``_dump_snapshot`` / ``_record_memory_history`` are
    pointed at ``memory_snapshot`` / ``record_memory_history`` (PyTorch's would be empty),
    so existing tooling keeps working.  Raises RuntimeError if PyTorch's allocator is in use.
    """
    global _installed
    if not torch.cuda.is_available():
        raise NoDevice("deferalloc.install() replaces PyTorch's CUDA allocator, and there is no CUDA GPU here "
                       "(torch.cuda.is_available() is False). On the CPU, deferalloc's own tensors serve: "
                       "deferalloc.deferred_empty(..., device='cpu') with materialize / release (host driver), "
                       "and deferalloc.optim.StreamedAdamW on CPU parameters.")
    alloc = pluggable_allocator()
    torch.cuda.memory.change_current_allocator(alloc)
    _installed = True
    torch.cuda.memory._snapshot = _snapshot_for_torch
    torch.cuda.memory._record_memory_history = _record_history_for_torch
    return alloc


def _snapshot_for_torch(device=None, augment_with_fx_traces=False) -> dict:
    """torch.cuda.memory._snapshot under install(): deferalloc's (PyTorch's is empty)."""
    return memory_snapshot()


def _record_history_for_torch(enabled="all", *args, max_entries: int = 1_000_000, **kwargs) -> None:
    """torch.cuda.memory._record_memory_history under install(): deferalloc's events
    (no stack frames; the ring holds at most 10**7)."""
    record_memory_history(enabled is not None, max_entries=max(1, min(int(max_entries), 10_000_000)))
