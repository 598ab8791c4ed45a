"""torch_memory_saver's public API (version 0.0.10) on deferalloc: the RL stacks' pause/resume.

``from deferalloc.memory_saver import torch_memory_saver`` is a drop-in for
``from torch_memory_saver import torch_memory_saver``; ``install_as_torch_memory_saver()`` (or
``PYTHONPATH=$(python -c 'import deferalloc.memory_saver as m; print(m.shim_path())')``) makes
the second spelling give this one, unchanged code included.  docs/RL.md says what differs.

Note [Two hook modes on deferalloc]
Rationale: torch_memory_saver (TMS) has two ways to see a region's memory: "torch" (a
CUDAPluggableAllocator MemPool per region) and "preload" (an LD_PRELOAD library through which
every cudaMalloc of a region becomes pauseable, CUDA graphs' private pools included).
deferalloc has both underneath: per-tag regions on MemPools whose segments come from its
caching allocator, and libdeferalloc_preload.so, whose cudaMalloc serves PyTorch's segments
(a region's in an arena of few large slabs).
Approach:
* "torch": ``region(tag, enable_cpu_backup)`` opens an internal deferalloc tag per (tag,
  backup) ("tms.host/<tag>" keeps contents in pinned host memory, "tms.discard/<tag>" drops
  them), so one TMS tag may hold both kinds as in TMS, and routes the thread's allocations to
  a MemPool of that (tag, backup, device) whose segments come from deferalloc
  (``deferalloc.mem_pool``), kept for the process as TMS keeps its pools; ``pause(tag)`` is
  ``deferalloc.pause`` of both internal tags (the pool's cached segments are paused with the
  rest).
  ``cuda_graph`` captures into a MemPool of its own (deferalloc's segments, the tag current):
  never the region's pool (PyTorch refuses to record one pool twice, and eager tensors
  handed a graph's freed blocks would be overwritten at replay).  deferalloc's allocator
  queries and records stream events, which a global-mode capture forbids on its thread, so
  the capture runs with this thread's capture mode relaxed (what PyTorch does around its
  own cudaMalloc during a capture).
* "preload": the process runs with libdeferalloc_preload.so in LD_PRELOAD (checked at first
  use, as TMS checks its own library).  ``region`` routes allocations to a native MemPool per
  (tag, backup, device) and makes the preload library's arena of the same name ("tms.host/<tag>",
  "tms.discard/<tag>") current on the thread: the segments PyTorch cudaMallocs there are placed
  in the arena's slabs, a few large mappings (Note [Preload arenas] in
  allocator/abi/preload_arena.cpp).  ``cuda_graph`` captures with the arena current too and
  records the graph's private pool under the tag.  A pause releases the tag's arenas
  (dfa_preload_arena_pause: O(slabs) driver calls, keep host or discard); resume backs their
  slabs again at the same addresses (restore or undefined).  Segments of the tag's pools
  outside its arenas (PyTorch's default pool with TMS_INIT_ENABLE=1, which belongs to the tag
  "default"; a pool passed to cuda_graph; segments allocated while the tag was paused, or on
  another thread in a capture's pool) are found in PyTorch's snapshot, each one a reservation of the preload
  library (dfa_find), and released and backed again as such (dfa_release_many /
  dfa_materialize_many).  The arena follows the thread, PyTorch's pools follow its routing:
  so every pause first checks, in PyTorch's snapshot of every pool, that no segment of
  another pool lies in the tag's arena (a torch.cuda.use_mem_pool of another library nested
  with a region, the inner one or the outer one taking the allocations by PyTorch's version,
  or an allocation of a stream other than the capture's inside cuda_graph, would put one there) and raises InvalidState, nothing paused, when one does.
  The check and the look for segments outside read one snapshot per pause() call, and none
  for a tag whose arenas gained no segment and no stray since its last pause checked them,
  hold no stray, and whose pools can hold segments only through them (no capture's pool, not
  PyTorch's default pool): their segments are still of the pools they were checked for.
  The kind with a backup is paused first and the discarded kind last, so that a pause that
  fails has lost no contents the caller keeps (a failure among the discard kind's own calls
  leaves what it had discarded undefined, as a resume after a pause would).
Limits: in hook mode "torch", memory that does not come through PyTorch's allocator (a
library's own cudaMalloc) is not paused; in "preload", a cudaMalloc on the region's thread is
placed in the arena and paused with it, as TMS's preload mode does.  The preload library
serves one device (DEFERALLOC_CONF's): a region on another refuses to start.  Allocating in a
paused tag is the caller's error as in TMS (torch mode refuses it, preload mode may hand out a
released block); a pool shared by cuda_graph captures of two tags pauses each tag's arena
segments with that tag only; get_cpu_backup and disk backup raise NotImplementedError (the C
ABI has neither a way to read a paused block's host copy nor a file tier for tags).
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
import types
from typing import Iterator, Optional

import torch

import deferalloc as _dfa

from . import _native

__all__ = ["TorchMemorySaver", "torch_memory_saver", "configure_subprocess", "install_as_torch_memory_saver",
           "shim_path", "preload_library_path"]

_TAG_DEFAULT = "default"
_HOOK_MODES = ("preload", "torch")
_BACKENDS = ("pinned", "mmap")
_SIZE_MAX = (1 << 64) - 1
_KEEPS = ("discard", "host")


# ---- the environment variables TMS's library reads ---------------------------------------------

def _env_flag(name: str, default: bool = False) -> bool:
    """A boolean variable: unset or empty -> default; 1/true/yes/on, 0/false/no/off (any case);
    anything else raises ValueError naming the variable."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    v = raw.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={raw!r} is not a boolean (1/true/yes/on or 0/false/no/off)")


