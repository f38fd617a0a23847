"""The job folder: everything about one job in one place, readable after the job and elsewhere.

Every file name of a job folder is defined here and nowhere else (other modules import the names or
ask `JobDir` for the paths):

    <job_root>/<job_id>/
        recipe.yaml     the resolved recipe (every default filled in, data paths absolute)
        meta.json       job id, backend, creation time, the recipe it came from; status and exit code at the end
        secret          per-job control-plane secret, mode 0600 (`create_secret`, `load_secret`)
        events.jsonl    the event log (engine, supervisor), read by `dashboard`, `events`, `report`
        metrics.csv     node metrics, `time,node,metric,value` (detection/metrics.py)
        profile.json    the profile given to `submit --profile` (the job plans with it, as `plan` does)
        faults.json     optional drill: faults the workers inject (engine/faults.py)
        job.json        the workers' JobSpec (model, data, training), written by the supervisor
        elastic.json    the store's address, timeouts, workers per node: written by the supervisor for workers
        supervisor.json the control server's address (host, port, heartbeat interval): for agents and commands
        supervisor_state.json  what the supervisor cannot rebuild from the agents and workers (generation,
                        members, plan, phase, a recovery in progress, replacements asked for), rewritten
                        whole as it changes (protocol/records.py SupervisorState)
        supervisor.lease the primary supervisor's epoch, pid, host, renewed every heartbeat interval
        epoch.<e>       created exclusively by the supervisor that claimed epoch e (cluster/lease.py)
        cancelled       marker written by `cancel` before it stops the job: losses that follow are no failure
        requeue         marker written on preemption / time limit: the requeued run resumes from a checkpoint
        data/           token files prepared for the job
        checkpoints/    step<S>/<layer>.safetensors: periodic, on-demand and final checkpoints
        trace_request.json  `profile-steps`: the steps every worker traces with torch.profiler (engine/requests.py)
        traces/<id>/    the Chrome traces of request <id>, one per worker: <worker>-rank<r>.json
        dump_request.json   a hang verdict: every worker dumps its stacks and flight recorder now
        corrupt_request.json  `kill-node --how corrupt`: one worker flips a bit of a parameter (a drill)
        dumps/<id>/     <worker>.stacks.txt (every thread's Python stack), flight_recorder/rank_<r> (torch's
                        flight recorder: NCCL or gloo collectives), <worker>.done
        tensorboard/    TensorBoard scalars (`logging.tensorboard`), events.offset: what is exported
        wandb/          W&B's files (`logging.wandb`), run_id: the job's one run, events.offset
        logs/           per-process logs: supervisor.log (local backend), supervisor.err (its traceback),
                        agent-<node>.log, worker-<node id>-<i>.log
        submitit/       submitit's files and Slurm's output of the allocation and of replacement jobs
"""

from __future__ import annotations

import json
import os
import secrets
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from oobleck_slurm.cluster import durable
from oobleck_slurm.errors import BadInputError

if TYPE_CHECKING:  # the recipe package is imported where a recipe is read: naming a path stays cheap
    from oobleck_slurm.recipe import Recipe

RECIPE_FILE = "recipe.yaml"
META_FILE = "meta.json"
SECRET_FILE = "secret"
EVENTS_FILE = "events.jsonl"
METRICS_FILE = "metrics.csv"
PROFILE_FILE = "profile.json"
FAULTS_FILE = "faults.json"
JOB_SPEC_FILE = "job.json"
ELASTIC_FILE = "elastic.json"
SUPERVISOR_FILE = "supervisor.json"
SUPERVISOR_STATE_FILE = "supervisor_state.json"
SUPERVISOR_LEASE_FILE = "supervisor.lease"
CANCEL_MARKER = "cancelled"
REQUEUE_MARKER = "requeue"
DATA_DIR = "data"
CHECKPOINTS_DIR = "checkpoints"
LOGS_DIR = "logs"
SUBMITIT_DIR = "submitit"
SUPERVISOR_LOG = "supervisor.log"
SUPERVISOR_ERROR = "supervisor.err"
TRACE_REQUEST_FILE = "trace_request.json"
TRACES_DIR = "traces"
DUMP_REQUEST_FILE = "dump_request.json"
DUMPS_DIR = "dumps"
CORRUPT_REQUEST_FILE = "corrupt_request.json"

SECRET_BYTES = 32


class JobNotFound(BadInputError):
    """No job folder matches what the user named; the message says what was looked for, and where."""


class SecretError(BadInputError):
    """The job secret is missing, malformed or readable by others."""


class MetaError(BadInputError):
    """meta.json is missing, empty, truncated or not a JSON object; the message names the file."""


