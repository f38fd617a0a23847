"""How the supervisor ends (supervisor/main.py `run_supervisor`): the error's class (errors.py) gives
the exit code Slurm records and the `requeue` the job's meta records, which `SupervisorJob.checkpoint`
follows. A coordinator's run timeout is a failed run that a requeue may finish, not "unrecoverable".
Unit level: the coordinator runs against a backend that starts nothing; no process is started."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import submitit
import torch.distributed as dist
from planning_helpers import make_profile

from oobleck_slurm.cluster.jobdir import REQUEUE_MARKER, SUPERVISOR_ERROR, JobDir
from oobleck_slurm.detection.health import Rebalance
from oobleck_slurm.exit_codes import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_UNRECOVERABLE
from oobleck_slurm.models import FactoryError
from oobleck_slurm.planning import generate_templates, instantiate
from oobleck_slurm.protocol.events import EventLog, read_events
from oobleck_slurm.supervisor import main as supervisor_main
from oobleck_slurm.supervisor.coordinator import CannotContinue, Coordinator, CoordinatorConfig, CoordinatorTimeout
from oobleck_slurm.supervisor.main import SupervisorJob, run_supervisor
from oobleck_slurm.supervisor.membership import Loss
from oobleck_slurm.supervisor.observer import StoreObserver
from oobleck_slurm.timeouts import JobTimeouts

NODES = ["n0", "n1", "n2", "n3"]
RUN_TIMEOUT_S = 0.2


class SilentNodes:
    """A NodeBackend whose nodes start and then neither finish nor fail: the run can only time out."""

    def start(self, node: str) -> None:
        pass

    def exited(self) -> dict[str, Loss | None]:
        return {}

    def stop(self, nodes: Sequence[str]) -> None:
        pass

    def new_node(self) -> str | None:
        return None

    def rebalances(self) -> list[Rebalance]:
        return []


def timed_out_coordinator(tmp_path: Path) -> Coordinator:
    profile = make_profile([0.03] * 4, memory=(4000 * 0.6 + 2000) / 0.9, state=[1000] * 4, out=[100] * 4)
    templates = generate_templates(profile, len(NODES), num_microbatches=8)
    plan = instantiate(templates, NODES, 1, 8)
    config = CoordinatorConfig(f=1, timeouts=JobTimeouts(run_timeout=RUN_TIMEOUT_S))
    store = dist.HashStore()
    # The observer is not started: no worker writes anything, the coordinator only has to time out.
    return Coordinator(store, SilentNodes(), templates, plan, [f"layer{i}" for i in range(4)],
                       EventLog(tmp_path / "coordinator-events.jsonl"), config, StoreObserver(store, config.timeouts),
                       total_steps=5)


def job_folder(tmp_path: Path) -> Path:
    job = tmp_path / "job-1"
    (job / "logs").mkdir(parents=True)
    (job / "meta.json").write_text(json.dumps({"status": "running"}))
    return job


def end_with(monkeypatch: pytest.MonkeyPatch, job: Path, error: BaseException | None = None,
             run: Any = None) -> int:
    """run_supervisor on `job` with its `_run` replaced: raising `error`, or calling `run`."""
    def fake_run(*_: Any) -> None:
        if run is not None:
            run()
        if error is not None:
            raise error

    monkeypatch.setattr(supervisor_main, "_run", fake_run)
    return run_supervisor(job, "local")


def test_the_coordinators_run_timeout_raises_the_timeout_kind(tmp_path: Path) -> None:
    coordinator = timed_out_coordinator(tmp_path)
    coordinator.start()
    with pytest.raises(CoordinatorTimeout, match=f"run exceeded its timeout of {RUN_TIMEOUT_S:g} s"):
        coordinator.run()


def test_a_run_timeout_ends_the_supervisor_with_a_requeue_allowed_code(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    job = job_folder(tmp_path)
    coordinator = timed_out_coordinator(tmp_path)

    def run() -> None:
        coordinator.start()
        coordinator.run()

    code = end_with(monkeypatch, job, run=run)

    assert code == EXIT_FAILED != EXIT_UNRECOVERABLE
    meta = JobDir.at(job).meta()
    assert (meta["status"], meta["exit_code"], meta["requeue"]) == ("failed", EXIT_FAILED, True)
    [finished] = read_events(job / "events.jsonl", "job_finished")
    assert finished["status"] == "failed" and finished["exit_code"] == EXIT_FAILED
    assert "CoordinatorTimeout" in finished["error"] and "CoordinatorTimeout" in (job / "logs" / SUPERVISOR_ERROR).read_text()
    # A preemption notice now finds a job that may go on: it is requeued.
    again = SupervisorJob(str(job)).checkpoint()
    assert isinstance(again, submitit.helpers.DelayedSubmission) and (job / REQUEUE_MARKER).exists()


@pytest.mark.parametrize(("error", "code", "status", "requeue"), [
    (CannotContinue("cannot continue: no complete checkpoint"), EXIT_UNRECOVERABLE, "unrecoverable", False),
    (FactoryError("model.factory", "not a callable"), EXIT_BAD_INPUT, "failed", False),
    (RuntimeError("a bug nobody named"), EXIT_FAILED, "failed", True),
], ids=["unrecoverable", "bad-input", "other"])
def test_the_error_class_gives_the_exit_code_and_the_requeue_decision(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: BaseException, code: int, status: str,
        requeue: bool) -> None:
    job = job_folder(tmp_path)
    assert end_with(monkeypatch, job, error) == code
    meta = JobDir.at(job).meta()
    assert (meta["exit_code"], meta["status"], meta["requeue"]) == (code, status, requeue)
    again = SupervisorJob(str(job)).checkpoint()
    assert (again is not None) == requeue and (job / REQUEUE_MARKER).exists() == requeue


def test_a_cancelled_job_is_cancelled_whatever_the_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    job = job_folder(tmp_path)
    JobDir.at(job).cancel_marker.write_text("x")
    assert end_with(monkeypatch, job, CoordinatorTimeout("run exceeded")) == EXIT_FAILED
    meta = JobDir.at(job).meta()
    assert (meta["status"], meta["requeue"]) == ("cancelled", False)


def test_a_completed_run_is_not_requeued(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    job = job_folder(tmp_path)
    assert end_with(monkeypatch, job) == 0
    assert JobDir.at(job).meta()["requeue"] is False
    assert SupervisorJob(str(job)).checkpoint() is None


@pytest.mark.parametrize("logged", [True, False])
def test_a_takeover_does_not_report_again_a_join_the_lost_supervisor_logged(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch,
                                                                           logged: bool) -> None:
    """The lost supervisor was killed between logging a join's recovery as resumed (`resumed`,
    `node_joined`) and writing its state (seen in the suite under load: `node_joined` twice). The
    standby's takeover then finds that recovery over; one not yet resumed in the log is carried on, its
    joins reported when the takeover's recovery resumes."""
    from oobleck_slurm.protocol.records import RecoveryState, SupervisorState
    from oobleck_slurm.supervisor.coordinator import Phase

    coordinator = timed_out_coordinator(tmp_path)
    if logged:
        coordinator.log.emit("resumed", generation=2, step=5, total_seconds=0.5, recovery=2, phase="replaying")
    seen: dict[str, Any] = {}
    monkeypatch.setattr(coordinator, "_change", lambda change: seen.update(recovery=coordinator.recovery,
                                                                            phase=coordinator.phase))
    state = SupervisorState(epoch=1, generation=2, members=tuple(NODES), plan=coordinator.plan.to_dict(),
                            start_step=5, phase="replaying",
                            recovery=RecoveryState(id=2, generation=2, t_start=1.0, step=5, started=1.0,
                                                   joined=("n3",)))
    coordinator.take_over(state)
    if logged:
        assert seen == {"recovery": None, "phase": Phase.RUNNING}
    else:
        assert seen["recovery"].joined == ("n3",) and seen["phase"] == Phase.REPLAYING