def _env_settings() -> dict:
    """TMS_INIT_* / TMS_RETAIN_CPU_BACKUP / TMS_DISK_BACKUP_*, parsed and checked."""
    out = {
        "init_enable": _env_flag("TMS_INIT_ENABLE"),
        "init_cpu_backup": _env_flag("TMS_INIT_ENABLE_CPU_BACKUP"),
        "init_disk_backup": _env_flag("TMS_INIT_ENABLE_DISK_BACKUP"),
        # deferalloc keeps pinned backups for the next pause (up to pinned_cache_mb): that
        # is its default; TMS_RETAIN_CPU_BACKUP=0 asks for TMS's free-at-resume.
        "retain_cpu_backup": _env_flag("TMS_RETAIN_CPU_BACKUP", default=True),
        "backend": os.environ.get("TMS_INIT_CPU_BACKUP_BACKEND", "").strip() or "pinned",
        "disk_dir": os.environ.get("TMS_DISK_BACKUP_DIR") or None,
        "disk_chunk_mb": None,
    }
    chunk = os.environ.get("TMS_DISK_BACKUP_CHUNK_MB", "").strip()
    if chunk:
        if not chunk.isdigit() or int(chunk) == 0:
            raise ValueError(f"TMS_DISK_BACKUP_CHUNK_MB={chunk!r} is not a positive whole number of MiB")
        out["disk_chunk_mb"] = int(chunk)
    _check_backend(out["backend"], "TMS_INIT_CPU_BACKUP_BACKEND")
    if out["init_cpu_backup"] and out["init_disk_backup"]:
        raise ValueError("TMS_INIT_ENABLE_CPU_BACKUP and TMS_INIT_ENABLE_DISK_BACKUP are mutually exclusive")
    if out["init_disk_backup"]:
        raise NotImplementedError(_NO_DISK.format(what="TMS_INIT_ENABLE_DISK_BACKUP=1"))
    return out


_NO_DISK = ("{what}: deferalloc has no disk backup for paused regions (its C ABI keeps a paused tag's "
            "contents in pinned host memory or drops them; the file tier serves the optimizer's state "
            "only). Use enable_cpu_backup=True, or torch_memory_saver itself for disk spills.")


def _check_backend(backend, what: str) -> None:
    if not isinstance(backend, str) or backend not in _BACKENDS:
        raise ValueError(f"{what} must be one of {list(_BACKENDS)}, not {backend!r}")
    if backend == "mmap":
        raise NotImplementedError(f"{what}='mmap': deferalloc keeps host backups in pinned memory only "
                                  "(its pinned pool; a pageable, reclaimable mmap shadow is not served). "
                                  "Use 'pinned' (the default).")


def _check_bool(value, what: str) -> bool:
    """A bool, or 0 / 1 (torch_memory_saver hands these to C as a C bool)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise TypeError(f"{what} must be a bool, not {type(value).__name__} ({value!r})")


def _check_tag(tag, what: str = "tag") -> str:
    if not isinstance(tag, str):
        raise TypeError(f"{what} must be a string, not {type(tag).__name__}")
    if not tag:
        raise ValueError(f"{what} must not be empty")
    return tag


# ---- paths: the preload library and the shim ---------------------------------------------------

def _arena_api():
    """The preloaded library's arena entry points (Note [Preload arenas] in
    allocator/abi/preload_arena.cpp), found in the process; None when the library in
    LD_PRELOAD has none (every segment is then paused as a reservation of its own)."""
    lib = ctypes.CDLL(None)
    if not hasattr(lib, "dfa_preload_arena_classify"):
        return None
    for name, args in (("dfa_preload_arena_push", [ctypes.c_char_p]), ("dfa_preload_arena_pop", []),
                       ("dfa_preload_arena_pause", [ctypes.c_char_p, ctypes.c_int, ctypes.c_void_p]),
                       ("dfa_preload_arena_resume", [ctypes.c_char_p, ctypes.c_void_p]),
                       ("dfa_preload_arena_owns", [ctypes.c_void_p]),
                       ("dfa_preload_arena_classify", [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p),
                                                       ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]),
                       ("dfa_preload_arena_figures", [ctypes.c_char_p, ctypes.POINTER(ctypes.c_size_t)])):
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = ctypes.c_int
    return lib


def preload_library_path() -> str:
    """libdeferalloc_preload.so beside the libdeferalloc.so this package loads."""
    return os.path.join(os.path.dirname(os.path.abspath(_native.library_path())), "libdeferalloc_preload.so")


def shim_path() -> str:
    """A directory to put first on PYTHONPATH: its ``torch_memory_saver`` package is this module."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "tms_shim")