@dataclass(frozen=True)
class JobDir:
    path: Path
    job_id: str

    @classmethod
    def at(cls, path: str | os.PathLike[str]) -> JobDir:
        """The job folder at `path` (its name is the job id)."""
        resolved = Path(path).resolve()
        return cls(resolved, resolved.name)

    # ---- files ------------------------------------------------------------------------------------

    @property
    def recipe_path(self) -> Path:
        return self.path / RECIPE_FILE

    @property
    def meta_path(self) -> Path:
        return self.path / META_FILE

    @property
    def events(self) -> Path:
        return self.path / EVENTS_FILE

    @property
    def profile(self) -> Path:
        return self.path / PROFILE_FILE

    @property
    def faults(self) -> Path:
        return self.path / FAULTS_FILE

    @property
    def job_spec(self) -> Path:
        return self.path / JOB_SPEC_FILE

    @property
    def elastic(self) -> Path:
        return self.path / ELASTIC_FILE

    @property
    def supervisor_file(self) -> Path:
        return self.path / SUPERVISOR_FILE

    @property
    def supervisor_state(self) -> Path:
        return self.path / SUPERVISOR_STATE_FILE

    @property
    def supervisor_lease(self) -> Path:
        return self.path / SUPERVISOR_LEASE_FILE

    @property
    def cancel_marker(self) -> Path:
        return self.path / CANCEL_MARKER

    @property
    def requeue_marker(self) -> Path:
        return self.path / REQUEUE_MARKER

    @property
    def data(self) -> Path:
        return self.path / DATA_DIR

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS_DIR

    @property
    def tensorboard(self) -> Path:
        return self.path / "tensorboard"

    @property
    def wandb(self) -> Path:
        return self.path / "wandb"

    @property
    def trace_request(self) -> Path:
        return self.path / TRACE_REQUEST_FILE

    @property
    def traces(self) -> Path:
        return self.path / TRACES_DIR

    @property
    def corrupt_request(self) -> Path:
        return self.path / CORRUPT_REQUEST_FILE

    @property
    def dump_request(self) -> Path:
        return self.path / DUMP_REQUEST_FILE

    @property
    def dumps(self) -> Path:
        return self.path / DUMPS_DIR

    @property
    def logs(self) -> Path:
        return self.path / LOGS_DIR

    @property
    def submitit(self) -> Path:
        return self.path / SUBMITIT_DIR

    def agent_log(self, node: str) -> Path:
        return self.logs / f"agent-{node}.log"

    def standby_log(self, node: str) -> Path:
        """A standby supervisor's log under Slurm (a step on `node` inside the allocation)."""
        return self.logs / f"supervisor-standby-{node}.log"

    def worker_log(self, node_id: str, local: int) -> Path:
        return self.logs / f"worker-{node_id}-{local}.log"

    # ---- contents ---------------------------------------------------------------------------------

    def recipe(self) -> Recipe:
        from oobleck_slurm.recipe import load_recipe

        return load_recipe(self.recipe_path)

    def meta(self) -> dict[str, Any]:
        """meta.json; MetaError naming the file when it is missing or damaged (written durably since, so
        damage means a crash of an older version or of the disk)."""
        try:
            text = durable.read_text(self.meta_path)
        except FileNotFoundError:
            raise MetaError(f"{self.meta_path}: no meta.json (not a job folder, or it was removed)") from None
        except OSError as err:
            raise MetaError(f"{self.meta_path}: unreadable ({err})") from None
        except ValueError:
            raise MetaError(f"{self.meta_path}: not UTF-8 text (damaged)") from None
        try:
            meta = json.loads(text)
        except ValueError as err:
            state = "empty" if not text.strip() else f"truncated or not JSON ({err})"
            raise MetaError(f"{self.meta_path}: {state}") from None
        if not isinstance(meta, dict):
            raise MetaError(f"{self.meta_path}: not a JSON object")
        return meta

    def update_meta(self, **fields: Any) -> None:
        _write_json(self.meta_path, {**self.meta(), **fields}, indent=2)

    def write_supervisor_address(self, **address: Any) -> None:
        """Publish the control server's address (written whole: an agent may be reading already)."""
        _write_json(self.supervisor_file, address)

    def supervisor_address(self) -> dict[str, Any] | None:
        """The control server's address, or None before the supervisor published it."""
        try:
            address = json.loads(durable.read_text(self.supervisor_file))
        except (OSError, ValueError):  # not written yet, or damaged: a supervisor rewrites it when it starts
            return None
        if not isinstance(address, dict) or not isinstance(address.get("host"), str) \
                or not isinstance(address.get("port"), int):
            return None
        return address


