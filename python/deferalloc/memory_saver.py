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
caching allocator, and libdeferalloc_preload.so, whose cudaMalloc gives each PyTorch segment
a reservation of its own.
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
  (tag, backup, device); ``cuda_graph`` records the graph's private pool under the tag.  A
  pause finds the tag's pools' segments in PyTorch's snapshot, each one a reservation of the
  preload library (dfa_find), and releases them (dfa_release_many, keep host or discard, the
  disk pools' segments written to a file first and released as discard); resume backs them
  again at the same addresses (dfa_materialize_many, restore or undefined, the file read back).  With
  TMS_INIT_ENABLE=1, PyTorch's default pool belongs to the tag "default" too.
* Disk backup (``enable_disk_backup``; Note [Disk backup]): a third kind beside host backup
  and discard, in both modes ("tms.disk/<tag>" in torch mode, its own pools in preload
  mode): a pause writes the kind's live memory to a file (dfa_spill_save) and releases it as
  discard; resume backs it again and reads the file back into it (dfa_spill_load).
Limits: memory that does not come through PyTorch's allocator (a library's own cudaMalloc)
is not paused in either mode; allocating in a paused tag is the caller's error as in TMS
(torch mode refuses it, preload mode may hand out a released block); get_cpu_backup raises
NotImplementedError outside disk regions (the C ABI has no way to read a paused block's
host copy); for a disk region's tensor it returns None, as TMS.
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
# Rationale: PyTorch routes an allocation to the first pool whose filter matches, in the order
# the pools began (beginAllocateToPool appends): a MemPool entered inside another one on the
# same thread (a nested region, disable(), a graph captured inside a region) would never be
# used, the outer pool taking the allocations.
# Approach: the saver keeps a stack of routed pools per thread and routes only the top one:
# entering suspends the outer pool (end + release, as torch.cuda.use_mem_pool leaves it) and
# leaving routes it again (begin).  A capture suspends the region's pool, so its stream
# filter takes the graph's allocations.
# Limits: pools routed by other code (torch.cuda.use_mem_pool around a saver region) are not
# suspended: the outer one keeps winning, as in PyTorch.
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
            if self.init_enable:
                self._note(_TAG_DEFAULT, self.init_keep)
                self.pool_ids.setdefault((_TAG_DEFAULT, self.init_keep), set()).add((0, 0))
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
        with self._route(pool), self._in_region():
            yield

    @contextlib.contextmanager
    def cuda_graph(self, graph, pool, stream, capture_error_mode: str, tag: str, keep: str):
        if not torch.cuda.is_available():
            raise RuntimeError("cuda_graph needs CUDA")
        if self.mode == "preload":
            self._note(tag, keep)
            with self._route(None), torch.cuda.graph(graph, pool=pool, stream=stream,
                                                      capture_error_mode=capture_error_mode), self._in_region():
                yield
            with self.lock:
                self.pool_ids.setdefault((tag, keep), set()).add(tuple(graph.pool()))
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
            with self._route(pool):
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
        with self.lock:
            for t in names:
                if t in self.paused:
                    raise _dfa.InvalidState(f"pause({t!r}): the tag is paused already (resume it first)")
                if self.mode == "torch":
                    self._torch_pause(t)
                else:
                    self.paused[t] = self._preload_pause(t)

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
            for t in names:
                spills = self.spills.get(t, [])
                if self.mode == "torch":
                    for keep in _ordered(self.keeps[t], _RESUME_ORDER):
                        self._torch_resume_keep(t, keep, spills)
                else:
                    self._preload_resume(self.paused[t], spills)
                del self.paused[t]
                self.disk.remove(self.spills.pop(t, []))
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
            if "disk" in keeps:
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

    def _check_covered(self, t: str, spills: list, what: str, then: str) -> None:
        """InvalidState when a live block of the tag's disk kind is in none of its files (one
        allocated by another thread inside the region while the pause ran)."""
        saved = {(dev, a, n) for _, dev, ranges in spills for a, n in ranges}
        missing = [(dev, a, n) for dev, rows in _tag_blocks(self._itag(t, "disk")).items() for a, n in rows
                   if (dev, a, n) not in saved]
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

    # preload mode: the tag's segments are reservations of the preload library
    def _segments(self, t: str) -> list:
        """(address, keep, bytes) of every segment of the tag's pools (PyTorch's snapshot of
        each pool; the default pool's segments picked out of the whole snapshot)."""
        out = []
        for keep in sorted(self.keeps[t]):
            for pid in sorted(self.pool_ids.get((t, keep), ())):
                if pid == (0, 0):
                    segs = [s for s in torch.cuda.memory.memory_snapshot(None, include_traces=False)
                            if tuple(s.get("segment_pool_id", (0, 0))) == (0, 0)]
                else:
                    segs = torch.cuda.memory.memory_snapshot(pid, include_traces=False)
                out += [(s["address"], keep, s["total_size"]) for s in segs]
        return out

    def _preload_pause(self, t: str) -> list:
        lib = _native.allocator()
        found = []
        for addr, keep, size in self._segments(t):
            rid = ctypes.c_uint64()
            if lib.dfa_find(ctypes.c_void_p(addr), ctypes.byref(rid)) != 0:
                raise _dfa.InvalidState(
                    f"pause({t!r}): the segment at {addr:#x} ({size} bytes) is not a deferalloc reservation: is "
                    "libdeferalloc_preload.so in LD_PRELOAD the one beside the libdeferalloc.so this package loads "
                    f"({_native.library_path()}), and DEFERALLOC_CONF's device this one? Nothing paused")
            found.append((addr, rid.value, keep, size))
        for addr, rid, keep, size in found:  # a segment released already: its memory cannot be read
            backed = ctypes.c_int()
            _native.allocator.check(lib.dfa_is_backed(rid, 0, size, ctypes.byref(backed)), "dfa_is_backed")
            if keep == "disk" and not backed.value:
                raise _dfa.InvalidState(f"pause({t!r}): the disk segment at {addr:#x} ({size} bytes) is not backed "
                                        "(released by another caller?): nothing paused")
        disk = [(addr, size) for addr, _, keep, size in found if keep == "disk"]
        spills = self.disk.save(t, {self._device(): disk}) if disk else []  # Note [Disk backup]: first
        released = []  # one call per keep, all or nothing
        try:
            stream = _stream(self._device())
            for keep, ids in _by_keep([(rid, keep) for _, rid, keep, _ in found], _PAUSE_ORDER):
                _native.allocator.check(lib.dfa_release_many(ids, len(ids), _KEEPS.index(_released_as(keep)),
                                                             stream), "dfa_release_many")
                released.append(keep)
        except BaseException as err:
            try:
                self._preload_resume([f for f in found if f[2] in released], spills)
            except BaseException as e:
                self._keep_paused(t, [f for f in found if f[2] in released], spills, e)
                raise err
            self.disk.remove(spills)
            raise
        if spills:
            self.spills[t] = spills
        return found

    def _preload_resume(self, paused: list, spills: list) -> None:
        lib = _native.allocator()
        stream = _stream(self._device())
        live = []
        for addr, rid, keep, _ in paused:
            now = ctypes.c_uint64()
            if lib.dfa_find(ctypes.c_void_p(addr), ctypes.byref(now)) != 0 or now.value != rid:
                continue  # PyTorch freed the segment while paused (empty_cache of a pool no longer used)
            live.append((rid, keep, addr))
        for keep, ids in _by_keep([(rid, keep) for rid, keep, _ in live], _RESUME_ORDER):
            fill = 2 if keep == "host" else 0  # restore / undefined
            _native.allocator.check(lib.dfa_materialize_many(ids, len(ids), fill, stream), "dfa_materialize_many")
            if keep != "disk" or not spills:
                continue
            try:
                addrs = {addr for _, k, addr in live if k == "disk"}
                self.disk.load(spills, lambda dev, addr, size: addr in addrs)
            except BaseException:  # released again: the tag stays paused, no wrong contents handed out
                try:
                    _native.allocator.check(lib.dfa_release_many(ids, len(ids), _KEEPS.index("discard"), stream),
                                            "dfa_release_many")
                except BaseException as e:  # backed with undefined contents; the next resume reads the file again
                    _log.warning("deferalloc.memory_saver: the disk segments of a tag stay backed after its file "
                                 "failed to load (%s); the tag stays paused and its next resume reads the file again",
                                 e)
                raise

    def in_disk_region(self, ptr: int, nbytes: int) -> bool:
        """True when [ptr, ptr + nbytes) lies in memory of a disk-backup region."""
        with self.lock:
            tags = [t for t, keeps in self.keeps.items() if "disk" in keeps]
            for t in tags:
                if self.mode == "torch":
                    rows = [r for rows in _tag_blocks(self._itag(t, "disk")).values() for r in rows]
                elif t in self.paused:
                    rows = [(a, n) for a, _, k, n in self.paused[t] if k == "disk"]
                else:
                    rows = [(a, n) for a, k, n in self._segments(t) if k == "disk"]
                if any(a <= ptr and ptr + nbytes <= a + n for a, n in rows):
                    return True
        return False


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
# segments; preload mode: the disk pools' segments from PyTorch's snapshot) to one file per
# (tag, device), named by the process (pid and a random token), a count and the tag, in the
# process-global directory (set_disk_backup_dir, else TMS_DISK_BACKUP_DIR, else
# /tmp/deferalloc-disk-backup-<uid>),
# staged through chunks of TMS_DISK_BACKUP_CHUNK_MB (256 by default, as TMS); then releases the
# kinds, host first, then disk and discard as discard: the files are written before anything
# is released, and a failure at any step resumes what was released (a disk kind reads its file
# back) and removes the files.  A resume backs the disk kind first (contents undefined) and
# reads its file into it; the file is deleted once every kind of the tag is resumed.  A load
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
# without a tag: its memory cannot be read), and rolls back when the disk kind holds a block
# in no file after the release (another thread allocated in the region meanwhile: that
# block's contents are lost); a resume refuses such a block.
# Limits: files of a process that died stay in the directory (no process deletes another's);
# TMS writes one file per allocation kept until it is freed, deferalloc one per tag and device
# deleted at resume; a directory owned by another user (as /tmp itself) is refused; a resume
# that fails after the disk kind came back (the host kind's pinned copy, no memory) leaves
# the tag paused with that kind backed, as a failed resume of host and discard kinds does.


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
