"""`kill -USR1` on a supervisor or agent writes every thread's stack to its stderr and it goes on
(oobleck_slurm/stack_dumps.py): a real process, blocked in a thread, is asked twice."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from oobleck_slurm.stack_dumps import STACK_DUMP_SIGNAL

CHILD = """
import sys, threading, time
from oobleck_slurm.stack_dumps import enable_stack_dumps
enable_stack_dumps()
def waiting_for_a_verdict_forever():
    threading.Event().wait()
threading.Thread(target=waiting_for_a_verdict_forever, daemon=True).start()
print("ready", flush=True)
while True:
    time.sleep(0.05)
"""


def test_the_signal_dumps_every_threads_stack_and_the_process_goes_on(tmp_path: Path) -> None:
    err = tmp_path / "err.log"
    with err.open("wb") as stderr:
        proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, stderr=stderr)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        for n in (1, 2):
            os.kill(proc.pid, STACK_DUMP_SIGNAL)
            deadline = time.monotonic() + 30
            while err.read_text().count("waiting_for_a_verdict_forever") < n:
                assert time.monotonic() < deadline, err.read_text()
                time.sleep(0.05)
            assert proc.poll() is None  # it goes on
        assert "Thread 0x" in err.read_text()
    finally:
        proc.kill()
        proc.wait()
