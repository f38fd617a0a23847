"""A run as sentences, for a log file or a pipe (`submit` without a terminal): step lines every few
steps, and each failure, recovery, join and the job's end as one sentence with its durations rounded.
Pure: events in, lines out (`Narrator.lines`), and the closing summary (`summary_lines`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

STEP_LINES = 20  # about this many step lines over a run (and always its first and last step)

# node_lost / failure causes, as the end of "node2 lost: ..."
CAUSES = {
    "process_exit": "its worker process exited",
    "agent_lost": "its agent stopped answering",
    "heartbeat": "it missed its heartbeats",
    "slurm_down": "Slurm marked it down",
    "srun_exit": "its Slurm step ended",
    "hung": "a rank stopped advancing",
    "faulty_metrics": "its metrics deviate (evicted)",
    "straggler": "it is too slow (evicted)",
    "replica_mismatch": "its copy of the model disagrees with its replicas' (evicted)",
}


def seconds(s: float | None) -> str:
    """A duration for people: 0.21 s, 3.4 s, 52 s, 3 min 05 s."""
    if s is None:
        return "? s"
    if s < 1:
        return f"{s:.2f} s"
    if s < 10:
        return f"{s:.1f} s"
    if s < 120:
        return f"{s:.0f} s"
    return f"{int(s // 60)} min {int(s % 60):02d} s"


def _nodes(names: Iterable[str]) -> str:
    names = list(names)
    return ", ".join(names[:-1]) + f" and {names[-1]}" if len(names) > 1 else (names[0] if names else "a node")


def _cause(cause: str | None) -> str:
    return ", ".join(CAUSES.get(c, c) for c in (cause or "").split(",") if c) or "cause unknown"


def _pipelines(plan: dict[str, Any]) -> str:
    sizes = [len(p.get("nodes", [])) for p in plan.get("pipelines", [])]
    return f"{len(sizes)} pipeline{'s' if len(sizes) != 1 else ''} ({' + '.join(map(str, sizes))} nodes)"


@dataclass
class Narrator:
    """Feed events in log order to `lines`; it keeps what a sentence needs from earlier events."""

    total_steps: int | None = None
    lost: dict[str, dict[str, Any]] = field(default_factory=dict)  # node -> its node_lost, until the failure
    reasons: dict[int, str] = field(default_factory=dict)  # generation -> its plan's reason
    spares: frozenset[str] = frozenset()  # the latest plan's nodes in no pipeline
    copied: int = 0  # bytes copied by the change in progress
    last_step: int | None = None

    def _every(self) -> int:
        return max(1, (self.total_steps or 0) // STEP_LINES)

    def lines(self, e: dict[str, Any]) -> list[str]:
        kind = e.get("kind")
        if kind == "job_started":
            self.total_steps = e.get("steps")
            spares = f" and {len(e['spares'])} spare(s)" if e.get("spares") else ""
            started = [f"job {e.get('job_id') or '?'} started on {len(e.get('nodes') or [])} nodes{spares} "
                       f"({e.get('backend') or '?'} backend): {self.total_steps} steps, surviving "
                       f"{e.get('f')} failure(s) at a time"]
            if e.get("resumed_from"):
                started.append(f"starting from another job's checkpoint: {e['resumed_from']}")
            return started
        if kind == "checkpoint" and e.get("ok") is False and e.get("worker"):
            return [f"checkpoint of step {e.get('step')} NOT written by {e['worker']} ({e.get('detail') or '?'}; "
                    f"{e.get('failures') or 1} failed so far): training goes on, the next interval tries again"]
        if kind == "plan":
            self.spares = frozenset(map(str, e.get("spares") or ()))
            if e.get("generation") is not None:
                self.reasons[int(e["generation"])] = str(e.get("reason"))
            return [f"plan: {_pipelines(e)}"] if e.get("reason") in ("initial", "requeue", None) else []
        if kind == "step":
            step = int(e["step"])
            self.last_step = step
            last = self.total_steps is not None and step == self.total_steps - 1
            if e.get("skipped"):  # said whatever the step's number: a run's numerics went wrong
                if e.get("skip_reason") == "loss_spike":
                    return [f"step {step} skipped: loss {e.get('loss', float('nan')):.4f} above the spike bar "
                            f"{e.get('loss_threshold', float('nan')):.4f} (training.loss_spike); parameters and "
                            f"optimizer state unchanged"]
                return [f"step {step} skipped: gradient norm {e.get('grad_norm')} (not finite); parameters and "
                        f"optimizer state unchanged"]
            if step % self._every() and not last:
                return []
            of = f"/{self.total_steps}" if self.total_steps else ""
            per_device = e.get("tokens_per_s_per_device")
            mfu = e.get("mfu")
            return [f"step {step}{of}: loss {e.get('loss', float('nan')):.4f}, "
                    f"{e.get('samples_per_s') or 0:,.1f} samples/s"
                    + (f", {per_device:,.0f} tokens/s per device" if isinstance(per_device, (int, float)) else "")
                    + (f", MFU {mfu:.1%}" if isinstance(mfu, (int, float)) else "")]
        if kind == "eval":
            return [f"eval after {e.get('step')} steps: loss {e.get('loss', float('nan')):.4f} ({e.get('samples')} samples)"]
        if kind == "node_lost":
            self.lost[str(e["node"])] = e
            return []
        if kind == "preflight" and not e.get("admitted"):  # an admitted node is not news
            when = "at the start" if e.get("at") == "start" else "before it joined"
            return [f"{e.get('node')} refused by the pre-flight check {when}: {e.get('reason') or '?'}"]
        if kind == "preflight" and str(e.get("reason") or "").startswith("not refused"):
            return [f"{e.get('node')} measured slow at the start, {e['reason']}"]
        if kind == "loss_spike_stop":
            return [e.get("message") or "training.loss_spike: too many loss spikes in a row"]
        if kind == "loss_spike_rollback":
            return [f"rolling back after loss spikes at steps {e.get('spikes')}: every worker restarts from the "
                    f"checkpoint of step {e.get('checkpoint')} and reads on from step {e.get('data_step')}'s samples, "
                    f"{e.get('skipped_samples')} samples skipped (rollback {e.get('rollback')} of "
                    f"{e.get('max_rollbacks')}, training.loss_spike)"]
        if kind == "failure":
            nodes = [str(n) for n in e.get("nodes", [])]
            self.copied = 0
            detected = [self.lost.pop(n, {}).get("detection_seconds") for n in nodes]
            known = [d for d in detected if d is not None]
            when = f"at step {e['step']}" if e.get("step") is not None else "between steps"
            found = f", detected in {seconds(max(known))}" if known else ""
            return [f"{_nodes(nodes)} lost {when}: {_cause(e.get('cause'))}{found}"]
        if kind == "state_copy":
            self.copied += int(e.get("bytes") or 0)
            return []
        if kind == "resumed":
            reason = self.reasons.get(int(e.get("generation") or -1), "")
            if reason == "join":
                return []  # node_joined says it
            copied = f", {self.copied / 2**20:.1f} MiB copied from replicas" if self.copied else ""
            self.copied = 0
            why = {"failure": "after the fault", "rebalance": "after the rebalance", "reform": "after the re-forming"}
            return [f"training resumed at step {e.get('step')}, {seconds(e.get('total_seconds'))} "
                    f"{why.get(reason, 'after the change')}{copied}; no checkpoint loaded"]
        if kind == "replacement_requested":
            if not e.get("ok"):
                return [f"no replacement node could be had: {e.get('detail') or '?'}"]
            return [f"asked for a replacement node ({e.get('node') or e.get('slurm_job') or '?'}, {e.get('how')})"]
        if kind == "node_joined":
            self.copied = 0
            if str(e.get("node")) in self.spares:  # the plan kept its pipelines: the newcomer waits
                return [f"replacement {e.get('node')} joined as a spare (the plan keeps its pipelines), the change "
                        f"took {seconds(e.get('seconds'))}"]
            return [f"replacement {e.get('node')} joined: training goes on with it, the change took "
                    f"{seconds(e.get('seconds'))}"]
        if kind == "checkpoint_fallback":
            return [f"every replica of some layers is lost ({e.get('reason')}): restarting from the last checkpoint"]
        if kind == "takeover":
            lost = f"; {_nodes(e['lost'])} did not come back" if e.get("lost") else ""
            return [f"a standby supervisor took over (epoch {e.get('epoch')}) after "
                    f"{seconds(e.get('lease_age'))} without the lease{lost}"]
        if kind == "faulty_node":
            what = f"{e.get('node')} flagged from its metrics ({e.get('detail') or 'metrics deviate'})"
            if e.get("action") == "report":  # the default (detection.evict: false): nothing changes
                return [f"{what}: reported only, it keeps training (eviction on metrics is off: detection.evict)"]
            return [f"{what}: evicting it"]
        if kind == "replica_mismatch":
            return [f"replicas disagree at step {e.get('step')} ({e.get('detail') or '?'}): evicting "
                    f"{_nodes([str(n) for n in e.get('nodes', [])])}, step {e.get('step')} withheld"]
        if kind == "transfer_refetch":
            again = f", fetched again from rank {e['retry_from']}" if e.get("retry_from") is not None else ""
            return [f"layer {e.get('layer')} arrived corrupted from rank {e.get('sender')} at rank "
                    f"{e.get('receiver')}{again}"]
        if kind == "straggler" and e.get("action") == "rebalance" and e.get("nodes"):
            slow = ", ".join(f"{n} x{f:.1f}" for n, f in e["nodes"].items())
            return [f"stragglers ({slow}): giving their pipelines fewer microbatches"]
        if kind == "job_finished":
            took = f" after {seconds(e.get('seconds'))}" if e.get("seconds") is not None else ""
            error = f": {e['error']}" if e.get("error") else ""
            return [f"job {e.get('status')}{took}{error}"]
        return []


@dataclass(frozen=True)
class Recovery:
    nodes: list[str]
    step: int | None
    detected_s: float | None
    resumed_s: float | None


def summary_lines(events: list[dict[str, Any]]) -> list[str]:
    """What the run went through, in a few sentences (pure)."""
    finished = next((e for e in reversed(events) if e.get("kind") == "job_finished"), None)
    started = next((e for e in events if e.get("kind") == "job_started"), None)
    total = started.get("steps") if started else None
    steps = [e["step"] for e in events if e.get("kind") == "step"]
    reasons = {e.get("generation"): e.get("reason") for e in events if e.get("kind") == "plan"}
    recoveries: list[Recovery] = []
    pending: dict[str, Any] | None = None
    detection: dict[str, float] = {}
    for e in events:
        kind = e.get("kind")
        if kind == "node_lost" and e.get("detection_seconds") is not None:
            detection[str(e["node"])] = float(e["detection_seconds"])
        elif kind == "failure":
            pending = e
        elif kind == "resumed" and pending is not None and reasons.get(e.get("generation")) != "join":
            nodes = [str(n) for n in pending.get("nodes", [])]
            found = [detection[n] for n in nodes if n in detection]
            recoveries.append(Recovery(nodes, pending.get("step"), max(found) if found else None, e.get("total_seconds")))
            pending = None
    joined = [e for e in events if e.get("kind") == "node_joined"]
    fallbacks = sum(1 for e in events if e.get("kind") == "checkpoint_fallback")
    status = finished.get("status") if finished else "not finished"
    took = f" in {seconds(finished['seconds'])}" if finished and finished.get("seconds") is not None else ""
    done = f"{len(set(steps))}" + (f" of {total}" if total else "") + " steps"
    n = len(recoveries)
    out = [f"summary: {status}{took}; {done}; "
           + (f"{n} failure{'s' if n != 1 else ''}" if n else "no failure")]
    for r in recoveries:
        at = f" at step {r.step}" if r.step is not None else ""
        seen = f", detected in {seconds(r.detected_s)}" if r.detected_s is not None else ""
        out.append(f"  {_nodes(r.nodes)} lost{at}{seen}; training resumed {seconds(r.resumed_s)} after the fault")
    for j in joined:
        out.append(f"  replacement {j.get('node')} joined (the change took {seconds(j.get('seconds'))})")
    if n:
        replayed = len(steps) - len(set(steps))
        if fallbacks:
            out.append(f"  {fallbacks} checkpoint fallback(s): see the events")
        elif total is not None and sorted(set(steps)) == list(range(total)):
            again = f" ({replayed} interrupted step(s) replayed)" if replayed else ""
            out.append(f"  the trajectory went on unchanged: every step trained{again}, no checkpoint loaded")
    return out