def _preload_in_env() -> list:
    return [p for p in os.environ.get("LD_PRELOAD", "").replace(" ", ":").split(":")
            if "deferalloc_preload" in os.path.basename(p)]


@contextlib.contextmanager
def configure_subprocess() -> Iterator[None]:
    """LD_PRELOAD (prepended) with deferalloc's preload library for the subprocesses started
    inside, as TMS's configure_subprocess does with its own: needed for hook_mode="preload"."""
    lib = preload_library_path()
    old = os.environ.get("LD_PRELOAD")
    os.environ["LD_PRELOAD"] = f"{lib}:{old}" if old else lib
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("LD_PRELOAD", None)
        else:
            os.environ["LD_PRELOAD"] = old


# ---- the CUDA runtime's per-thread capture mode (torch mode's graphs) --------------------------

_cudart = None


def _capture_mode_exchange(mode: int) -> int:
    """cudaThreadExchangeStreamCaptureMode: sets this thread's mode, returns the old one
    (0 global, 1 thread_local, 2 relaxed)."""
    global _cudart
    if _cudart is None:
        major = (torch.version.cuda or "13").split(".")[0]
        _cudart = ctypes.CDLL(f"libcudart.so.{major}")  # the one torch loaded (same soname)
        _cudart.cudaThreadExchangeStreamCaptureMode.argtypes = [ctypes.POINTER(ctypes.c_int)]
        _cudart.cudaThreadExchangeStreamCaptureMode.restype = ctypes.c_int
    m = ctypes.c_int(mode)
    err = _cudart.cudaThreadExchangeStreamCaptureMode(ctypes.byref(m))
    if err != 0:
        raise RuntimeError(f"cudaThreadExchangeStreamCaptureMode failed (cudaError {err})")
    return m.value


# ---- the memory saver ----------------------------------------------------------------------------

class TorchMemorySaver:
    """torch_memory_saver.TorchMemorySaver's API on deferalloc (Note [Two hook modes on deferalloc])."""

    def __init__(self):
        self._hook_mode = "preload"
        self._impl: Optional[_Impl] = None
        self._lock = threading.Lock()

    # configuration before first use -----------------------------------------------------------
    @property
    def hook_mode(self) -> str:
        return self._hook_mode

    @hook_mode.setter
    def hook_mode(self, mode: str):
        if self._impl is not None:
            raise RuntimeError("hook_mode: cannot configure after initialization (set it before the first "
                               "region/pause/resume, as torch_memory_saver)")
        if mode not in _HOOK_MODES:
            raise ValueError(f"hook_mode must be one of {list(_HOOK_MODES)}, not {mode!r}")
        self._hook_mode = mode

    @property
    def enabled(self) -> bool:
        return True

    @property
    def memory_margin_bytes(self):
        raise NotImplementedError("Only setter is supported")

    @memory_margin_bytes.setter
    def memory_margin_bytes(self, value: int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"memory_margin_bytes must be an int, not {type(value).__name__}")
        if value < 0 or value > _SIZE_MAX:
            raise ValueError(f"memory_margin_bytes = {value} is outside [0, 2**64 - 1]")
        self._ensure_initialized().margin = value

    @property
    def retain_cpu_backup(self) -> bool:
        return self._ensure_initialized().retain

    @retain_cpu_backup.setter
    def retain_cpu_backup(self, value: bool):
        self._ensure_initialized().retain = _check_bool(value, "retain_cpu_backup")

    # regions ------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def region(self, tag: str = _TAG_DEFAULT, enable_cpu_backup: bool = False, enable_disk_backup: bool = False,
               cpu_backup_backend: Optional[str] = None) -> Iterator[None]:
        """Allocations inside belong to ``tag``: ``pause(tag)`` gives their memory back
        (addresses kept), ``resume(tag)`` backs it again, with contents when
        ``enable_cpu_backup``."""
        keep = self._check_region_args(tag, enable_cpu_backup, enable_disk_backup, cpu_backup_backend)
        with self._ensure_initialized().region(tag, keep):
            yield

    @contextlib.contextmanager
    def cuda_graph(self, cuda_graph, pool=None, stream=None, capture_error_mode: str = "global",
                   tag: str = _TAG_DEFAULT, enable_cpu_backup: bool = False,
                   cpu_backup_backend: Optional[str] = None) -> Iterator[None]:
        """``torch.cuda.graph(cuda_graph, pool, stream, capture_error_mode)`` whose memory (the
        graph's private pool) belongs to ``tag``: pause gives it back, resume maps it at the
        same addresses, replay works on without a new capture."""
        keep = self._check_region_args(tag, enable_cpu_backup, False, cpu_backup_backend)
        if not isinstance(cuda_graph, torch.cuda.CUDAGraph):
            raise TypeError(f"cuda_graph must be a torch.cuda.CUDAGraph, not {type(cuda_graph).__name__}")
        if capture_error_mode not in ("global", "thread_local", "relaxed"):
            raise ValueError(f"capture_error_mode must be 'global', 'thread_local' or 'relaxed', "
                             f"not {capture_error_mode!r}")
        with self._ensure_initialized().cuda_graph(cuda_graph, pool, stream, capture_error_mode, tag, keep):
            yield

    @contextlib.contextmanager
    def disable(self) -> Iterator[None]:
        """Inside a region: allocations made inside are not pauseable (a fresh native
        MemPool, dropped at exit), as TMS's disable()."""
        with self._ensure_initialized().disable():
            yield

    def pause(self, tag: Optional[str] = None) -> None:
        """Gives back the memory of ``tag`` (every tag of this saver not paused yet when None)."""
        if tag is not None:
            _check_tag(tag)
        self._ensure_initialized().pause(tag)

    def resume(self, tag: Optional[str] = None) -> None:
        """Backs ``tag``'s memory again at the same addresses (every paused tag when None)."""
        if tag is not None:
            _check_tag(tag)
        self._ensure_initialized().resume(tag)

    def get_cpu_backup(self, x: torch.Tensor, zero_copy: bool = False):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"get_cpu_backup: x must be a torch.Tensor, not {type(x).__name__}")
        raise NotImplementedError("get_cpu_backup: deferalloc's C ABI gives no access to a paused block's pinned "
                                  "host copy (it is the allocator's, reused by the next pause); read the tensor "
                                  "after resume() instead")

    def set_disk_backup_dir(self, path: str) -> None:
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"set_disk_backup_dir: path must be a string, not {type(path).__name__}")
        raise NotImplementedError(_NO_DISK.format(what="set_disk_backup_dir"))

    # internals ----------------------------------------------------------------------------------
    def _check_region_args(self, tag, enable_cpu_backup, enable_disk_backup, cpu_backup_backend) -> str:
        _check_tag(tag)
        _check_bool(enable_cpu_backup, "enable_cpu_backup")
        _check_bool(enable_disk_backup, "enable_disk_backup")
        if cpu_backup_backend is not None:
            if not enable_cpu_backup:
                raise ValueError("cpu_backup_backend requires enable_cpu_backup=True")
            _check_backend(cpu_backup_backend, "cpu_backup_backend")
        if enable_cpu_backup and enable_disk_backup:
            raise ValueError("enable_cpu_backup and enable_disk_backup are mutually exclusive")
        if enable_disk_backup:
            raise NotImplementedError(_NO_DISK.format(what="enable_disk_backup=True"))
        return "host" if _check_bool(enable_cpu_backup, "enable_cpu_backup") else "discard"

    def _ensure_initialized(self) -> "_Impl":
        impl = self._impl
        if impl is None:
            with self._lock:
                if self._impl is None:
                    self._impl = _Impl(self._hook_mode)
                impl = self._impl
        return impl


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