def test_a_takeover_before_the_first_step_starts_the_members_again(tmp_path: Path) -> None:
    """The lost supervisor died while the job started (seen in the suite under load: a lease lost 6 s
    into the default demo): members whose workers had not started could never report for generation 0,
    and the takeover's recovery waited for them until it gave the job up. It now starts them again, a
    generation later, from the seed."""
    from oobleck_slurm.protocol import keys, records
    from oobleck_slurm.protocol.records import GenerationConfig, SupervisorState

    calls: list[tuple[str, Any]] = []

    class Recorded(SilentNodes):
        def start(self, node: str) -> None:
            calls.append(("start", node))

        def stop(self, nodes: Sequence[str]) -> None:
            calls.append(("stop", tuple(nodes)))

    coordinator = timed_out_coordinator(tmp_path)
    coordinator.backend = Recorded()
    state = SupervisorState(epoch=1, generation=0, members=tuple(NODES), plan=coordinator.plan.to_dict(),
                            start_step=0, phase="running", trained=False)
    coordinator.take_over(state)
    assert calls == [("stop", tuple(NODES))] + [("start", n) for n in NODES]
    assert coordinator.gen == 1 and coordinator.store.get(keys.CURRENT_GEN) == b"1"
    config = records.get(coordinator.store, GenerationConfig, 1)
    assert (config.source, config.resume_step, config.members) == ("seed", 0, tuple(NODES))
    assert [e["reason"] for e in read_events(coordinator.log.path, "plan")] == ["initial"]
