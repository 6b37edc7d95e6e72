"""Process lifecycle of a service started by `echospec serve --processes` (stack.py).

`exit_with_parent` is the first thing each service's ``__main__`` does: when the parent that
started it (named by ECHOSPEC_PARENT_PID) dies in any way, even SIGKILL, the kernel sends this
process SIGTERM (Linux PR_SET_PDEATHSIG), so no service outlives the `echospec serve` that
started it and keeps holding its port. The kernel's trigger is the end of the parent *thread*
that forked the child, so the parent starts its children from its main thread.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys

PARENT_ENV = "ECHOSPEC_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def exit_with_parent() -> None:
    """Ask for SIGTERM when the parent named by ECHOSPEC_PARENT_PID dies; exit at once if it is
    already gone. A no-op without the variable or off Linux."""
    want = os.environ.get(PARENT_ENV)
    if not want or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if str(os.getppid()) != want:   # the parent died before prctl took effect
        os._exit(1)
