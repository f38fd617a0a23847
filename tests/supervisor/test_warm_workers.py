"""Warm workers (agent/warm.py): a node agent's workers are forked from its warm server, which
imported torch, torch._dynamo and the engine before they were asked for. Real processes: the server,
children it forks (tests/supervisor/warm_probe.py plays a worker), a real agent against a control
server played by this test, and the death of an agent taking its server and workers with it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import psutil
import pytest

from oobleck_slurm.agent.warm import WarmServer
from oobleck_slurm.cluster.jobdir import JobDir, create_secret
from oobleck_slurm.protocol.messages import Drill, Heartbeat, Register, Start, WorkerExit, parse
from oobleck_slurm.protocol.wire import Channel
from oobleck_slurm.supervisor.server import ControlServer

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
IMPORT_CPU_S = 2.0  # torch + torch._dynamo take ~3.6 s of CPU in a fresh interpreter (issue 24)
T = TypeVar("T")


def until(what: str, check: Callable[[], T], timeout: float = 60.0) -> T:
    deadline = time.monotonic() + timeout
    while not (value := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)
    return value


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def probe_env(**extra: str) -> dict[str, str]:
    """The environment a warm server needs to import warm_probe (this folder on its path)."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(REPO)]), **extra)


def first_line(log: Path) -> dict[str, Any]:
    text = until(f"{log}'s first line", lambda: log.is_file() and "\n" in log.read_text() and log.read_text())
    return json.loads(text.splitlines()[0])


@pytest.fixture(scope="module")
def server() -> Iterator[WarmServer]:
    warm = WarmServer(env=probe_env())
    try:
        assert warm.ready.wait(120) and warm.alive()
        yield warm
    finally:
        warm.close()


def test_a_child_is_forked_warm_with_its_own_environment_and_signals(server: WarmServer, tmp_path: Path) -> None:
    child = server.spawn("warm_probe", ["exit", "7"], {"WARM_PROBE": "mine", "PATH": os.environ["PATH"]},
                         str(tmp_path / "child.log"), cwd=str(tmp_path))
    assert child.wait(30) == 7  # its exit code, as the server reaped it
    info = first_line(tmp_path / "child.log")  # stdout goes to its log
    # torch and the engine were imported before the child's own code ran, not by it: a forked child's
    # CPU time starts at zero, a fresh interpreter's would count the imports (whatever the machine's load).
    assert info["preloaded"] == {"torch": True, "torch._dynamo": True, "oobleck_slurm.engine.elastic_process": True}
    assert info["cpu_s"] < IMPORT_CPU_S / 4, info
    assert (info["pid"], info["ppid"]) == (child.pid, server.pid)
    assert (info["env"], info["cwd"]) == ("mine", str(tmp_path))  # exactly the environment it was given
    assert info["sigusr2_ignored"] and info["sighup_ignored"] and info["sigchld_default"]


def test_a_child_that_exits_at_once_is_still_returned(server: WarmServer, tmp_path: Path) -> None:
    # The server's "spawned" and "exited" lines can both be read before `spawn` wakes up: it must
    # return the process (with its exit code) all the same, never look it up after it was reaped.
    for i in range(30):
        child = server.spawn("warm_probe", ["exit", "3"], probe_env(), str(tmp_path / f"quick{i}.log"))
        assert child.wait(30) == 3


def test_a_child_is_stopped_and_killed_by_pid(server: WarmServer, tmp_path: Path) -> None:
    log = tmp_path / "sleeper.log"
    child = server.spawn("warm_probe", ["sleep"], probe_env(), str(log))
    until("ticks", lambda: log.is_file() and log.read_text().count("tick") >= 2)
    # Named as `python -m MODULE ARGV` would be (ps; tools that find workers by their command line).
    assert psutil.Process(child.pid).cmdline() == [sys.executable, "-m", "warm_probe", "sleep"]
    child.send_signal(signal.SIGSTOP)  # the hang drill; the slow drill duty-cycles it
    assert until("stopped", lambda: psutil.Process(child.pid).status() == psutil.STATUS_STOPPED)
    child.send_signal(signal.SIGCONT)
    ticks = log.read_text().count("tick")
    until("ticking again", lambda: log.read_text().count("tick") > ticks)
    assert child.poll() is None
    child.kill()  # the worker drill
    assert child.wait(30) == -signal.SIGKILL
    child.kill()  # once reaped, no signal goes to the pid (it may be another process's)


