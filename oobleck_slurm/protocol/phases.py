"""The coordinator's phases: the state in which each event of a membership change is written (the
events' `phase` field). Their transitions and the decisions that drive them are in
supervisor/decisions.py."""

from __future__ import annotations

from enum import StrEnum


class Phase(StrEnum):
    RUNNING = "running"  # training in generation g
    COLLECTING = "collecting"  # g aborted: survivors report their step and layers
    REBUILDING = "rebuilding"  # g+1 published: its workers build groups and copy layers
    RESTARTING = "restarting"  # no in-memory recovery: every worker restarts from a checkpoint
    REPLAYING = "replaying"  # rebuilt: the first step of the new generation runs
    ENDING = "ending"  # the run ended during a change: members stop
    CHECKPOINTING = "checkpointing"  # preemption: an on-demand checkpoint, then every worker stops
    DONE = "done"
