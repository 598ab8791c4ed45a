"""The streamed AdamW engine through its C ABI (include/deferalloc/optimizer.h): the one
module that calls libdeferalloc_optimizer.

``Engine`` owns one ``dfa_optimizer`` handle and wraps every entry point: the shards and
groups, initialize, plain and speculative steps (``GradBatch`` marshals the gradient
pointers), commit / discard, state reads and writes, per-shard steps, checkpoints,
progress and statistics.  ``EngineConfig`` fills the typed ``dfa_optimizer_config``
from keyword arguments and the user's settings texts.  ``deferalloc.optim``,
``deferalloc.overlap`` and ``deferalloc.megatron`` reach the engine through
``StreamedAdamW``, which holds an ``Engine``.

Note [Options reach the engine typed]
Rationale: a value given as a keyword argument (a directory, a tier, a size) must mean
exactly that: joined into one settings text, a directory ``".../x,tier:host"`` set the
tier, and a plain comma in a path was refused as a settings syntax error.
Approach: the config is the C struct C users fill (``dfa_opt_config_init`` gives the
defaults).  The user's texts, ``DEFERALLOC_CONF`` first and ``settings=`` last, go through
``dfa_opt_config_apply_text``, the engine's own parser and settings table (the allocator's
keys come back as text for ``allocator_settings``); the keyword arguments are set as typed
fields between the two, so ``settings=`` still overrides them as before.  Nothing a caller
passes as a value is ever parsed.
Limits: the struct's strings point at bytes objects this module keeps alive until
``dfa_opt_create_with_config`` returns (the engine copies them).
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
from typing import Callable

import torch

from ._native import Library, library_path
from .errors import DeferallocError, NoDevice

__all__ = ["Engine", "EngineConfig", "GradBatch", "optimizer_library_path", "DTYPE_CODES", "STATE_ARRAYS"]

# dfa_dtype of the parameter and gradient types the optimizer takes.
DTYPE_CODES = {torch.bfloat16: 0, torch.float32: 1, torch.float16: 2}
# dfa_state_array, by state_dict key.
STATE_ARRAYS = {"main_param": 0, "exp_avg": 1, "exp_avg_sq": 2}


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


class OptimizerConfig(ctypes.Structure):
    """dfa_optimizer_config (versioned by struct_size)."""
    _fields_ = [("struct_size", ctypes.c_size_t), ("driver", ctypes.c_int), ("device", ctypes.c_int),
                ("allocator_settings", ctypes.c_char_p), ("tier", ctypes.c_int), ("directory", ctypes.c_char_p),
                ("window_mb", ctypes.c_uint64), ("depth", ctypes.c_int), ("resume", ctypes.c_int),
                ("rank", ctypes.c_int), ("io_threads", ctypes.c_int), ("io_request_mb", ctypes.c_uint64),
                ("keep_window", ctypes.c_int), ("resident_mb", ctypes.c_uint64), ("moments", ctypes.c_int),
                ("progress_line", ctypes.c_int), ("pass_taper", ctypes.c_int),
                ("pass_chain", ctypes.c_int), ("writeback_queue_mb", ctypes.c_uint64)]


# dfa_progress_fn: phase, done, total, seconds, user.
PROGRESS_FN = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_double,
                               ctypes.c_void_p)

DRIVERS = {"auto": 0, "cuda": 1, "host": 2}
TIERS = {"device": 0, "host": 1, "file": 2}
MOMENTS = {"fp32": 0, "bf16": 1, "int8": 2}


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


def _signatures() -> dict:
    c = ctypes
    P = c.c_void_p
    cfg = c.POINTER(OptimizerConfig)
    return {
        "dfa_opt_last_error": (c.c_char_p, []),
        "dfa_opt_config_init": (c.c_int, [cfg]),
        "dfa_opt_config_apply_text": (c.c_int, [cfg, c.c_char_p, c.c_char_p, c.c_size_t, c.POINTER(c.c_size_t)]),
        "dfa_opt_create_with_config": (c.c_int, [cfg, c.POINTER(P)]),
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


# libdeferalloc_optimizer with its signatures set, opened on first call.
library = Library(optimizer_library_path, _signatures, "dfa_opt_last_error")
_check = library.check


# ---- typed options ---------------------------------------------------------------------------

class EngineConfig:
    """A ``dfa_optimizer_config`` being filled: the engine's defaults, then settings texts
    (``apply_text``) and typed fields (``set``) in the order of the calls, a later one
    overriding an earlier (Note [Options reach the engine typed])."""

    _ENUMS = {"driver": DRIVERS, "tier": TIERS, "moments": MOMENTS}

    def __init__(self):
        self.struct = OptimizerConfig()
        self.struct.struct_size = ctypes.sizeof(OptimizerConfig)
        _check(library().dfa_opt_config_init(ctypes.byref(self.struct)), "dfa_opt_config_init")
        self._keep: list = []  # the bytes the struct's strings point at
        self._rest: list[str] = []  # the allocator's keys of the texts

    def apply_text(self, text: str | None, where: str) -> None:
        """Applies settings text through the engine's table; a bad key or value raises
        InvalidArgument prefixed with ``where`` (the argument the user passed)."""
        if not text:
            return
        lib = library()
        raw = text.encode()
        cap = max(256, 2 * len(raw) + 1)
        while True:
            buf = ctypes.create_string_buffer(cap)
            needed = ctypes.c_size_t()
            status = lib.dfa_opt_config_apply_text(ctypes.byref(self.struct), raw, buf, cap, ctypes.byref(needed))
            if status == 0:
                break
            if needed.value > cap:
                cap = needed.value
                continue
            e = library.error(status, "dfa_opt_config_apply_text")
            raise type(e)(f"{where}: {e}") from None
        if buf.value:
            self._rest.append(buf.value.decode())

    def set(self, **fields) -> None:
        """Typed fields of dfa_optimizer_config by name (driver / tier / moments by their
        names, directory a path); None leaves a field as it is."""
        for name, value in fields.items():
            if value is None:
                continue
            if name in self._ENUMS:
                value = self._ENUMS[name][value]
            elif name == "directory":
                value = os.fsencode(value)
                self._keep.append(value)
            elif isinstance(value, bool):
                value = int(value)
            setattr(self.struct, name, value)

    def field(self, name: str):
        """A field's value: a name for driver / tier / moments, a str for directory (or None)."""
        v = getattr(self.struct, name)
        if name in self._ENUMS:
            return next(k for k, code in self._ENUMS[name].items() if code == v)
        return os.fsdecode(v) if isinstance(v, bytes) else v

    def finish(self) -> OptimizerConfig:
        allocator = ",".join(self._rest).encode()
        self._keep.append(allocator)
        self.struct.allocator_settings = allocator or None
        return self.struct


