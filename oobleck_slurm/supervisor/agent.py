"""The node agent: `python -m oobleck_slurm.supervisor.agent JOB_DIR [--node NAME] [--replacement ID]`.

One per node (Slurm: one srun task per node; local backend: a process per virtual node). It connects
to the supervisor over the authenticated control plane, beats every `heartbeat_interval` seconds
(with its worker's process state, so that a SIGSTOPped worker can be named), and obeys:

    start {node_id}     start this node's elastic worker (engine/elastic_process.py) as `node_id`
    stop                SIGKILL the worker (no exit is reported for it)
    drill {how}         fault injection: "agent" (kill -9 this agent), "worker" (kill -9 the worker),
                        "hang" (SIGSTOP the worker)
    health {...}        run a short collective with the supervisor (engine and network work here)
    shutdown            stop the worker and exit 0

and reports `worker_exit {code}`, and `preempt` when Slurm sends SIGUSR2 to the job's steps (submitit's
`--signal=USR2@90` before the time limit, or a preemption): the supervisor runs in the batch step,
which that signal does not reach. The worker ignores SIGUSR2 (it would end it). If the supervisor goes away, the job is over: the agent kills its
worker and exits, so that nothing outlives the job on the node.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from oobleck_slurm.supervisor.protocol import Channel, ProtocolError
from oobleck_slurm.supervisor.secret import load_secret
from oobleck_slurm.supervisor.server import connect

SUPERVISOR_FILE = "supervisor.json"  # host, port, heartbeat_interval: written by the supervisor
ADDRESS_WAIT_S = 120.0  # a replacement job may start before the supervisor wrote its address
CONNECT_TIMEOUT_S = 10.0
WATCH_S = 0.02  # how often the worker's exit is polled: bounds process-exit detection


def _die_with_parent() -> None:
    """In the worker, before exec: SIGKILL it when the agent dies, so that no orphan worker of a
    lost node goes on in a job that has moved on without it (Linux prctl PR_SET_PDEATHSIG)."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # Slurm signals every process of the step; the agent relays it


def node_name(explicit: str | None = None) -> str:
    """This node's name: given, else Slurm's (hostname is the same on every virtual node of a lab)."""
    return explicit or os.environ.get("SLURMD_NODENAME") or os.uname().nodename


def read_address(job_dir: Path, wait_s: float = ADDRESS_WAIT_S) -> dict[str, Any]:
    path = job_dir / SUPERVISOR_FILE
    deadline = time.time() + wait_s
    while True:
        try:
            return json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            if time.time() > deadline:
                raise RuntimeError(f"{path}: no supervisor address after {wait_s:g} s") from None
            time.sleep(0.2)


