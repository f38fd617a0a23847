"""A child for the warm-worker tests (tests/supervisor/test_warm_workers.py), run as
`python -m warm_probe MODE [CODE]` or forked by a warm server: it prints what it found at its start as
one JSON line (what was imported before its own code, its signals, its environment), then
    exit CODE    leaves with CODE
    sleep        ticks on stdout every 10 ms until killed (a stopped one stops ticking)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

PRELOADED = {m: m in sys.modules for m in ("torch", "torch._dynamo", "oobleck_slurm.engine.elastic_process")}


def main(argv: list[str]) -> int:
    print(json.dumps({"preloaded": PRELOADED, "pid": os.getpid(), "ppid": os.getppid(), "cpu_s": time.process_time(),
                      "env": os.environ.get("WARM_PROBE"), "cwd": os.getcwd(),
                      "sigusr2_ignored": signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN,
                      "sighup_ignored": signal.getsignal(signal.SIGHUP) == signal.SIG_IGN,
                      "sigchld_default": signal.getsignal(signal.SIGCHLD) == signal.SIG_DFL}), flush=True)
    if argv[0] == "exit":
        sys.stdout.flush()
        os._exit(int(argv[1]))
    while True:
        print("tick", time.time(), flush=True)
        time.sleep(0.01)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
