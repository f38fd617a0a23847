"""Warm workers: a node's worker processes are forked from a server that has already imported what
every worker imports (torch, torch._dynamo, the engine, the models), instead of each starting a fresh
interpreter that spends ~3.6 s of CPU on those imports before its first step.

    python -m oobleck_slurm.agent.warm AGENT_PID     (the agent starts it: `WarmServer`)

One server per node agent, started when the agent starts (before it registers), so that its imports
overlap the registration, a replacement's health check and the planning (the health check's imports
come first: `PRELOAD_STAGES`, a request is served once its module's stage is in). It never initialises CUDA
(importing torch does not): a worker chooses its GPU in the child, before its first CUDA call
(engine/elastic_process.py `main`), as a freshly started one did. It runs no thread (a fork copies only
the forking thread: a lock held by another one would stay held in the child); numpy's OpenBLAS would
start one at import, so the server runs with OMP_NUM_THREADS=1 (each worker sets its own thread
budget with torch.set_num_threads).

The agent talks to it over its stdin/stdout, one JSON object a line:

    agent -> server   {"spawn": ID, "module": M, "argv": [...], "env": {...}, "cwd": DIR, "log": PATH}
    server -> agent   {"ready": PRELOAD_S}          once, after every stage of imports
                      {"spawned": ID, "pid": PID}   or {"spawned": ID, "error": TEXT}
                      {"exited": PID, "code": CODE} (os.waitstatus_to_exitcode: -9 for a SIGKILL)

A spawned child is the process the agent used to start with `python -m M ARGV...`: its environment is
exactly `env` (the agent's worker_env), its cwd `cwd`, its stdin /dev/null, its stdout and stderr
appended to `log`; it ignores SIGUSR2 (Slurm signals every process of the step; the agent relays it)
and SIGHUP (supervisor/main.py); it runs `M.main(argv)` and leaves with os._exit (a worker's main
does so itself). The agent signals it by pid (kill, SIGSTOP drills) and reads psutil by pid as it did.

Death: the server gets SIGKILL when the agent dies (PR_SET_PDEATHSIG, relative to the agent's thread
that started it: the agent's main thread), and each child gets SIGKILL when the server dies: an
agent's death takes its server and its workers with it. The server also kills its children and exits
when its stdin closes (the agent closed it, or is gone).

One server per job on the local backend (`LocalLauncher`): its virtual nodes share one machine, so
their agents are forked from one server too (request `"detached": true`: no PR_SET_PDEATHSIG, not
killed when the server ends, so that they outlive a lost supervisor as agents started cold did). An
agent forked warm has every preloaded module already: its own server is then a fork of the agent
itself (`ForkedServer`, before the agent starts any thread), not a new interpreter. The job's server
is itself a fork of the supervisor, which has imported torch already (it runs the job's store): the
fork imports only the rest. A 4-node local job then imports torch once, not 5 or 6 times. A forked
server's children show their command lines in the argv room of the process it was forked from: the
local supervisor is started with `TITLE_ROOM` bytes of it (`--title-room`, hidden once it runs).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Mapping
from typing import IO, Any

from oobleck_slurm.timeouts import DEFAULT_TIMEOUTS, JobTimeouts

WORKER_MODULE = "oobleck_slurm.engine.elastic_process"
HEALTH_MODULE = "oobleck_slurm.agent.preflight"
# What every worker imports, in stages: a request for a stage's module is served once that stage is
# imported. First the health check's (it imports torch.distributed and the engine's group maker only
# when it runs, so they are named here: a replacement's check comes right after its agent registers),
# then the worker's (the engine, the models) and torch._dynamo, which torch.optim imports on a worker's
# first optimizer (1.2 s of CPU, during a joining worker's state copy).
PRELOAD_STAGES = ((HEALTH_MODULE, "torch.distributed", "oobleck_slurm.engine.comm"),
                  (WORKER_MODULE, "torch._dynamo", "torch.optim", "oobleck_slurm.models.gpt.model",
                   "oobleck_slurm.models.llama.model"))
PR_SET_PDEATHSIG = 1
# The server's own environment additions: no BLAS thread pool in a process that forks.
SERVER_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
# Room for a child's command line (`set_command_line`): the server starts with this many bytes of
# padding in its argv, so that `python -m oobleck_slurm.engine.elastic_process JOB_DIR NODE LOCAL` fits
# where a worker's command line always was (ps, and tools that find workers by it).
TITLE_ROOM = 4000


def set_command_line(words: list[str]) -> None:
    """Show `words` as this process's command line (/proc/PID/cmdline, ps, psutil's cmdline()), as
    setproctitle(3) does: written over the original argv strings, the room the server reserved
    (`TITLE_ROOM`), ending in a non-NUL byte, from which Linux reads the title up to its first NUL."""
    import ctypes

    with contextlib.suppress(OSError, IndexError, ValueError):  # a name only: never worth failing for
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end: fields 48 and 49 of proc(5)
        room = end - start
        if room >= 2:
            title = " ".join(words).encode()[: room - 2]
            ctypes.memmove(start, title + b"\0" * (room - len(title) - 1) + b" ", room)


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when its parent dies (Linux prctl PR_SET_PDEATHSIG); already gone: now."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the prctl: no signal will come
        os._exit(1)


def ignore_step_signals() -> None:
    """In a process of an agent's step other than the agent (its warm server, its workers): ignore the
    signals Slurm sends to every process of the step, which only the agent acts on (it relays them to
    the supervisor). SIGUSR2 is the time-limit or preemption notice (submitit's `--signal`); inside a
    Slurm step SIGTERM is too: preemption (`PreemptMode=REQUEUE`/`CANCEL`, within `GraceTime`),
    `scontrol requeue` and `scancel` send SIGTERM, then SIGKILL after `KillWait` (slurm.conf(5),
    preempt.shtml). A worker that died of it would lose the state the on-demand checkpoint saves.
    Outside Slurm (the local backend) SIGTERM keeps its default: it is how a local job is stopped."""
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    if in_slurm_step():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def in_slurm_step() -> bool:
    """Whether this process runs in a Slurm job step (srun sets SLURM_STEP_ID; a batch step does not)."""
    return "SLURM_STEP_ID" in os.environ


def write_output_to(path: str | os.PathLike[str]) -> None:
    """Write this process's stdout and stderr to `path` (appended) itself, not through srun: the srun
    that forwards a step's output runs on the batch host, and when that machine dies the step's
    slurmstepd stops reading the task's output (measured on the lab), so what an agent or a standby
    says after the loss would be lost, and a task that writes a full pipe's worth would block. srun
    appends its own lines to the same file."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


# ---- the server (its own process) -------------------------------------------------------------------

def _send(message: dict[str, Any]) -> None:
    data = (json.dumps(message) + "\n").encode()
    while data:
        data = data[os.write(1, data):]


def _child(request: dict[str, Any], server: int, close: tuple[int, ...]) -> None:
    """In the forked child: become the worker `python -m MODULE ARGV` would have been, run it, leave."""
    code = 1
    try:
        if not request.get("detached"):
            die_with_parent(server)
        signal.set_wakeup_fd(-1)
        for fd in close:
            os.close(fd)
        for sig in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        ignore_step_signals()  # Slurm signals every process of the step; the agent relays it
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # see supervisor/main.py
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        module, argv = str(request["module"]), [str(a) for a in request["argv"]]
        sys.argv = [module, *argv]
        set_command_line([sys.executable, "-m", module, *argv])
        result = importlib.import_module(module).main(argv)
        code = result if isinstance(result, int) else 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - whatever it was, the child must not return into the server
        traceback.print_exc()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def _spawn(request: dict[str, Any], close: tuple[int, ...]) -> dict[str, Any]:
    server = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        pid = os.fork()
    except OSError as e:
        return {"spawned": request.get("spawn"), "error": f"fork: {e}"}
    if pid == 0:
        _child(request, server, close)
    return {"spawned": request.get("spawn"), "pid": pid}


def _imported(stage: tuple[str, ...]) -> bool:
    return all(module in sys.modules for module in stage)


def preloaded() -> bool:
    """Whether this process has imported every preloaded module (a process forked by a server has)."""
    return all(_imported(stage) for stage in PRELOAD_STAGES)


def _cuda_initialised() -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and bool(torch.cuda.is_initialized())


def serve(agent: int) -> int:
    """The server's loop: preload stage by stage, fork on request (a request waits for its module's
    stage; any other module for the whole preload) and report exits, until stdin closes."""
    die_with_parent(agent)
    set_command_line([sys.executable, "-m", "oobleck_slurm.agent.warm", str(agent)])  # the padding hidden
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the handler of a supervisor it was forked from
    ignore_step_signals()  # as the workers: only the agent acts on them
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # wakes the select (set_wakeup_fd)
    t0 = time.process_time()
    # A server forked from a warm process (`ForkedServer`) has every stage already: ready at once.
    stages = [stage for stage in PRELOAD_STAGES if not _imported(stage)]
    loaded: set[str] = {module for stage in PRELOAD_STAGES if _imported(stage) for module in stage}
    pending: list[dict[str, Any]] = []
    children: set[int] = set()
    detached: set[int] = set()  # children that outlive the server (agents of the local backend)
    buffer = b""
    if not stages:
        _send({"ready": 0.0})
    while True:
        # While modules remain to import, only look (timeout 0); then wait for a request or an exit.
        readable, _, _ = select.select([0, wake_r], [], [], 0 if stages else None)
        if wake_r in readable:
            os.read(wake_r, 4096)
        while children:  # reap every child that ended, report its code
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            detached.discard(pid)
            _send({"exited": pid, "code": os.waitstatus_to_exitcode(status)})
        if 0 in readable:
            data = os.read(0, 65536)
            if not data:
                break  # the agent is gone or done: its workers go with it
            buffer += data
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                pending.append(json.loads(line))
        # Requests whose stage is in are served before the next stage's imports (a replacement's health
        # check must not wait for the worker's modules), and again after them.
        for serve_now in (True, False):
            for request in [r for r in pending if r["module"] in loaded or not stages]:
                pending.remove(request)
                reply = _spawn(request, close=(wake_r, wake_w))
                if "pid" in reply:
                    children.add(reply["pid"])
                    if request.get("detached"):
                        detached.add(reply["pid"])
                _send(reply)
            if serve_now and stages:  # one stage an iteration
                stage = stages.pop(0)
                for module in stage:
                    importlib.import_module(module)
                loaded.update(stage)
                if _cuda_initialised():  # a fork would inherit a CUDA context no child can use
                    print(f"warm server: importing {stage} initialised CUDA; workers start cold", file=sys.stderr)
                    return 1
                if not stages:
                    _send({"ready": time.process_time() - t0})
    for pid in children - detached:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return 0


class ForkedServer:
    """A server forked from this process, which runs no other thread (an agent forked by a job's server,
    before it starts its threads; a local job's supervisor, before it starts any): what `WarmServer`
    uses of the subprocess.Popen it otherwise starts (pid, stdin, stdout, wait, kill), no interpreter
    started. The fork imports the preload stages this process has not imported."""

    def __init__(self) -> None:
        requests_r, requests_w = os.pipe()
        replies_r, replies_w = os.pipe()
        agent = os.getpid()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the server: its stdin and stdout are the pipes, as a started one's are
            code = 1
            try:
                os.dup2(requests_r, 0)
                os.dup2(replies_w, 1)
                for fd in (requests_r, requests_w, replies_r, replies_w):
                    os.close(fd)  # the write end of its own stdin above all: EOF when the agent goes
                os.environ.update(SERVER_ENV)
                code = serve(agent)
            except BaseException:  # noqa: BLE001 - the child must never return into the agent
                traceback.print_exc()
            os._exit(code)
        os.close(requests_r)
        os.close(replies_w)
        self.pid = pid
        self.stdin: IO[bytes] | None = os.fdopen(requests_w, "wb")
        self.stdout: IO[bytes] | None = os.fdopen(replies_r, "rb")
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped by another thread's poll, which sets the code now
                pid, status = 0, 0
                time.sleep(0.01)
                if self.returncode is None:
                    self.returncode = -signal.SIGKILL
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"warm server {self.pid}", timeout or 0.0)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


