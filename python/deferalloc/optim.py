"""StreamedAdamW: PyTorch's AdamW whose FP32 state lives off the GPU.

``deferalloc.optim.StreamedAdamW`` is a ``torch.optim.Optimizer``.  Its FP32 main
parameters and Adam moments (12 bytes per parameter) live in pinned host memory (tier
"host"), in a file (tier "file") or in HBM (tier "device"), and each ``step()`` streams
them through a fixed HBM window at the PCIe bound, with the arithmetic of
``torch._fused_adamw_`` (bit for bit).  The engine is libdeferalloc_optimizer.so,
reached through ctypes (its C ABI, include/deferalloc/optimizer.h).

Note [ctypes, not an extension]
Rationale: the package stays pure Python (as the allocator face): no compiler at install
time, no build per torch version / Python ABI, and the engine's C ABI is already the
stable interface.  The cost is the Python side of ``step()``: one pass over the
parameters to collect ``.grad`` pointers into a preallocated ctypes array and one call;
measured per step by ``stats()["python_seconds"]``.
Limits: gradients and parameters must be dense and contiguous; the state lives beside
the parameters, so a model whose weights are replaced after the first step (outside
``load_state_dict``) needs ``sync_main_from_params()``.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import time
import weakref
from typing import Any, Callable, Iterable

import torch

from . import library_path
from .errors import (CorruptData, CudaError, DeferallocError, InternalError, InvalidArgument, InvalidState, IoError,
                     NoDevice, OutOfMemory, from_status)

__all__ = [
    "StreamedAdamW", "OptimizerError", "InvalidArgumentError", "InvalidStateError", "OutOfMemoryError",
    "CudaError", "NoDeviceError", "IOFailure", "CorruptDataError", "InternalError", "optimizer_library_path",
]


# ---- errors: the package's, one class per dfa_status (deferalloc.errors) ---------------------
# The names below are kept for optimizer users; each is the class of deferalloc.errors.
OptimizerError = DeferallocError
InvalidArgumentError = InvalidArgument
InvalidStateError = InvalidState
OutOfMemoryError = OutOfMemory
NoDeviceError = NoDevice
IOFailure = IoError
CorruptDataError = CorruptData


# ---- the library ---------------------------------------------------------------------------

_DTYPE = {torch.bfloat16: 0, torch.float32: 1, torch.float16: 2}
_ARRAYS = {"main_param": 0, "exp_avg": 1, "exp_avg_sq": 2}


class _AdamwParams(ctypes.Structure):
    _fields_ = [("lr", ctypes.c_double), ("beta1", ctypes.c_double), ("beta2", ctypes.c_double),
                ("eps", ctypes.c_double), ("weight_decay", ctypes.c_double)]


class _Stats(ctypes.Structure):
    _fields_ = [("steps", ctypes.c_uint64), ("shards", ctypes.c_size_t), ("piece_elements", ctypes.c_size_t),
                ("seconds", ctypes.c_double), ("params", ctypes.c_size_t), ("pieces", ctypes.c_size_t),
                ("bytes_to_device", ctypes.c_size_t), ("bytes_from_device", ctypes.c_size_t),
                ("peak_backed_bytes", ctypes.c_size_t), ("map_seconds", ctypes.c_double),
                ("retire_seconds", ctypes.c_double), ("io_wait_seconds", ctypes.c_double)]


_PROGRESS = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_double, ctypes.c_void_p)
_lib = None


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
    import ctypes.util
    found = ctypes.util.find_library("deferalloc_optimizer")
    if found is None:
        raise NoDeviceError("libdeferalloc_optimizer.so not found: set DEFERALLOC_OPTIMIZER_LIB to its path")
    return found


def _load():
    global _lib
    if _lib is not None:
        return _lib
    lib = ctypes.CDLL(optimizer_library_path())
    c = ctypes
    P = c.c_void_p
    sigs = {
        "dfa_opt_last_error": (c.c_char_p, []),
        "dfa_opt_create": (c.c_int, [c.c_char_p, c.POINTER(P)]),
        "dfa_opt_destroy": (c.c_int, [P]),
        "dfa_opt_add_shard": (c.c_int, [P, P, c.c_size_t, c.c_int, c.c_int, c.c_char_p, c.POINTER(c.c_size_t)]),
        "dfa_opt_set_group": (c.c_int, [P, c.c_int, c.POINTER(_AdamwParams)]),
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
        "dfa_opt_set_progress": (c.c_int, [P, _PROGRESS, P]),
        "dfa_opt_get_stats": (c.c_int, [P, c.POINTER(_Stats)]),
    }
    for name, (res, args) in sigs.items():
        fn = getattr(lib, name)
        fn.restype = res
        fn.argtypes = args
    _lib = lib
    return lib


def _check(status: int, call: str) -> None:
    if status != 0:
        msg = _load().dfa_opt_last_error().decode(errors="replace") or call
        raise from_status(status, msg)


def _stream_ptr(stream, device: torch.device):
    if device.type != "cuda":
        return None
    if stream is None:
        stream = torch.cuda.current_stream(device)
    if isinstance(stream, torch.cuda.Stream):
        return ctypes.c_void_p(stream.cuda_stream)
    return ctypes.c_void_p(int(stream))


# ---- the optimizer -------------------------------------------------------------------------

# Note [Parameter storage under the optimizer]
# Rationale: the engine writes each step's parameters through the pointer it was given
# at construction.  m.half(), m.to(torch.bfloat16) or p.data = p.data.clone() replace a
# parameter's storage and free the old one: the engine then wrote freed memory (double
# free, SIGSEGV) and the parameter never changed.  Two optimizers over one parameter (or
# over overlapping views of one storage) each write back their own FP32 copy, so one's
# update is lost.
# Approach: each parameter's engine tensor is bound as (data_ptr, dtype, numel).
# _follow_params(), at the start of every call that lets the engine read or write the
# parameters, compares them (three attribute reads per parameter): a new storage of the
# same dtype and numel is followed (dfa_opt_set_shard_param; the FP32 state stays the
# master, as torch's optimizers keep theirs); another dtype or numel raises
# InvalidStateError naming the parameter, before the engine touches anything.  At
# construction, the parameters' byte ranges must be disjoint from each other and from
# those of every live StreamedAdamW (_LIVE), else InvalidArgumentError.
# Limits: a storage replaced between two calls is followed at the next call only; a
# replaced storage's values are not read (call sync_main_from_params() to take them).
_LIVE: "weakref.WeakSet[StreamedAdamW]" = weakref.WeakSet()


def _span(t: torch.Tensor) -> tuple:
    return (t.device, t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())


class StreamedAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias correction; ``torch._fused_adamw_``'s arithmetic)
    with FP32 main params and moments streamed from ``tier`` each step.

    Args:
        params, lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (param groups may set
            their own; schedulers may change them between steps).
        tier: "host" (pinned host memory), "file" (``directory``), or "device" (HBM).
        moment_dtype: how the host tier stores the Adam moments: "fp32" (exact torch AdamW),
            "bf16" (round to nearest even, 8 B/param moved each way instead of 12) or
            "int8" (block-scaled 8-bit floats, ~6 B/param); the arithmetic stays FP32.
        resident_mb: host tier: HBM (MiB) for parameters whose FP32 state stays resident
            (taken in order while they fit; the rest stream), or "auto": the free HBM at
            construction less the window and a tenth of the device (for activations).
        window_mb: HBM budget of the streamed state (host and file tiers).
        depth: pieces in flight (3 overlaps fetch, step and write-back; more lets fetches run
            ahead over parameters of mixed sizes).  None: 8 on the host tier, 3 on the file
            tier, fewer if the window holds fewer.
        resume: file tier: continue from the state file's last committed step.
        stream: a ``torch.cuda.Stream`` (or cudaStream_t as int) the step is ordered
            after; default: the current stream at each step.
        settings: extra "key:value" settings of the engine (optimizer.h).
        progress: ``progress(phase, done, total, seconds)`` after each piece.

    BF16, FP16 and FP32 parameters; a parameter whose ``.grad`` is None is skipped (its
    ``step`` stays).  ``amsgrad``, ``maximize``, ``capturable`` and ``differentiable``
    are refused.  The state is created at the first ``step()`` (or ``load_state_dict``)
    from the parameters' values then.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, amsgrad: bool = False, maximize: bool = False,
                 foreach: bool | None = None, fused: bool | None = None, capturable: bool = False,
                 differentiable: bool = False, tier: str = "host", directory: str | None = None,
                 window_mb: int = 512, depth: int | None = None, resume: bool = False, stream=None,
                 settings: str | None = None, moment_dtype: str = "fp32",
                 resident_mb: int | str | None = None, progress: Callable[[str, int, int, float], None] | None = None):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
                        foreach=foreach, capturable=capturable, differentiable=differentiable, fused=fused)
        self._handle = None
        super().__init__(params, defaults)
        self._params = [p for g in self.param_groups for p in g["params"]]
        if not self._params:
            raise InvalidArgumentError("StreamedAdamW: no parameters")
        devices = {p.device for p in self._params}
        if len(devices) != 1:
            raise InvalidArgumentError(f"StreamedAdamW: parameters on several devices {sorted(map(str, devices))}")
        self._device = devices.pop()
        if self._device.type not in ("cuda", "cpu"):
            raise InvalidArgumentError(f"StreamedAdamW: parameters on {self._device} (cuda or cpu expected)")
        if tier == "file" and not directory:
            raise InvalidArgumentError("StreamedAdamW: tier 'file' needs directory=")
        self._stream = stream
        if resident_mb == "auto":
            resident_mb = 0
            if self._device.type == "cuda":
                free, total = torch.cuda.mem_get_info(self._device)
                resident_mb = max(0, (free - total // 10) // (1 << 20) - int(window_mb))
        driver = (f"driver:cuda,device:{self._device.index or 0}" if self._device.type == "cuda" else "driver:host")
        text = ",".join(t for t in (os.environ.get("DEFERALLOC_CONF", ""), driver, f"tier:{tier}",
                                    f"window_mb:{int(window_mb)}", f"depth:{int(depth)}" if depth is not None else "",
                                    f"resume:{int(bool(resume))}", f"directory:{directory}" if directory else "",
                                    f"moments:{moment_dtype}" if moment_dtype != "fp32" else "",
                                    f"resident_mb:{int(resident_mb)}" if resident_mb else "",
                                    settings or "") if t)
        lib = _load()
        h = ctypes.c_void_p()
        _check(lib.dfa_opt_create(text.encode(), ctypes.byref(h)), "dfa_opt_create")
        self._handle = h
        self._finalizer = weakref.finalize(self, lib.dfa_opt_destroy, h)
        self._progress_cb = None
        if progress is not None:
            self._progress_cb = _PROGRESS(lambda ph, d, t, s, _u: progress(ph.decode(), d, t, s))
            _check(lib.dfa_opt_set_progress(h, self._progress_cb, None), "dfa_opt_set_progress")
        self._shard_of: dict[torch.Tensor, int] = {}
        for gi, g in enumerate(self.param_groups):
            for p in g["params"]:
                name = f"group{gi}.param{len(self._shard_of)}"
                self._shard_of[p] = len(self._shard_of)
                t = self._engine_tensor(p)
                if t.numel() != p.numel() or t.dtype not in _DTYPE or not t.is_contiguous():
                    raise InvalidArgumentError(f"StreamedAdamW: the engine tensor of {name} has {t.numel()} "
                                                  f"{t.dtype} elements (contiguous, {p.numel()} expected)")
                _check(lib.dfa_opt_add_shard(h, ctypes.c_void_p(t.data_ptr()), t.numel(), _DTYPE[t.dtype], gi,
                                             name.encode(), None), "dfa_opt_add_shard")
        self._bound = [(t.data_ptr(), t.dtype, t.numel()) for t in map(self._engine_tensor, self._params)]
        self._refuse_shared_params()
        n = len(self._params)
        self._numels = [(p, p.numel()) for p in self._params]
        self._grad_ptrs = (ctypes.c_void_p * n)()
        self._grad_types = (ctypes.c_int * n)()
        self._pushed: list[tuple | None] = [None] * len(self.param_groups)
        self._initialized = False
        self._python_seconds = 0.0
        self._push_groups()
        _LIVE.add(self)
        if resume:
            self._resume()

    def _refuse_shared_params(self) -> None:
        """Note [Parameter storage under the optimizer]: no two parameters (of this or a
        live StreamedAdamW) share bytes."""
        spans = [(_span(self._engine_tensor(p)), i, self) for i, p in enumerate(self._params)]
        for other in list(_LIVE):
            if other is not self and getattr(other, "_handle", None) is not None:
                spans += [(_span(other._engine_tensor(p)), i, other) for i, p in enumerate(other._params)]
        spans.sort(key=lambda x: (str(x[0][0]), x[0][1]))
        cur = None  # the span reaching furthest so far (on its device)
        for b, j, ob in spans:
            if cur is None or cur[0][0] != b[0] or cur[0][2] <= b[1]:
                cur = (b, j, ob)
                continue
            a, i, oa = cur
            if b[2] > a[2]:
                cur = (b, j, ob)
            if oa is self or ob is self:
                if oa is ob:
                    raise InvalidArgumentError(f"StreamedAdamW: parameters {i} and {j} overlap in memory (views of "
                                               f"one storage); each would keep its own state and overwrite the other")
                mine, theirs = (i, j) if oa is self else (j, i)
                raise InvalidArgumentError(f"StreamedAdamW: parameter {mine} is already held by another live "
                                           f"StreamedAdamW (its parameter {theirs} shares its memory); one optimizer "
                                           f"per parameter (delete the other first)")

    def _follow_params(self) -> None:
        """Note [Parameter storage under the optimizer]: follows replaced storages of the
        same dtype and numel, refuses other changes."""
        lib = None
        for i, p in enumerate(self._params):
            t = self._engine_tensor(p)
            ptr, dtype, numel = self._bound[i]
            if t.data_ptr() == ptr and t.dtype == dtype and t.numel() == numel:
                continue
            if t.dtype != dtype or t.numel() != numel:
                raise InvalidStateError(
                    f"StreamedAdamW: parameter {i} changed from {numel} {dtype} elements to {t.numel()} {t.dtype} "
                    f"after the optimizer was built (m.half() / m.to(dtype)?); the optimizer keeps the state of the "
                    f"old parameters: build a new StreamedAdamW after converting the model (load_state_dict carries "
                    f"the state over)")
            if not t.is_contiguous():
                raise InvalidStateError(f"StreamedAdamW: parameter {i}'s new storage is not contiguous")
            lib = lib or _load()
            _check(lib.dfa_opt_set_shard_param(self._handle, i, ctypes.c_void_p(t.data_ptr())),
                   "dfa_opt_set_shard_param")
            self._bound[i] = (t.data_ptr(), dtype, numel)

    @contextlib.contextmanager
    def _state_write(self):
        """Groups the state writes in it into one publish (the file tier commits them at
        once: a kill leaves the old state or the new; Note [State writes] in
        optimizer/home.cpp); an exception drops them on the file tier."""
        lib = _load()
        _check(lib.dfa_opt_begin_state_write(self._handle), "dfa_opt_begin_state_write")
        try:
            yield
        except BaseException:
            lib.dfa_opt_end_state_write(self._handle, 0)
            raise
        _check(lib.dfa_opt_end_state_write(self._handle, 1), "dfa_opt_end_state_write")

    def _engine_tensor(self, p: torch.Tensor) -> torch.Tensor:
        """The tensor the engine updates in place for parameter ``p``: ``p`` itself here; a
        subclass may name another of the same size (deferalloc.megatron: a BF16 model shard
        for an FP32 main-param handle that holds no memory)."""
        return p

    # ---- groups and hyper-parameters ---------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_handle", None) is not None:
            raise InvalidStateError("StreamedAdamW: parameter groups are fixed once the optimizer exists "
                                       "(the engine registers its shards at construction)")
        for key, why in (("amsgrad", "amsgrad"), ("maximize", "maximize"), ("capturable", "capturable"),
                         ("differentiable", "differentiable")):
            if param_group.get(key, self.defaults.get(key)):
                raise InvalidArgumentError(f"StreamedAdamW: {why}=True is not supported (torch._fused_adamw_'s "
                                              f"plain AdamW only)")
        super().add_param_group(param_group)
        for p in param_group["params"]:
            if p.dtype not in _DTYPE:
                raise InvalidArgumentError(f"StreamedAdamW: parameter dtype {p.dtype} (bfloat16, float16 or "
                                              f"float32 expected)")
            if not p.is_contiguous():
                raise InvalidArgumentError("StreamedAdamW: parameters must be contiguous")
            if p.numel() == 0:
                raise InvalidArgumentError("StreamedAdamW: an empty parameter")

    def _group_keys(self) -> list[tuple]:
        """Each group's hyper-parameters as the engine takes them (lr, beta1, beta2, eps,
        weight_decay), a snapshot."""
        return [(float(g["lr"]), float(g["betas"][0]), float(g["betas"][1]), float(g["eps"]),
                 float(g["weight_decay"])) for g in self.param_groups]

    def _push_groups(self, keys: list[tuple] | None = None) -> None:
        """Gives the engine the groups' hyper-parameters (``keys``: a snapshot of
        ``_group_keys()``; default: the current ones) where they changed."""
        lib = _load()
        for gi, key in enumerate(self._group_keys() if keys is None else keys):
            if key != self._pushed[gi]:
                _check(lib.dfa_opt_set_group(self._handle, gi, ctypes.byref(_AdamwParams(*key))), "dfa_opt_set_group")
                self._pushed[gi] = key

    # ---- state ---------------------------------------------------------------------------------

    def _resume(self) -> None:
        # File tier with resume: a committed state file is taken as is, and the parameters
        # are written from its main params; without one, the state starts at the first step.
        self._follow_params()
        try:
            self._ensure_initialized()
        except InvalidStateError:
            _check(_load().dfa_opt_sync_model_params(self._handle, _stream_ptr(self._stream, self._device)),
                   "dfa_opt_sync_model_params")
            self._initialized = True

    def _ensure_initialized(self) -> None:
        if not self._initialized:
            self._follow_params()
            _check(_load().dfa_opt_initialize(self._handle, _stream_ptr(self._stream, self._device)),
                   "dfa_opt_initialize")
            self._initialized = True

    def sync_main_from_params(self) -> None:
        """Re-derives the FP32 main params from the parameters' current values (moments and
        steps are kept): after model weights were replaced behind the optimizer's back."""
        if not self._initialized:
            return
        for p, i in self._shard_of.items():
            self._write(i, 0, self._engine_tensor(p).detach().cpu().float())

    def _read(self, shard: int, array: int, p: torch.Tensor) -> torch.Tensor:
        out = torch.empty(p.shape, dtype=torch.float32)
        _check(_load().dfa_opt_read_state(self._handle, shard, array, 0, p.numel(), ctypes.c_void_p(out.data_ptr())),
               "dfa_opt_read_state")
        return out

    def _write(self, shard: int, array: int, t: torch.Tensor) -> None:
        t = t.detach().to("cpu", torch.float32).contiguous()
        _check(_load().dfa_opt_write_state(self._handle, shard, array, 0, t.numel(), ctypes.c_void_p(t.data_ptr())),
               "dfa_opt_write_state")

    def _shard_step(self, shard: int) -> int:
        v = ctypes.c_uint64()
        _check(_load().dfa_opt_get_shard_step(self._handle, shard, ctypes.byref(v)), "dfa_opt_get_shard_step")
        return v.value

    def state_dict(self) -> dict[str, Any]:
        """torch's layout: per parameter ``step`` (float32 scalar), ``exp_avg``, ``exp_avg_sq``
        and ``main_param`` (the FP32 main copy), as FP32 CPU tensors of the parameter's
        shape, read from the tier now.  Parameters not stepped yet have no entry."""
        self.state.clear()
        try:
            if self._initialized:
                for p, i in self._shard_of.items():
                    step = self._shard_step(i)
                    if step == 0:
                        continue
                    self.state[p] = {"step": torch.tensor(float(step), dtype=torch.float32),
                                     **{k: self._read(i, a, p) for k, a in _ARRAYS.items()}}
            return super().state_dict()
        finally:
            self.state.clear()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads hyper-parameters and state saved by ``state_dict()`` (or by
        ``torch.optim.AdamW``: then the main params come from the parameters' values).
        Does not change the parameters themselves (load the model's state_dict for that)."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
                len(g["params"]) != len(o["params"]) for g, o in zip(groups, self.param_groups)):
            raise InvalidArgumentError("StreamedAdamW.load_state_dict: the parameter groups do not match "
                                          "(number of groups or of parameters per group)")
        super().load_state_dict({"state": {}, "param_groups": groups})
        self._ensure_initialized()
        with self._state_write():
            self._load_state(groups, state_dict["state"])
        self.state.clear()
        self._pushed = [None] * len(self.param_groups)
        self._push_groups()

    def _load_state(self, groups: list, saved: dict) -> None:
        for g, o in zip(groups, self.param_groups):
            for pid, p in zip(g["params"], o["params"]):
                i = self._shard_of[p]
                st = saved.get(pid)
                if st is None:
                    for a in (1, 2):
                        self._write(i, a, torch.zeros(p.shape))
                    self._write(i, 0, self._engine_tensor(p).detach().cpu().float())
                    _check(_load().dfa_opt_set_shard_step(self._handle, i, 0), "dfa_opt_set_shard_step")
                    continue
                for k, a in _ARRAYS.items():
                    src = st.get(k, self._engine_tensor(p).detach().cpu().float() if k == "main_param" else None)
                    if src is None:
                        raise InvalidArgumentError(f"StreamedAdamW.load_state_dict: parameter {pid} has no {k}")
                    if src.numel() != p.numel():
                        raise InvalidArgumentError(f"StreamedAdamW.load_state_dict: {k} of parameter {pid} has "
                                                      f"{src.numel()} elements, the parameter {p.numel()}")
                    self._write(i, a, src)
                _check(_load().dfa_opt_set_shard_step(self._handle, i, int(float(st["step"]))),
                       "dfa_opt_set_shard_step")

    # ---- the step ------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._engine_step(_load().dfa_opt_step, "dfa_opt_step")
        return loss

    @torch.no_grad()
    def step_speculative(self) -> None:
        """``step()``, but the new state of the stepped parameters is kept aside (host tier):
        ``commit_speculation()`` makes it the state (and advances their ``step``),
        ``discard_speculation()`` drops it, leaving state and steps as they were; the
        parameters keep the speculative values until they are stepped again.  The first
        speculative step of a parameter allocates a second pinned copy of its state (2x its
        host memory).  Refused
        (InvalidStateError) for other tiers, resident parameters (``can_speculate``) and
        parameters already pending.  See Note [Speculative steps] in optimizer/streamed_adamw.cpp."""
        self._engine_step(_load().dfa_opt_step_speculative, "dfa_opt_step_speculative")

    def commit_speculation(self) -> None:
        _check(_load().dfa_opt_commit_speculation(self._handle), "dfa_opt_commit_speculation")

    def discard_speculation(self) -> None:
        _check(_load().dfa_opt_discard_speculation(self._handle), "dfa_opt_discard_speculation")

    def speculation_pending(self) -> int:
        """Parameters stepped speculatively and neither committed nor discarded."""
        v = ctypes.c_size_t()
        _check(_load().dfa_opt_speculation_pending(self._handle, ctypes.byref(v)), "dfa_opt_speculation_pending")
        return v.value

    def can_speculate(self, p: torch.Tensor) -> bool:
        """Whether ``step_speculative`` can step ``p`` (host tier, not resident; initializes
        the state, which picks the resident parameters)."""
        self._ensure_initialized()
        return self._can_speculate(self._shard_of[p])

    def _can_speculate(self, shard: int) -> bool:
        v = ctypes.c_int()
        _check(_load().dfa_opt_can_speculate(self._handle, shard, ctypes.byref(v)), "dfa_opt_can_speculate")
        return bool(v.value)

    def _engine_step(self, fn, call: str) -> None:
        """One engine step call over every parameter's ``.grad`` (None: skipped)."""
        t0 = time.perf_counter()
        self._ensure_initialized()
        self._follow_params()
        self._push_groups()
        keep = []
        ptrs, types, dtypes = self._grad_ptrs, self._grad_types, _DTYPE
        # torch checks a .grad's size, dtype and device against its parameter on assignment;
        # what remains to check per step is cheap (see Note [ctypes, not an extension]).
        for i, (p, n) in enumerate(self._numels):
            g = p.grad
            if g is None:
                ptrs[i] = None
                continue
            t = dtypes.get(g.dtype)
            if t is None or g.is_sparse or g.numel() != n:
                raise InvalidArgumentError(f"StreamedAdamW: the gradient of parameter {i} is "
                                              f"{'sparse' if g.is_sparse else f'{g.dtype}, {g.numel()} elements'} "
                                              f"(dense bfloat16 / float16 / float32 of {n} elements expected)")
            if not g.is_contiguous():
                g = g.contiguous()
                keep.append(g)
            ptrs[i] = g.data_ptr()
            types[i] = t
        stream = _stream_ptr(self._stream, self._device)
        t1 = time.perf_counter()
        _check(fn(self._handle, ptrs, len(self._params), types, 1.0, stream), call)
        self._python_seconds = t1 - t0
        del keep

    # ---- the engine's own paths ----------------------------------------------------------------

    def save_checkpoint(self, directory: str) -> None:
        """The engine's checkpoint (fast path: raw FP32 files + a checksummed manifest).
        One step count for all parameters (use state_dict() when some were skipped)."""
        self._ensure_initialized()
        _check(_load().dfa_opt_save_checkpoint(self._handle, directory.encode()), "dfa_opt_save_checkpoint")

    def load_checkpoint(self, directory: str) -> None:
        """Loads save_checkpoint's directory and writes the parameters from the main params."""
        self._follow_params()
        _check(_load().dfa_opt_load_checkpoint(self._handle, directory.encode()), "dfa_opt_load_checkpoint")
        self._initialized = True
        self._pushed = [None] * len(self.param_groups)
        self._push_groups()

    def stats(self) -> dict[str, float]:
        """The last pass (initialize or step): seconds, bytes each way, peak state HBM
        (physical memory behind the state, <= the window), host time split, and
        python_seconds, the Python side of the last step() before the engine call."""
        st = _Stats()
        _check(_load().dfa_opt_get_stats(self._handle, ctypes.byref(st)), "dfa_opt_get_stats")
        out = {name: getattr(st, name) for name, _ in _Stats._fields_}
        out["python_seconds"] = self._python_seconds
        return out
