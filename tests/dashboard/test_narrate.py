"""`submit` without a terminal (dashboard/narrate.py): recorded runs' events as sentences, step lines every
few steps, and a summary that names what happened, with durations rounded for people."""

from __future__ import annotations

import json
from pathlib import Path

from oobleck_slurm.dashboard.narrate import Narrator, seconds, summary_lines

LOGS = Path(__file__).resolve().parent / "logs"


def narrate(name: str) -> tuple[list[dict], list[str]]:
    events = [json.loads(line) for line in (LOGS / f"{name}.jsonl").read_text().splitlines() if line.strip()]
    narrator = Narrator()
    return events, [line for e in events for line in narrator.lines(e)]


def test_a_failure_and_a_join_read_as_sentences() -> None:
    events, lines = narrate("join")
    (lost,) = [e for e in events if e["kind"] == "node_lost"]
    resumed = next(e for e in events if e["kind"] == "resumed")  # the failure's (the join's comes later)
    (joined,) = [e for e in events if e["kind"] == "node_joined"]
    step = next(e["step"] for e in events if e["kind"] == "failure")
    assert f"node2 lost at step {step}: its agent stopped answering, detected in {seconds(lost['detection_seconds'])}" in lines
    assert (f"training resumed at step {resumed['step']}, {seconds(resumed['total_seconds'])} after the fault; "
            "no checkpoint loaded") in lines
    assert f"replacement r1 joined: training goes on with it, the change took {seconds(joined['seconds'])}" in lines
    assert lines[0].startswith("job dash-join-") and "started on 4 nodes (local backend): 80 steps" in lines[0]
    assert lines[-1].startswith("job completed after ")
    assert not [line for line in lines if "=" in line or "{" in line]  # no field dumps


def test_a_replacement_that_joins_as_a_spare_is_not_said_to_train() -> None:
    narrator = Narrator()
    narrator.lines({"t": 1.0, "kind": "plan", "generation": 2, "reason": "join",
                    "pipelines": [{"id": 0, "nodes": ["node1", "node3"], "microbatches": 8, "stages": []}],
                    "spares": ["r1"]})
    (line,) = narrator.lines({"t": 2.0, "kind": "node_joined", "node": "r1", "generation": 2, "seconds": 0.5})
    assert line.startswith("replacement r1 joined as a spare (the plan keeps its pipelines)"), line


def test_a_skipped_step_is_said_whatever_its_number() -> None:
    (line,) = Narrator().lines({"t": 1.0, "kind": "step", "step": 7, "loss": float("nan"),
                                "grad_norm": float("nan"), "skipped": True})
    assert line == "step 7 skipped: gradient norm nan (not finite); parameters and optimizer state unchanged"


def test_a_loss_spike_skip_and_stop_are_said_with_their_figures() -> None:
    narrator = Narrator()
    (line,) = narrator.lines({"t": 1.0, "kind": "step", "step": 9, "loss": 7.5, "grad_norm": 3.0, "skipped": True,
                              "skip_reason": "loss_spike", "loss_threshold": 4.25})
    assert line == ("step 9 skipped: loss 7.5000 above the spike bar 4.2500 (training.loss_spike); parameters "
                    "and optimizer state unchanged")
    (line,) = narrator.lines({"t": 2.0, "kind": "loss_spike_stop", "step": 12, "spikes": [10, 11, 12],
                              "message": "training.loss_spike: 3 loss spikes in a row"})
    assert line == "training.loss_spike: 3 loss spikes in a row"  # the message says what follows
    (line,) = narrator.lines({"t": 3.0, "kind": "loss_spike_rollback", "step": 12, "spikes": [10, 11, 12],
                              "checkpoint": 8, "data_step": 13, "skipped_samples": 40, "rollback": 1,
                              "max_rollbacks": 3})
    assert line == ("rolling back after loss spikes at steps [10, 11, 12]: every worker restarts from the checkpoint "
                    "of step 8 and reads on from step 13's samples, 40 samples skipped (rollback 1 of 3, "
                    "training.loss_spike)")