# ---- the agent's side ---------------------------------------------------------------------------------

class WarmProcess:
    """A process forked by a `WarmServer`: what the agent uses of subprocess.Popen (pid, poll, wait,
    send_signal), its exit code as the server reported it."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._ended = threading.Event()

    def _end(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
        self._ended.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:  # once reaped, the pid may be another process's
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class WarmServer:
    """The agent's fork server (see the module's doc): `spawn` a module's main in a warm child."""

    def __init__(self, env: Mapping[str, str] | None = None, timeouts: JobTimeouts = DEFAULT_TIMEOUTS,
                 fork_here: bool = False) -> None:
        """`fork_here`: the server is a fork of this process (warm itself, or partly: it imports the
        rest), if it runs no other thread yet; else a new interpreter."""
        self.timeouts = timeouts
        self.proc: subprocess.Popen | ForkedServer
        if fork_here and env is None and threading.active_count() == 1:
            self.proc = ForkedServer()
        else:
            base = dict(os.environ if env is None else env)
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "oobleck_slurm.agent.warm", str(os.getpid()), "-" * TITLE_ROOM],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={**base, **SERVER_ENV})
        self.ready = threading.Event()
        self.preload_s: float | None = None
        self._lock = threading.Lock()  # one spawn request at a time: its reply is the next "spawned"
        self._spawned: dict[int, dict[str, Any]] = {}
        self._reply = threading.Condition()
        self._processes: dict[int, WarmProcess] = {}
        self._next_id = 0
        self._gone = threading.Event()
        threading.Thread(target=self._read, name="warm-server", daemon=True).start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return not self._gone.is_set()

    def _read(self) -> None:
        stdout: IO[bytes] = self.proc.stdout  # type: ignore[assignment]
        for line in stdout:
            message = json.loads(line)
            if "ready" in message:
                self.preload_s = float(message["ready"])
                self.ready.set()
            elif "exited" in message:
                with self._reply:
                    process = self._processes.pop(int(message["exited"]), None)
                if process is not None:
                    process._end(int(message["code"]))
            elif "spawned" in message:
                with self._reply:
                    if "pid" in message:
                        # The reply keeps the process: a child that exits at once is popped from
                        # `_processes` (its "exited" line) before `spawn` wakes up to return it.
                        message["process"] = self._processes[int(message["pid"])] = WarmProcess(int(message["pid"]))
                    self._spawned[int(message["spawned"])] = message
                    self._reply.notify_all()
        self._lost()

    def _lost(self) -> None:
        """The server is gone: so are its children (PR_SET_PDEATHSIG), whose exits it cannot report
        any more. Each is reported as killed once its pid is gone (or after warm_orphan_wait)."""
        self._gone.set()
        self.ready.set()
        with self._reply:
            orphans, self._processes = list(self._processes.values()), {}
            self._reply.notify_all()
        deadline = time.monotonic() + self.timeouts.warm_orphan_wait
        for process in orphans:
            while time.monotonic() < deadline and _exists(process.pid):
                time.sleep(self.timeouts.agent_poll)
            process._end(-signal.SIGKILL)
        with contextlib.suppress(Exception):
            self.proc.wait(self.timeouts.warm_orphan_wait)

    def spawn(self, module: str, argv: list[str], env: Mapping[str, str], log: str,
              cwd: str | None = None, detached: bool = False) -> WarmProcess:
        """Fork `python -m module argv` from the server: its process once the server forked it. Waits
        for the server's imports if they are still under way. OSError if the server is gone.
        `detached`: the child outlives the server (it is neither killed with it nor when it ends)."""
        timeout = self.timeouts.warm_spawn_timeout
        request: dict[str, Any] = {"module": module, "argv": list(argv), "env": dict(env), "log": log,
                                   "cwd": cwd or os.getcwd(), "detached": detached}
        with self._lock:
            if self._gone.is_set():
                raise OSError(f"the warm server (pid {self.pid}) is gone")
            self._next_id += 1
            ident = request["spawn"] = self._next_id
            stdin: IO[bytes] = self.proc.stdin  # type: ignore[assignment]
            try:
                stdin.write((json.dumps(request) + "\n").encode())
                stdin.flush()
            except (BrokenPipeError, ValueError) as e:
                raise OSError(f"the warm server (pid {self.pid}) is gone") from e
            with self._reply:
                if not self._reply.wait_for(lambda: ident in self._spawned or self._gone.is_set(), timeout):
                    raise OSError(f"the warm server (pid {self.pid}) did not fork within {timeout:g} s")
                reply = self._spawned.pop(ident, None)
                if reply is None:
                    raise OSError(f"the warm server (pid {self.pid}) is gone")
                if "pid" not in reply:
                    raise OSError(f"the warm server could not fork: {reply.get('error')}")
                process: WarmProcess = reply["process"]
                return process

    def close(self) -> None:
        """End the server (its children are killed) and wait for it."""
        with contextlib.suppress(OSError, ValueError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.proc.wait(self.timeouts.warm_orphan_wait)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (not yet reaped by init) is dead for our purposes.
    with contextlib.suppress(OSError):
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    return False


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (1, 2) or not args[0].isdigit():  # the second: room for the children's titles
        print("usage: python -m oobleck_slurm.agent.warm AGENT_PID [PADDING]", file=sys.stderr)
        return 2
    return serve(int(args[0]))


if __name__ == "__main__":
    raise SystemExit(main())