AGENT_LIKE = textwrap.dedent("""
    import os, sys
    from oobleck_slurm.agent.warm import WarmServer
    warm = WarmServer(env=dict(os.environ, PYTHONPATH=sys.argv[1]))
    child = warm.spawn("warm_probe", ["sleep"], dict(os.environ), sys.argv[2])
    print(warm.pid, child.pid, flush=True)
    sys.stdin.read()
""")


def test_the_death_of_its_parent_kills_the_server_and_its_children(tmp_path: Path) -> None:
    """kill -9 of the process that started the server (the agent) ends the server and every child."""
    parent = subprocess.Popen([sys.executable, "-c", AGENT_LIKE, os.pathsep.join([str(HERE), str(REPO)]),
                               str(tmp_path / "child.log")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        server_pid, child_pid = map(int, parent.stdout.readline().split())
        assert psutil.Process(child_pid).ppid() == server_pid and psutil.Process(server_pid).ppid() == parent.pid
        parent.kill()
        parent.wait()
        until("the server gone", lambda: gone(server_pid), timeout=30)
        until("its child gone", lambda: gone(child_pid), timeout=30)
    finally:
        parent.kill()
        parent.wait()


class Supervisor:
    """The control server an agent reads from supervisor.json, played by this test."""

    def __init__(self, job: JobDir) -> None:
        self.channels: list[Channel] = []
        self.messages: list[Any] = []
        self.server = ControlServer(create_secret(job.path), self._handle).start()

    def _handle(self, channel: Channel, message: dict[str, Any]) -> None:
        if channel not in self.channels:
            self.channels.append(channel)
        self.messages.append(parse(message))

    def send(self, message: Any) -> None:
        self.channels[0].send(message.to_dict())

    def first(self, kind: type[T]) -> T | None:
        return next((m for m in self.messages if isinstance(m, kind)), None)


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], Supervisor, JobDir]]:
    job = JobDir.at(tmp_path / "job")
    job.path.mkdir()
    (job.path / "logs").mkdir(exist_ok=True)
    supervisor = Supervisor(job)
    job.write_supervisor_address(host="127.0.0.1", port=supervisor.server.port, epoch=1)
    proc = subprocess.Popen([sys.executable, "-m", "oobleck_slurm.agent.main", str(job.path), "--node", "n1"],
                            cwd=REPO)
    try:
        until("the registration", lambda: supervisor.first(Register))
        yield proc, supervisor, job
    finally:
        proc.kill()
        proc.wait()
        supervisor.server.stop()


def warm_server_of(agent: subprocess.Popen[bytes]) -> psutil.Process:
    children = psutil.Process(agent.pid).children()
    servers = [c for c in children if "oobleck_slurm.agent.warm" in c.cmdline()]
    assert len(servers) == 1, [c.cmdline() for c in children]
    return servers[0]


def test_an_agents_workers_are_forked_from_its_warm_server_and_their_exit_is_reported(agent: Any) -> None:
    """A real agent: its workers are children of its warm server, their failure (here: a job folder
    without a job) is reported with its code, and the agent's death takes the server with it."""
    proc, supervisor, job = agent
    server = warm_server_of(proc)
    supervisor.send(Start(node_id="n1", workers=2, threads=1, device="cpu"))
    exit_ = until("the workers' exit", lambda: supervisor.first(WorkerExit))
    assert exit_.node_id == "n1" and exit_.code == 1  # EXIT_FAILED: the traceback is in the log
    # The first worker to fail is reported and its peer killed (the node is the unit), so only the
    # reported worker's log is sure to hold its traceback; it flushed it before it exited.
    assert exit_.worker in (0, 1)
    log = job.worker_log("n1", exit_.worker).read_text()
    assert "FileNotFoundError" in log, log
    assert server.is_running() and not [c for c in server.children() if c.status() != psutil.STATUS_ZOMBIE]
    beat = until("a heartbeat", lambda: [m for m in supervisor.messages if isinstance(m, Heartbeat)])
    assert beat
    supervisor.send(Drill(how="agent", worker=0))  # kill -9 of the agent
    until("the agent gone", lambda: proc.poll() is not None, timeout=30)
    until("its warm server gone", lambda: gone(server.pid), timeout=30)


