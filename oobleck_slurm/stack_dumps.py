"""Every thread's Python stack on demand, for a supervisor or agent that seems stuck.

`kill -USR1 PID` makes the process write each of its threads' stacks to its stderr (the supervisor's
and the agents' logs: docs/troubleshooting.md) and go on: Python's faulthandler writes them from the
signal handler itself, so a thread that holds the GIL in C code, or a lock that every Python thread
waits for, does not stop the dump. A worker's stacks are collected by the hang verdict instead
(supervisor/hang_dumps.py), into the job folder.
"""

from __future__ import annotations

import faulthandler
import signal
import sys

STACK_DUMP_SIGNAL = signal.SIGUSR1  # Slurm's notices use SIGUSR2 and SIGTERM (supervisor/preemption.py)


def enable_stack_dumps() -> None:
    """From now on, STACK_DUMP_SIGNAL dumps every thread's stack to stderr (a file descriptor that
    stays valid: faulthandler keeps it, not the Python object)."""
    faulthandler.register(STACK_DUMP_SIGNAL, file=sys.stderr, all_threads=True, chain=False)
