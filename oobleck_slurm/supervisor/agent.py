"""The node agent: `python -m oobleck_slurm.supervisor.agent JOB_DIR [--node NAME] [--replacement ID]`.

One per node (Slurm: one srun task per node; local backend: a process per virtual node). It connects
to the supervisor over the authenticated control plane, beats every `heartbeat_interval` seconds
(with its workers' process states, so that a SIGSTOPped worker can be named), and obeys:

    start {node_id, workers, threads, device}
                        start this node's workers (engine/elastic_process.py), one per device: worker
                        i of `node_id` gets `threads` CPU threads and, on GPUs, GPU i (set before CUDA
                        initialises, every GPU of the node stays visible for NCCL's peer access)
    stop                SIGKILL the workers (no exit is reported for them)
    drill {how, worker} fault injection: "agent" (kill -9 this agent), "worker" (kill -9 a worker),
                        "hang" (SIGSTOP a worker), "slow" and "leak" (agent_health.py: the node keeps
                        working, slower; its memory grows)
    health {...}        run a short collective with the supervisor (engine and network work here)
    shutdown            stop the workers and exit 0

The node is the failure unit (the planner places pipelines on nodes): the first worker to exit
non-zero is reported as `worker_exit {code, worker}` and the node's other workers are killed at once;
`worker_exit {code: 0}` is reported once every worker finished. `preempt` is relayed when Slurm sends
SIGUSR2 to the job's steps (submitit's `--signal=USR2@90` before the time limit, or a preemption): the
supervisor runs in the batch step, which that signal does not reach. Workers ignore SIGUSR2 (it would
end them). If the supervisor goes away, the job is over: the agent kills its workers and exits, so
that nothing outlives the job on the node. With detection on (`metrics` in supervisor.json), it also
samples its node and sends the metrics (agent_health.py).
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

from oobleck_slurm.protocol.wire import Channel, ProtocolError
from oobleck_slurm.supervisor.agent_health import DRILLS, MetricsReporter, NodeDrills
from oobleck_slurm.supervisor.secret import load_secret
from oobleck_slurm.supervisor.server import connect

SUPERVISOR_FILE = "supervisor.json"  # host, port, heartbeat_interval: written by the supervisor
ADDRESS_WAIT_S = 120.0  # a replacement job may start before the supervisor wrote its address
CONNECT_TIMEOUT_S = 10.0
# Set in every NCCL worker's environment, before torch starts (shared/docs/nccl-notes.md, "Recommended
# design"): torch's watchdog must never act on its own (it sleeps 60 s, then tears the process down);
# the generation design aborts groups itself (engine/abort.py), and a timeout dump key left in the root
# store by one generation must not kill a later process.
NCCL_WORKER_ENV = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
    "TORCH_NCCL_ENABLE_MONITORING": "0",
    "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0",
    "NCCL_NVLS_ENABLE": "0",
}
WATCH_S = 0.02  # how often the worker's exit is polled: bounds process-exit detection


def _die_with_parent() -> None:
    """In the worker, before exec: SIGKILL it when the agent dies, so that no orphan worker of a
    lost node goes on in a job that has moved on without it (Linux prctl PR_SET_PDEATHSIG)."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # Slurm signals every process of the step; the agent relays it


