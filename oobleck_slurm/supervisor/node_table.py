"""A node's life in the supervisor's node table: pure states, events and the transitions between them,
and the records `AgentNodes` (agent_nodes.py) keeps per node id.

One `NodeRecord` per node id holds everything about the node (its Slurm node, agent connection,
srun step, replacement request, trust, fault time, loss) and its `NodeState`. The state changes only
through `transition(state, event)`, by this table (a dot: the event is refused in that state,
`transition` raises IllegalTransition):

    state           register      assign  start_worker  check_health  await_agent     stop       finish    lose  adopt
    launching       idle          .       .             .             awaiting_agent  launching  .         lost  running
    spare           spare         idle    .             .             .               .          .         .     .
    requested       idle          .       .             .             awaiting_agent  requested  .         .     .
    idle            idle          .       running       health_check  awaiting_agent  idle       .         .     .
    awaiting_agent  health_check  .       .             .             .               idle       .         .     .
    health_check    .             .       running       .             .               idle       .         lost  .
    running         .             .       .             .             .               idle       finished  lost  .
    finished        .             .       running       .             awaiting_agent  finished   .         .     .
    lost            .             .       lost          lost          lost            lost       lost      .     .

States: `launching` an allocation member whose agent's step is launched and has not registered;
`spare` an allocation node held in reserve (its agent waits); `requested` a replacement asked of Slurm;
`idle` an agent may be up, no worker runs (before the start, or stopped by the coordinator);
`awaiting_agent` started by the coordinator before its agent registered (a replacement whose job has
not started); `health_check` a joining node proves it can run a collective and passes the pre-flight
check (an initial member, with pre-flight on, waits here for the start's verdicts); `running` its workers run
and every detection path watches it; `finished` its workers completed training; `lost` named lost by
the first evidence, or its join failed: reported to the coordinator once, fenced, never started again
under this id (a start, stop or finish that races with the report leaves it lost).
Events: `register` its agent registered; `assign` `new_node` hands a spare to the coordinator;
`start_worker` its workers start (a trusted node: an initial member or one that ran before, or one
that passed its health check); `check_health` the coordinator starts an untrusted node whose agent is
up, or an initial member whose pre-flight verdict is pending or refused; `await_agent` the coordinator
starts a node whose agent is not up; `stop` the coordinator stops it; `finish` every worker exited 0;
`lose` a detection path named it, or its health check failed, or (after a supervisor's takeover) its
agent did not come back; `adopt` after a takeover, its agent came
back with its workers running (`adopt_agents`).
"""

from __future__ import annotations

import queue
import subprocess
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

from oobleck_slurm.errors import InternalError
from oobleck_slurm.protocol.messages import HealthResult, Heartbeat, Message
from oobleck_slurm.protocol.wire import Channel
from oobleck_slurm.supervisor.membership import STOPPED_STATES, Loss

if TYPE_CHECKING:
    from oobleck_slurm.agent.warm import WarmProcess

# ---- a node's life: pure ---------------------------------------------------------------------------

class NodeState(StrEnum):
    LAUNCHING = "launching"
    SPARE = "spare"
    REQUESTED = "requested"
    IDLE = "idle"
    AWAITING_AGENT = "awaiting_agent"
    HEALTH_CHECK = "health_check"
    RUNNING = "running"
    FINISHED = "finished"
    LOST = "lost"


class NodeEvent(StrEnum):
    REGISTER = "register"
    ASSIGN = "assign"
    START_WORKER = "start_worker"
    CHECK_HEALTH = "check_health"
    AWAIT_AGENT = "await_agent"
    STOP = "stop"
    FINISH = "finish"
    LOSE = "lose"
    ADOPT = "adopt"


