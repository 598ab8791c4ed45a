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
Limits: gradients and parameters must be dense and contiguous.  An FP32 parameter is its
own main copy (an edit between steps is what the next step reads); a BF16 / FP16 parameter
edited outside the optimizer is taken into its main at the next step, with a warning.

Example::

    from deferalloc.optim import StreamedAdamW
    opt = StreamedAdamW(model.parameters(), lr=3e-4, weight_decay=0.1, tier="host", window_mb=512)
    for batch in data:
        model(batch).loss.backward()
        opt.step()
        opt.zero_grad()

See docs/OPTIM.md for checkpoints (torch.save, DCP), FSDP2, AMP and torch.compile.
"""
from __future__ import annotations

import functools
import math
import os
import threading
import time
import weakref
from collections.abc import Mapping, MutableMapping
from typing import Any, Callable, Iterable

import torch

from . import _native
from ._logging import logger
from ._engine import STATE_ARRAYS as _ARRAYS, DTYPE_CODES as _DTYPE, Engine, EngineConfig, GradBatch
from ._engine import MOMENTS, TIERS
from ._engine import optimizer_library_path
from .errors import (CorruptData, CudaError, DeferallocError, InternalError, InvalidArgument, InvalidState, IoError,
                     NoDevice, OutOfMemory)


@functools.cache
def _adamw_group_keys() -> frozenset:
    """The keys of this torch's AdamW param groups (2.6's lack decoupled_weight_decay)."""
    return frozenset(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]).defaults)


__all__ = [
    "StreamedAdamW", "OptimizerError", "InvalidArgumentError", "InvalidStateError", "OutOfMemoryError",
    "CudaError", "NoDeviceError", "IOFailure", "CorruptDataError", "InternalError", "optimizer_library_path",
    "resident_budgets",
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

_stream_ptr = _native.stream_ptr
_STATE_KEYS = ("step", "exp_avg", "exp_avg_sq", "main_param")
_MOMENT_BYTES = {"fp32": 8.0, "bf16": 4.0, "int8": 2.125}  # both moments per element, by moment_dtype (optimizer.hpp)

try:
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # a torch built without distributed
    _DTensor = None


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2's parameters and gradients); any other tensor itself."""
    return t._local_tensor if _DTensor is not None and isinstance(t, _DTensor) else t


# Every live StreamedAdamW: deferalloc.memory_snapshot()'s "optimizers" annotation, and the
# refusal of a parameter another one holds (Note [Parameter storage under the optimizer]).
_LIVE: "weakref.WeakSet" = weakref.WeakSet()


def live_optimizers() -> list:
    """Every StreamedAdamW alive now (deferalloc.memory_snapshot() lists their stats)."""
    return list(_LIVE)


# ---- opt.state, the torch way ----------------------------------------------------------------

# Note [opt.state reads through the engine]
# Rationale: whatever reads optimizer state the torch way (DCP's get_state_dict /
# set_state_dict, whose _init_optim_state runs a zero-gradient step when ``opt.state`` is
# empty; Lightning, Accelerate, wrappers' state_dict) must see the engine's state, and a
# copy kept in ``opt.state`` would double the host memory the tiers exist to save (and go
# stale at the next step).
# Approach: ``opt.state`` is a mapping over the parameters the engine holds with a step
# count > 0 (torch's: a parameter has state once stepped); ``opt.state[p]`` is a small
# view whose items are read from the engine on each access (``step`` a float32 scalar
# tensor as torch.optim.AdamW's, the arrays FP32 CPU tensors of the parameter's shape, a
# DTensor with the parameter's mesh and placements for a DTensor parameter) and whose
# assignments (``opt.state[p]["exp_avg"] = t``) are checked and written into the engine.
# A tensor the view returns (for a plain parameter) is a _StateTensor: a fresh CPU copy
# whose in-place changes (``mul_``, ``copy_``, ``+=``, item assignment) write the whole
# array back through the engine when they are made.
# Limits: the returned DTensors of DTensor parameters are copies only (assign them back);
# changes through another view of a _StateTensor (``t[0].zero_()``) are not seen; items
# cannot be deleted (load_state_dict replaces state).


_INPLACE_DUNDERS = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ipow__"}


class _StateTensor(torch.Tensor):
    """A state item read from the engine; in-place changes write it back (Note [opt.state
    reads through the engine]).  Results of other operations are plain tensors."""

    _dfa_back: tuple | None = None  # (weakref to the optimizer, parameter, key)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        target = args[0] if args else None
        name = getattr(func, "__name__", "")
        if (isinstance(target, _StateTensor) and target._dfa_back is not None and
                (name in _INPLACE_DUNDERS or (name.endswith("_") and not name.startswith("_")))):
            ref, p, key = target._dfa_back
            opt = ref()
            if opt is not None:
                opt._write_state_values(p, {key: target._plain()}, "opt.state[p] (changed in place)")
        return out

    def _plain(self) -> torch.Tensor:
        with torch._C.DisableTorchFunctionSubclass():
            return torch.Tensor.clone(self)

    def __reduce_ex__(self, protocol):  # pickled (torch.save) as the plain tensor it holds
        return self._plain().__reduce_ex__(protocol)

    def __deepcopy__(self, memo):  # a copy writes nothing back
        return self._plain()


class _ParamState(MutableMapping):
    """``opt.state[p]``: step, exp_avg, exp_avg_sq, main_param of one held parameter, read
    from the engine on access and written through on assignment (Note [opt.state reads
    through the engine])."""

    __slots__ = ("_opt", "_p")

    def __init__(self, opt: "StreamedAdamW", p: torch.Tensor):
        self._opt, self._p = opt, p

    def _has_state(self) -> bool:
        return self._opt._stepped(self._p)

    def __getitem__(self, key):
        if key not in _STATE_KEYS or not self._has_state():
            raise KeyError(key)
        t = self._opt._state_value(self._p, key)
        if _DTensor is not None and isinstance(t, _DTensor):
            return t
        view = t.as_subclass(_StateTensor)
        view._dfa_back = (weakref.ref(self._opt), self._p, key)
        return view

    def __setitem__(self, key, value) -> None:
        if key not in _STATE_KEYS:
            raise KeyError(f"StreamedAdamW state holds {', '.join(_STATE_KEYS)} only, not {key!r}")
        self._opt._write_state_values(self._p, {key: value}, "opt.state[p]")

    def __delitem__(self, key) -> None:
        raise InvalidStateError("StreamedAdamW: the state of a held parameter cannot be deleted "
                                "(load_state_dict replaces it)")

    def __iter__(self):
        return iter(_STATE_KEYS if self._has_state() else ())

    def __len__(self) -> int:
        return len(_STATE_KEYS) if self._has_state() else 0

    def __repr__(self) -> str:
        return f"<StreamedAdamW state of a {tuple(self._p.shape)} parameter: {list(self)}>"


