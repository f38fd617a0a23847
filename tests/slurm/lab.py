"""Control and fault injection for the local Slurm lab started by tests/slurm/start.sh.

The lab runs one ``slurmd -N nodeX`` per virtual node on this machine. "Killing a node" means what
losing a machine means to Slurm and to the job: its slurmd, its slurmstepds and every task they run
disappear at once. They are found without trusting process names alone:

- slurmd: the node's pid file ``$LAB/run/slurmd-nodeX.pid`` (its command name checked);
- slurmstepd: they daemonise away from slurmd, but each keeps the node's log file
  ``$LAB/log/slurmd-nodeX.log`` open;
- tasks: the descendants of those stepds, plus any process whose environment says it is a job
  process of this node of this lab (``SLURMD_NODENAME=nodeX`` and ``SLURM_CONF=$LAB/slurm.conf``),
  which also finds tasks that left their stepd's process tree.

node1..node4 form the cluster. node5..node8 are spares: declared in slurm.conf, DOWN with reason
"spare" until :meth:`SlurmLab.start_spare` starts their slurmd and resumes them (a "replacement
node" that joins the same partition), and :meth:`SlurmLab.stop_spare` puts them back.

Command line: ``python tests/slurm/lab.py {status|kill|start|start-spare|stop-spare|reset} [NODE]``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil

from oobleck_slurm.cluster.slurm import parse_scontrol_records

LAB_ENV = "OOBLECK_SLURM_LAB"
DEFAULT_LAB = Path("/tmp/oobleck-slurm-lab")
CLUSTER_NODES = ("node1", "node2", "node3", "node4")
SPARE_NODES = ("node5", "node6", "node7", "node8")
SPARE_REASON = "spare"


class LabError(RuntimeError):
    """The lab is not in the state a call needs (a daemon down, a timeout, a failed command)."""


# ---------------------------------------------------------------------------------------------
# Pure parsing (no I/O)


def node_records(text: str) -> dict[str, dict[str, str]]:
    """Node name -> its ``scontrol show node -o`` fields."""
    return {r["NodeName"]: r for r in parse_scontrol_records(text) if "NodeName" in r}


def state_flags(record: dict[str, str]) -> frozenset[str]:
    """``State=DOWN+NOT_RESPONDING`` -> ``{"DOWN", "NOT_RESPONDING"}``.

    scontrol spells the flags out, where sinfo appends '*' and the like: that is why it is parsed.
    """
    return frozenset(record.get("State", "UNKNOWN").split("+"))


def is_idle(flags: frozenset[str]) -> bool:
    """Up, responding, schedulable and running nothing."""
    bad = {"NOT_RESPONDING", "DRAIN", "COMPLETING", "FAIL", "POWERED_DOWN", "POWERING_UP"}
    return "IDLE" in flags and not flags & bad


def is_down(flags: frozenset[str]) -> bool:
    """Slurm has given up on the node (or an admin took it out)."""
    return bool(flags & {"DOWN", "FAIL"})


def is_not_responding(flags: frozenset[str]) -> bool:
    """Slurm noticed the node is silent (it turns DOWN later), or already marked it DOWN."""
    return "NOT_RESPONDING" in flags or is_down(flags)


def is_up(flags: frozenset[str]) -> bool:
    """Responding and not DOWN (it may be running jobs or draining)."""
    return not is_not_responding(flags)


# Names for wait_node(node, until=...).
CONDITIONS: dict[str, Callable[[frozenset[str]], bool]] = {
    "idle": is_idle, "down": is_down, "not_responding": is_not_responding, "up": is_up,
}


# ---------------------------------------------------------------------------------------------
# Processes


def _alive(proc: psutil.Process) -> bool:
    """Zombies count as dead: here they wait for the container's init to reap them."""
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _depth(proc: psutil.Process) -> int:
    """How many ancestors the process has (0 once it is gone)."""
    try:
        return len(proc.parents())
    except psutil.Error:
        return 0


