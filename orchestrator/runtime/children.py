"""Child processes that do not outlive the process that started them.

A SIGKILLed (or OOM-killed) ``ddpbus run`` or ``ddpbus broker`` runs no cleanup: without
this, its nats-server (and the launcher's coordinator and workers, each in a session of its
own) live on as orphans holding ports and a store. On Linux the child asks the kernel to
send it ``sig`` when its parent dies (``prctl(PR_SET_PDEATHSIG)``, set between fork and
exec), and exits at once if the parent died before that.

The kernel sends the signal when the *thread* that forked the child exits, so the tie is
made only for children started from the main thread (whose end is the process's); from
any other thread, and off Linux, children are started as before, untied. (``preexec_fn``
is unsafe with threads because arbitrary Python may take a lock another thread held at
the fork; this one makes two system calls through a function looked up before the fork.)
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def tied_to_parent(sig: signal.Signals) -> Callable[[], None] | None:
    """A ``preexec_fn`` for :class:`subprocess.Popen` that ties the child to this
    process (it gets ``sig`` when this process dies); None where that cannot be done."""
    if not sys.platform.startswith("linux"):
        return None
    if threading.current_thread() is not threading.main_thread():
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here, not in the child
    parent = os.getpid()

    def tie() -> None:  # in the child, between fork and exec: two system calls
        if prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0 and os.getppid() != parent:
            os._exit(1)  # the parent died before the tie was made
    return tie