# Note [One routed pool per thread]
# Rationale: PyTorch routes an allocation to one pool whose filter matches: the first in the
# order the pools began (beginAllocateToPool appends) in older versions, the last begun in
# newer ones (PyTorch 2.11 searches captures_underway in LIFO order).  With the first, a
# MemPool entered inside another one on the same thread (a nested region, disable(), a graph
# captured inside a region) would never be used, the outer pool taking the allocations.
# Approach: the saver keeps a stack of routed pools per thread and routes only the top one:
# entering suspends the outer pool (end + release, as torch.cuda.use_mem_pool leaves it) and
# leaving routes it again (begin).  A capture suspends the region's pool, so its stream
# filter takes the graph's allocations.
# Limits: pools routed by other code (torch.cuda.use_mem_pool around or inside a saver region)
# are not suspended: PyTorch picks between that pool and the region's as above, the outer or
# the inner by its version (a pause then finds the other pool's segments in the tag's arena
# and refuses: _segments).
# Note [A MemPool is deleted with no pool routed]
# Rationale: deleting a torch.cuda.MemPool empties its cache, and PyTorch's allocator refuses to
# empty a cache while any pool takes allocations (``captures_underway`` not empty: an internal
# assert that aborts the process).  disable() inside a region leaves its own pool while the
# region's pool is routed again.
# Approach: the pool is kept (per thread) until this thread's last routed pool ends, then
# dropped; outside every region it is dropped at once.
# Limits: a pool routed on another thread at that moment (a region open there) still trips
# PyTorch's assert; disable() pools of a thread that never leaves its outermost region are
# kept until it does (their cached blocks with them).
def _begin_route(device: int, pool_id: tuple) -> None:
    torch._C._cuda_beginAllocateCurrentThreadToPool(device, pool_id)


def _end_route(device: int, pool_id: tuple) -> None:
    torch._C._cuda_endAllocateToPool(device, pool_id)
    torch._C._cuda_releasePool(device, pool_id)