class _EngineState(MutableMapping):
    """``opt.state``: parameter -> _ParamState for every held parameter that has state.
    Looking up any other parameter gives an empty dict, as torch's defaultdict does."""

    __slots__ = ("_ref",)

    def __init__(self, opt: "StreamedAdamW"):
        # A weak reference: the optimizer holds this mapping, and a cycle would keep a
        # deleted optimizer (its engine, its state file's lock) alive until the next gc.
        self._ref = weakref.ref(opt)

    @property
    def _opt(self) -> "StreamedAdamW":
        opt = self._ref()
        if opt is None:
            raise InvalidStateError("StreamedAdamW: opt.state of an optimizer that was deleted")
        return opt

    def __getitem__(self, p):
        if self._opt._has_state_slot(p):
            return _ParamState(self._opt, p)
        return {}

    def __contains__(self, p) -> bool:
        return self._opt._has_state_slot(p) and self._opt._stepped(p)

    def __setitem__(self, p, value) -> None:
        if not self._opt._has_state_slot(p):
            raise InvalidArgumentError("StreamedAdamW: opt.state[p] = ... for a parameter without state "
                                       "(not in the optimizer, or frozen at construction)")
        if not isinstance(value, Mapping):
            raise InvalidArgumentError("StreamedAdamW: opt.state[p] takes a mapping of step / exp_avg / exp_avg_sq "
                                       "/ main_param")
        self._opt._write_state_values(p, value, "opt.state[p]")

    def __delitem__(self, p) -> None:
        raise InvalidStateError("StreamedAdamW: the state of a held parameter cannot be deleted "
                                "(load_state_dict replaces it)")

    def __iter__(self):
        return iter([p for p in self._opt._trainable if self._opt._stepped(p)])

    def __len__(self) -> int:
        return sum(1 for p in self._opt._trainable if self._opt._stepped(p))

    def __repr__(self) -> str:
        return f"<StreamedAdamW state: {len(self)} of {len(self._opt._trainable)} trainable parameters stepped>"


# ---- checks of values from outside (state dicts, opt.state assignments) ------------------------

def _group_key(g: Mapping, where: str) -> tuple:
    """(lr, beta1, beta2, eps, weight_decay) of a param group, checked as the engine and
    torch.optim.AdamW check them; refuses groups of another optimizer kind.  Checked here
    too because load_state_dict pushes them after the state (Note [Arguments are checked
    where they enter] in docs/DESIGN.md)."""
    missing = [k for k in ("lr", "betas", "eps", "weight_decay") if k not in g]
    if missing:
        raise InvalidArgumentError(f"{where}: not an AdamW param group (no {', '.join(map(repr, missing))}; "
                                   f"saved by another kind of optimizer?)")
    for key in ("amsgrad", "maximize"):
        if g.get(key):
            raise InvalidArgumentError(f"{where}: {key}=True is not supported (torch._fused_adamw_'s plain AdamW only)")
    if g.get("decoupled_weight_decay") is False and float(g["weight_decay"]) != 0.0:
        raise InvalidArgumentError(f"{where}: Adam with L2 weight decay (decoupled_weight_decay=False), not AdamW")
    betas = g["betas"]
    if isinstance(betas, (str, bytes)) or not hasattr(betas, "__len__") or len(betas) != 2:
        raise InvalidArgumentError(f"{where}: betas={betas!r} (two numbers, (beta1, beta2), expected)")
    try:
        key = (float(g["lr"]), float(betas[0]), float(betas[1]), float(g["eps"]), float(g["weight_decay"]))
    except (TypeError, ValueError, RuntimeError) as e:
        raise InvalidArgumentError(f"{where}: a hyper-parameter is not a number ({e})") from None
    lr, b1, b2, eps, wd = key
    for ok, what in ((math.isfinite(lr) and lr >= 0, f"lr={g['lr']!r} (a finite number >= 0 expected)"),
                     (0 <= b1 < 1 and 0 <= b2 < 1, f"betas={tuple(betas)!r} (each in [0, 1) expected)"),
                     (eps >= 0, f"eps={g['eps']!r} (>= 0 expected)"),
                     (wd >= 0, f"weight_decay={g['weight_decay']!r} (>= 0 expected)")):
        if not ok:
            raise InvalidArgumentError(f"{where}: {what}")
    return key


def _choice(name: str, value, choices: tuple) -> str:
    """A named option (tier, moment_dtype) checked against its choices, naming the argument."""
    if value not in choices:
        raise InvalidArgumentError(f"StreamedAdamW: {name}={value!r} ({', '.join(choices)} expected)")
    return value


def _whole_mb(name: str, v) -> int | None:
    """A size in MiB as the typed field takes it (a whole float converts; None stays None);
    its upper bound is the engine's to check (Note [Arguments are checked where they enter]
    in docs/DESIGN.md)."""
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v != int(v) or v < 0:
        raise InvalidArgumentError(f"StreamedAdamW: {name}={v!r} (a whole number of MiB >= 0 expected)")
    return int(v)


# Note [resident_mb="auto"]
# Rationale: the resident shards' HBM (Note [Resident shards] in optimizer/resident.cpp) is
# what the process does not need otherwise; a caller rarely knows that figure, and two
# callers (StreamedAdamW, deferalloc.megatron for each DistributedOptimizer of a chain) must
# not each take all of it.
# Approach: one rule, resident_budgets(): "auto" is the device's free HBM at the call
# (torch's cache counts as taken) less a tenth of the device (activations) and one window
# per optimizer being built, on the host tier and on the file tier with fp32 moments (where
# resident shards are also committed to the state file: Note [Resident shards on the file
# tier] in optimizer/resident.cpp); 0 off CUDA, on the device tier and on the file tier with
# compressed moments (the engine refuses a number there).  A number is that many MiB.  The budget is shared by the optimizers built together, each getting its part in
# proportion to the elements it holds (rounded down to whole MiB): StreamedAdamW is one
# optimizer, a Megatron ChainedOptimizer (dense + expert DistributedOptimizers) one per
# member.
# Limits: measured once, at construction; the engine picks the resident shards when the
# state is created, never again.  A member whose shards fit in less than its part leaves
# the rest unused (the others do not take it).