_S, _E = NodeState, NodeEvent
TRANSITIONS: dict[tuple[NodeState, NodeEvent], NodeState] = {
    (_S.LAUNCHING, _E.REGISTER): _S.IDLE,
    (_S.LAUNCHING, _E.AWAIT_AGENT): _S.AWAITING_AGENT,
    (_S.LAUNCHING, _E.STOP): _S.LAUNCHING,
    (_S.LAUNCHING, _E.ADOPT): _S.RUNNING,  # after a takeover: its agent came back with its workers running
    (_S.LAUNCHING, _E.LOSE): _S.LOST,  # after a takeover: its agent did not come back
    (_S.SPARE, _E.REGISTER): _S.SPARE,
    (_S.SPARE, _E.ASSIGN): _S.IDLE,
    (_S.REQUESTED, _E.REGISTER): _S.IDLE,
    (_S.REQUESTED, _E.AWAIT_AGENT): _S.AWAITING_AGENT,
    (_S.REQUESTED, _E.STOP): _S.REQUESTED,
    (_S.IDLE, _E.REGISTER): _S.IDLE,  # its agent had gone (the backend refuses a second agent)
    (_S.IDLE, _E.START_WORKER): _S.RUNNING,
    (_S.IDLE, _E.CHECK_HEALTH): _S.HEALTH_CHECK,
    (_S.IDLE, _E.AWAIT_AGENT): _S.AWAITING_AGENT,
    (_S.IDLE, _E.STOP): _S.IDLE,
    (_S.AWAITING_AGENT, _E.REGISTER): _S.HEALTH_CHECK,  # a node that was not up is checked before it joins
    (_S.AWAITING_AGENT, _E.STOP): _S.IDLE,
    (_S.HEALTH_CHECK, _E.START_WORKER): _S.RUNNING,
    (_S.HEALTH_CHECK, _E.STOP): _S.IDLE,  # the check's result is then ignored
    (_S.HEALTH_CHECK, _E.LOSE): _S.LOST,
    (_S.RUNNING, _E.STOP): _S.IDLE,
    (_S.RUNNING, _E.FINISH): _S.FINISHED,
    (_S.RUNNING, _E.LOSE): _S.LOST,
    (_S.FINISHED, _E.START_WORKER): _S.RUNNING,  # a restart from a checkpoint
    (_S.FINISHED, _E.AWAIT_AGENT): _S.AWAITING_AGENT,
    (_S.FINISHED, _E.STOP): _S.FINISHED,
    # Lost is final; what races with its report changes nothing. It is reported once: no second loss.
    **{(_S.LOST, e): _S.LOST for e in (_E.START_WORKER, _E.CHECK_HEALTH, _E.AWAIT_AGENT, _E.STOP, _E.FINISH)},
}


class IllegalTransition(InternalError):
    """An event that a node's state does not allow (see the module's table)."""


def transition(state: NodeState, event: NodeEvent) -> NodeState:
    """The state after `event`; IllegalTransition if `state` does not allow it."""
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise IllegalTransition(f"a node in state {state} cannot {event}") from None


def transition_table() -> str:
    """TRANSITIONS as the module docstring shows it (a test keeps the two the same)."""
    rows = [["state", *[str(e) for e in NodeEvent]]]
    rows += [[str(s), *[str(TRANSITIONS.get((s, e), ".")) for e in NodeEvent]] for s in NodeState]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("    " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def node_worker_state(states: Sequence[str]) -> str:
    """One state for a node's workers: "stopped" if any is stopped (a SIGSTOPped worker stalls the
    whole node), else the first worker's, "none" before any started."""
    if not states:
        return "none"
    stopped = [s for s in states if s in STOPPED_STATES]
    return str(stopped[0] if stopped else states[0])


# ---- records ---------------------------------------------------------------------------------------

@dataclass
class AgentConn:
    """A registered agent's control connection."""

    channel: Channel
    pid: int | None = None  # the agent's process id on its node (local drills find the node's processes by it)
    lock: threading.Lock = field(default_factory=threading.Lock)
    checks: dict[str, queue.Queue[HealthResult]] = field(default_factory=dict)  # health check prefix -> its result

    def send(self, message: Message) -> bool:
        try:
            with self.lock:
                self.channel.send(message.to_dict())
            return True
        except OSError:
            return False


@dataclass
class NodeRecord:
    """Everything the backend knows about one coordinator node id."""

    node_id: str
    state: NodeState
    slurm_node: str | None  # the machine; None for a replacement until its agent registers
    replacement: bool = False  # a requested node, known by its token until then
    request: str | None = None  # the replacement's Slurm job id (local: the agent's pid)
    trusted: bool = False  # its workers may start without a health check (an initial member, or it ran)
    agent: AgentConn | None = None
    step: subprocess.Popen | WarmProcess | None = None  # the srun step (local: the process) running its agent, until it ends
    last_beat: Heartbeat | None = None
    fault_at: float | None = None  # when a drill injected a fault (detection times are measured from it)
    health_check: str | None = None  # the store prefix of the health check in progress
    loss: Loss | None = None