class _Impl:
    """The saver after first use: one hook mode, the tags it made, their pools."""

    def __init__(self, hook_mode: str):
        env = _env_settings()
        if "expandable_segments:true" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower():
            raise RuntimeError("deferalloc.memory_saver: PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True, "
                               "whose segments neither MemPools with an allocator nor cudaMalloc serve "
                               "(torch_memory_saver refuses it too); remove it")
        self.mode = hook_mode
        self.retain = env["retain_cpu_backup"]
        self.margin = 0
        self.init_enable = env["init_enable"]
        self.init_keep = "host" if env["init_cpu_backup"] else "discard"
        self.lock = threading.RLock()
        self.local = threading.local()   # .depth: regions open on this thread
        self.keeps: dict = {}            # tag -> set of keeps it holds
        self.pools: dict = {}            # (tag, keep, device) -> the region's MemPool, kept for the process (as TMS)
        self.graph_pools: dict = {}      # (tag, keep, device) -> [MemPool] of cuda_graph (torch mode)
        self.pool_ids: dict = {}         # (tag, keep) -> {pool id} whose segments the tag holds (preload mode)
        self.outside: set = set()        # (tag, keep) whose pools may hold segments outside its arena (preload)
        self.verified: dict = {}         # (tag, keep) -> its arena's generation its last pause checked (preload)
        self.arenas = None               # the preload library's arena entry points (preload mode)
        self.paused: dict = {}           # tag -> [(address, reservation, keep, bytes)] (torch: one row, the bytes)
        if hook_mode == "preload":
            found = _preload_in_env()
            if len(found) != 1:
                raise RuntimeError(
                    "deferalloc.memory_saver (hook_mode='preload') needs libdeferalloc_preload.so in LD_PRELOAD "
                    f"exactly once (found {found}, LD_PRELOAD={os.environ.get('LD_PRELOAD', '')!r}, "
                    f"pid {os.getpid()}): start the process inside configure_subprocess(), or with "
                    f"LD_PRELOAD={preload_library_path()}; or set hook_mode='torch' before first use")
            self.arenas = _arena_api()
            if self.init_enable:
                self._note(_TAG_DEFAULT, self.init_keep)
                self.pool_ids.setdefault((_TAG_DEFAULT, self.init_keep), set()).add((0, 0))
                self.outside.add((_TAG_DEFAULT, self.init_keep))  # PyTorch's default pool: every thread's
        elif self.init_enable:
            raise NotImplementedError("TMS_INIT_ENABLE=1 makes every allocation of the process pauseable under "
                                      "'default': hook_mode='preload' serves it (PyTorch's default pool); in "
                                      "hook_mode='torch' only allocations inside region() reach deferalloc")

    # bookkeeping
    def _note(self, tag: str, keep: str) -> None:
        with self.lock:
            self.keeps.setdefault(tag, set()).add(keep)

    @staticmethod
    def _itag(tag: str, keep: str) -> str:
        return f"tms.{keep}/{tag}"

    def _depth(self) -> int:
        return getattr(self.local, "depth", 0)

    @contextlib.contextmanager
    def _in_region(self):
        self.local.depth = self._depth() + 1
        try:
            yield
        finally:
            self.local.depth -= 1

    @contextlib.contextmanager
    def _arena(self, name: Optional[str]):
        """The thread's cudaMallocs go to the preload library's arena ``name`` (None: to none)
        until exit (preload mode; nothing without arenas)."""
        if self.arenas is None:
            yield
            return
        st = self.arenas.dfa_preload_arena_push((name or "").encode())
        if st == _dfa.InvalidState.status:
            raise _dfa.InvalidState(
                f"region {name!r}: libdeferalloc_preload.so does not serve this thread's cudaMalloc (device "
                f"{self._device()} is not DEFERALLOC_CONF's device, or the library is disabled: see its line on "
                "stderr), so nothing allocated here could be paused")
        _native.allocator.check(st, "dfa_preload_arena_push")
        try:
            yield
        finally:
            self.arenas.dfa_preload_arena_pop()

    def _arena_figures(self, name: str) -> list:
        """[slabs, their bytes, bytes of segments, segments, paused, strays, generation] of an
        arena (the generation: segments placed in it so far)."""
        out = (ctypes.c_size_t * 7)()
        _native.allocator.check(self.arenas.dfa_preload_arena_figures(name.encode(), out), "dfa_preload_arena_figures")
        return list(out)

    @staticmethod
    def _device() -> int:
        return torch.cuda.current_device() if torch.cuda.is_available() else -1

    # routing: Note [One routed pool per thread]
    @contextlib.contextmanager
    def _route(self, pool):
        """Allocations of this thread go to ``pool`` (None: to no pool of ours, PyTorch's
        default or a capture's) until exit; the pool routed before is suspended meanwhile."""
        stack = self.local.__dict__.setdefault("routes", [])
        outer = stack[-1] if stack else None
        if outer is not None:
            _end_route(*outer)
        route = None if pool is None else (torch.cuda.current_device(), tuple(pool.id))
        if route is not None:
            _begin_route(*route)
        stack.append(route)
        try:
            yield
        finally:
            stack.pop()
            if route is not None:
                _end_route(*route)
            if outer is not None:
                _begin_route(*outer)
            if not stack:
                # Note [A MemPool is deleted with no pool routed]
                self.local.__dict__.pop("retired", None)

    def _retire(self, pool) -> None:
        """Keeps ``pool`` until no pool of this thread is routed (Note [A MemPool is deleted
        with no pool routed]); with none routed the caller's reference is the last."""
        if self.local.__dict__.get("routes"):
            self.local.__dict__.setdefault("retired", []).append(pool)

    def _pool(self, table: dict, key: tuple, make):
        with self.lock:
            pool = table.get(key)
            if pool is None:
                pool = table[key] = make()
            return pool

    # region
    @contextlib.contextmanager
    def region(self, tag: str, keep: str):
        if not torch.cuda.is_available():  # the host driver (tests): the tag only
            if self.mode == "torch":
                with _dfa.tag(self._itag(tag, keep)), self._in_region():
                    self._note(tag, keep)
                    yield
                return
            raise RuntimeError("hook_mode='preload' needs CUDA")
        key = (tag, keep, self._device())
        if self.mode == "torch":
            pool = self._pool(self.pools, key, _dfa.mem_pool)
            with _dfa.tag(self._itag(tag, keep)), self._route(pool), self._in_region():
                self._note(tag, keep)  # once deferalloc knows the tag
                yield
            return
        pool = self._pool(self.pools, key, torch.cuda.MemPool)
        with self.lock:
            self.pool_ids.setdefault((tag, keep), set()).add(tuple(pool.id))
        self._note(tag, keep)
        with self._route(pool), self._arena(self._itag(tag, keep)), self._in_region():
            yield

    @contextlib.contextmanager
    def cuda_graph(self, graph, pool, stream, capture_error_mode: str, tag: str, keep: str):
        if not torch.cuda.is_available():
            raise RuntimeError("cuda_graph needs CUDA")
        if self.mode == "preload":
            self._note(tag, keep)
            # The arena is current inside the capture only: what capture_begin allocates first
            # (the RNG's graph-safe state, in PyTorch's default pool) stays outside it.  The
            # capture's pool is the tag's from the start, so that a capture that raises leaves
            # no segment of an unknown pool in the arena: without a pool given, the capture
            # gets a new one of ours (graph_pool_handle(), what capture_begin would make
            # itself), whose id is known before the capture (PyTorch 2.11's graph.pool()
            # raises until a capture has succeeded).  Its stream filter takes other threads'
            # allocations on the capture stream, and a pool passed in may hold a capture's made
            # outside the saver: a pause always looks for segments outside.
            if pool is None:
                pool = torch.cuda.graph_pool_handle()
            with self.lock:
                self.pool_ids.setdefault((tag, keep), set()).add(tuple(pool))
                self.outside.add((tag, keep))
            with self._route(None), \
                    torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode), \
                    self._arena(self._itag(tag, keep)), self._in_region():
                yield
            return
        itag = self._itag(tag, keep)
        with self.lock:
            mine = self.graph_pools.setdefault((tag, keep, self._device()), [])
            if pool is None:
                mp = _dfa.mem_pool()
                mine.append(mp)
                pool = mp.id
            elif tuple(pool) not in {tuple(p.id) for p in mine}:
                raise NotImplementedError(
                    f"cuda_graph(pool={pool!r}) in hook_mode='torch': only a pool of an earlier cuda_graph of the "
                    f"same tag ({tag!r}, enable_cpu_backup={keep == 'host'}) is served by deferalloc (graph.pool() "
                    "of that graph); another pool's segments come from cudaMalloc and could not be paused. Pass "
                    "pool=None, or use hook_mode='preload'")
        # The tag opens after capture_begin: torch.cuda.graph empties the caches first.
        with self._route(None), torch.cuda.graph(graph, pool=pool, stream=stream,
                                                 capture_error_mode=capture_error_mode), \
                _dfa.tag(itag), self._in_region():
            self._note(tag, keep)
            old = _capture_mode_exchange(2)  # relaxed on this thread: Note [Two hook modes on deferalloc]
            try:
                yield
            finally:
                _capture_mode_exchange(old)

    @contextlib.contextmanager
    def disable(self):
        if self._depth() == 0 and not (self.mode == "preload" and self.init_enable):
            raise RuntimeError("disable() should be called only when the memory saver is active (inside region(), "
                               "or with TMS_INIT_ENABLE=1 in hook_mode='preload')")
        if not torch.cuda.is_available():
            raise RuntimeError("disable() needs CUDA")
        pool = torch.cuda.MemPool()  # PyTorch's own allocator: cudaMalloc, never paused
        depth = self._depth()
        self.local.depth = 0
        try:
            with self._route(pool), self._arena(None):
                yield
        finally:
            self.local.depth = depth
            self._retire(pool)
            del pool

    # pause / resume
    def _tags(self, tag: Optional[str], paused: bool) -> list:
        with self.lock:
            if tag is not None:
                return [tag] if tag in self.keeps else []  # a tag never used holds nothing (as TMS)
            return [t for t in self.keeps if (t in self.paused) == paused]

    def pause(self, tag: Optional[str]) -> None:
        names = self._tags(tag, paused=False)
        if not names:
            return
        _sync()
        with self.lock:
            snap = []  # preload mode: PyTorch's snapshot, taken at most once for every tag of this call
            for t in names:
                if t in self.paused:
                    raise _dfa.InvalidState(f"pause({t!r}): the tag is paused already (resume it first)")
                if self.mode == "torch":
                    free0 = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 0
                    done = []
                    try:
                        for keep in _pause_order(self.keeps[t]):
                            _dfa.pause(self._itag(t, keep), keep=keep)
                            done.append(keep)
                    except BaseException as failed:
                        try:
                            for keep in done:  # all or nothing
                                _dfa.resume(self._itag(t, keep))
                        except BaseException:
                            self.paused[t] = [(0, 0, "", 0)]  # paused in part: resume(t) resumes what is
                            raise failed
                        raise
                    given = torch.cuda.mem_get_info()[0] - free0 if torch.cuda.is_available() else 0
                    self.paused[t] = [(0, 0, "", max(0, given))]  # what the margin check counts at resume
                else:
                    self.paused[t] = self._preload_pause(t, snap)

    def resume(self, tag: Optional[str]) -> None:
        names = self._tags(tag, paused=True)
        if not names:
            return
        with self.lock:
            for t in names:
                if t not in self.paused:
                    raise _dfa.InvalidState(f"resume({t!r}): the tag is not paused")
            self._check_margin(names)
            for t in names:
                if self.mode == "torch":
                    for keep in sorted(self.keeps[t]):
                        if _dfa.is_paused(self._itag(t, keep)):
                            _dfa.resume(self._itag(t, keep))
                else:
                    self._preload_resume(self.paused[t])
                del self.paused[t]
            _sync()
            if not self.retain:
                _dfa.trim(_SIZE_MAX)  # frees the cached pinned backups, keeps the device chunks cached

    def _check_margin(self, names: list) -> None:
        if self.margin == 0 or not torch.cuda.is_available():
            return
        need = sum(size for t in names for _, _, _, size in self.paused[t])
        free = torch.cuda.mem_get_info()[0]
        if free < need + self.margin:
            raise _dfa.OutOfMemory(f"resume({names}): {free} bytes free, {need} to map back + memory_margin_bytes "
                                   f"{self.margin}: nothing resumed")

    # preload mode: the tag's arenas, and its segments outside them (reservations of the preload library)
    @staticmethod
    def _snapshot() -> list:
        """(address, pool id, bytes) of every segment of PyTorch's caching allocator, every pool's."""
        return [(s["address"], tuple(s.get("segment_pool_id", (0, 0))), s["total_size"])
                for s in torch.cuda.memory.memory_snapshot(None, include_traces=False)]

    def _scan_needed(self, t: str, figs: dict) -> bool:
        """Whether a pause of tag ``t`` must read PyTorch's snapshot (``figs``: keep -> its
        arena's figures).  Not when every arena of the tag gained no segment since the check of
        its last pause (the segments checked then are still of the pools they were), holds no
        stray, and no pool of the tag can hold a segment outside it (a capture's or PyTorch's
        default pool can: other threads allocate in them)."""
        if self.arenas is None:
            return True
        return any(f[5] or f[6] != self.verified.get((t, keep)) or (t, keep) in self.outside
                   for keep, f in figs.items())

    def _segments(self, t: str, snap: list) -> tuple:
        """(address, keep, bytes) of every segment of the tag's pools outside every arena, in
        the order the pause takes them (backup first), and {keep: its arena's generation}.
        Raises InvalidState, nothing paused, when an arena of the tag holds a segment of a pool
        that is not the tag's (its memory is another pool's: pausing it would break that pool's
        tensors).  ``snap`` holds PyTorch's snapshot once a tag of the same pause() read it."""
        figs = {} if self.arenas is None else \
            {keep: self._arena_figures(self._itag(t, keep)) for keep in self.keeps[t]}
        gens = {keep: f[6] for keep, f in figs.items()}
        if not self._scan_needed(t, figs):
            return [], gens
        if not snap:
            snap.append(self._snapshot())
        segs = snap[0]
        addrs = (ctypes.c_void_p * len(segs))(*[a for a, _, _ in segs])
        out = []
        for keep in _pause_order(self.keeps[t]):
            pools = self.pool_ids.get((t, keep), set())
            if self.arenas is None:
                out += [(a, keep, size) for a, pid, size in segs if pid in pools]
                continue
            name = self._itag(t, keep)
            where = (ctypes.c_ubyte * len(segs))()
            _native.allocator.check(self.arenas.dfa_preload_arena_classify(name.encode(), addrs, len(segs), where),
                                    "dfa_preload_arena_classify")
            for (a, pid, size), w in zip(segs, where):
                if w == 2 and pid not in pools:
                    raise _dfa.InvalidState(
                        f"pause({t!r}): the segment at {a:#x} ({size} bytes) in the tag's arena {name!r} belongs to "
                        f"PyTorch's pool {pid}, not one of the tag's: allocated on the region's thread for another "
                        "pool (a torch.cuda.use_mem_pool nested with the region, or a stream other than the "
                        "capture's inside cuda_graph). Pausing it would break that pool's tensors. Nothing paused")
                if w == 0 and pid in pools:
                    out.append((a, keep, size))
        return out, gens

    def _preload_pause(self, t: str, snap: Optional[list] = None) -> list:
        """Pauses the tag; returns its rows for _preload_resume: (arena name, 0, keep, slab
        bytes) per arena, (address, reservation, keep, bytes) per segment outside them."""
        lib = _native.allocator()
        found = []
        outside, gens = self._segments(t, [] if snap is None else snap)
        for addr, keep, size in outside:
            rid = ctypes.c_uint64()
            if lib.dfa_find(ctypes.c_void_p(addr), ctypes.byref(rid)) != 0:
                raise _dfa.InvalidState(
                    f"pause({t!r}): the segment at {addr:#x} ({size} bytes) is not a deferalloc reservation: is "
                    "libdeferalloc_preload.so in LD_PRELOAD the one beside the libdeferalloc.so this package loads "
                    f"({_native.library_path()}), and DEFERALLOC_CONF's device this one? Nothing paused")
            found.append((addr, rid.value, keep, size))
        stream = _native.stream_ptr(None, torch.device("cuda", self._device()))
        done = []  # all or nothing: per kind, backup first, its arena then its segments outside
        try:
            for keep in _pause_order(self.keeps[t]):
                if self.arenas is not None:
                    name = self._itag(t, keep)
                    held = self._arena_figures(name)[1]
                    _native.allocator.check(
                        self.arenas.dfa_preload_arena_pause(name.encode(), _KEEPS.index(keep), stream),
                        "dfa_preload_arena_pause")
                    done.append((name, 0, keep, held))
                for _, ids in _by_keep([(rid, k) for _, rid, k, _ in found if k == keep]):
                    _native.allocator.check(lib.dfa_release_many(ids, len(ids), _KEEPS.index(keep), stream),
                                            "dfa_release_many")
                    done += [f for f in found if f[2] == keep]
        except BaseException as failed:
            try:
                self._preload_resume(done)
            except BaseException:
                # The rollback failed too: the tag stays paused in part, recorded so that
                # resume(t) can finish it (_preload_resume takes each arena once, and a segment
                # backed again already is backed as it is).
                self.paused[t] = done
                raise failed
            raise
        for keep, gen in gens.items():  # checked and paused: the next pause reads no snapshot for them
            self.verified[(t, keep)] = gen
        return done

    def _preload_resume(self, paused: list) -> None:
        lib = _native.allocator()
        stream = _native.stream_ptr(None, torch.device("cuda", self._device()))
        live = []
        for addr, rid, keep, _ in paused:
            if isinstance(addr, str):  # an arena: its slabs at their addresses (once: a resume may be retried)
                if self._arena_figures(addr)[4]:
                    _native.allocator.check(self.arenas.dfa_preload_arena_resume(addr.encode(), stream),
                                            "dfa_preload_arena_resume")
                continue
            now = ctypes.c_uint64()
            if lib.dfa_find(ctypes.c_void_p(addr), ctypes.byref(now)) != 0 or now.value != rid:
                continue  # PyTorch freed the segment while paused (empty_cache of a pool no longer used)
            live.append((rid, keep))
        for keep, ids in _by_keep(live):
            fill = 2 if keep == "host" else 0  # restore / undefined
            _native.allocator.check(lib.dfa_materialize_many(ids, len(ids), fill, stream), "dfa_materialize_many")