def _wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while (left := [p for p in procs if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


class SlurmLab:
    """The running lab in ``folder`` (default: ``$OOBLECK_SLURM_LAB`` or /tmp/oobleck-slurm-lab)."""

    def __init__(self, folder: str | os.PathLike[str] | None = None) -> None:
        self.folder = Path(folder or os.environ.get(LAB_ENV) or DEFAULT_LAB)
        self.conf = self.folder / "slurm.conf"
        self.nodes: tuple[str, ...] = CLUSTER_NODES
        self.spare_nodes: tuple[str, ...] = SPARE_NODES

    def __repr__(self) -> str:
        return f"SlurmLab({str(self.folder)!r})"

    @property
    def env(self) -> dict[str, str]:
        """os.environ plus SLURM_CONF: what Slurm clients and daemons of this lab need."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    # -- Slurm commands ------------------------------------------------------------------------

    def run(self, *args: str, timeout: float = 30) -> str:
        """Run a Slurm client command against this lab; its stdout, or LabError with its stderr."""
        try:
            done = subprocess.run(
                args, env=self.env, capture_output=True, text=True, timeout=timeout, check=False
            )
        except subprocess.TimeoutExpired as err:
            raise LabError(f"{' '.join(args)}: no answer after {timeout}s") from err
        if done.returncode != 0:
            raise LabError(f"{' '.join(args)} failed (exit {done.returncode}): {done.stderr.strip()}")
        return done.stdout

    def node_record(self, node: str) -> dict[str, str]:
        """The node's ``scontrol show node -o`` fields."""
        self._check_node(node)
        return node_records(self.run("scontrol", "show", "node", "-o", node))[node]

    def node_states(self) -> dict[str, frozenset[str]]:
        """State flags of every node of the lab, spares included."""
        records = node_records(self.run("scontrol", "show", "node", "-o"))
        return {name: state_flags(record) for name, record in records.items()}

    def node_state(self, node: str) -> frozenset[str]:
        """State flags of one node, e.g. ``{"IDLE"}`` or ``{"DOWN", "NOT_RESPONDING"}``."""
        return state_flags(self.node_record(node))

    def wait_node(
        self, node: str, until: str | Callable[[frozenset[str]], bool], timeout: float = 60
    ) -> float:
        """Poll the node's state until ``until`` holds ("idle", "up", "not_responding", "down",
        or a predicate on the state flags); return the seconds it took."""
        if isinstance(until, str):
            if until not in CONDITIONS:
                raise LabError(f"unknown node condition {until!r}; expected one of {', '.join(CONDITIONS)}")
            until = CONDITIONS[until]
        start = time.monotonic()
        while not until(flags := self.node_state(node)):
            if time.monotonic() - start > timeout:
                raise LabError(
                    f"{node}: state {'+'.join(sorted(flags))} still not {until.__name__} "
                    f"after {timeout}s; see {self.folder}/log/slurmd-{node}.log"
                )
            time.sleep(0.1)
        return time.monotonic() - start

    def set_down(self, node: str, reason: str = "test") -> None:
        """``scontrol update state=down``: takes effect at once, as an admin would."""
        self._check_node(node)
        self.run("scontrol", "update", f"nodename={node}", "state=down", f"reason={reason}")

    def resume(self, node: str) -> None:
        """``scontrol update state=resume``."""
        self._check_node(node)
        self.run("scontrol", "update", f"nodename={node}", "state=resume")

    def job_ids(self) -> list[str]:
        """Jobs Slurm still tracks as pending, running or completing."""
        return self.run("squeue", "-h", "-o", "%A").split()

    # -- node processes ------------------------------------------------------------------------

    def slurmd_process(self, node: str) -> psutil.Process | None:
        """The node's running slurmd, from its pid file; None when it is not running."""
        self._check_node(node)
        try:
            pid = int((self.folder / "run" / f"slurmd-{node}.pid").read_text().strip())
            proc = psutil.Process(pid)
            if proc.name() == "slurmd" and _alive(proc):
                return proc
        except (OSError, ValueError, psutil.Error):
            pass
        return None

    def node_processes(self, node: str) -> list[psutil.Process]:
        """The node's slurmd, slurmstepds and job processes (see the module docstring)."""
        self._check_node(node)
        log = str(self.folder / "log" / f"slurmd-{node}.log")
        found: dict[int, psutil.Process] = {}
        slurmd = self.slurmd_process(node)
        if slurmd is not None:
            found[slurmd.pid] = slurmd
        for proc in psutil.process_iter(["name"]):
            with contextlib.suppress(psutil.Error):
                if proc.info["name"] == "slurmstepd":
                    if any(f.path == log for f in proc.open_files()):
                        found[proc.pid] = proc
                        for child in proc.children(recursive=True):
                            found[child.pid] = child
                elif proc.pid != os.getpid():
                    environ = proc.environ()
                    if (
                        environ.get("SLURMD_NODENAME") == node
                        and environ.get("SLURM_CONF") == str(self.conf)
                    ):
                        found[proc.pid] = proc
        return [p for p in found.values() if _alive(p)]

    def kill_node(self, node: str, timeout: float = 10) -> int:
        """Kill the node as a machine dies: slurmd, stepds and tasks, all at once; wait until gone.

        Everything is SIGSTOPped first, then SIGKILLed, so no process of the node sees another one
        die and reacts (a stepd reporting its task's exit to srun, say): Slurm and the job's other
        nodes only learn of the loss from silence. Children are killed before their parents: a
        process whose exit orphans a process group that holds a stopped process makes the kernel send
        that group SIGHUP and SIGCONT, which woke a stopped srun of the batch step, and srun aborted
        its step on the other nodes (seen on the lab) where a dead machine's srun sends nothing.
        Returns how many processes were killed.
        """
        killed = 0
        # Again while something is found: a stepd may have forked a task during the first scan.
        for _ in range(3):
            procs = self.node_processes(node)
            if not procs:
                break
            for sig in (signal.SIGSTOP, signal.SIGKILL):
                for proc in sorted(procs, key=_depth, reverse=True):
                    with contextlib.suppress(psutil.NoSuchProcess):
                        proc.send_signal(sig)
            if left := _wait_gone(procs, timeout):
                raise LabError(f"{node}: processes {[p.pid for p in left]} survived SIGKILL for {timeout}s")
            killed += len(procs)
        return killed

    def start_node(self, node: str, timeout: float = 60) -> float:
        """Start the node's slurmd if it is not running, resume the node if Slurm holds it DOWN,
        and wait until it is idle. Returns the seconds until idle."""
        start = time.monotonic()
        if self.slurmd_process(node) is None:
            self._launch_slurmd(node, timeout)
        if self.node_state(node) & {"DOWN", "DRAIN", "FAIL"}:
            self.resume(node)
        self.wait_node(node, "idle", timeout=max(1.0, timeout - (time.monotonic() - start)))
        return time.monotonic() - start

    def start_spare(self, node: str | None = None, timeout: float = 60) -> str:
        """Bring up a spare node (the first one not running when ``node`` is None): a replacement
        node that joins the cluster's partition. Returns its name once it is idle."""
        if node is None:
            free = [n for n in self.spare_nodes if self.slurmd_process(n) is None]
            if not free:
                raise LabError(f"all spare nodes {', '.join(self.spare_nodes)} are already running")
            node = free[0]
        elif node not in self.spare_nodes:
            raise LabError(f"{node!r} is not a spare node; spares are {', '.join(self.spare_nodes)}")
        self.start_node(node, timeout=timeout)
        return node

    def stop_spare(self, node: str) -> None:
        """Kill a spare node and mark it DOWN with reason "spare" again, as start.sh leaves it."""
        if node not in self.spare_nodes:
            raise LabError(f"{node!r} is not a spare node; spares are {', '.join(self.spare_nodes)}")
        self.kill_node(node)
        self.set_down(node, SPARE_REASON)

    def reset(self, timeout: float = 120) -> None:
        """Back to the state start.sh leaves: no jobs, node1..node4 up and idle, spares stopped.

        Run between tests so that each one starts from the same cluster, whatever the last one
        killed, downed or left running.
        """
        deadline = time.monotonic() + timeout
        if jobs := self.job_ids():
            self.run("scancel", *jobs)
        for node in self.spare_nodes:
            if self.slurmd_process(node) is not None or "DOWN" not in self.node_state(node):
                self.stop_spare(node)
        for node in self.nodes:  # a job on a dead node stays COMPLETING until the node is back
            if self.slurmd_process(node) is None:
                self._launch_slurmd(node, timeout)
        # A job that Slurm requeues (a node failure races the first scancel) is pending again under
        # the same id: it is cancelled again every few seconds until the queue is empty.
        next_cancel = time.monotonic() + 5
        while jobs := self.job_ids():
            if time.monotonic() > deadline:
                states = self.run("squeue", "-h", "-o", "%A %T %R").strip().replace("\n", "; ")
                raise LabError(f"jobs still in the queue {timeout}s after scancel: {states}")
            if time.monotonic() > next_cancel:
                self.run("scancel", *jobs)
                next_cancel = time.monotonic() + 5
            time.sleep(0.2)
        for node in self.nodes:
            self.start_node(node, timeout=max(1.0, deadline - time.monotonic()))

    @contextlib.contextmanager
    def exclusive(self, timeout: float = 600, holder: str | None = None) -> Iterator[None]:
        """Hold the lab for one user (a test, or a script) at a time: tests kill and reset nodes,
        which would break another user's jobs. Waits up to ``timeout`` seconds for the holder; the
        lock file names the holder (``holder``, else this process's pid and command line)."""
        self.folder.parent.mkdir(parents=True, exist_ok=True)
        path = Path(f"{self.folder}.session-lock")
        with open(path, "a+") as lock:
            deadline, waited = time.monotonic() + timeout, False
            while True:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    lock.seek(0)
                    current = lock.read().strip() or "unknown"
                    if time.monotonic() > deadline:
                        raise LabError(
                            f"the Slurm lab {self.folder} is held by another test session "
                            f"({current}) for more than {timeout}s"
                        ) from None
                    if not waited:
                        print(f"waiting for the Slurm lab, held by {current}", file=sys.stderr)
                        waited = True
                    time.sleep(1)
            lock.truncate(0)
            lock.write((holder or f"pid {os.getpid()}: {' '.join(sys.argv)}") + "\n")
            lock.flush()
            try:
                yield
            finally:
                lock.truncate(0)
                fcntl.flock(lock, fcntl.LOCK_UN)

    # -- helpers -------------------------------------------------------------------------------

    def _check_node(self, node: str) -> None:
        if node not in self.nodes + self.spare_nodes:
            raise LabError(
                f"unknown node {node!r}; the lab has {', '.join(self.nodes + self.spare_nodes)}"
            )

    def _launch_slurmd(self, node: str, timeout: float) -> None:
        """Start the node's slurmd and wait until it has registered with slurmctld.

        Resuming a node before its slurmd registered would let slurmctld schedule onto a node
        that cannot run anything yet. Registration shows as a new SlurmdStartTime (whole seconds:
        so never start two slurmds of one node within one second).
        """
        if not self.conf.is_file():
            raise LabError(f"{self.conf} does not exist: run tests/slurm/start.sh first")
        before = self.node_record(node).get("SlurmdStartTime")
        if before == time.strftime("%Y-%m-%dT%H:%M:%S"):
            time.sleep(1.0)
        with open(self.folder / "log" / f"slurmd-{node}.out", "ab") as out:
            # Own session (setsid -f): the slurmd must outlive this process and its terminal.
            subprocess.run(
                ["setsid", "-f", "slurmd", "-f", str(self.conf), "-N", node],
                env=self.env, stdin=subprocess.DEVNULL, stdout=out, stderr=out, check=True,
            )
        deadline = time.monotonic() + timeout
        while self.node_record(node).get("SlurmdStartTime") == before:
            if time.monotonic() > deadline:
                raise LabError(
                    f"{node}: slurmd did not register within {timeout}s; "
                    f"see {self.folder}/log/slurmd-{node}.log and slurmd-{node}.out"
                )
            time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["status", "kill", "start", "start-spare", "stop-spare", "reset"])
    parser.add_argument("node", nargs="?", help="node name (start-spare: optional)")
    args = parser.parse_args(argv)
    lab = SlurmLab()
    try:
        if args.action == "status":
            for name, flags in lab.node_states().items():
                print(name, "+".join(sorted(flags)))
        elif args.action == "reset":
            lab.reset()
        elif args.action == "start-spare":
            print(lab.start_spare(args.node))
        elif args.node is None:
            parser.error(f"{args.action} needs a node name")
        elif args.action == "kill":
            print(f"killed {lab.kill_node(args.node)} processes of {args.node}")
        elif args.action == "start":
            print(f"{args.node} idle after {lab.start_node(args.node):.1f}s")
        else:
            lab.stop_spare(args.node)
    except LabError as err:
        print(f"lab.py: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