# ---- one engine ------------------------------------------------------------------------------

class GradBatch:
    """The gradient arguments of one engine step over ``n`` shards: a pointer and a dtype
    code per shard (None: the shard is skipped).  ``set`` takes a dense gradient; a
    non-contiguous one is copied, and the copy kept alive until ``release``."""

    __slots__ = ("ptrs", "types", "n", "_keep", "used")

    def __init__(self, n: int):
        self.n = n
        self.ptrs = (ctypes.c_void_p * n)()  # all None
        self.types = (ctypes.c_int * n)()
        self._keep: list = []
        self.used = False

    def set(self, i: int, g: torch.Tensor) -> None:
        if not g.is_contiguous():
            g = g.contiguous()
            self._keep.append(g)
        self.ptrs[i] = g.data_ptr()
        self.types[i] = DTYPE_CODES[g.dtype]
        self.used = True

    def skip(self, i: int) -> None:
        self.ptrs[i] = None

    def release(self) -> None:
        """Drops the contiguous copies (after the step that read them)."""
        self._keep.clear()


class Engine:
    """One ``dfa_optimizer``: every call of the optimizer's C ABI (optimizer.h says what each
    does).  Destroyed when the Engine is collected, or by ``close()``."""

    def __init__(self, config: EngineConfig):
        import weakref
        lib = library()
        h = ctypes.c_void_p()
        _check(lib.dfa_opt_create_with_config(ctypes.byref(config.finish()), ctypes.byref(h)),
               "dfa_opt_create_with_config")
        self.handle = h
        self._finalizer = weakref.finalize(self, lib.dfa_opt_destroy, h)
        self._progress = None

    def close(self) -> None:
        self._finalizer()

    # ---- shards and groups

    def add_shard(self, ptr: int, numel: int, dtype: torch.dtype, group: int, name: str) -> int:
        index = ctypes.c_size_t()
        _check(library().dfa_opt_add_shard(self.handle, ctypes.c_void_p(ptr), numel, DTYPE_CODES[dtype], group,
                                           name.encode(), ctypes.byref(index)), "dfa_opt_add_shard")
        return index.value

    def set_group(self, group: int, key: tuple) -> None:
        """``key``: (lr, beta1, beta2, eps, weight_decay)."""
        _check(library().dfa_opt_set_group(self.handle, group, ctypes.byref(AdamwParams(*key))), "dfa_opt_set_group")

    def set_shard_param(self, shard: int, ptr: int) -> None:
        _check(library().dfa_opt_set_shard_param(self.handle, shard, ctypes.c_void_p(ptr)), "dfa_opt_set_shard_param")

    # ---- passes

    def initialize(self, stream) -> None:
        _check(library().dfa_opt_initialize(self.handle, stream), "dfa_opt_initialize")

    def sync_model_params(self, stream) -> None:
        _check(library().dfa_opt_sync_model_params(self.handle, stream), "dfa_opt_sync_model_params")

    def step(self, grads: GradBatch, scale: float, stream, speculative: bool = False) -> None:
        lib = library()
        fn, call = ((lib.dfa_opt_step_speculative, "dfa_opt_step_speculative") if speculative
                    else (lib.dfa_opt_step, "dfa_opt_step"))
        _check(fn(self.handle, grads.ptrs, grads.n, grads.types, scale, stream), call)

    def commit_speculation(self) -> None:
        _check(library().dfa_opt_commit_speculation(self.handle), "dfa_opt_commit_speculation")

    def discard_speculation(self) -> None:
        _check(library().dfa_opt_discard_speculation(self.handle), "dfa_opt_discard_speculation")

    def speculation_pending(self) -> int:
        v = ctypes.c_size_t()
        _check(library().dfa_opt_speculation_pending(self.handle, ctypes.byref(v)), "dfa_opt_speculation_pending")
        return v.value

    def can_speculate(self, shard: int) -> bool:
        v = ctypes.c_int()
        _check(library().dfa_opt_can_speculate(self.handle, shard, ctypes.byref(v)), "dfa_opt_can_speculate")
        return bool(v.value)

    # ---- state

    def read(self, shard: int, array: int, shape) -> torch.Tensor:
        """State array ``array`` of ``shard`` as a new FP32 CPU tensor of ``shape``."""
        out = torch.empty(shape, dtype=torch.float32)
        _check(library().dfa_opt_read_state(self.handle, shard, array, 0, out.numel(),
                                            ctypes.c_void_p(out.data_ptr())), "dfa_opt_read_state")
        return out

    def write(self, shard: int, array: int, t: torch.Tensor) -> None:
        t = t.detach().to("cpu", torch.float32).contiguous()
        _check(library().dfa_opt_write_state(self.handle, shard, array, 0, t.numel(), ctypes.c_void_p(t.data_ptr())),
               "dfa_opt_write_state")

    def shard_step(self, shard: int) -> int:
        v = ctypes.c_uint64()
        _check(library().dfa_opt_get_shard_step(self.handle, shard, ctypes.byref(v)), "dfa_opt_get_shard_step")
        return v.value

    def set_shard_step(self, shard: int, step: int) -> None:
        _check(library().dfa_opt_set_shard_step(self.handle, shard, int(step)), "dfa_opt_set_shard_step")

    @contextlib.contextmanager
    def state_write(self):
        """Groups the writes in it into one publish (the file tier commits them at once; an
        exception drops them there)."""
        lib = library()
        _check(lib.dfa_opt_begin_state_write(self.handle), "dfa_opt_begin_state_write")
        try:
            yield
        except BaseException:
            lib.dfa_opt_end_state_write(self.handle, 0)
            raise
        _check(lib.dfa_opt_end_state_write(self.handle, 1), "dfa_opt_end_state_write")

    # ---- checkpoints, progress, statistics

    def save_checkpoint(self, directory: str) -> None:
        _check(library().dfa_opt_save_checkpoint(self.handle, os.fsencode(directory)), "dfa_opt_save_checkpoint")

    def load_checkpoint(self, directory: str) -> None:
        _check(library().dfa_opt_load_checkpoint(self.handle, os.fsencode(directory)), "dfa_opt_load_checkpoint")

    def set_progress(self, fn: Callable[[str, int, int, float], None] | None) -> None:
        """``fn(phase, done, total, seconds)`` after each piece (None: removed)."""
        cb = None if fn is None else PROGRESS_FN(lambda ph, d, t, s, _u: fn(ph.decode(), d, t, s))
        _check(library().dfa_opt_set_progress(self.handle, cb if cb is not None else PROGRESS_FN(), None),
               "dfa_opt_set_progress")
        self._progress = cb  # kept alive while the engine may call it

    def stats(self) -> dict:
        st = OptimizerStats()
        _check(library().dfa_opt_get_stats(self.handle, ctypes.byref(st)), "dfa_opt_get_stats")
        return {name: getattr(st, name) for name, _ in OptimizerStats._fields_}
