"""The library's log messages in Python's ``logging``: logger ``"deferalloc"``.

Installed when the package loads libdeferalloc.so: from then on the C++ library (core,
optimizer, C ABI) sends each message to ``logging.getLogger("deferalloc")`` instead of
stderr (``dfa_set_log_callback``).  Under torchrun (``RANK`` set) every message starts
with ``[rank N]``.  The library passes messages at or below the logger's effective level
when the bridge is installed; after changing that level, call ``install(lib)`` again
(``deferalloc._logging.install(deferalloc._load())``).  ``DEFERALLOC_PY_LOGGING=0`` keeps
the library's own stderr lines (and its ``log_level`` setting) instead.
"""
from __future__ import annotations

import atexit
import ctypes
import logging
import os

logger = logging.getLogger("deferalloc")

# dfa log levels (1 error .. 4 debug) <-> logging's
_TO_PY = {1: logging.ERROR, 2: logging.WARNING, 3: logging.INFO, 4: logging.DEBUG}
_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
_installed = None  # the ctypes callback object: must outlive every call into it


def _prefix() -> str:
    rank = os.environ.get("RANK")
    return f"[rank {rank}] " if rank is not None else ""


def _deliver(level: int, message: bytes, _user) -> None:
    logger.log(_TO_PY.get(level, logging.WARNING), "%s%s", _prefix(), message.decode(errors="replace"))


def _dfa_level(py_level: int) -> int:
    if py_level <= logging.DEBUG:
        return 4
    if py_level <= logging.INFO:
        return 3
    if py_level <= logging.WARNING:
        return 2
    return 1 if py_level <= logging.ERROR else 0


def install(lib) -> bool:
    """Routes `lib`'s log messages to the ``deferalloc`` logger; False when disabled by
    DEFERALLOC_PY_LOGGING=0.  Cost: one C call."""
    global _installed
    if os.environ.get("DEFERALLOC_PY_LOGGING", "1") == "0":
        return False
    fn = lib.dfa_set_log_callback
    fn.restype = ctypes.c_int
    fn.argtypes = [_CALLBACK, ctypes.c_void_p, ctypes.c_int]
    cb = _CALLBACK(_deliver)
    status = fn(cb, None, _dfa_level(logger.getEffectiveLevel()))
    if status != 0:
        return False
    if _installed is None:
        atexit.register(_uninstall, lib)  # no call into Python once the interpreter is going away
    _installed = cb
    return True


def _uninstall(lib) -> None:
    lib.dfa_set_log_callback(_CALLBACK(), None, 0)
