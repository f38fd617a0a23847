"""Requests to a running job's workers through its folder (engine/requests.py): `profile-steps` traces,
and on a hang verdict every worker's stacks and flight recorder saved before the hung node is stopped.
Real supervisor, agents and workers on the local backend; the CLI as a process."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
from job_events import running_job, wait_for

from oobleck_slurm.commands.profile_steps import steps_window
from oobleck_slurm.engine.requests import RequestWatcher, file_stem, request_dumps, write_request

REPO = Path(__file__).resolve().parents[2]
WORKERS = ["node1:0", "node2:0", "node3:0", "node4:0"]


def test_steps_window() -> None:
    assert steps_window("3:7", 10, 0.5, 0.5) == (3, 7)
    # next 2 steps after step 10 at 0.1 s a step: two polls of 0.5 s are 10 steps, plus one
    assert steps_window("2", 10, 0.1, 0.5) == (22, 24)
    assert steps_window("2", None, None, 0.5) == (2, 4)  # nothing trained yet
    for bad in ("0", "5:5", "-1:3"):
        with pytest.raises(ValueError):
            steps_window(bad, 10, 0.1, 0.5)


def test_a_dump_request_is_served_by_each_watcher_thread(tmp_path: Path) -> None:
    write_request(tmp_path / "dump_request.json", reason="an old one")  # before the workers: not for them
    watchers = [RequestWatcher(tmp_path, w, 0.05, lambda: 7) for w in WORKERS[:2]]
    assert all(w.trace is None for w in watchers)
    ident, done, missing = request_dumps(tmp_path, "test", WORKERS[:3], wait=2.0)
    assert ident == 2 and done == WORKERS[:2] and missing == WORKERS[2:3]  # no watcher for node3: waited out
    folder = tmp_path / "dumps" / "2"
    assert not (tmp_path / "dumps" / "1").exists()
    for w in WORKERS[:2]:
        stacks = (folder / f"{file_stem(w)}.stacks.txt").read_text()
        assert f"# worker {w} rank 7" in stacks and "in _run" in stacks  # the watcher thread's own stack
        # no recorder in this process (TORCH_FR_BUFFER_SIZE unset): stacks only
        assert json.loads((folder / f"{file_stem(w)}.done").read_text()) == {"rank": 7, "files": [f"{file_stem(w)}.stacks.txt"]}
    write_request(tmp_path / "trace_request.json", start=5, stop=8)
    deadline = time.monotonic() + 10
    while any(w.trace is None for w in watchers) and time.monotonic() < deadline:
        time.sleep(0.01)  # the threads look every 50 ms
    assert [(w.trace.id, w.trace.start, w.trace.stop) if w.trace else None for w in watchers] == [(1, 5, 8)] * 2


@pytest.mark.slow
def test_profile_steps_writes_a_chrome_trace_per_worker(tmp_path: Path, templates_cache: Path) -> None:
    with running_job(tmp_path, "  checkpoint_interval: 0\n", templates_cache) as job:
        wait_for(job, "a step", lambda ev: [e for e in ev if e["kind"] == "step"])
        cli = subprocess.run([sys.executable, "-m", "oobleck_slurm", "profile-steps", str(job), "--steps", "2"],
                             cwd=REPO, capture_output=True, text=True, timeout=120)
        assert cli.returncode == 0, cli.stderr
        (request,) = wait_for(job, "trace_requested", lambda ev: [e for e in ev if e["kind"] == "trace_requested"])
        assert request["stop"] - request["start"] == 2 and f"traces/{request['id']}/" in cli.stdout
        written = wait_for(job, "4 traces", lambda ev: (w := [e for e in ev if e["kind"] == "trace_written"])
                           and len(w) >= 4 and w)
    assert sorted(e["node"] for e in written) == ["node1", "node2", "node3", "node4"]
    assert sorted(e["rank"] for e in written) == [0, 1, 2, 3]
    for e in written:
        assert (e["start"], e["stop"]) == (request["start"], request["stop"])  # every worker saw it in time
        path = Path(e["path"])
        assert path.parent == job / "traces" / str(request["id"])
        names = {x.get("name", "") for x in json.loads(path.read_text())["traceEvents"]}
        assert any(n.startswith("aten::") for n in names)  # the step's torch operators, traced


@pytest.mark.slow
def test_a_hang_verdict_saves_every_worker_s_stacks_and_flight_recorder_first(tmp_path: Path,
                                                                              templates_cache: Path) -> None:
    # node3's worker hangs (sleeps) at the start of step 4 while its process stays runnable: per-rank
    # progress names it hung (tests/supervisor/test_hung_running_worker.py); gloo's flight recorder on
    with running_job(tmp_path, "  checkpoint_interval: 0\n  step_timeout: 4.0\n  collective_timeout: 1.0\n"
                               "  heartbeat_lease: 2.0\n  reconfiguration_timeout: 60\n  replacement: none\n",
                     templates_cache, [{"node": "node3", "step": 4, "at": "start", "do": "hang"}],
                     sections="logging:\n  flight_recorder: 200\n") as job:
        lost = wait_for(job, "node3 lost", lambda ev: [e for e in ev if e["kind"] == "node_lost"], 180)
        kinds = [(e["kind"], e.get("node")) for e in wait_for(job, "events", lambda ev: ev)]
    assert [(e["node"], e["cause"]) for e in lost] == [("node3", "hung")]
    (dump,) = [e for e in wait_for(job, "hang_dump", lambda ev: [e for e in ev if e["kind"] == "hang_dump"])]
    assert kinds.index(("hang_dump", None)) < kinds.index(("node_lost", "node3"))  # before the stop
    assert dump["nodes"] == ["node3"] and sorted(dump["dumped"]) == WORKERS and dump["missing"] == []
    folder = Path(dump["folder"])
    hung = (folder / "node3-0.stacks.txt").read_text()
    assert "faults.py" in hung and "Thread" in hung  # the hung training thread, in the fault's sleep
    ranks = sorted(json.loads((folder / f"{file_stem(w)}.done").read_text())["rank"] for w in WORKERS)
    assert ranks == [0, 1, 2, 3]
    for rank in ranks:
        trace = pickle.loads((folder / "flight_recorder" / f"rank_{rank}").read_bytes())
        names = {entry["profiling_name"] for entry in trace["entries"]}
        assert any(n.startswith("gloo:") for n in names), names  # the collectives and p2p ops of the steps

