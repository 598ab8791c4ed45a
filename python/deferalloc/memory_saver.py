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
  them, "tms.disk/<tag>" spills them to a file), so one TMS tag may hold several kinds as in
  TMS, and routes the thread's allocations to
  a MemPool of that (tag, backup, device) whose segments come from deferalloc
  (``deferalloc.mem_pool``), kept for the process as TMS keeps its pools; ``pause(tag)`` is
  ``deferalloc.pause`` of its internal tags, up to three, the disk kind's file written first
  (the pool's cached segments are paused with the rest).
  ``cuda_graph`` captures into a MemPool of its own (deferalloc's segments, the tag current):
  never the region's pool (PyTorch refuses to record one pool twice, and eager tensors
  handed a graph's freed blocks would be overwritten at replay).  deferalloc's allocator
  queries and records stream events, which a global-mode capture forbids on its thread, so
  the capture runs with this thread's capture mode relaxed (what PyTorch does around its
  own cudaMalloc during a capture).
* "preload": the process runs with libdeferalloc_preload.so in LD_PRELOAD (checked at first
  use, as TMS checks its own library).  ``region`` routes allocations to a native MemPool per
  (tag, backup, device) and makes the preload library's arena of the same name ("tms.host/<tag>",
  "tms.discard/<tag>", "tms.disk/<tag>") current on the thread: the segments PyTorch cudaMallocs
  there are placed in the arena's slabs, a few large mappings (Note [Preload arenas] in
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
  A pause writes the disk kind's files first (Note [Disk backup]), then takes the kind with a
  host backup, then releases the disk kind (checked to hold no segment in no file) and then
  the discarded kind, so that a pause that fails and is rolled back has lost no contents the
  caller keeps (a failure among the discard kind's own calls leaves what it had discarded
  undefined, as a resume after a pause would; a rollback that fails keeps the tag paused).
* Disk backup (``enable_disk_backup``; Note [Disk backup]): a third kind beside host backup
  and discard, in both modes ("tms.disk/<tag>": a deferalloc tag in torch mode, an arena and
  its pools in preload mode): a pause writes the kind's live memory to a file (dfa_spill_save)
  and releases it as discard; resume backs it again and reads the file back into it
  (dfa_spill_load).