def _write_json(path: Path, value: Any, indent: int | None = None) -> None:
    """Write a JSON file so that a reader sees the old or the new content, never a part, and a crash
    keeps one of them (cluster/durable.py)."""
    durable.write_json(path, value, indent=indent)


def create_job_dir(recipe: Recipe, job_root: str | os.PathLike[str] | None = None) -> JobDir:
    """A new, uniquely named job folder holding the resolved recipe and a fresh secret."""
    import yaml

    from oobleck_slurm.recipe import recipe_to_dict

    root = Path(job_root if job_root is not None else recipe.cluster.job_root)
    root.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for attempt in range(1000):  # two submits in the same second get distinct folders
        job_id = f"{recipe.name}-{stamp}" + (f"-{attempt}" if attempt else "")
        path = root / job_id
        try:
            path.mkdir()
            break
        except FileExistsError:
            continue
    else:
        raise RuntimeError(f"could not create a job folder under {root}")
    durable.write_text(path / RECIPE_FILE,
                       f"# resolved from {recipe.source}\n" + yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False))
    _write_json(path / META_FILE, {
        "job_id": job_id, "backend": recipe.cluster.backend, "recipe": recipe.name,
        "recipe_source": recipe.source, "created": time.time(),
    }, indent=2)
    create_secret(path)
    (path / LOGS_DIR).mkdir()
    return JobDir(path.resolve(), job_id)


def find_job(
    name: str | os.PathLike[str], job_root: str | os.PathLike[str] = "jobs", *, needs_meta: bool = True
) -> JobDir:
    """The job folder a user's JOB argument names: a folder (or its events.jsonl), or a job id under
    `job_root` (a unique prefix is enough). Raises JobNotFound saying what was looked for, and where.

    needs_meta=False also takes a folder holding only an event log (a copied job): the log is all
    `dashboard` and `report` read, while `status`, `cancel` and `kill-node` need meta.json.
    """
    markers = (META_FILE,) if needs_meta else (META_FILE, EVENTS_FILE)

    def is_job(folder: Path) -> bool:
        return any((folder / marker).is_file() for marker in markers)

    path = Path(name)
    if path.name == EVENTS_FILE and path.is_file():
        path = path.parent
    if is_job(path):
        return JobDir(path.resolve(), path.resolve().name)
    looked = f"looked for {' or '.join(str(path / marker) for marker in markers)}"
    # Only a bare name can be a job id; a path that is not a job folder has nothing to look up.
    if len(path.parts) != 1 or path.name in (".", ".."):
        raise JobNotFound(f"no job folder {str(name)!r} ({looked})")
    root = Path(job_root)
    if not root.is_dir():
        raise JobNotFound(f"no job folder {str(name)!r} ({looked}; no job root {root} to look up job ids in)")
    candidates = sorted(p for p in root.iterdir() if p.name.startswith(path.name) and is_job(p))
    exact = [p for p in candidates if p.name == path.name]
    if exact or len(candidates) == 1:
        found = (exact or candidates)[0]
        return JobDir(found.resolve(), found.name)
    if candidates:
        raise JobNotFound(f"{str(name)!r} matches several jobs under {root}: {', '.join(p.name for p in candidates)}")
    raise JobNotFound(f"no job folder {str(name)!r} ({looked}, and for jobs named {path.name}* under {root})")


# ---- the secret: authenticates every control-plane connection (protocol/wire.py) ------------------
# Anyone who can read it can steer the job, so a file that others can read is refused rather than used.


def create_secret(job_dir: str | os.PathLike[str]) -> bytes:
    """Write a fresh secret for a new job; refuses to overwrite an existing one."""
    path = Path(job_dir) / SECRET_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    value = secrets.token_bytes(SECRET_BYTES)
    # O_EXCL + mode at creation: the file is never visible with wider permissions.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(value.hex() + "\n")
    return value


def load_secret(job_dir: str | os.PathLike[str]) -> bytes:
    path = Path(job_dir) / SECRET_FILE
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise SecretError(f"{path}: job secret not found (was the job created by `submit`?)") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SecretError(f"{path}: job secret is accessible by other users (mode {stat.S_IMODE(mode):o}); "
                          "expected 600")
    text = path.read_text().strip()
    try:
        value = bytes.fromhex(text)
    except ValueError:
        raise SecretError(f"{path}: job secret is not hex text") from None
    if len(value) != SECRET_BYTES:
        raise SecretError(f"{path}: job secret has {len(value)} bytes, expected {SECRET_BYTES}")
    return value
