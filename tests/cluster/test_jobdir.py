"""find_job: the JOB argument of every command (a folder, its event log, or a job id) -> the job folder."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from oobleck_slurm.cluster.jobdir import META_FILE, JobDir, JobNotFound, find_job
from oobleck_slurm.protocol.events import events_path


def make_job(root: Path, job_id: str, *, meta: bool = True, log: bool = True) -> Path:
    folder = root / job_id
    folder.mkdir(parents=True)
    if meta:
        (folder / META_FILE).write_text(f'{{"job_id": "{job_id}"}}')
    if log:
        events_path(folder).write_text('{"t": 1.0, "kind": "job_started"}\n')
    return folder


def test_a_folder_its_event_log_or_a_job_id(tmp_path: Path) -> None:
    folder = make_job(tmp_path / "jobs", "tiny-20260101-120000")
    for name in (folder, str(folder), events_path(folder)):
        job = find_job(name, tmp_path / "elsewhere")
        assert (job.path, job.job_id) == (folder.resolve(), "tiny-20260101-120000")
    assert find_job("tiny-20260101-120000", tmp_path / "jobs").path == folder.resolve()
    assert find_job("tiny-2026", tmp_path / "jobs").meta() == {"job_id": "tiny-20260101-120000"}


def test_an_exact_id_wins_over_longer_ones_and_an_ambiguous_prefix_names_them(tmp_path: Path) -> None:
    root = tmp_path / "jobs"
    make_job(root, "run-1")
    make_job(root, "run-1-1")
    make_job(root, "run-2")
    assert find_job("run-1", root).job_id == "run-1"
    with pytest.raises(JobNotFound, match=r"'run' matches several jobs under .*jobs: run-1, run-1-1, run-2$"):
        find_job("run", root)


def test_a_copied_event_log_is_a_job_only_for_readers_of_the_log(tmp_path: Path) -> None:
    copied = make_job(tmp_path, "copied", meta=False)
    assert find_job(copied, needs_meta=False).path == copied.resolve()
    assert find_job("cop", tmp_path, needs_meta=False).job_id == "copied"
    with pytest.raises(JobNotFound, match=f"looked for copied/{META_FILE}, and for jobs named copied"):
        find_job("copied", tmp_path)
    pending = make_job(tmp_path, "pending", log=False)  # submitted, no event yet: the dashboard waits for it
    assert find_job(pending, needs_meta=False).job_id == "pending"


def test_not_found_says_what_was_looked_for_and_where(tmp_path: Path) -> None:
    root = tmp_path / "jobs"
    make_job(root, "tiny-1")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(JobNotFound) as err:
        find_job(empty, root, needs_meta=False)
    # A path is not looked up under the job root, so the message names only the folder.
    assert str(err.value) == (f"no job folder {str(empty)!r} "
                              f"(looked for {empty / META_FILE} or {events_path(empty)})")
    with pytest.raises(JobNotFound) as err:
        find_job("nope", root)
    assert str(err.value) == f"no job folder 'nope' (looked for nope/{META_FILE}, and for jobs named nope* under {root})"
    with pytest.raises(JobNotFound, match=r"no job root .*missing to look up job ids in"):
        find_job("tiny-1", tmp_path / "missing")
    with pytest.raises(JobNotFound, match=r"^no job folder '\.'"):  # not "the only job under the root"
        find_job(".", root)


def test_commands_report_a_bad_job_in_one_line_without_a_traceback(tmp_path: Path) -> None:
    make_job(tmp_path / "jobs", "copied", meta=False)
    for command in ("status", "events", "cancel", "kill-node", "dashboard", "report"):
        argv = [command, "nope", "node1"] if command == "kill-node" else [command, "nope"]
        done = subprocess.run([sys.executable, "-m", "oobleck_slurm", *argv], cwd=tmp_path, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 2, (command, done.stderr)
        assert done.stderr.strip() == (f"error: no job folder 'nope' (looked for nope/{META_FILE}"
                                       + (" or nope/events.jsonl" if command in ("dashboard", "report") else "")
                                       + ", and for jobs named nope* under jobs)"), command
    # `status` needs meta.json: a copied log is refused with a message, not a KeyError or traceback.
    done = subprocess.run([sys.executable, "-m", "oobleck_slurm", "status", "copied"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "looked for copied/meta.json" in done.stderr and "Traceback" not in done.stderr


def test_every_file_of_a_job_folder_is_named_by_jobdir(tmp_path: Path) -> None:
    job = JobDir.at(tmp_path / "j")
    assert job.job_id == "j" and job.path == (tmp_path / "j").resolve()
    names = {p.relative_to(job.path).as_posix() for p in (
        job.recipe_path, job.meta_path, job.events, job.profile, job.faults, job.job_spec, job.elastic,
        job.supervisor_file, job.cancel_marker, job.requeue_marker, job.data, job.checkpoints, job.logs,
        job.submitit, job.agent_log("node2"), job.worker_log("r1", 3))}
    assert names == {"recipe.yaml", "meta.json", "events.jsonl", "profile.json", "faults.json", "job.json",
                     "elastic.json", "supervisor.json", "cancelled", "requeue", "data", "checkpoints", "logs",
                     "submitit", "logs/agent-node2.log", "logs/worker-r1-3.log"}
    assert events_path(job.path) == job.events


def test_the_supervisor_address_is_absent_until_written_whole(tmp_path: Path) -> None:
    job = JobDir.at(tmp_path)
    assert job.supervisor_address() is None
    job.supervisor_file.write_text('{"host": "node1", "po')  # a writer that is not atomic, mid-write
    assert job.supervisor_address() is None
    job.supervisor_file.write_text('{"host": "node1"}')  # no port: not an address
    assert job.supervisor_address() is None
    job.write_supervisor_address(host="node1", port=4242, heartbeat_interval=1.0)
    assert job.supervisor_address() == {"host": "node1", "port": 4242, "heartbeat_interval": 1.0}
    assert [p.name for p in tmp_path.iterdir()] == ["supervisor.json"]  # no temporary file left