def worker_env(base: dict[str, str] | os._Environ[str], local: int, threads: int, device: str) -> dict[str, str]:
    """Worker `local`'s environment: its CPU thread budget (the node's cores split between its workers,
    so they do not oversubscribe it) and, on GPUs, its device and NCCL's settings (engine/comm.py)."""
    env = dict(base, OMP_NUM_THREADS=str(threads), LOCAL_RANK=str(local), OOBLECK_DEVICE=device)
    if device == "cuda":
        env.update(NCCL_WORKER_ENV)
    return env


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
        self.workers: list[subprocess.Popen] = []  # index = the worker's local index (device)
        self.worker_id: str | None = None  # the node id the supervisor gave this node's workers
        self._lock = threading.Lock()  # the channel is written by the beat loop and the command reader
        self._done = threading.Event()
        self._preempt = threading.Event()  # Slurm's SIGUSR2 arrived: relay it once
        self.drills = NodeDrills(lambda: [w.pid for w in self.workers if w.poll() is None])
        self.channel: Channel = connect(self.address["host"], int(self.address["port"]), load_secret(job_dir),
                                        {"role": "agent", "node": node}, timeout=CONNECT_TIMEOUT_S)
        self.send({"type": "register", "node": node, "replacement": replacement, "pid": os.getpid(),
                   "slurm_job_id": os.environ.get("SLURM_JOB_ID")})

    def send(self, message: dict[str, Any]) -> None:
        with self._lock:
            self.channel.send(message)

    # ---- the workers -----------------------------------------------------------------------------

    def start_workers(self, node_id: str, count: int, threads: int, device: str) -> None:
        if any(w.poll() is None for w in self.workers):
            raise RuntimeError(f"node {self.node} already runs workers of {self.worker_id}")
        self.workers = []
        for local in range(count):
            log = open(self.job_dir / "logs" / f"worker-{node_id}-{local}.log", "ab")  # noqa: SIM115 - the child owns it
            self.workers.append(subprocess.Popen(
                [sys.executable, "-m", "oobleck_slurm.engine.elastic_process", str(self.job_dir), node_id, str(local)],
                stdout=log, stderr=subprocess.STDOUT, env=worker_env(os.environ, local, threads, device),
                preexec_fn=_die_with_parent))
            log.close()
        self.worker_id = node_id

    def stop_workers(self) -> None:
        self.drills.stop()
        workers, self.workers = self.workers, []
        for w in workers:
            if w.poll() is None:
                w.send_signal(signal.SIGKILL)
        for w in workers:
            w.wait()

    def worker_states(self) -> list[str]:
        """psutil's state of each worker ("running", "sleeping", "stopped", ...; "gone" once reaped)."""
        states = []
        with self.drills.workers_running():  # a slow drill's pauses are slowness, not a stopped worker
            for w in self.workers:
                try:
                    states.append(psutil.Process(w.pid).status())
                except psutil.Error:
                    states.append("gone")
        return states

    def _check_workers(self) -> None:
        """Report the node's end: the first worker that failed (its peers are killed: the node is the
        failure unit), or every worker done."""
        if not self.workers:
            return
        codes = [w.poll() for w in self.workers]
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            local, code = failed[0]
            self.stop_workers()
            self.send({"type": "worker_exit", "node": self.node, "node_id": self.worker_id, "code": code,
                       "worker": local})
        elif all(c == 0 for c in codes):
            self.workers = []
            self.send({"type": "worker_exit", "node": self.node, "node_id": self.worker_id, "code": 0})

    # ---- commands ----------------------------------------------------------------------------------

    def _read_commands(self) -> None:
        try:
            while not self._done.is_set():
                message = self.channel.recv()
                kind = message["type"]
                if kind == "start":
                    self.start_workers(str(message["node_id"]), int(message.get("workers", 1)),
                                       int(message.get("threads", 1)), str(message.get("device", "cpu")))
                elif kind == "stop":
                    self.stop_workers()
                elif kind == "health":
                    threading.Thread(target=self._health, args=(message,), daemon=True).start()
                elif kind == "drill":
                    self._drill(str(message.get("how")), int(message.get("worker") or 0))
                elif kind == "shutdown":
                    break
        except (EOFError, OSError, ProtocolError):
            pass  # the supervisor is gone (or dropped us): the job is over for this node
        self._done.set()

    def _drill(self, how: str, worker: int) -> None:
        if how == "agent":
            os.kill(os.getpid(), signal.SIGKILL)  # the workers follow (PR_SET_PDEATHSIG)
        if how in DRILLS:
            self.drills.start(how)
            return
        workers = self.workers
        if 0 <= worker < len(workers) and how in ("worker", "hang"):
            workers[worker].send_signal(signal.SIGKILL if how == "worker" else signal.SIGSTOP)

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
        settings = self.address.get("metrics")
        reporter = MetricsReporter(self.node, settings, self.send, lambda: [w.pid for w in self.workers]).start() \
            if isinstance(settings, dict) else None
        try:
            while not self._done.is_set():
                now = time.time()
                self._check_workers()
                if self._preempt.is_set() and not relayed:
                    relayed = True
                    self.send({"type": "preempt", "node": self.node, "signal": "SIGUSR2", "t": now})
                if now >= next_beat:
                    self.send({"type": "heartbeat", "node": self.node, "workers": self.worker_states(),
                               "cpu": psutil.cpu_percent(interval=None), "t": now})
                    next_beat = now + self.interval
                self._done.wait(WATCH_S)
        except (OSError, ProtocolError):
            pass
        finally:
            if reporter is not None:
                reporter.stop()
            self.stop_workers()
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