def test_step_lines_every_few_steps_and_the_last() -> None:
    events, lines = narrate("healthy")
    total = next(e["steps"] for e in events if e["kind"] == "job_started")
    shown = [int(line.split()[1].split("/")[0]) for line in lines if line.startswith("step ")]
    every = max(1, total // 20)
    assert shown == sorted({*range(0, total, every), total - 1})
    assert all(f"/{total}: loss " in line and line.endswith(" samples/s") for line in lines if line.startswith("step "))


def test_the_summary_names_each_failure_its_recovery_and_the_join_apart() -> None:
    events, _ = narrate("join")
    resumed = next(e for e in events if e["kind"] == "resumed")  # the failure's (the join's comes later)
    (joined,) = [e for e in events if e["kind"] == "node_joined"]
    summary = summary_lines(events)
    assert summary[0].startswith("summary: completed in ") and summary[0].endswith("; 80 of 80 steps; 1 failure")
    assert summary[1].endswith(f"training resumed {seconds(resumed['total_seconds'])} after the fault")
    assert summary[2] == f"  replacement r1 joined (the change took {seconds(joined['seconds'])})"
    assert summary[3] == "  the trajectory went on unchanged: every step trained, no checkpoint loaded"
    healthy, _ = narrate("healthy")
    assert summary_lines(healthy)[0].endswith("no failure") and len(summary_lines(healthy)) == 1


def test_durations_are_rounded_for_people() -> None:
    assert [seconds(s) for s in (0.2149, 3.4567, 51.98245, 185.2)] == ["0.21 s", "3.5 s", "52 s", "3 min 05 s"]


def test_a_metrics_flag_says_whether_the_node_was_evicted_or_only_reported() -> None:
    flag = {"t": 1.0, "kind": "faulty_node", "node": "node3", "detail": "procs.rss_gib 6.1 spreads above its peers"}
    (reported,) = Narrator().lines({**flag, "action": "report"})
    assert reported.startswith("node3 flagged from its metrics (procs.rss_gib") and "reported only, it keeps training" in reported
    (evicted,) = Narrator().lines({**flag, "action": "evict"})
    assert evicted.endswith(": evicting it")


def test_a_pre_flight_refusal_is_said_with_its_reason_and_an_admission_is_not() -> None:
    narrator = Narrator()
    refused = {"t": 1.0, "kind": "preflight", "node": "node5", "at": "join", "admitted": False,
               "reason": "matmul 11.05 GFLOP/s is 0.12 x the fleet's median 93.07 (below 0.7)"}
    assert narrator.lines(refused) == ["node5 refused by the pre-flight check before it joined: matmul 11.05 GFLOP/s "
                                       "is 0.12 x the fleet's median 93.07 (below 0.7)"]
    assert narrator.lines({**refused, "at": "start"})[0].startswith("node5 refused by the pre-flight check at the start")
    assert narrator.lines({**refused, "admitted": True, "reason": None}) == []
    (line,) = narrator.lines({**refused, "at": "start", "admitted": True,
                              "reason": "not refused (the nodes share a machine): matmul 40 GFLOP/s is 0.4 x"})
    assert line == "node5 measured slow at the start, not refused (the nodes share a machine): matmul 40 GFLOP/s is 0.4 x"


def test_a_step_line_gives_tokens_per_device_and_mfu_when_the_event_has_them() -> None:
    narrator = Narrator()
    step = {"t": 1.0, "kind": "step", "step": 0, "loss": 2.5, "samples_per_s": 10.0,
            "tokens_per_s_per_device": 2048.4}
    assert narrator.lines(step) == ["step 0: loss 2.5000, 10.0 samples/s, 2,048 tokens/s per device"]
    assert narrator.lines({**step, "mfu": 0.412}) == [
        "step 0: loss 2.5000, 10.0 samples/s, 2,048 tokens/s per device, MFU 41.2%"]
