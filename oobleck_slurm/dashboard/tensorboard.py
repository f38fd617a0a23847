"""The job's metrics as TensorBoard scalars, read from its event log (recipe `logging.tensorboard`).

TensorBoard, or any tool that reads its files (Weights & Biases' `sync_tensorboard`), then shows:

    train/loss, train/lr, train/grad_norm,        by step (a step replayed after a recovery is written
    train/samples_per_s, train/step_seconds,      again, with the same loss: recovery is exact)
    train/data_seconds                            (the step's wait for its samples: `data_s`)
    train/loss_threshold                          training.loss_spike's bar for the step's loss
    train/skipped/non_finite, .../loss_spike      1 at each skipped step, by its reason
    eval/loss                                     by step
    recovery/seconds, recovery/nodes_lost         at the step training resumed from
    cluster/ranks, cluster/pipelines              at the step each plan took effect

The supervisor runs the exporter in a thread (supervisor/main.py); `report JOB --tensorboard` runs it
once over a finished job. It follows `events.jsonl` from the byte offset it last exported (kept in the
TensorBoard folder), so a supervisor that takes over from a lost one goes on where it stopped, and a
second `report --tensorboard` writes nothing twice.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from oobleck_slurm.errors import BadInputError
from oobleck_slurm.protocol.events import EventTail

OFFSET_FILE = "events.offset"  # bytes of events.jsonl already exported
STEP_SCALARS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
                "samples_per_s": "train/samples_per_s", "seconds": "train/step_seconds",
                "data_s": "train/data_seconds", "loss_threshold": "train/loss_threshold"}


class TensorBoardUnavailable(BadInputError):
    """`logging.tensorboard` asked for, but the `tensorboard` package is not installed."""


def _summary_writer(folder: Path) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as err:  # torch's writer needs the tensorboard package
        raise TensorBoardUnavailable("logging.tensorboard: the `tensorboard` package is not installed "
                                     "(pip install 'oobleck-slurm[tensorboard]')") from err
    return SummaryWriter(str(folder))


class TensorBoardExporter:
    def __init__(self, events: str | os.PathLike[str], folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._offset_path = self.folder / OFFSET_FILE
        self._tail = EventTail(events, offset=self._read_offset())
        self._writer = _summary_writer(self.folder)
        self._step: int | None = None  # the last step seen: where a plan's or a recovery's point goes

    def _read_offset(self) -> int:
        try:
            return int(self._offset_path.read_text())
        except (FileNotFoundError, ValueError):
            return 0

    def export(self) -> int:
        """Write the scalars of the events new since the last call; returns how many events were read."""
        records = self._tail.poll()
        for record in records:
            self._scalars(record)
        if records:
            self._writer.flush()
            tmp = self._offset_path.with_name(f".{OFFSET_FILE}.{os.getpid()}.tmp")
            tmp.write_text(str(self._tail.offset))
            os.replace(tmp, self._offset_path)  # after the flush: what the offset covers is on disk
        return len(records)

    def _scalars(self, e: dict[str, Any]) -> None:
        kind, t = e.get("kind"), e.get("t")
        add = self._writer.add_scalar
        if kind == "step" and isinstance(e.get("step"), int):
            self._step = e["step"]
            for field, tag in STEP_SCALARS.items():
                if isinstance(e.get(field), (int, float)):
                    add(tag, e[field], e["step"], walltime=t)
            if e.get("skipped"):  # why, as its own series: a skipped step's loss alone does not say
                add(f"train/skipped/{e.get('skip_reason') or 'non_finite'}", 1, e["step"], walltime=t)
        elif kind == "eval" and isinstance(e.get("step"), int) and isinstance(e.get("loss"), (int, float)):
            add("eval/loss", e["loss"], e["step"], walltime=t)
        elif kind == "resumed" and isinstance(e.get("step"), int):
            if isinstance(e.get("total_seconds"), (int, float)):
                add("recovery/seconds", e["total_seconds"], e["step"], walltime=t)
        elif kind == "failure" and isinstance(e.get("nodes"), list) and e.get("recovery") is not None:
            add("recovery/nodes_lost", len(e["nodes"]), self._step if self._step is not None else 0, walltime=t)
        elif kind == "plan" and isinstance(e.get("pipelines"), list):
            step = self._step + 1 if self._step is not None else 0
            add("cluster/pipelines", len(e["pipelines"]), step, walltime=t)
            if isinstance(e.get("ranks"), int):
                add("cluster/ranks", e["ranks"], step, walltime=t)

    def close(self) -> None:
        self.export()
        self._writer.close()