def test_a_health_check_is_forked_once_torch_is_in_without_waiting_for_the_workers_modules(tmp_path: Path) -> None:
    # A replacement's health check comes right after its agent registers, while its server imports:
    # it is forked once the first stage is in (torch.distributed and what the check imports when it
    # runs), before the worker's modules (torch._dynamo, the engine): the server is not ready yet. On the
    # lab the check took 9-10 s when it waited for them, or imported torch itself beside them.
    from oobleck_slurm.agent.warm import HEALTH_MODULE, PRELOAD_STAGES

    assert {"torch.distributed", "oobleck_slurm.engine.comm"} <= set(PRELOAD_STAGES[0])
    warm = WarmServer(env=probe_env())
    try:
        until("the server's loop", lambda: "-" * 8 not in " ".join(psutil.Process(warm.pid).cmdline()))
        check = warm.spawn(HEALTH_MODULE, [], dict(os.environ), str(tmp_path / "health.log"))
        assert not warm.ready.is_set(), f"the health check waited for the whole preload ({warm.preload_s} s of CPU)"
        assert check.wait(60) == 2  # forked: its main ran (no arguments: usage, exit 2)
        assert warm.ready.wait(120)
    finally:
        warm.close()


def test_a_local_jobs_agents_are_forked_warm_and_fork_their_own_servers(tmp_path: Path) -> None:
    """The local backend's one server per job (LocalLauncher): an agent it forks is warm, so the agent's
    own server is the agent's fork (no import of torch per virtual node), its workers are forked from
    that, the agent outlives the job's server (detached: a standby supervisor must find it alive), and
    the agent's death still takes its server with it."""
    job = JobDir.at(tmp_path / "job")
    (job.path / "logs").mkdir(parents=True)
    supervisor = Supervisor(job)
    job.write_supervisor_address(host="127.0.0.1", port=supervisor.server.port, epoch=1)
    jobs_server = WarmServer()
    agent = None
    try:
        assert jobs_server.ready.wait(120)
        agent = jobs_server.spawn("oobleck_slurm.agent.main", [str(job.path), "--node", "n1"], dict(os.environ),
                                  str(job.agent_log("n1")), cwd=str(REPO), detached=True)
        until("the registration", lambda: supervisor.first(Register))
        assert psutil.Process(agent.pid).ppid() == jobs_server.pid
        assert psutil.Process(agent.pid).cmdline()[:3] == [sys.executable, "-m", "oobleck_slurm.agent.main"]
        server = warm_server_of(agent)  # type: ignore[arg-type]
        assert server.cmdline()[:3] == [sys.executable, "-m", "oobleck_slurm.agent.warm"]
        # A fork of a warm process: a fresh interpreter would have spent seconds importing torch.
        assert server.cpu_times().user + server.cpu_times().system < IMPORT_CPU_S / 4
        supervisor.send(Start(node_id="n1", workers=2, threads=1, device="cpu"))
        exit_ = until("the workers' exit", lambda: supervisor.first(WorkerExit))
        assert exit_.code == 1 and "FileNotFoundError" in job.worker_log("n1", 0).read_text()
        jobs_server.close()  # returns once the server exited, after killing what it kills: not the agent
        assert psutil.Process(agent.pid).status() != psutil.STATUS_ZOMBIE and server.is_running()
        supervisor.send(Drill(how="agent", worker=0))  # kill -9 of the agent
        until("the agent gone", lambda: gone(agent.pid), timeout=30)  # type: ignore[union-attr]
        until("its warm server gone", lambda: gone(server.pid), timeout=30)
    finally:
        if agent is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(agent.pid, signal.SIGKILL)
        jobs_server.close()
        supervisor.server.stop()