class Agent:
    def __init__(self, job_dir: Path, node: str, replacement: str | None = None) -> None:
        self.job_dir, self.node, self.replacement = job_dir, node, replacement
        self.address = read_address(job_dir)
        self.interval = float(self.address["heartbeat_interval"])
        self.worker: subprocess.Popen | None = None
        self.worker_id: str | None = None
        self._lock = threading.Lock()  # the channel is written by the beat loop and the command reader
        self._done = threading.Event()
        self._preempt = threading.Event()  # Slurm's SIGUSR2 arrived: relay it once
        self.channel: Channel = connect(self.address["host"], int(self.address["port"]), load_secret(job_dir),
                                        {"role": "agent", "node": node}, timeout=CONNECT_TIMEOUT_S)
        self.send({"type": "register", "node": node, "replacement": replacement, "pid": os.getpid(),
                   "slurm_job_id": os.environ.get("SLURM_JOB_ID")})

    def send(self, message: dict[str, Any]) -> None:
        with self._lock:
            self.channel.send(message)

    # ---- the worker ------------------------------------------------------------------------------

    def start_worker(self, node_id: str) -> None:
        if self.worker is not None and self.worker.poll() is None:
            raise RuntimeError(f"node {self.node} already runs worker {self.worker_id} (pid {self.worker.pid})")
        log = open(self.job_dir / "logs" / f"node{node_id}.log", "ab")  # noqa: SIM115 - the child owns it
        self.worker = subprocess.Popen(
            [sys.executable, "-m", "oobleck_slurm.engine.elastic_process", str(self.job_dir), node_id],
            stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"),
            preexec_fn=_die_with_parent)
        log.close()
        self.worker_id = node_id

    def stop_worker(self) -> None:
        w, self.worker = self.worker, None
        if w is not None and w.poll() is None:
            w.send_signal(signal.SIGKILL)
            w.wait()

    def worker_state(self) -> str:
        if self.worker is None:
            return "none"
        try:
            return psutil.Process(self.worker.pid).status()
        except psutil.Error:
            return "gone"

    # ---- commands ----------------------------------------------------------------------------------

    def _read_commands(self) -> None:
        try:
            while not self._done.is_set():
                message = self.channel.recv()
                kind = message["type"]
                if kind == "start":
                    self.start_worker(str(message["node_id"]))
                elif kind == "stop":
                    self.stop_worker()
                elif kind == "health":
                    threading.Thread(target=self._health, args=(message,), daemon=True).start()
                elif kind == "drill":
                    self._drill(str(message.get("how")))
                elif kind == "shutdown":
                    break
        except (EOFError, OSError, ProtocolError):
            pass  # the supervisor is gone (or dropped us): the job is over for this node
        self._done.set()

    def _drill(self, how: str) -> None:
        if how == "agent":
            os.kill(os.getpid(), signal.SIGKILL)  # the worker follows (PR_SET_PDEATHSIG)
        w = self.worker
        if w is not None and how in ("worker", "hang"):
            w.send_signal(signal.SIGKILL if how == "worker" else signal.SIGSTOP)

    def _health(self, message: dict[str, Any]) -> None:
        t0 = time.time()
        done = subprocess.run(
            [sys.executable, "-m", "oobleck_slurm.supervisor.health", message["host"], str(message["port"]),
             message["prefix"], str(message["timeout"])],
            capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), check=False,
            timeout=float(message["timeout"]) + 60)
        self.send({"type": "health_result", "node": self.node, "ok": done.returncode == 0,
                   "seconds": time.time() - t0, "detail": (done.stdout + done.stderr).strip()[-500:]})

    # ---- the loop ----------------------------------------------------------------------------------

    def run(self) -> int:
        threading.Thread(target=self._read_commands, name="agent-commands", daemon=True).start()
        signal.signal(signal.SIGUSR2, lambda signum, frame: self._preempt.set())
        relayed = False
        next_beat = 0.0
        try:
            while not self._done.is_set():
                now = time.time()
                w = self.worker
                if w is not None and (code := w.poll()) is not None:
                    self.worker = None
                    self.send({"type": "worker_exit", "node": self.node, "node_id": self.worker_id, "code": code})
                if self._preempt.is_set() and not relayed:
                    relayed = True
                    self.send({"type": "preempt", "node": self.node, "signal": "SIGUSR2", "t": now})
                if now >= next_beat:
                    self.send({"type": "heartbeat", "node": self.node, "worker": self.worker_state(),
                               "cpu": psutil.cpu_percent(interval=None), "t": now})
                    next_beat = now + self.interval
                self._done.wait(WATCH_S)
        except (OSError, ProtocolError):
            pass
        finally:
            self.stop_worker()
            self.channel.close()
        return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="oobleck_slurm.supervisor.agent", description=__doc__.split("\n\n")[0])
    parser.add_argument("job_dir", type=Path)
    parser.add_argument("--node", default=None, help="node name (default: $SLURMD_NODENAME)")
    parser.add_argument("--replacement", default=None, help="the node id the supervisor asked Slurm for")
    args = parser.parse_args(argv)
    try:
        agent = Agent(args.job_dir.resolve(), node_name(args.node), args.replacement)
    except Exception as err:  # noqa: BLE001 - reported plainly; srun's log keeps it
        print(f"agent: cannot reach the supervisor: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    return agent.run()


if __name__ == "__main__":
    raise SystemExit(main())