def _pause_order(keeps) -> list:
    """The kinds of a tag in the order a pause takes them: "host" (kept in pinned memory)
    first, "discard" last, so that a failure that rolls the pause back has destroyed nothing
    the caller keeps."""
    return sorted(keeps, key=lambda k: k != "host")


def _by_keep(rows: list) -> list:
    """(keep, C array of the reservation ids) for each keep of `rows` ((id, keep) pairs)."""
    out = []
    for keep in sorted({k for _, k in rows}):
        rids = [rid for rid, k in rows if k == keep]
        out.append((keep, (ctypes.c_uint64 * len(rids))(*rids)))
    return out


torch_memory_saver = TorchMemorySaver()


def install_as_torch_memory_saver() -> types.ModuleType:
    """Registers this module as ``torch_memory_saver`` in sys.modules, so that ``from
    torch_memory_saver import torch_memory_saver`` (and ``TorchMemorySaver``,
    ``configure_subprocess``) give deferalloc's.  Call it before that import.  Raises
    RuntimeError when the real torch_memory_saver is imported already."""
    current = sys.modules.get("torch_memory_saver")
    if current is not None and getattr(current, "__deferalloc__", False) is False:
        raise RuntimeError("install_as_torch_memory_saver: torch_memory_saver is imported already "
                           f"({getattr(current, '__file__', '?')}); call this before anything imports it")
    mod = sys.modules[__name__]
    sys.modules["torch_memory_saver"] = mod
    return mod


__deferalloc__ = True
