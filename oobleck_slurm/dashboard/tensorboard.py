"""The job's metrics as TensorBoard scalars, read from its event log (recipe `logging.tensorboard`).

TensorBoard, or any tool that reads its files (Weights & Biases' `sync_tensorboard`), then shows:

    train/loss, train/lr, train/grad_norm,        by step (a step replayed after a recovery is written
    train/samples_per_s, train/step_seconds,      again, with the same loss: recovery is exact)
    train/data_seconds                            (the step's wait for its samples: `data_s`)
    train/loss_threshold                          training.loss_spike's bar for the step's loss
    train/skipped/non_finite, .../loss_spike      1 at each skipped step, by its reason
    train/tokens_per_s, train/tokens_per_s_per_device, train/tflops_per_device, train/mfu
                                                  (planning/flops.py; mfu only with a device peak)
    eval/loss                                     by step
    recovery/seconds, recovery/nodes_lost         at the step training resumed from
    cluster/ranks, cluster/pipelines              at the step each plan took effect

The supervisor runs the exporter in a thread (supervisor/main.py); `report JOB --tensorboard` runs it
once over a finished job. It follows `events.jsonl` from the byte offset it last exported (kept in the
TensorBoard folder), so a supervisor that takes over from a lost one goes on where it stopped, and a
second `report --tensorboard` writes nothing twice. The W&B logger (dashboard/wandb_logger.py) writes
the same scalars (`Scalars`), following the log the same way (`ExportedTail`).
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
                "data_s": "train/data_seconds", "tokens_per_s": "train/tokens_per_s",
                "tokens_per_s_per_device": "train/tokens_per_s_per_device",
                "tflops_per_device": "train/tflops_per_device", "mfu": "train/mfu",
                "loss_threshold": "train/loss_threshold"}


class TensorBoardUnavailable(BadInputError):
    """`logging.tensorboard` asked for, but the `tensorboard` package is not installed."""


def _summary_writer(folder: Path) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as err:  # torch's writer needs the tensorboard package
        raise TensorBoardUnavailable("logging.tensorboard: the `tensorboard` package is not installed "
                                     "(pip install 'oobleck-slurm[tensorboard]')") from err
    return SummaryWriter(str(folder))


class ExportedTail:
    """The event log from the byte offset last exported into `folder` (its OFFSET_FILE): `poll` returns
    the new records, `commit` (after they are on disk wherever they went) records the new offset."""

    def __init__(self, events: str | os.PathLike[str], folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self._offset_path = folder / OFFSET_FILE
        try:
            offset = int(self._offset_path.read_text())
        except (FileNotFoundError, ValueError):
            offset = 0
        self._tail = EventTail(events, offset=offset)

    def poll(self) -> list[dict[str, Any]]:
        return self._tail.poll()

    @property
    def offset(self) -> int:
        """Bytes of the log returned so far, as whole records."""
        return self._tail.offset

    def commit(self, offset: int | None = None) -> None:
        """Record `offset` (default: all returned so far) as exported."""
        tmp = self._offset_path.with_name(f".{OFFSET_FILE}.{os.getpid()}.tmp")
        tmp.write_text(str(self._tail.offset if offset is None else offset))
        os.replace(tmp, self._offset_path)


class Scalars:
    """Events to (tag, value, step) scalars; keeps the last step seen: where a plan's or a recovery's
    point goes."""

    def __init__(self) -> None:
        self.step: int | None = None

    def of(self, e: dict[str, Any]) -> list[tuple[str, float, int]]:
        kind = e.get("kind")
        out: list[tuple[str, float, int]] = []
        if kind == "step" and isinstance(e.get("step"), int):
            self.step = e["step"]
            out += [(tag, e[field], e["step"]) for field, tag in STEP_SCALARS.items()
                    if isinstance(e.get(field), (int, float))]
            if e.get("skipped"):  # why, as its own series: a skipped step's loss alone does not say
                out.append((f"train/skipped/{e.get('skip_reason') or 'non_finite'}", 1, e["step"]))
        elif kind == "eval" and isinstance(e.get("step"), int) and isinstance(e.get("loss"), (int, float)):
            out.append(("eval/loss", e["loss"], e["step"]))
        elif kind == "resumed" and isinstance(e.get("step"), int):
            if isinstance(e.get("total_seconds"), (int, float)):
                out.append(("recovery/seconds", e["total_seconds"], e["step"]))
        elif kind == "failure" and isinstance(e.get("nodes"), list) and e.get("recovery") is not None:
            out.append(("recovery/nodes_lost", len(e["nodes"]), self.step if self.step is not None else 0))
        elif kind == "plan" and isinstance(e.get("pipelines"), list):
            step = self.step + 1 if self.step is not None else 0
            out.append(("cluster/pipelines", len(e["pipelines"]), step))
            if isinstance(e.get("ranks"), int):
                out.append(("cluster/ranks", e["ranks"], step))
        return out


class TensorBoardExporter:
    def __init__(self, events: str | os.PathLike[str], folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder)
        self._tail = ExportedTail(events, self.folder)
        self._writer = _summary_writer(self.folder)
        self._scalars = Scalars()

    def export(self) -> int:
        """Write the scalars of the events new since the last call; returns how many events were read."""
        records = self._tail.poll()
        for record in records:
            for tag, value, step in self._scalars.of(record):
                self._writer.add_scalar(tag, value, step, walltime=record.get("t"))
        if records:
            self._writer.flush()
            self._tail.commit()  # after the flush: what the offset covers is on disk
        return len(records)

    def close(self) -> None:
        self.export()
        self._writer.close()
