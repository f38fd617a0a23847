"""The recovery-cost model, fitted from measured recoveries in job event logs.

An Oobleck recovery after a failure costs, in the simulator:

    detection + agreement + replan + group_rebuild + copy_overhead + copy_bytes / copy_bandwidth
      + (replay_factor - 1) * step_time        (the replayed step itself trains: it counts as useful)

and a join (a replacement folded in at a step boundary) the same without detection and replay.
`copy_bytes` is the largest number of bytes one device sends or receives in the transfers that the
real `reconfigure` returns (the copies run in parallel across holders), and the bandwidth is the
profile's inter-node link unless a fitted `copy_Bps` is given.

Fitting (`fit_calibration`), from the events the runtime writes (oobleck_slurm/protocol/events.py):
- detection_s:     median `detection.seconds`
- replan_s:        median `replan.seconds` (the planner call)
- rebuild_s:       median `group_rebuild.seconds`
- agreement_s:     median over recoveries of `resumed.total_seconds` minus the phases above and the
                   copy and replay: survivors reporting their step and layers, messages, waits
- copy_overhead_s: median `state_copy.seconds` of copies that moved 0 bytes
- copy_Bps:        median bytes / (seconds - overhead) of copies that moved bytes
- replay_factor:   median `replay.seconds` / the median step time of the generation it resumed
- checkpoint_steps: median `checkpoint.seconds` / the log's median step time: the asynchronous
                   snapshot's stall as a share of a step (the simulator also charges at least the
                   device-to-host copy of the largest shard, `scenario.SNAPSHOT_BPS`)

DEFAULT_CALIBRATION is `fit_calibration` of the three recorded logs in tests/dashboard/logs
(failure.jsonl, join.jsonl, healthy.jsonl: tiny GPT, 4 local nodes, f=1, a worker kill and an agent
kill, one replacement join; recorded on this project's 2-core machine), rounded, with one exception:
copy_Bps is left to the profile's link (None). The logs' one non-empty copy moved 20.0 MB in 1.38 s
(14.5 MB/s) over gloo on 2 shared CPU cores, which says nothing about an InfiniBand or NVLink link;
`--calibrate JOBDIR` fits it when the job folders come from the hardware being simulated.
`test_default_calibration_matches_recorded_logs` checks the constants against the logs.
These constants describe a 4-process CPU job: its rebuild (0.0134 s, 4 gloo processes) and detection
(0.041 s, killed processes) do not carry to GPU nodes at scale; `nccl_model.scale_calibration` replaces
both there (docs/simulator.md#at-scale).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any


@dataclass(frozen=True)
class Calibration:
    detection_s: float
    agreement_s: float
    replan_s: float
    rebuild_s: float
    copy_overhead_s: float
    copy_Bps: float | None  # None: the profile's inter-node link bandwidth
    replay_factor: float
    checkpoint_steps: float
    restart_s: float = 60.0  # checkpoint fallback: relaunch the job (assumed ~1 min, baselines.RELAUNCH_S)
    source: str = "default"

    def recovery_s(self, copy_bytes: float, link_Bps: float, step_s: float, *, join: bool = False) -> float:
        """Seconds from the failure (or the join's step boundary) until training resumes, minus the
        replayed step's own training time."""
        bw = self.copy_Bps or link_Bps
        copy = self.copy_overhead_s + (copy_bytes / bw if copy_bytes > 0 else 0.0)
        base = self.agreement_s + self.replan_s + self.rebuild_s + copy
        if join:
            return base
        return self.detection_s + base + max(0.0, self.replay_factor - 1.0) * step_s

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


DEFAULT_CALIBRATION = Calibration(
    detection_s=0.041, agreement_s=0.147, replan_s=0.0011, rebuild_s=0.0134, copy_overhead_s=0.0001,
    copy_Bps=None, replay_factor=1.04, checkpoint_steps=0.05,
    source="tests/dashboard/logs (failure, join, healthy): 2 failures, 1 join, 3 checkpoints",
)


def _median(values: Sequence[float], default: float) -> float:
    return float(statistics.median(values)) if values else default


def _step_seconds_by_generation(records: Sequence[dict[str, Any]]) -> dict[int, float]:
    by_gen: dict[int, list[float]] = {}
    replayed = {(r.get("generation"), r.get("step")) for r in records if r["kind"] == "replay"}
    for r in records:
        if r["kind"] == "step" and isinstance(r.get("seconds"), (int, float)) and r.get("step", 0) > 0:
            if (r.get("generation"), r.get("step")) in replayed:
                continue
            by_gen.setdefault(int(r.get("generation", 0)), []).append(float(r["seconds"]))
    return {g: statistics.median(v) for g, v in by_gen.items()}


def fit_calibration(logs: Iterable[Sequence[dict[str, Any]]], *, base: Calibration = DEFAULT_CALIBRATION,
                    source: str = "fitted") -> Calibration:
    """Fit the constants from event logs (lists of records); a constant with no sample keeps `base`'s."""
    det, rep, reb, agree, zero_copy, rates, replay, ckpt = [], [], [], [], [], [], [], []
    copies: list[tuple[float, float]] = []
    for records in logs:
        steps = _step_seconds_by_generation(records)
        by_gen: dict[int, dict[str, Any]] = {}
        for r in records:
            kind = r["kind"]
            sec = r.get("seconds")
            if kind == "checkpoint" and isinstance(sec, (int, float)) and steps:
                ckpt.append(float(sec) / statistics.median(steps.values()))
            if kind not in ("detection", "replan", "group_rebuild", "state_copy", "replay", "resumed"):
                continue
            gen = int(r.get("generation", -1))
            if kind == "detection":
                gen += 1  # the detection of generation g's failure belongs to the recovery into g + 1
            by_gen.setdefault(gen, {})[kind] = r
        for gen, phases in sorted(by_gen.items()):
            if "detection" in phases:
                det.append(float(phases["detection"]["seconds"]))
            if "replan" in phases:
                rep.append(float(phases["replan"]["seconds"]))
            if "group_rebuild" in phases:
                reb.append(float(phases["group_rebuild"]["seconds"]))
            if "state_copy" in phases:
                c = phases["state_copy"]
                nbytes = float(c.get("bytes") or 0)
                if nbytes > 0:
                    copies.append((nbytes, float(c["seconds"])))
                else:
                    zero_copy.append(float(c["seconds"]))
            if "replay" in phases and gen in steps:
                replay.append(float(phases["replay"]["seconds"]) / steps[gen])
            if "resumed" in phases:
                known = sum(float(phases[k]["seconds"]) for k in
                            ("detection", "replan", "group_rebuild", "state_copy", "replay") if k in phases)
                agree.append(max(0.0, float(phases["resumed"]["total_seconds"]) - known))
    overhead = _median(zero_copy, base.copy_overhead_s)
    for nbytes, sec in copies:
        if sec > overhead:
            rates.append(nbytes / (sec - overhead))
    return replace(
        base, detection_s=_median(det, base.detection_s), agreement_s=_median(agree, base.agreement_s),
        replan_s=_median(rep, base.replan_s), rebuild_s=_median(reb, base.rebuild_s), copy_overhead_s=overhead,
        copy_Bps=_median(rates, 0.0) or base.copy_Bps, replay_factor=_median(replay, base.replay_factor),
        checkpoint_steps=_median(ckpt, base.checkpoint_steps), source=source,
    )
