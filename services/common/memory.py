"""Giving freed heap memory back to the system.

glibc's malloc keeps what a thread frees in that thread's arena for its next allocation; a
server whose worker threads each decode one large image (hundreds of MB of intermediates, below
the size malloc maps separately) would keep that much per thread long after the requests ended.
``release_freed_memory`` returns those free pages (``malloc_trim(0)``, every arena); elsewhere
(musl, macOS) it does nothing.
"""
from __future__ import annotations

import ctypes
import ctypes.util

_libc = None
_looked = False


def release_freed_memory() -> bool:
    """Return free heap pages to the system; True when the C library could be asked (glibc)."""
    global _libc, _looked
    if not _looked:
        _looked = True
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _libc = lib if hasattr(lib, "malloc_trim") else None
        except OSError:
            _libc = None
    if _libc is None:
        return False
    _libc.malloc_trim(0)
    return True