def resident_budgets(resident_mb, tier: str, window_mb: int | None, device: torch.device,
                     shares=(1,), moment_dtype: str = "fp32") -> list[int | None]:
    """``resident_mb`` (whole MiB, None or "auto") split over optimizers on ``tier`` with
    moments in ``moment_dtype`` built together whose held elements are ``shares``: each
    one's resident_mb (Note [resident_mb="auto"]).
    @throws InvalidArgumentError for a resident_mb that is not a whole number of MiB >= 0 or "auto"."""
    if resident_mb == "auto":
        mb = 0
        if device.type == "cuda" and (tier == "host" or (tier == "file" and moment_dtype == "fp32")):
            free, total = torch.cuda.mem_get_info(device)
            mb = max(0, (free - total // 10) // (1 << 20) - (window_mb or 0) * len(shares))
    else:
        mb = _whole_mb("resident_mb", resident_mb)
    if mb is None:
        return [None] * len(shares)
    whole = sum(shares)
    return [mb * n // whole if whole else 0 for n in shares]


class _ProgressToLogger:
    """progress=True: the engine's progress_line lines through the ``deferalloc`` logger
    (INFO): the first after _PROGRESS_AFTER_S seconds of a pass, then one every 10 s, and
    the last."""

    def __init__(self):
        self._pass = None  # (phase, seconds of its last line, or -1 before one)

    def __call__(self, phase: str, done: int, total: int, seconds: float) -> None:
        if self._pass is None or self._pass[0] != phase or self._pass[1] > seconds:
            self._pass = (phase, -1.0)  # a new pass
        last = self._pass[1]
        due = last < 0 or seconds - last > 10.0 or done == total
        if seconds > _PROGRESS_AFTER_S and due:
            self._pass = (phase, seconds)
            logger.info("%s %5.1f%%  %.2f Gparam/s", phase, 100.0 * done / max(total, 1),
                         done / seconds / 1e9 if seconds > 0 else 0.0)


_PROGRESS_AFTER_S = 1.0


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
# Limits: a storage replaced between two calls is followed at the next call only; its
# values are the next step's (an FP32 parameter is its own main; a 16-bit one's edit is
# detected by the engine, Note [Edits of 16-bit parameters]).


# Note [Overlap steps settle first]
# Rationale: a BackwardOverlap (deferalloc.overlap) steps buckets on its worker thread,
# and with a model its step() returns before they are done (the next forward waits per
# module).  A state_dict(), opt.state read, checkpoint or load in that gap read the state
# of some shards stepped and others not, or wrote under a running step: a checkpoint
# silently mixed two steps.
# Approach: an overlap registers itself in its optimizer's _overlaps (a weak set); every
# public call that reads or writes the state or the parameters (step, state_dict,
# load_state_dict, opt.state, checkpoints, sync_main_from_params, add_param_group) first
# waits for the overlaps' queued steps (_quiesce), except on an overlap's own worker.  The
# model's state_dict() waits too (a hook the overlap registers).  A bucket step holds the
# storages the engine writes (_follow_params(hold=)), so a parameter whose storage is
# replaced while its step runs (p.data = ...) never has freed memory written.
# Limits: a parameter read or replaced directly (p.data, p.clone()) between step() and
# the next forward is not waited for: it may hold the step in part, and a replaced
# storage misses the step that was running; call the overlap's synchronize() first.


def _span(t: torch.Tensor) -> tuple:
    return (t.device, t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())


class StreamedAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias correction; ``torch._fused_adamw_``'s arithmetic)
    with FP32 main params and moments streamed from ``tier`` each step.

    Args:
        params, lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (param groups may set
            their own; schedulers may change them between steps).
        tier: "host" (pinned host memory), "file" (``directory``), or "device" (HBM).
        moment_dtype: how the host and file tiers store the Adam moments: "fp32" (exact torch AdamW),
            "bf16" (round to nearest even, 8 B/param moved each way instead of 12) or
            "int8" (block-scaled 8-bit floats, ~6 B/param); the arithmetic stays FP32.  A
            state file keeps the format it was created with (another one is refused at
            resume); int8 on the file tier needs window_mb >= 12 * depth.
        resident_mb: host and file tiers: HBM (MiB) for parameters whose FP32 state stays
            resident (taken in order while they fit; the rest stream), or "auto": the free HBM
            at construction less the window and a tenth of the device (for activations; Note
            [resident_mb="auto"]).  On the file tier resident parameters are still written to
            the state file at every step (12 B/param out, none in), so a resume is exact; it
            needs moment_dtype "fp32" there ("auto" gives 0 with compressed moments).
        window_mb: HBM budget of the streamed state (host and file tiers), whole MiB.
        depth: pieces in flight (3 overlaps fetch, step and write-back; more lets fetches run
            ahead over parameters of mixed sizes).  None: 8 on the host tier, 3 on the file
            tier, fewer if the window holds fewer.
        resume: file tier: continue from the state file's last committed step.
        overwrite: file tier: replace an existing state file (without ``resume`` or
            ``overwrite`` an existing one is refused: its state would be lost).
        stream: a ``torch.cuda.Stream`` (or cudaStream_t as int) the step is ordered
            after; default: the current stream at each step.
        settings: extra "key:value" settings of the engine (optimizer.h).
        progress: ``progress(phase, done, total, seconds)`` after each piece, or True: the
            engine's progress lines (initialize, long steps) through the ``deferalloc`` logger.
        main_param_in_state_dict: ``state_dict()`` carries each parameter's FP32
            ``main_param`` (exact resumption of BF16/FP16 params).  False: torch.optim.AdamW's
            keys only, as needed to load a torch.optim.AdamW checkpoint through DCP (main
            params then come from the loaded parameters).

    BF16, FP16 and FP32 parameters; a parameter whose ``.grad`` is None is skipped (its
    ``step`` stays).  ``amsgrad``, ``maximize``, ``capturable`` and ``differentiable``
    are refused.  The state is created at the first ``step()`` (or ``load_state_dict``)
    from the parameters' values then.  Parameters with ``requires_grad=False`` at
    construction (frozen ``nn.Parameter`` objects) get no state and no memory; one that is unfrozen later is
    refused at the step (build the optimizer again).  DTensor parameters (FSDP2's
    ``fully_shard``) are held as their local shards, and their state is DTensors of the
    same placements.  ``opt.state`` reads through the engine (Note [opt.state reads
    through the engine]).  ``torch.amp.GradScaler`` drives the step as it drives torch's
    fused AdamW (``grad_scale`` / ``found_inf``), for FP16 and BF16 parameters.

    Example::

        opt = StreamedAdamW(model.parameters(), lr=1e-4, tier="host", window_mb=256)
        loss.backward(); opt.step(); opt.zero_grad()
        torch.save(opt.state_dict(), "opt.pt")              # FP32 CPU tensors, torch's layout
        opt.load_state_dict(torch.load("opt.pt"))           # all or nothing
    """

    _step_supports_amp_scaling = True  # torch.amp.GradScaler: sets grad_scale / found_inf (see step)

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, amsgrad: bool = False, maximize: bool = False,
                 foreach: bool | None = None, fused: bool | None = None, capturable: bool = False,
                 differentiable: bool = False, tier: str = "host", directory: str | None = None,
                 window_mb: int = 512, depth: int | None = None, resume: bool = False, overwrite: bool = False,
                 stream=None, settings: str | None = None, moment_dtype: str = "fp32",
                 resident_mb: int | str | None = None,
                 progress: Callable[[str, int, int, float], None] | bool | None = None,
                 main_param_in_state_dict: bool = True):
        window_mb = _whole_mb("window_mb", window_mb)
        if resident_mb != "auto":
            resident_mb = _whole_mb("resident_mb", resident_mb)
        if resume and overwrite:
            raise InvalidArgumentError("StreamedAdamW: resume=True and overwrite=True contradict each other")
        # torch.optim.AdamW's keys, so that DCP finds every key of one in a checkpoint of the other.
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
                        foreach=foreach, capturable=capturable, differentiable=differentiable, fused=fused)
        if "decoupled_weight_decay" in _adamw_group_keys():
            defaults["decoupled_weight_decay"] = True
        self._engine = None
        super().__init__(params, defaults)
        held = [p for g in self.param_groups for p in g["params"] if self._holds(p) and _local(p).numel() > 0]
        if not held:
            raise InvalidArgumentError("StreamedAdamW: no parameters to train (none given, or every one has "
                                       "requires_grad=False)")
        devices = {p.device for p in held}
        if len(devices) != 1:
            raise InvalidArgumentError(f"StreamedAdamW: parameters on several devices {sorted(map(str, devices))}")
        self._device = devices.pop()
        if self._device.type not in ("cuda", "cpu"):
            raise InvalidArgumentError(f"StreamedAdamW: parameters on {self._device} (cuda or cpu expected)")
        self._stream = stream
        self.main_param_in_state_dict = bool(main_param_in_state_dict)
        (resident_mb,) = resident_budgets(resident_mb, tier, window_mb, self._device, moment_dtype=moment_dtype)
        config = self._engine_config(tier=tier, directory=directory, window_mb=window_mb, depth=depth,
                                     resume=resume, moment_dtype=moment_dtype, resident_mb=resident_mb,
                                     settings=settings)
        if config.field("tier") == "file" and not config.field("resume") and not overwrite:
            self._refuse_existing_state_file(config)
        self._engine = Engine(config)
        self.tier, self._moment_dtype = config.field("tier"), config.field("moments")  # settings= may set them
        if progress is True:
            progress = _ProgressToLogger()
        if progress:
            self._engine.set_progress(progress)
        self._shard_of: dict[torch.Tensor, int] = {}
        self._params: list[torch.Tensor] = []  # held parameters, in shard order
        self._trainable: list[torch.Tensor] = []  # held ones and empty local shards, in group order
        self._empty: dict[torch.Tensor, int] = {}  # an empty local shard (FSDP2) -> its step count
        self._unheld: list[torch.Tensor] = []  # frozen at construction
        self._pushed: list[tuple | None] = []
        self._bound: list[tuple] = []  # (data_ptr, dtype, numel) per held parameter (Note [Parameter storage under the optimizer])
        self._overlaps: "weakref.WeakSet" = weakref.WeakSet()  # BackwardOverlaps stepping it (Note [Overlap steps settle first])
        self._initialized = False
        self._python_seconds = 0.0
        self._lock = threading.RLock()  # one engine call sequence at a time (steps, the lazy start)
        for gi, g in enumerate(self.param_groups):
            self._register(gi, g["params"])
        self._push_groups()
        if self.state_view:
            self.state = _EngineState(self)
        if resume:
            self._resume()
        _LIVE.add(self)

    @staticmethod
    def _holds(p: torch.Tensor) -> bool:
        """Whether ``p`` trains: not a frozen ``nn.Parameter`` (requires_grad=False at
        construction; a plain tensor, whose ``.grad`` is set by hand, trains).  The engine
        holds those with local elements; an empty local shard (FSDP2 with fewer rows than
        ranks) keeps only a step count here, so that every rank has the same state keys."""
        return p.requires_grad or not isinstance(p, torch.nn.Parameter)

    def _has_state_slot(self, p) -> bool:
        return p in self._shard_of or p in self._empty

    def _engine_config(self, *, tier, directory, window_mb, depth, resume, moment_dtype, resident_mb,
                       settings) -> EngineConfig:
        """The engine's typed options (Note [Options reach the engine typed] in _engine.py): this
        process's rank in the default process group (the state file's name), then
        DEFERALLOC_CONF, then the arguments and the parameters' device, then ``settings``."""
        config = EngineConfig()
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            config.set(rank=dist.get_rank())
        config.apply_text(os.environ.get("DEFERALLOC_CONF", ""), "DEFERALLOC_CONF")
        if self._device.type == "cpu" and config.field("driver") == "cuda":
            raise NoDeviceError("StreamedAdamW: DEFERALLOC_CONF sets driver:cuda, but the parameters are on the CPU "
                                "(the host driver steps CPU tensors): move the model to a GPU, or drop driver:cuda")
        config.set(driver="cuda" if self._device.type == "cuda" else "host", device=self._device.index or 0,
                   tier=_choice("tier", tier, tuple(TIERS)), directory=directory,
                   window_mb=window_mb, depth=depth, resume=resume,
                   moments=_choice("moment_dtype", moment_dtype, tuple(MOMENTS)), resident_mb=resident_mb)
        config.apply_text(settings, f"StreamedAdamW(settings={settings!r})")
        return config

    @staticmethod
    def _refuse_existing_state_file(config: EngineConfig) -> None:
        """``overwrite`` is never passed down: the file the settings name is refused here.
        No directory: the engine refuses the file tier (Note [Arguments are checked where
        they enter] in docs/DESIGN.md)."""
        directory = config.field("directory")
        if not directory:
            return
        path = os.path.join(directory, f"deferalloc-rank{config.field('rank')}.state")
        if os.path.exists(path):
            raise InvalidStateError(f"StreamedAdamW: {path} holds optimizer state already: pass resume=True to "
                                    f"continue from it, or overwrite=True to replace it")

    def _register(self, gi: int, params: list[torch.Tensor]) -> None:
        """Gives the engine group ``gi``'s held parameters (before its state exists)."""
        held = [p for p in params if self._holds(p) and _local(p).numel() > 0]
        self._refuse_shared_params(held)
        for k, p in enumerate(held):  # every check before the engine is given any of them
            t = self.engine_tensor(p)
            if t.numel() != _local(p).numel() or t.dtype not in _DTYPE or not t.is_contiguous():
                raise InvalidArgumentError(f"StreamedAdamW: the engine tensor of group{gi}.param"
                                           f"{len(self._params) + k} has {t.numel()} {t.dtype} elements "
                                           f"(contiguous, {_local(p).numel()} expected)")
        for p in params:
            if not self._holds(p):
                self._unheld.append(p)
                continue
            self._trainable.append(p)
            if _local(p).numel() == 0:
                self._empty[p] = 0
                continue
            t = self.engine_tensor(p)
            self._engine.add_shard(t.data_ptr(), t.numel(), t.dtype, gi, f"group{gi}.param{len(self._params)}")
            self._shard_of[p] = len(self._params)
            self._params.append(p)
            self._bound.append((t.data_ptr(), t.dtype, t.numel()))
        self._pushed.append(None)
        n = len(self._params)
        self._numels = [(p, _local(p).numel()) for p in self._params]
        self._grads = GradBatch(n)

    def _refuse_shared_params(self, new: list[torch.Tensor], when: str | None = None) -> None:
        """Note [Parameter storage under the optimizer]: no two parameters (of this one, the
        ``new`` ones it is about to hold, or a live StreamedAdamW's) share bytes.  ``when``:
        a change after construction (InvalidStateError naming it) rather than an argument."""
        error = InvalidArgumentError if when is None else InvalidStateError
        suffix = "" if when is None else f" ({when})"
        spans = [(_span(self.engine_tensor(p)), i, self) for i, p in enumerate([*self._params, *new])]
        for other in list(_LIVE):
            if other is not self and getattr(other, "_engine", None) is not None:
                spans += [(_span(other.engine_tensor(p)), i, other) for i, p in enumerate(getattr(other, "_params", ()))]
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
                    raise error(f"StreamedAdamW: parameters {i} and {j} overlap in memory{suffix} (views of one "
                                f"storage); each would keep its own state and overwrite the other")
                mine, theirs = (i, j) if oa is self else (j, i)
                raise error(f"StreamedAdamW: parameter {mine} is already held by another live StreamedAdamW{suffix} "
                            f"(its parameter {theirs} shares its memory); one optimizer per parameter (delete the "
                            f"other first)")

    def _quiesce(self) -> None:
        """Note [Overlap steps settle first]: waits for the bucket steps of every
        BackwardOverlap over this optimizer (not on an overlap's own worker)."""
        for ov in list(getattr(self, "_overlaps", ())):
            ov.synchronize()  # (returns at once on the overlap's own worker)

    def _follow_params(self, hold: list | None = None, shards: set | None = None) -> None:
        """Note [Parameter storage under the optimizer]: follows replaced storages of the
        same dtype and numel, refuses other changes.  ``hold`` gets, for each shard of
        ``shards``, a tensor holding the storage the engine is bound to from here on (a
        storage replaced during the step that follows stays alive until ``hold`` goes)."""
        moved = []
        for i, p in enumerate(self._params):
            t = self.engine_tensor(p)
            if hold is not None and i in shards:
                t = t.detach()  # one snapshot: p.data may be replaced by another thread
                hold.append(t)
            ptr, dtype, numel = self._bound[i]
            if t.data_ptr() == ptr and t.dtype == dtype and t.numel() == numel and t.is_contiguous():
                continue
            if t.dtype != dtype or t.numel() != numel:
                raise InvalidStateError(
                    f"StreamedAdamW: parameter {i} changed from {numel} {dtype} elements to {t.numel()} {t.dtype} "
                    f"after the optimizer was built (m.half() / m.to(dtype)?); the optimizer keeps the state of the "
                    f"old parameters: build a new StreamedAdamW after converting the model (load_state_dict carries "
                    f"the state over)")
            if not t.is_contiguous():
                raise InvalidStateError(
                    f"StreamedAdamW: parameter {i} is no longer contiguous (p.data = p.data.t()?): its elements "
                    f"would no longer be in its gradient's order; assign a contiguous tensor (p.data = "
                    f"x.contiguous())")
            moved.append((i, t))
        if moved:
            # A new storage may be another held parameter's (p1.data = p0.data): refused
            # before the engine is pointed at it.
            self._refuse_shared_params([], when="after a parameter's storage was replaced")
            for i, t in moved:
                self._engine.set_shard_param(i, t.data_ptr())
                self._bound[i] = (t.data_ptr(), t.dtype, t.numel())

    def __getstate__(self):
        raise TypeError("StreamedAdamW cannot be pickled or copied (copy.deepcopy, torch.save(opt)): its state "
                        "lives in the engine, outside Python.  Save opt.state_dict() and load it into a new "
                        "StreamedAdamW with load_state_dict.")

    # ---- groups and hyper-parameters ---------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As ``torch.optim.Optimizer.add_param_group``, before the first ``step()`` (or
        load / resume).  Refused after it (InvalidStateError): the engine lays out its state
        once, for the parameters it holds then; a parameter that becomes trainable later
        needs a new optimizer (``state_dict`` / ``load_state_dict`` carry the rest over)."""
        self._quiesce()
        if getattr(self, "_engine", None) is not None and self._initialized:
            raise InvalidStateError("StreamedAdamW.add_param_group: the state exists already (created at the first "
                                    "step, load_state_dict or resume) and its parameters are fixed; build a new "
                                    "optimizer with every parameter that will train and load_state_dict into it")
        for key, why in (("amsgrad", "amsgrad"), ("maximize", "maximize"), ("capturable", "capturable"),
                         ("differentiable", "differentiable")):
            if param_group.get(key, self.defaults.get(key)):
                raise InvalidArgumentError(f"StreamedAdamW: {why}=True is not supported (torch._fused_adamw_'s "
                                           f"plain AdamW only)")
        super().add_param_group(param_group)
        try:  # all or nothing: a refused group is not kept
            gi = len(self.param_groups) - 1
            group = self.param_groups[gi]
            _group_key(group, f"StreamedAdamW: param group {gi}")
            for p in group["params"]:
                if not p.requires_grad and isinstance(p, torch.nn.Parameter):
                    continue  # frozen: never held, so any dtype or layout
                t = _local(p)
                if t.dtype not in _DTYPE:
                    raise InvalidArgumentError(f"StreamedAdamW: parameter dtype {t.dtype} (bfloat16, float16 or "
                                               f"float32 expected)")
                if not t.is_contiguous():
                    raise InvalidArgumentError("StreamedAdamW: parameters must be contiguous")
                if p.numel() == 0:
                    raise InvalidArgumentError("StreamedAdamW: an empty parameter")
            if getattr(self, "_engine", None) is not None:
                if any(self._holds(p) and p.device != self._device for p in group["params"]):
                    raise InvalidArgumentError(f"StreamedAdamW.add_param_group: parameters not on {self._device}")
                self._register(gi, group["params"])
        except BaseException:
            self.param_groups.pop()
            raise

    def _group_keys(self) -> list[tuple]:
        """Each group's hyper-parameters as the engine takes them (lr, beta1, beta2, eps,
        weight_decay), a snapshot, checked (a scheduler or the user may have set them)."""
        return [_group_key(g, f"StreamedAdamW: param group {gi}") for gi, g in enumerate(self.param_groups)]

    def _push_groups(self, keys: list[tuple] | None = None) -> None:
        """Gives the engine the groups' hyper-parameters (``keys``: a snapshot of
        ``_group_keys()``; default: the current ones) where they changed."""
        for gi, key in enumerate(self._group_keys() if keys is None else keys):
            if key != self._pushed[gi]:
                self._engine.set_group(gi, key)
                self._pushed[gi] = key

    # ---- state ---------------------------------------------------------------------------------

    def _resume(self) -> None:
        # File tier with resume: a committed state file is taken as is, and the parameters
        # are written from its main params; without one, the state starts at the first step.
        self._follow_params()
        try:
            self.initialize_state()
        except InvalidStateError:
            self._engine.sync_model_params(_stream_ptr(self._stream, self._device))
            self._initialized = True

    def sync_main_from_params(self) -> None:
        """Re-derives the FP32 main params from the parameters' current values (moments and
        steps are kept): after model weights were replaced behind the optimizer's back."""
        self._quiesce()
        if not self._initialized:
            return
        for p, i in self._shard_of.items():
            self._engine.write(i, 0, self.engine_tensor(p).detach().cpu().float())

    def _stepped(self, p: torch.Tensor) -> bool:
        """Whether held parameter ``p`` has state (torch's sense: stepped, or loaded)."""
        self._quiesce()
        if p in self._empty:
            return self._empty[p] > 0
        return self._initialized and self._engine.shard_step(self._shard_of[p]) > 0

    def _state_value(self, p: torch.Tensor, key: str) -> torch.Tensor:
        """One state item of held parameter ``p``, read from the engine now."""
        self._quiesce()
        if key == "step":
            step = self._empty[p] if p in self._empty else self._engine.shard_step(self._shard_of[p])
            return torch.tensor(float(step), dtype=torch.float32)
        if p in self._empty:
            t = torch.empty(_local(p).shape, dtype=torch.float32)
        else:
            t = self._engine.read(self._shard_of[p], _ARRAYS[key], _local(p).shape)
        if _DTensor is not None and isinstance(p, _DTensor):
            # A DTensor over the CPU tensor, on the parameter's mesh, made as FSDP2 makes its
            # CPU-offloaded parameters (DTensor.from_local would copy it to the mesh's device).
            from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
            spec = DTensorSpec(p.device_mesh, p.placements, tensor_meta=TensorMeta(p.shape, p.stride(), t.dtype))
            return _DTensor(t, spec, requires_grad=False)
        return t

    def _local_values(self, p: torch.Tensor, value, key: str, where: str) -> torch.Tensor:
        """``value`` for state array ``key`` of held parameter ``p``, checked (a floating
        tensor of the parameter's shape; for a DTensor parameter a DTensor of its local shape
        or a full tensor, of which the local shard is taken) as an FP32 CPU tensor."""
        if not isinstance(value, torch.Tensor):
            raise InvalidArgumentError(f"{where}: {key} is a {type(value).__name__}, not a tensor")
        if not value.is_floating_point():
            raise InvalidArgumentError(f"{where}: {key} has dtype {value.dtype} (a floating dtype expected)")
        local = _local(p)
        if _DTensor is not None and isinstance(value, _DTensor):
            value = value.to_local()
        elif _DTensor is not None and isinstance(p, _DTensor) and tuple(value.shape) == tuple(p.shape):
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
            shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            value = value[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
        if tuple(value.shape) != tuple(local.shape):
            raise InvalidArgumentError(f"{where}: {key} has shape {tuple(value.shape)}, the parameter "
                                       f"{tuple(local.shape)}")
        return value.detach().to("cpu", torch.float32).contiguous()

    def _checked_state(self, p: torch.Tensor, st: Mapping, where: str, partial: bool = False) -> dict:
        """A parameter's state from outside, checked: {"step": int, array index: FP32 CPU
        tensor}; a missing main_param comes from the parameter.  ``partial``: only the items
        given (an opt.state assignment)."""
        if not isinstance(st, Mapping):
            raise InvalidArgumentError(f"{where}: the state is a {type(st).__name__}, not a mapping")
        unknown = sorted(map(str, set(st) - set(_STATE_KEYS)))
        if unknown:
            raise InvalidArgumentError(f"{where}: state keys {unknown} are not AdamW's (step, exp_avg, exp_avg_sq, "
                                       f"main_param): saved by another kind of optimizer?")
        missing = [k for k in ("step", "exp_avg", "exp_avg_sq") if k not in st]
        if missing and not partial:
            raise InvalidArgumentError(f"{where}: no {', '.join(missing)}")
        out: dict = {}
        if "step" in st:
            out["step"] = _native.checked_step(st["step"], where)
        for key, a in _ARRAYS.items():
            if key in st:
                out[a] = self._local_values(p, st[key], key, where)
            elif key == "main_param" and not partial:
                out[a] = self.engine_tensor(p).detach().cpu().float()
        if out.get("step") == 0 and any(a in out and bool(out[a].any()) for a in (1, 2)):
            # The engine keeps state from the first step on: step 0 means "not stepped",
            # and moments that were set would vanish from state_dict() unseen.
            raise InvalidArgumentError(f"{where}: step 0 with non-zero exp_avg / exp_avg_sq (a parameter that "
                                       f"was never stepped has zero moments): give its step count, or zero moments")
        return out

    def _apply_state(self, p: torch.Tensor, st: dict) -> None:
        """Writes a checked state (_checked_state) into the engine."""
        if p in self._empty:
            self._empty[p] = st.get("step", self._empty[p])
            return
        i = self._shard_of[p]
        for a, t in st.items():
            if a != "step":
                self._engine.write(i, a, t)
        if "step" in st:
            self._engine.set_shard_step(i, st["step"])

    def _write_state_values(self, p: torch.Tensor, values: Mapping, where: str) -> None:
        """opt.state assignments: checked, then written through."""
        self._quiesce()
        st = self._checked_state(p, values, where, partial=True)
        self._refuse_while_speculating(where)
        self.initialize_state()
        self._apply_state(p, st)

    def _refuse_while_speculating(self, where: str) -> None:
        # The engine refuses its own shards' writes; this covers the empty local shards only
        # Python holds too (Note [Arguments are checked where they enter] in docs/DESIGN.md).
        if self._initialized and self.speculation_pending():
            raise InvalidStateError(f"{where}: a speculative step is pending (commit or discard it first)")

    def state_dict(self) -> dict[str, Any]:
        """torch's layout: per parameter ``step`` (float32 scalar), ``exp_avg``, ``exp_avg_sq``
        and ``main_param`` (the FP32 main copy; see ``main_param_in_state_dict``), as FP32
        CPU tensors of the parameter's shape (DTensors for DTensor parameters), read from the
        tier now.  Parameters not stepped yet (and frozen ones) have no entry."""
        self._quiesce()
        keys = [k for k in _STATE_KEYS if k != "main_param" or self.main_param_in_state_dict]
        snapshot = {p: {k: self._state_value(p, k) for k in keys} for p in self._trainable if self._stepped(p)}
        view, self.state = self.state, snapshot
        try:
            return super().state_dict()
        finally:
            self.state = view

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads hyper-parameters and state saved by ``state_dict()`` (or by
        ``torch.optim.AdamW``: then the main params come from the parameters' values), all
        or nothing: groups (count, sizes, AdamW hyper-parameters), state keys, shapes,
        dtypes and step counts are checked before anything changes, and a refused dict
        leaves the optimizer as it was.  Does not change the parameters themselves (load the
        model's state_dict for that, first)."""
        self._quiesce()
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            out = hook(self, state_dict)
            if out is not None:
                state_dict = out
        where = "StreamedAdamW.load_state_dict"
        if not isinstance(state_dict, Mapping) or "param_groups" not in state_dict:
            raise InvalidArgumentError(f"{where}: not an optimizer state dict (no 'param_groups')")
        groups, saved = state_dict["param_groups"], state_dict.get("state", {})
        if not isinstance(saved, Mapping):
            raise InvalidArgumentError(f"{where}: 'state' is a {type(saved).__name__}, not a mapping")
        if len(groups) != len(self.param_groups) or any(
                len(g.get("params", ())) != len(o["params"]) for g, o in zip(groups, self.param_groups)):
            raise InvalidArgumentError(f"{where}: the parameter groups do not match (number of groups or of "
                                       f"parameters per group: {[len(g.get('params', ())) for g in groups]} saved, "
                                       f"{[len(o['params']) for o in self.param_groups]} here)")
        keys = [_group_key(g, f"{where}: param group {gi}") for gi, g in enumerate(groups)]
        writes = []
        for g, o in zip(groups, self.param_groups):
            for pid, p in zip(g["params"], o["params"]):
                st = saved.get(pid)
                if not self._has_state_slot(p):
                    if st:
                        raise InvalidArgumentError(f"{where}: parameter {pid!r} has state, but this optimizer holds "
                                                   f"none for it (requires_grad=False at construction)")
                    continue
                if st is None:  # never stepped: fresh state from the parameter
                    fresh = {"step": 0, 1: torch.zeros(_local(p).shape), 2: torch.zeros(_local(p).shape),
                             0: self.engine_tensor(p).detach().cpu().float()}
                    writes.append((p, fresh))
                else:
                    writes.append((p, self._checked_state(p, st, f"{where}: parameter {pid!r}")))
        self._refuse_while_speculating(where)
        # Everything is checked: from here on only the engine's own failures (I/O) can stop it.
        self.initialize_state()
        with self._engine.state_write():  # one publish: a kill leaves the old state or the new (Note [State writes])
            for p, st in writes:
                self._apply_state(p, st)
        # The hyper-parameters change only once the state is in (a failed write keeps both).
        self._pushed = [None] * len(self.param_groups)
        self._push_groups(keys)
        kept = ("params", "param_names", "capturable", "differentiable", "foreach", "fused")
        self.param_groups[:] = [{**o, **{k: v for k, v in g.items() if k not in kept}, "params": o["params"]}
                                for g, o in zip(groups, self.param_groups)]
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    # ---- the step ------------------------------------------------------------------------------

    # Note [step under torch.compile]
    # Rationale: the step is one call into the engine through ctypes, which TorchDynamo
    # cannot trace; a training step compiled with torch.compile that calls opt.step() must
    # still run it, as it runs torch's optimizers.
    # Approach: step() is torch.compiler.disable'd: Dynamo ends the graph before it (a graph
    # break), runs it eagerly, and compiles what follows as a new graph; the model's forward
    # and backward stay compiled.
    # Limits: fullgraph=True over a function that calls step() is refused by Dynamo (it
    # allows no graph break): compile the model (or forward + backward) and call step()
    # outside, as torch recommends for optimizers that are not traceable.
    @torch.compiler.disable
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        """One AdamW step of every held parameter with a ``.grad`` (see the class docstring;
        under GradScaler see ``_amp_scale``).  ``closure`` as torch's optimizers."""
        self._quiesce()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        scale = self._amp_scale()
        if scale is not None:
            self._engine_step(scale)
            for p in self._empty:
                if p.grad is not None:
                    self._empty[p] += 1
        return loss

    def _amp_scale(self) -> float | None:
        """The factor of the gradients under torch.amp.GradScaler's protocol for fused
        optimizers (it sets ``grad_scale`` and ``found_inf`` before ``step()``): None when
        an inf/NaN was found (no parameter is stepped and no step count advances, as in
        torch's fused AdamW), else 1 / grad_scale (1 without a scaler).  Reads both values
        on the host (one synchronization).  The engine multiplies by the reciprocal where
        torch's kernel divides: the same for GradScaler's power-of-two scales."""
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and float(found_inf) != 0.0:
            return None
        grad_scale = getattr(self, "grad_scale", None)
        return 1.0 if grad_scale is None else 1.0 / float(grad_scale)

    @torch.no_grad()
    def step_speculative(self) -> None:
        """``step()``, but the new state of the stepped parameters is kept aside (host and
        file tiers): ``commit_speculation()`` makes it the state (and advances their
        ``step``), ``discard_speculation()`` drops it, leaving state and steps as they were.
        The first speculative step of a parameter allocates a second pinned copy of its
        state (2x its host memory).  Refused (InvalidStateError) for the device tier,
        resident parameters (``can_speculate``) and parameters already pending.  See Note
        [Speculative steps] in optimizer/speculation.cpp."""
        self._quiesce()
        self._engine_step(1.0, speculative=True)

    def commit_speculation(self) -> None:
        self._engine.commit_speculation()

    def discard_speculation(self) -> None:
        self._engine.discard_speculation()

    def speculation_pending(self) -> int:
        """Parameters stepped speculatively and neither committed nor discarded."""
        return self._engine.speculation_pending()

    def can_speculate(self, p: torch.Tensor) -> bool:
        """Whether ``step_speculative`` can step ``p`` (host or file tier, not resident;
        initializes the state, which picks the resident parameters)."""
        self.initialize_state()
        return self._engine.can_speculate(self._shard_of[p])

    def _check_grad(self, i: int, g: torch.Tensor, n: int) -> None:
        # torch checks a .grad's size, dtype and device against its parameter on assignment;
        # what remains to check per step is cheap (see Note [ctypes, not an extension]).
        if g.dtype not in _DTYPE or g.is_sparse or g.numel() != n:
            raise InvalidArgumentError(f"StreamedAdamW: the gradient of parameter {i} is "
                                       f"{'sparse' if g.is_sparse else f'{g.dtype}, {g.numel()} elements'} "
                                       f"(dense bfloat16 / float16 / float32 of {n} elements expected)")

    def _engine_step(self, scale: float, speculative: bool = False) -> None:
        """One engine step over every held parameter's ``.grad`` (None: skipped; a
        DTensor's local shard), each multiplied by ``scale``."""
        with self._lock:
            t0 = time.perf_counter()
            self.initialize_state()
            self._follow_params()
            self._push_groups()
            grads = self._grads
            for i, (p, n) in enumerate(self._numels):
                g = p.grad
                if g is None:
                    grads.skip(i)
                    continue
                g = _local(g)
                self._check_grad(i, g, n)
                grads.set(i, g)
            for p in self._unheld:
                if p.grad is not None and _local(p.grad).numel() > 0:
                    raise InvalidStateError("StreamedAdamW: a parameter that had requires_grad=False when the "
                                            "optimizer was built has a gradient: frozen parameters get no state; "
                                            "build the optimizer again (load_state_dict carries the state over)")
            stream = _stream_ptr(self._stream, self._device)
            t1 = time.perf_counter()
            try:
                self._engine.step(grads, scale, stream, speculative)
            finally:
                grads.release()
            self._python_seconds = t1 - t0

    # ---- hooks for deferalloc.overlap and subclasses ----------------------------------------------
    # Note [StreamedAdamW's hooks]
    # Rationale: deferalloc.overlap steps buckets of parameters on its own thread, and
    # deferalloc.megatron's subclass holds handles whose engine tensor is another tensor;
    # both go through these documented members, never through the optimizer's private ones.
    # Approach: read-only views (device, held_params, state_initialized), the state of one
    # held parameter as plain FP32 CPU tensors (read_shard_state / write_shard_state, step
    # counts), the hyper-parameters as snapshots, and step_grads, one engine pass over given
    # gradients.  A subclass may override engine_tensor and set state_view = False.
    # Limits: step_grads and the shard-state calls do not wait for overlaps (an overlap's
    # worker calls them): outside one, call synchronize() on the overlaps first.

    state_view = True  # opt.state reads through the engine (False: a subclass keeps torch's dict)

    @property
    def device(self) -> torch.device:
        """The device of the held parameters (cuda or cpu)."""
        return self._device

    @property
    def held_params(self) -> tuple:
        """The parameters the engine holds (frozen and empty ones not), in its shard order."""
        return tuple(self._params)

    @property
    def state_initialized(self) -> bool:
        """Whether the engine's state exists (first step, load, or resume)."""
        return self._initialized

    def initialize_state(self) -> None:
        """Creates the engine's state from the parameters' values now, unless it exists."""
        if self._initialized:
            return
        with self._lock:  # two threads' first steps: one initialize
            if not self._initialized:
                self._follow_params()
                self._engine.initialize(_stream_ptr(self._stream, self._device))
                self._initialized = True

    def hyperparameters(self) -> list[tuple]:
        """Each group's (lr, beta1, beta2, eps, weight_decay) as the engine takes them, now."""
        return self._group_keys()

    def sync_hyperparameters(self) -> None:
        """Gives the engine every group's hyper-parameters again."""
        self._pushed = [None] * len(self.param_groups)
        self._push_groups()

    def engine_tensor(self, p: torch.Tensor) -> torch.Tensor:
        """The tensor the engine updates in place for parameter ``p``: ``p`` itself (its
        local shard for a DTensor); a subclass may name another of the same size
        (deferalloc.megatron: a BF16 model shard for an FP32 main-param handle that holds
        no memory)."""
        return _local(p)

    def shard_step(self, p: torch.Tensor) -> int:
        """The engine's step count of held parameter ``p`` (0 before its state exists)."""
        return self._engine.shard_step(self._shard_of[p]) if self._initialized else 0

    def set_shard_step(self, p: torch.Tensor, step: int) -> None:
        """Sets held parameter ``p``'s step count (creates the state first)."""
        self.initialize_state()
        self._engine.set_shard_step(self._shard_of[p], _native.checked_step(step, "set_shard_step"))

    def read_shard_state(self, p: torch.Tensor) -> dict:
        """Held parameter ``p``'s step (int) and its main_param, exp_avg and exp_avg_sq as FP32
        CPU tensors of its local shape, read now (creates the state first)."""
        self.initialize_state()
        i, shape = self._shard_of[p], _local(p).shape
        return {"step": self._engine.shard_step(i), **{k: self._engine.read(i, a, shape) for k, a in _ARRAYS.items()}}

    def write_shard_state(self, p: torch.Tensor, state: Mapping) -> None:
        """Writes the items of ``state`` (step, main_param, exp_avg, exp_avg_sq; any subset)
        into held parameter ``p``'s state; sizes are checked, values are not."""
        self.initialize_state()
        i, n = self._shard_of[p], _local(p).numel()
        for k, a in _ARRAYS.items():
            t = state.get(k)
            if t is None:
                continue
            if t.numel() != n:
                raise InvalidArgumentError(f"StreamedAdamW: {k} has {t.numel()} elements, the parameter {n}")
            self._engine.write(i, a, t)
        if state.get("step") is not None:
            self._engine.set_shard_step(i, _native.checked_step(state["step"], "write_shard_state"))

    def attach_overlap(self, overlap) -> None:
        """Registers an object whose ``synchronize()`` every call that reads or writes the
        state or the parameters waits for first (Note [Overlap steps settle first])."""
        self._overlaps.add(overlap)

    def detach_overlap(self, overlap) -> None:
        self._overlaps.discard(overlap)

    def step_grads(self, grads: list, *, speculative=frozenset(), hyperparameters: list | None = None,
                   stream=None) -> None:
        """One engine pass over ``grads``, (held parameter, dense gradient) pairs: those whose
        parameter is in ``speculative`` by the engine's speculative step, the others by a plain
        step; ``hyperparameters`` a ``hyperparameters()`` snapshot (default: now); ordered
        after ``stream`` (default: the optimizer's).  Storage replaced under the optimizer is
        followed, and what the pass writes is held alive until it returns (Note [Overlap
        steps settle first])."""
        with self._lock:
            keep: list = []
            self._follow_params(hold=keep, shards={self._shard_of[p] for p, _ in grads})
            n = len(self._params)
            spec, plain = GradBatch(n), GradBatch(n)
            for p, g in grads:
                (spec if p in speculative else plain).set(self._shard_of[p], g)
            self._push_groups(hyperparameters)
            s = _stream_ptr(stream if stream is not None else self._stream, self._device)
            if spec.used:
                self._engine.step(spec, 1.0, s, speculative=True)
            if plain.used:
                self._engine.step(plain, 1.0, s)
            del keep

    # ---- the engine's own paths ----------------------------------------------------------------

    def save_checkpoint(self, directory: str) -> None:
        """The engine's checkpoint (fast path: raw FP32 files + a checksummed manifest).
        One step count for all parameters (use state_dict() when some were skipped)."""
        self._quiesce()
        self.initialize_state()
        self._engine.save_checkpoint(directory)

    def load_checkpoint(self, directory: str) -> None:
        """Loads save_checkpoint's directory and writes the parameters from the main params."""
        self._quiesce()
        self._follow_params()
        self._engine.load_checkpoint(directory)
        self._initialized = True
        self.sync_hyperparameters()

    def stats(self) -> dict[str, float]:
        """The last pass (initialize or step): seconds, bytes each way, peak state HBM
        (physical memory behind the state, <= the window), host time split, and
        python_seconds, the Python side of the last step() before the engine call;
        state_params, the elements the engine holds state for (frozen parameters none),
        and state_bytes, their state's bytes on the tier (12 per element with FP32 moments, 8 for an
        FP32 parameter, which is its own main, outside the file tier)."""
        out = self._engine.stats()
        out["python_seconds"] = self._python_seconds
        out["state_params"] = sum(n for _, n in self._numels)
        # The moments, and an FP32 main per element except where the parameter is its own main
        # (an FP32 parameter; the file tier keeps a durable copy of it all the same).
        moments = _MOMENT_BYTES[self._moment_dtype]
        out["state_bytes"] = int(sum(n * (moments + (0 if self.tier != "file" and self.engine_tensor(p).dtype ==
                                                      torch.float32 else 4)) for p, n in self._numels))
        return out
