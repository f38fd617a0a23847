"""cluster/slurm.py's clients against real, misbehaving Slurm clients (tests/fake_slurm.py): retries with
backoff, an unknown answer after the attempts (never "ended"), the counted RPCs, no cancel because one
squeue was slow."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from fake_slurm import FakeSlurm

from oobleck_slurm.cluster import slurm
from oobleck_slurm.cluster.jobdir import create_secret
from oobleck_slurm.recipe import load_recipe
from oobleck_slurm.supervisor.launchers import NodeJobLauncher, started_nodes
from oobleck_slurm.timeouts import JobTimeouts

# Fast but in the real proportions: a command timeout, then a doubling pause.
FAST = JobTimeouts(slurm_command=0.5, slurm_retry_backoff=0.05)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeSlurm:
    return FakeSlurm(tmp_path / "bin", monkeypatch)


def test_a_transient_failure_is_retried_and_the_answer_stands(fake: FakeSlurm) -> None:
    fake.client("squeue", "RUNNING\n", fail=2)
    before = slurm.client_calls()
    t0 = time.monotonic()
    assert slurm.in_queue("42", FAST) is True
    elapsed = time.monotonic() - t0
    assert fake.calls("squeue") == 3
    assert 0.05 + 0.1 <= elapsed < 5.0  # the two pauses: backoff, then twice it
    after = slurm.client_calls()
    assert (after["total"] - before["total"], after["failed"] - before["failed"]) == (3, 2)
    assert after["squeue"] - before.get("squeue", 0) == 3


def test_no_answer_after_every_attempt_is_unknown_never_ended(fake: FakeSlurm) -> None:
    fake.client("squeue", "RUNNING\n", fail=slurm.READ_ATTEMPTS)
    assert slurm.in_queue("42", FAST) is None
    assert fake.calls("squeue") == slurm.READ_ATTEMPTS
    with pytest.raises(slurm.SlurmUnavailable, match=r"attempt 3 of 3: the answer is unknown"):
        fake.client("squeue", "", fail=slurm.READ_ATTEMPTS)
        slurm.queued_jobs(["42"], FAST)


def test_a_client_that_sleeps_past_the_timeout_is_cut_off_and_retried(fake: FakeSlurm) -> None:
    fake.client("squeue", "PENDING\n", fail=1, how="sleep")
    t0 = time.monotonic()
    assert slurm.in_queue("42", FAST) is True
    elapsed = time.monotonic() - t0
    assert fake.calls("squeue") == 2
    assert FAST.slurm_command <= elapsed < FAST.slurm_command + 4.0  # one timeout, one pause, one answer
    fake.client("squeue", "PENDING\n", fail=slurm.READ_ATTEMPTS, how="sleep")
    t0 = time.monotonic()
    assert slurm.in_queue("42", FAST) is None
    # Every attempt waited its full timeout: 3 x 0.5 s + 0.05 + 0.1 s of pauses.
    assert 1.65 <= time.monotonic() - t0 < 8.0


def test_an_unknown_job_is_an_answer_gone_at_once(fake: FakeSlurm) -> None:
    fake.client("squeue")
    fake.refuse("squeue", "slurm_load_jobs error: Invalid job id specified")
    assert slurm.in_queue("42", FAST) is False
    assert fake.calls("squeue") == 1  # an answer: not retried
    assert slurm.queued_jobs(["42", "43"], FAST) == {}


@pytest.mark.parametrize(("listed", "answer"), [
    ("PENDING", True), ("RUNNING", True), ("COMPLETING", True), ("REQUEUED", True), ("", False),
    ("COMPLETED", False), ("CANCELLED", False), ("TIMEOUT", False), ("NODE_FAIL", False),
])
def test_a_job_listed_in_an_end_state_has_left(listed: str, answer: bool) -> None:
    assert slurm.queue_answer(listed + "\n") is answer


def test_cancelling_a_job_slurm_forgot_is_done_and_a_slow_scancel_is_retried(fake: FakeSlurm) -> None:
    fake.client("scancel", fail=1)
    slurm.cancel_jobs(["42"], FAST)
    assert fake.log("scancel") == ["42", "42"]
    fake.refuse("scancel", "scancel: error: Kill job error on job id 42: Invalid job id specified")
    slurm.cancel_jobs(["42"], FAST)  # already gone: what the cancel wanted


def test_the_steady_query_reads_node_states_and_local_commands_cost_no_rpc(fake: FakeSlurm) -> None:
    fake.client("scontrol", "NodeName=n1 State=ALLOCATED+DRAIN Reason=maint\nNodeName=n2 State=DOWN* Reason=x\n")
    before = slurm.client_calls()
    health = slurm.query_nodes(["n1", "n2"], timeouts=FAST)
    assert {n: (h.lost, h.advisory) for n, h in health.items()} == {"n1": (False, ("DRAIN",)), "n2": (True, ())}
    assert fake.log("scontrol") == ["show node -o n1,n2"]
    fake.answer("scontrol", "n1\nn2\n")
    assert slurm.expand_hostnames("n[1-2]") == ["n1", "n2"]
    after = slurm.client_calls()
    assert after["total"] - before["total"] == 1 and after["scontrol show"] - before.get("scontrol show", 0) == 1


def test_status_reads_sacct_with_retries(fake: FakeSlurm) -> None:
    fake.client("sacct", "COMPLETED|0:0|n1\n", fail=1)
    assert slurm.accounting("42", FAST) == "COMPLETED 0:0 n1"


def test_a_slow_squeue_never_cancels_the_node_jobs(tmp_path: Path, fake: FakeSlurm) -> None:
    """NodeJobLauncher.start_nodes waits for its node jobs through squeue: an answer that stays unknown
    for a whole query (every attempt failed), then a slow one, is waiting, not an ended job: it gets
    the nodes, and scancel is never run. sbatch is a real fake too (submitit parses its answer)."""
    job = tmp_path / "job"
    job.mkdir()
    (job / "meta.json").write_text("{}")
    create_secret(job)
    fake.client("sbatch", "Submitted batch job 4242\n")
    fake.client("squeue", "4242 RUNNING nodeA\n", fail=slurm.READ_ATTEMPTS + 1)
    fake.client("scancel")
    cluster = load_recipe(REPO / "recipes" / "gpt-1.3b-jureca.yaml").cluster
    launcher = NodeJobLauncher(job, cluster, "t")
    t0 = time.monotonic()
    assert launcher.start_nodes(1, timeout=60.0, poll=0.05) == ["nodeA"]
    # Default timeouts: the first query's pauses (1 s, 2 s), then one more pause of 1 s.
    assert 3.9 <= time.monotonic() - t0 < 30
    assert fake.calls("squeue") == slurm.READ_ATTEMPTS + 2 and fake.calls("scancel") == 0
    assert started_nodes(["4242"], None) is None  # pure: unknown is waiting