Limits: in hook mode "torch", memory that does not come through PyTorch's allocator (a
library's own cudaMalloc) is not paused; in "preload", a cudaMalloc on the region's thread is
placed in the arena and paused with it, as TMS's preload mode does (in a disk region, saved to
its file too).  The preload library serves one device (DEFERALLOC_CONF's): a region on another
refuses to start, and pause/resume sync, stream and name files by that device (its first
arena's), whichever device is current on the calling thread.  Allocating in a paused tag, or in a tag while it is being paused, is the
caller's error as in TMS (torch mode refuses the first, preload mode may hand out a released
block); a pool shared by cuda_graph captures of two tags pauses each tag's arena segments with
that tag only; get_cpu_backup raises NotImplementedError outside disk regions (the C ABI has no
way to read a paused block's host copy); for a disk region's tensor it returns None, as TMS.
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import sys
import threading
import types
from typing import Iterator, Optional

import torch

import deferalloc as _dfa

from . import _native, _snapshot

__all__ = ["TorchMemorySaver", "torch_memory_saver", "configure_subprocess", "install_as_torch_memory_saver",
           "shim_path", "preload_library_path"]

_TAG_DEFAULT = "default"
_HOOK_MODES = ("preload", "torch")
_BACKENDS = ("pinned", "mmap")
_SIZE_MAX = (1 << 64) - 1
_KEEPS = ("discard", "host")          # dfa_keep's values; the disk kind releases as discard
_PAUSE_ORDER = ("host", "disk", "discard")   # Note [Disk backup]: a failed pause loses nothing kept
_RESUME_ORDER = ("disk", "host", "discard")  # a failed disk load resumes nothing
_DEFAULT_CHUNK_MB = 256                      # TMS_DISK_BACKUP_CHUNK_MB's default in torch_memory_saver
_log = logging.getLogger("deferalloc")


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
    return out


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
    if not (hasattr(lib, "dfa_preload_arena_classify") and hasattr(lib, "dfa_preload_arena_segments")):
        return None
    for name, args in (("dfa_preload_arena_push", [ctypes.c_char_p]), ("dfa_preload_arena_pop", []),
                       ("dfa_preload_arena_pause", [ctypes.c_char_p, ctypes.c_int, ctypes.c_void_p]),
                       ("dfa_preload_arena_resume", [ctypes.c_char_p, ctypes.c_void_p]),
                       ("dfa_preload_arena_owns", [ctypes.c_void_p]),
                       ("dfa_preload_arena_classify", [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p),
                                                       ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]),
                       ("dfa_preload_arena_figures", [ctypes.c_char_p, ctypes.POINTER(ctypes.c_size_t)]),
                       ("dfa_preload_arena_segments", [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p),
                                                       ctypes.POINTER(ctypes.c_size_t), ctypes.c_size_t,
                                                       ctypes.POINTER(ctypes.c_size_t)])):
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
        """None for a tensor of a disk-backup region (it has no host copy, as in TMS)."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"get_cpu_backup: x must be a torch.Tensor, not {type(x).__name__}")
        if self._ensure_initialized().in_disk_region(x.data_ptr(), x.nbytes):
            return None
        raise NotImplementedError("get_cpu_backup: deferalloc's C ABI gives no access to a paused block's pinned "
                                  "host copy (it is the allocator's, reused by the next pause); read the tensor "
                                  "after resume() instead")

    def set_disk_backup_dir(self, path: str) -> None:
        """The directory of disk-backup files (created if needed; process-global, as in TMS)."""
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"set_disk_backup_dir: path must be a string, not {type(path).__name__}")
        self._ensure_initialized().disk.set_dir(path)

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
            return "disk"
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


def _sync_devices(devices) -> None:
    """Waits for every device of `devices` (the current one's sync does not cover the others:
    a block's last use may be on any stream of its own device).  Nothing without CUDA."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for dev in sorted(devices):
            if dev >= 0:
                torch.cuda.synchronize(dev)


def _open_region() -> Optional[str]:
    """dfa_tag_pause's refusal when a tagged region is open on this thread, else None.
    Probed with the empty name, which dfa_tag_pause refuses only after that check: nothing
    is paused either way."""
    try:
        _native.allocator.check(_native.allocator().dfa_tag_pause(b"", _KEEPS.index("discard"), None),
                                "dfa_tag_pause")
    except _dfa.InvalidState as e:
        return str(e)
    except _dfa.InvalidArgument:
        return None
    return None


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
        # TMS_INIT_ENABLE_DISK_BACKUP: the kind of what TMS_INIT_ENABLE makes pauseable
        # (preload mode; regions name their own kind, as TMS's do).
        self.init_keep = "host" if env["init_cpu_backup"] else "disk" if env["init_disk_backup"] else "discard"
        self.disk = _DiskBackup(env)
        self.lock = threading.RLock()
        self.local = threading.local()   # .depth: regions open on this thread
        self.keeps: dict = {}            # tag -> set of keeps it holds
        self.pools: dict = {}            # (tag, keep, device) -> the region's MemPool, kept for the process (as TMS)
        self.graph_pools: dict = {}      # (tag, keep, device) -> [MemPool] of cuda_graph (torch mode)
        self.pool_ids: dict = {}         # (tag, keep) -> {pool id} whose segments the tag holds (preload mode)
        self.outside: set = set()        # (tag, keep) whose pools may hold segments outside its arena (preload)
        self.verified: dict = {}         # (tag, keep) -> its arena's generation its last pause checked (preload)
        self.disk_gens: dict = {}        # disk arena name -> its generation when its file was written (while paused)
        self.arenas = None               # the preload library's arena entry points (preload mode)
        self.arena_device: Optional[int] = None  # the device the preload library serves (its first arena's)
        self.paused: dict = {}           # tag -> [(address, reservation, keep, bytes)] (torch: one row, the bytes)
        self.spills: dict = {}           # tag -> its disk files while paused: [(path, device, [(address, bytes)])]
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
        if env["init_disk_backup"] and self.disk.dir is not None:
            # TMS_DISK_BACKUP_DIR checked (and created) now, as at a disk region's start; the
            # default directory waits for its first use (set_disk_backup_dir may name another).
            self.disk.directory()

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
        if name and self.arena_device is None:
            self.arena_device = self._device()  # the one device the library serves (it took the push)
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

    def _preload_device(self) -> int:
        """The device of the preload library's segments (preload mode): the one it serves, as
        its first arena made current showed, else the current one (TMS_INIT_ENABLE before any
        region).  Not the current device of the thread that pauses: it may be another."""
        return self.arena_device if self.arena_device is not None else self._device()

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
        if keep == "disk":
            self.disk.directory()  # checked (and created) at the first disk region, not at its first pause
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
        if self.mode == "torch":
            err = _open_region()  # what the first deferalloc.pause would raise, before any file is written
            if err is not None:
                raise _dfa.InvalidState(f"pause({names}): {err}; nothing paused")
            _sync()
        else:
            _sync_devices({self._device(), self._preload_device()})
        with self.lock:
            snap = []  # preload mode: PyTorch's snapshot, taken at most once for every tag of this call
            for i, t in enumerate(names):
                with _partly("pause", names, i):
                    if t in self.paused:
                        raise _dfa.InvalidState(f"pause({t!r}): the tag is paused already (resume it first)")
                    if self.mode == "torch":
                        self._torch_pause(t)
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
            disk = [t for t in names if "disk" in self.keeps[t]]
            if self.mode == "torch" and disk:
                err = _open_region()  # a failed load could not release the disk kind again in there
                if err is not None:
                    raise _dfa.InvalidState(f"resume({disk}): {err}: a disk kind's resume needs no region open on "
                                            "this thread; nothing resumed")
            self._check_margin(names)
            for i, t in enumerate(names):
                spills = self.spills.get(t, [])
                with _partly("resume", names, i):
                    if self.mode == "torch":
                        for keep in _ordered(self.keeps[t], _RESUME_ORDER):
                            self._torch_resume_keep(t, keep, spills)
                    else:
                        self._preload_resume(self.paused[t], spills)
                del self.paused[t]
                self.disk_gens.pop(self._itag(t, "disk"), None)
                self.disk.remove(self.spills.pop(t, []))
            if self.mode == "torch":
                _sync()
            else:
                _sync_devices({self._device(), self._preload_device()})
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

    # torch mode: the tag's kinds are deferalloc tags
    def _torch_pause(self, t: str) -> None:
        keeps = self.keeps[t]
        for keep in _ordered(keeps, _PAUSE_ORDER):  # a kind released already: its memory cannot be read
            itag = self._itag(t, keep)
            if _dfa.is_paused(itag):
                raise _dfa.InvalidState(f"pause({t!r}): its kind {itag!r} is paused already (deferalloc.pause() "
                                        f"without a tag?): resume it (deferalloc.resume({itag!r})) first; nothing "
                                        "paused")
        groups = _tag_blocks(self._itag(t, "disk")) if "disk" in keeps else {}
        _sync_devices(groups)  # the blocks' streams, on every device of the file
        # Note [Disk backup]: the files first, while every kind still holds its contents.
        spills = self.disk.save(t, groups) if groups else []
        done = []
        try:
            free0 = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 0
            for keep in _ordered(keeps, _PAUSE_ORDER):
                _dfa.pause(self._itag(t, keep), keep=_released_as(keep))
                done.append(keep)
                if keep == "disk":
                    # a block allocated in the disk kind after its file was written (another
                    # thread in the region) was released without being written: rolled back
                    # before the discard kind is released (as the preload mode does)
                    self._check_covered(t, spills, f"pause({t!r})", "were released without being written (their "
                                        "contents are lost); every kind resumed, nothing paused")
            given = torch.cuda.mem_get_info()[0] - free0 if torch.cuda.is_available() else 0
        except BaseException as err:
            try:
                for keep in done:  # all or nothing
                    self._torch_resume_keep(t, keep, spills, check=False)
            except BaseException as e:
                self._keep_paused(t, [(0, 0, "", 0)], spills, e)
                raise err
            self.disk.remove(spills)
            raise
        self.paused[t] = [(0, 0, "", max(0, given))]  # what the margin check counts at resume
        if spills:
            self.spills[t] = spills

    def _keep_paused(self, t: str, rows: list, spills: list, error: BaseException) -> None:
        """A pause whose rollback failed: the tag is kept as paused with its files (`rows` as
        self.paused holds them), so that a resume retries (the file is read again)."""
        self.paused[t] = rows
        if spills:
            self.spills[t] = spills
        _log.warning("deferalloc.memory_saver: pause(%r) failed and its rollback too (%s): the tag stays paused "
                     "with its files; resume it again", t, error)

    def _check_covered(self, t: str, spills: list, what: str, then: str, live: Optional[dict] = None) -> None:
        """InvalidState when a live block of the tag's disk kind is in none of its files (one
        allocated by another thread inside the region while the pause ran).  ``live``:
        {device: [(address, bytes)]} of the blocks (preload mode: the disk arena's segments),
        by default the deferalloc tag's (torch mode)."""
        saved = {(dev, a, n) for _, dev, ranges in spills for a, n in ranges}
        if live is None:
            live = _tag_blocks(self._itag(t, "disk"))
        missing = [(dev, a, n) for dev, rows in live.items() for a, n in rows if (dev, a, n) not in saved]
        if missing:
            rows = ", ".join(f"{a:#x} ({n} bytes, device {dev})" for dev, a, n in missing[:4])
            raise _dfa.InvalidState(f"{what}: {len(missing)} block(s) of {self._itag(t, 'disk')!r} are in no disk "
                                    f"backup file (allocated while the pause ran?): {rows}; they {then}")

    def _torch_resume_keep(self, t: str, keep: str, spills: list, check: bool = True) -> None:
        itag = self._itag(t, keep)
        if keep != "disk" or not spills:
            if _dfa.is_paused(itag):
                _dfa.resume(itag)
            return
        # Note [Disk backup]: while the file exists it holds the only copy: read it whether the
        # kind is paused or was backed already (deferalloc.resume() without a tag, an earlier
        # resume whose release after a failed load failed): backed means undefined contents.
        try:
            if _dfa.is_paused(itag):
                _dfa.resume(itag)
            if check:
                self._check_covered(t, spills, f"resume({t!r})", "would come back with undefined contents "
                                    "(free them first); nothing resumed")
            live = {d: set(rows) for d, rows in _tag_blocks(itag).items()}
            self.disk.load(spills, lambda dev, addr, size: (addr, size) in live.get(dev, ()))
        except BaseException:
            try:
                if not _dfa.is_paused(itag):
                    _dfa.pause(itag, keep="discard")  # paused again: no wrong contents handed out
            except BaseException as e:  # backed with undefined contents; the next resume reads the file again
                _log.warning("deferalloc.memory_saver: %r stays backed after its file failed to load (%s); the tag "
                             "stays paused and its next resume reads the file again", itag, e)
            raise

    # preload mode: the tag's arenas, and its segments outside them (reservations of the preload library)
    @staticmethod
    def _snapshot() -> list:
        """(address, pool id, bytes) of every segment of PyTorch's caching allocator, every pool's."""
        return [(s["address"], tuple(s.get("segment_pool_id", (0, 0))), s["total_size"])
                for s in torch.cuda.memory.memory_snapshot(None, include_traces=False)]

    def _arena_segments(self, name: str) -> list:
        """[(address, bytes)] of every segment placed in arena ``name`` (PyTorch's and a
        library's own cudaMalloc on the region's thread), by address: what the disk kind's
        file holds of its arena."""
        n = ctypes.c_size_t()
        cap = 0
        while True:
            ptrs, sizes = (ctypes.c_void_p * cap)(), (ctypes.c_size_t * cap)()
            _native.allocator.check(self.arenas.dfa_preload_arena_segments(name.encode(), ptrs, sizes, cap,
                                                                           ctypes.byref(n)),
                                    "dfa_preload_arena_segments")
            if n.value <= cap:
                return [(ptrs[i], sizes[i]) for i in range(n.value)]
            cap = n.value + 16  # another thread placed segments meanwhile: asked again

    def _scan_needed(self, t: str, figs: dict) -> bool:
        """Whether a pause of tag ``t`` must read PyTorch's snapshot (``figs``: keep -> its
        arena's figures).  Not when every arena of the tag gained no segment since the check of
        its last pause (the segments checked then are still of the pools they were), holds no
        stray, and no pool of the tag can hold a segment outside it (a capture's or PyTorch's
        default pool can: other threads allocate in them).  The disk kind needs no snapshot for
        its arena's segments: the arena lists them (_arena_segments)."""
        if self.arenas is None:
            return True
        return any(f[5] or f[6] != self.verified.get((t, keep)) or (t, keep) in self.outside
                   for keep, f in figs.items())

    def _segments(self, t: str, snap: list) -> tuple:
        """(address, keep, bytes) of every segment of the tag's pools outside every arena, in
        the order the pause takes them (_PAUSE_ORDER), and {keep: its arena's generation}.
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
        for keep in _ordered(self.keeps[t], _PAUSE_ORDER):
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
        found, seen = [], set()
        outside, gens = self._segments(t, [] if snap is None else snap)
        for addr, keep, size in outside:
            rid = ctypes.c_uint64()
            if lib.dfa_find(ctypes.c_void_p(addr), ctypes.byref(rid)) != 0:
                raise _dfa.InvalidState(
                    f"pause({t!r}): the segment at {addr:#x} ({size} bytes) is not a deferalloc reservation: is "
                    "libdeferalloc_preload.so in LD_PRELOAD the one beside the libdeferalloc.so this package loads "
                    f"({_native.library_path()}), and DEFERALLOC_CONF's device this one? Nothing paused")
            if rid.value in seen:  # a pool of two kinds of the tag (one passed to two captures): its first
                continue           # kind in _PAUSE_ORDER takes it (the one that keeps most)
            seen.add(rid.value)
            found.append((addr, rid.value, keep, size))
        # Up front (Note [Disk backup]): a kind released already cannot be read (nor paused
        # again): a disk segment outside the arena not backed, an arena of the tag paused.
        for addr, rid, keep, size in found:
            backed = ctypes.c_int()
            _native.allocator.check(lib.dfa_is_backed(rid, 0, size, ctypes.byref(backed)), "dfa_is_backed")
            if keep == "disk" and not backed.value:
                raise _dfa.InvalidState(f"pause({t!r}): the disk segment at {addr:#x} ({size} bytes) is not backed "
                                        "(released by another caller?): nothing paused")
        if self.arenas is not None:
            for keep in _ordered(self.keeps[t], _PAUSE_ORDER):
                name = self._itag(t, keep)
                if self._arena_figures(name)[4]:
                    raise _dfa.InvalidState(f"pause({t!r}): its arena {name!r} is paused already (released by "
                                            "another caller?): nothing paused")
        # Note [Disk backup]: the files first, while every kind still holds its contents: the
        # disk kind's segments outside its arena and those placed in it.
        disk = [(addr, size) for addr, _, keep, size in found if keep == "disk"]
        gen = None  # the disk arena's generation when its segments were listed for the file
        if "disk" in self.keeps[t] and self.arenas is not None:
            gen = self._arena_figures(self._itag(t, "disk"))[6]
            disk += self._arena_segments(self._itag(t, "disk"))
        dev = self._preload_device()
        spills = self.disk.save(t, {dev: sorted(disk)}) if disk else []
        done = []  # all or nothing: per kind (_PAUSE_ORDER), its arena then its segments outside
        try:
            stream = _stream(dev)
            for keep in _ordered(self.keeps[t], _PAUSE_ORDER):
                released = _KEEPS.index(_released_as(keep))
                if self.arenas is not None:
                    name = self._itag(t, keep)
                    held = self._arena_figures(name)[1]
                    _native.allocator.check(self.arenas.dfa_preload_arena_pause(name.encode(), released, stream),
                                            "dfa_preload_arena_pause")
                    done.append((name, 0, keep, held))
                for _, ids in _by_keep([(rid, k) for _, rid, k, _ in found if k == keep], _PAUSE_ORDER):
                    _native.allocator.check(lib.dfa_release_many(ids, len(ids), released, stream),
                                            "dfa_release_many")
                    done += [f for f in found if f[2] == keep]
                if keep == "disk" and self.arenas is not None:
                    # a segment placed in the disk arena after its file was written (another
                    # thread in the region) was released without being written: rolled back
                    # before the discard kind is touched; so is one placed where a segment
                    # freed meanwhile was (same address and size: the file would give it the
                    # old bytes), which only the arena's generation shows
                    name = self._itag(t, "disk")
                    self._check_covered(t, spills, f"pause({t!r})", "were released without being written (their "
                                        "contents are lost); every kind resumed, nothing paused",
                                        {dev: self._arena_segments(name)})
                    now = self._arena_figures(name)[6]
                    if now != gen:
                        raise _dfa.InvalidState(
                            f"pause({t!r}): {now - gen} segment(s) were placed in {name!r} (or noted beside it) "
                            "after its file was listed (allocated while the pause ran?): the file may not hold "
                            "them; every kind resumed, nothing paused")
                    self.disk_gens[name] = gen
        except BaseException as err:
            try:
                # a segment backed again already is backed as it is, each arena taken once
                self._preload_resume(done, spills, check=False)
            except BaseException as e:
                self._keep_paused(t, done, spills, e)
                raise err
            self.disk_gens.pop(self._itag(t, "disk"), None)
            self.disk.remove(spills)
            raise
        for keep, gen in gens.items():  # checked and paused: the next pause reads no snapshot for them
            self.verified[(t, keep)] = gen
        if spills:
            self.spills[t] = spills
        return done

    def _preload_resume(self, paused: list, spills: Optional[list] = None, check: bool = True) -> None:
        """Backs the rows of _preload_pause again, kind by kind in _RESUME_ORDER: the kind's
        arena (once: a resume may be retried), then its segments outside it; the disk kind's
        file is then read back into both (Note [Disk backup]), whether or not they were paused
        (the file holds the only copy until it is loaded).  A step of the disk kind that fails
        (its arena's resume, its segments' materialize, the load) releases it again (arena
        and segments; a release that fails is a warning, the next resume reads the file
        again) and raises, nothing else resumed.  ``check``: segments placed in the disk arena
        since the pause (_check_generation) and one in no file are refused first, nothing
        resumed (a pause's rollback skips both)."""
        lib = _native.allocator()
        dev = self._preload_device()
        stream = _stream(dev)
        for keep in _ordered({row[2] for row in paused}, _RESUME_ORDER):
            names, live = [], []
            for addr, rid, k, _ in paused:
                if k != keep:
                    continue
                if isinstance(addr, str):  # an arena
                    names.append(addr)
                    continue
                now = ctypes.c_uint64()
                if lib.dfa_find(ctypes.c_void_p(addr), ctypes.byref(now)) != 0 or now.value != rid:
                    continue  # PyTorch freed the segment while paused (empty_cache of a pool no longer used)
                live.append((rid, addr))
            if keep == "disk" and spills and check:
                for name in names:  # placed while the arena was backed (after a failed release)
                    tag = name[len("tms.disk/"):]
                    self._check_generation(tag, name)
                    self._check_covered(tag, spills, f"resume({tag!r})",
                                        "would come back with undefined contents (free them first); nothing resumed",
                                        {dev: self._arena_segments(name)})
            disk = keep == "disk" and bool(spills)
            ids = (ctypes.c_uint64 * len(live))(*[rid for rid, _ in live])
            try:
                for name in names:  # its slabs at their addresses
                    if self._arena_figures(name)[4]:
                        _native.allocator.check(self.arenas.dfa_preload_arena_resume(name.encode(), stream),
                                                "dfa_preload_arena_resume")
                if live:
                    fill = 2 if keep == "host" else 0  # restore / undefined
                    _native.allocator.check(lib.dfa_materialize_many(ids, len(ids), fill, stream),
                                            "dfa_materialize_many")
                if disk:
                    addrs = {addr for _, addr in live}
                    placed = {r for name in names for r in self._arena_segments(name)}  # freed ones not read
                    self.disk.load(spills, lambda dev, addr, size: addr in addrs or (addr, size) in placed)
            except BaseException:  # the disk kind released again: the tag stays paused, no wrong contents handed out
                if disk:
                    self._release_again(names, live, paused, stream)
                raise

    def _check_generation(self, t: str, name: str) -> None:
        """InvalidState, nothing resumed, when segments were placed in the disk arena ``name``
        since its file was written while it was backed (a release after a failed load that
        failed: nothing is placed in a paused arena, a cudaMalloc there is a stray outside it):
        one may lie where a segment freed meanwhile was, same address and size, and the file
        would give it the old bytes.  Refused once: the caller is told to free them, and the
        next resume reads the file."""
        if name not in self.disk_gens:
            return
        f = self._arena_figures(name)
        if f[4] or f[6] == self.disk_gens[name]:
            return
        placed, self.disk_gens[name] = f[6] - self.disk_gens[name], f[6]
        raise _dfa.InvalidState(
            f"resume({t!r}): {placed} segment(s) were placed in {name!r} (or noted beside it) while the tag was "
            "paused and the arena backed (after a failed release): one at a freed segment's address would get "
            "the file's old bytes. Free every segment allocated there since the pause, then resume again (this "
            "is refused once: the next resume reads the file); nothing resumed")

    def _release_again(self, names: list, live: list, paused: list, stream) -> None:
        """The disk kind's arenas and segments outside them that are backed, released again (as
        discard) after its resume failed (the file is kept: the next resume reads it); a release
        that fails is a warning."""
        lib = _native.allocator()
        try:
            for name in names:
                if not self._arena_figures(name)[4]:
                    _native.allocator.check(self.arenas.dfa_preload_arena_pause(
                        name.encode(), _KEEPS.index("discard"), stream), "dfa_preload_arena_pause")
            sizes = {addr: size for addr, _, _, size in paused}
            backed = []
            for rid, addr in live:
                b = ctypes.c_int()
                _native.allocator.check(lib.dfa_is_backed(rid, 0, sizes[addr], ctypes.byref(b)), "dfa_is_backed")
                if b.value:
                    backed.append(rid)
            if backed:
                ids = (ctypes.c_uint64 * len(backed))(*backed)
                _native.allocator.check(lib.dfa_release_many(ids, len(ids), _KEEPS.index("discard"), stream),
                                        "dfa_release_many")
        except BaseException as e:  # backed with undefined contents; the next resume reads the file again
            _log.warning("deferalloc.memory_saver: the disk segments of a tag stay backed after its resume failed "
                         "(%s); the tag stays paused and its next resume reads the file again", e)

    def _disk_ranges(self, t: str) -> list:
        """[(address, bytes)] of the disk kind's memory of tag ``t``: while paused, its files'
        ranges; else its pools' segments (torch mode: the deferalloc tag's blocks; preload mode:
        PyTorch's snapshot of its pools, and its arena's segments)."""
        if t in self.paused:
            return [r for _, _, ranges in self.spills.get(t, []) for r in ranges]
        if self.mode == "torch":
            return [r for rows in _tag_blocks(self._itag(t, "disk")).values() for r in rows]
        pools = self.pool_ids.get((t, "disk"), set())
        rows = [(a, n) for a, pid, n in self._snapshot() if pid in pools]
        if self.arenas is not None:
            rows += self._arena_segments(self._itag(t, "disk"))
        return rows

    def in_disk_region(self, ptr: int, nbytes: int) -> bool:
        """True when [ptr, ptr + nbytes) lies in memory of a disk-backup region."""
        with self.lock:
            for t in [t for t, keeps in self.keeps.items() if "disk" in keeps]:
                if any(a <= ptr and ptr + nbytes <= a + n for a, n in self._disk_ranges(t)):
                    return True
        return False


@contextlib.contextmanager
def _partly(call: str, names: list, i: int):
    """pause(None) / resume(None) take the tags one by one, each all or nothing, and stop at the
    first that fails: the tags done before it stay done (logged, so the caller knows which)."""
    try:
        yield
    except BaseException as e:
        if i:
            _log.warning("deferalloc.memory_saver: %s(): %r failed (%s) after %s were done (they stay so); not tried: "
                         "%s", call, names[i], e, names[:i], names[i + 1:])
        raise


def _released_as(keep: str) -> str:
    return "discard" if keep == "disk" else keep


def _ordered(keeps, order: tuple) -> list:
    return [k for k in order if k in keeps]


def _by_keep(rows: list, order: tuple) -> list:
    """(keep, C array of the reservation ids) for each keep of `rows` ((id, keep) pairs), in `order`."""
    out = []
    for keep in _ordered({k for _, k in rows}, order):
        rids = [rid for rid, k in rows if k == keep]
        out.append((keep, (ctypes.c_uint64 * len(rids))(*rids)))
    return out


def _tag_blocks(itag: str) -> dict:
    """{device: [(address, bytes)]}: the live blocks of the deferalloc tag (its allocations:
    in torch mode the segments of its MemPools), resident ones left out (a pause keeps them)."""
    out: dict = {}
    for dev, d in _snapshot.parse(_snapshot.snapshot_text())["devices"].items():
        groups = {i for i, g in d["groups"].items() if g["name"] == itag}
        for seg in d["segments"]:
            if seg["group"] in groups:
                out.setdefault(dev, []).extend((a, req) for a, _, req, state, _, resident in seg["blocks"]
                                               if state == "a" and not resident)
    return out


# Note [Disk backup]
# Rationale: torch_memory_saver's enable_disk_backup spills a paused region to files instead of
# host memory (a host with less RAM than the GPUs' weights).  A file read back wrong would be
# silently wrong weights, so it goes through the library's file machinery: dfa_spill_save /
# dfa_spill_load (Note [Disk spills] in allocator/core/files/spill.cpp: one checksummed file,
# never torn under its final name, every block verified before it reaches the device).
# Approach: the disk kind is a third kind beside host and discard.  A pause writes the kind's
# live memory (torch mode: the allocated blocks of "tms.disk/<tag>", i.e. its MemPool's
# segments; preload mode: the segments placed in the arena "tms.disk/<tag>", which the arena
# lists (dfa_preload_arena_segments: no snapshot needed), and the disk pools' segments outside
# it from PyTorch's snapshot) to one file per
# (tag, device), named by the process (pid and a random token), a count and the tag, in the
# process-global directory (set_disk_backup_dir, else TMS_DISK_BACKUP_DIR, else
# /tmp/deferalloc-disk-backup-<uid>),
# staged through chunks of TMS_DISK_BACKUP_CHUNK_MB (256 by default, as TMS); then releases the
# kinds, host first, then disk and discard as discard: the files are written before anything
# is released, and a failure at any step resumes what was released (a disk kind reads its file
# back) and removes the files.  A resume backs the disk kind first (contents undefined) and
# reads its file into it (preload mode: the arena's slabs backed again, then its segments and
# the segments outside read back); the file is deleted once every kind of the tag is resumed.  A load
# that fails (a missing, corrupt or truncated file) releases the disk kind again, so the tag
# stays paused with nothing resumed, keeps the file and raises: no tensor is handed back with
# wrong contents.  A segment PyTorch freed while paused is skipped (verified, not copied).
# The file holds the only copy until a load succeeds: a resume reads it whether or not the disk
# kind is paused now (deferalloc.resume() without a tag backs it with undefined contents; a
# release after a failed load may fail), and only a successful load lets it be deleted.  A
# resume of a disk kind inside a tagged region is refused (the release after a failed load
# could not run there), as is a pause there (before any file is written).  A pause whose
# rollback fails keeps the tag paused with its files (the next resume reads them).  A pause
# waits for every device of its files, refuses a kind released already (deferalloc.pause()
# without a tag: its memory cannot be read; preload mode: a disk segment outside the arena not
# backed, an arena of the tag paused), and rolls back when the disk kind holds a block in no
# file after the release (another thread allocated in the region meanwhile: that block's
# contents are lost; preload mode: a segment placed in the disk arena between the file and the
# arena's pause, the arena's segments listed again after it, and its generation read before
# the file's list and after the pause: a segment freed and one of its size placed at its
# address in between shows only there); a resume refuses such a block (preload mode: one
# placed in the disk arena while it stayed backed after a failed release, in no file or
# shown by the arena's generation since the pause: that refusal is given once, telling the
# caller to free what it placed there, and the next resume reads the file).
# Limits: files of a process that died stay in the directory (no process deletes another's);
# TMS writes one file per allocation kept until it is freed, deferalloc one per tag and device
# deleted at resume; a directory owned by another user (as /tmp itself) is refused; a resume
# that fails after the disk kind came back (the host kind's pinned copy, no memory) leaves
# the tag paused with that kind backed, as a failed resume of host and discard kinds does.
# In preload mode a segment of a disk pool outside the arena that another thread allocates
# after the pause read PyTorch's snapshot is not released (it stays backed, in no file).  In
# torch mode the checks match blocks by device, address and size only (deferalloc keeps no
# per-tag count of allocations): a block freed and one of the same size allocated at its
# address by another thread while the pause (or a resume after a failed release) runs gets
# the file's old bytes.


class _DiskBackup:
    """The disk kind's directory, chunk size and files (Note [Disk backup])."""

    def __init__(self, env: dict):
        self.dir = os.path.abspath(env["disk_dir"]) if env["disk_dir"] else None
        self.chunk = (env["disk_chunk_mb"] or _DEFAULT_CHUNK_MB) << 20
        self.count = 0
        self.token = os.urandom(4).hex()  # with the pid: another process's names never collide
        self.checked: Optional[str] = None  # the directory checked last

    def set_dir(self, path) -> None:
        path = os.fspath(path)
        if not path:
            raise ValueError("set_disk_backup_dir: path must not be empty")
        path = os.path.abspath(path)
        self._prepare(path, "set_disk_backup_dir")
        self.dir = path

    def _prepare(self, path: str, what: str) -> None:
        """Creates the parents (TMS's create_directories), then checks (and creates) the directory."""
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
        except OSError as e:
            raise _dfa.IoError(f"{what}: cannot create the parents of {path}: {e}") from e
        self._check(path)

    def _check(self, path: str) -> None:
        mem = ctypes.c_int()
        lib = _native.allocator()
        _native.allocator.check(lib.dfa_spill_check_dir(path.encode(), ctypes.byref(mem)), "dfa_spill_check_dir")
        if mem.value and self.checked != path:
            _log.warning("deferalloc.memory_saver: the disk backup directory %s is tmpfs or ramfs: its files hold "
                         "host memory. Name a directory on a disk (TMS_DISK_BACKUP_DIR or set_disk_backup_dir)", path)
        self.checked = path

    def directory(self) -> str:
        if self.dir is not None:
            if self.checked != self.dir:
                self._prepare(self.dir, "TMS_DISK_BACKUP_DIR")
            return self.dir
        default = os.path.join("/tmp", f"deferalloc-disk-backup-{os.geteuid()}")
        try:
            if self.checked != default:
                self._check(default)
        except _dfa.IoError as e:
            raise _dfa.IoError(f"{e} (the default disk backup directory): set TMS_DISK_BACKUP_DIR or call "
                               "set_disk_backup_dir() with a directory of your own") from e
        return default

    def save(self, tag: str, groups: dict) -> list:
        """Writes each device's ranges to a file; returns [(path, device, ranges)], all or none."""
        done = []
        try:
            for dev, ranges in sorted(groups.items()):
                if not ranges:
                    continue
                self.count += 1
                safe = "".join(c if c.isalnum() or c in "-_." else f"%{ord(c):02x}" for c in tag)[:96]
                path = os.path.join(self.directory(), f"dfa-tms-{os.getpid()}-{self.token}-{self.count}-{safe}-d{dev}.spill")
                _spill("dfa_spill_save", path, dev, [(a, n) for a, n in ranges], self.chunk)
                done.append((path, dev, list(ranges)))
        except BaseException:
            self.remove(done)
            raise
        return done

    def load(self, spills: list, live) -> None:
        """Reads each file back; a range for which ``live(device, address, bytes)`` is False
        is verified and not copied."""
        for path, dev, ranges in spills:
            _spill("dfa_spill_load", path, dev, [(a if live(dev, a, n) else None, n) for a, n in ranges], self.chunk)

    @staticmethod
    def remove(spills: list) -> None:
        for path, _, _ in spills:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as e:  # the tag is resumed (or its pause rolled back) already: a leftover file only
                _log.warning("deferalloc.memory_saver: cannot remove the disk backup file %s: %s", path, e)


def _stream(device: int):
    """The current stream of `device` for the C ABI (None without CUDA: the host driver)."""
    return _native.stream_ptr(None, torch.device("cuda", device)) if torch.cuda.is_available() else None


def _spill(call: str, path: str, device: int, ranges: list, chunk: int) -> None:
    lib = _native.allocator()
    n = len(ranges)
    ptrs = (ctypes.c_void_p * n)(*[a for a, _ in ranges])
    sizes = (ctypes.c_size_t * n)(*[b for _, b in ranges])
    stream = _stream(device)
    _native.allocator.check(getattr(lib, call)(path.encode(), device, n, ptrs, sizes, chunk, stream), call)


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
