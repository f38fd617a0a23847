"""The job's metrics to Weights & Biases (recipe `logging.wandb`), read from its event log.

The same scalars as TensorBoard (`tensorboard.Scalars`: train/loss, train/tokens_per_s_per_device,
train/mfu, eval/loss, recovery/seconds, cluster/ranks, ...), logged by the supervisor (the process that
already follows the log for TensorBoard). One W&B run per job: its id is made once and kept in
JOB/wandb/run_id, and every supervisor of the job (a requeue, a standby that took over) resumes it
(`resume="allow"`), going on from the byte offset of the log already logged (JOB/wandb/events.offset):
nothing is left out, and after a supervisor killed mid-run the records of its last `wandb_commit_lag`
seconds are logged twice, at their own steps. W&B's own files go to JOB/wandb/start-<n>/ (one per
supervisor): with `mode: offline` (no network on compute nodes) `wandb sync
JOB/wandb/start-*/wandb/offline-run-*` uploads them into the one run.

The x axis is the training step (`job/step`), not W&B's own counter: a step replayed after a recovery is
logged again at its own step (W&B drops a `step=` lower than one it has seen).
"""

from __future__ import annotations

import collections
import os
import secrets
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from oobleck_slurm.dashboard.tensorboard import ExportedTail, Scalars
from oobleck_slurm.errors import BadInputError
from oobleck_slurm.timeouts import DEFAULT_TIMEOUTS

RUN_ID_FILE = "run_id"
STEP_METRIC = "job/step"


class WandbUnavailable(BadInputError):
    """`logging.wandb` asked for, but the `wandb` package is not installed."""


def job_run_id(folder: Path) -> str:
    """The job's W&B run id: read from `folder`, or made and written once (a link is atomic and
    exclusive: of two writers, both read the same id)."""
    path = folder / RUN_ID_FILE
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{RUN_ID_FILE}.{os.getpid()}.tmp"
    tmp.write_text(secrets.token_hex(8))  # W&B ids: letters and digits
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
    return path.read_text().strip()


def start_folder(folder: Path) -> Path:
    """A new folder for this supervisor's W&B files, `start-<n>`: W&B names a run's folder by the second
    it started and the run id, so two starts of one job within a second would share (and overwrite) one."""
    n = len(list(folder.glob("start-*")))
    while True:
        n += 1
        try:
            (folder / f"start-{n}").mkdir(parents=True)
            return folder / f"start-{n}"
        except FileExistsError:
            continue


def _settings(wandb: Any) -> Any:
    """No console capture (the supervisor's log is its own) and no system-metrics sampler (the node
    agents sample those; on a busy login or compute node it costs CPU)."""
    try:
        return wandb.Settings(console="off", silent=True, x_disable_stats=True)
    except Exception:  # a wandb without these settings: its defaults
        return wandb.Settings()


class WandbExporter:
    def __init__(self, events: str | os.PathLike[str], folder: str | os.PathLike[str], *, project: str,
                 entity: str | None = None, mode: Literal["online", "offline"] = "online", name: str | None = None,
                 config: Mapping[str, Any] | None = None,
                 commit_lag: float = DEFAULT_TIMEOUTS.wandb_commit_lag) -> None:
        try:
            import wandb
        except ImportError as err:
            raise WandbUnavailable("logging.wandb: the `wandb` package is not installed "
                                   "(pip install 'oobleck-slurm[wandb]')") from err
        self.folder = Path(folder)
        self._tail = ExportedTail(events, self.folder)
        self.run_id = job_run_id(self.folder)
        self.run = wandb.init(project=project, entity=entity, mode=mode, id=self.run_id, resume="allow",
                              dir=str(start_folder(self.folder)), name=name, config=dict(config or {}),
                              settings=_settings(wandb))
        self.run.define_metric(STEP_METRIC)
        self.run.define_metric("*", step_metric=STEP_METRIC)
        self._scalars = Scalars()
        self.commit_lag = commit_lag
        self._exported: collections.deque[tuple[float, int]] = collections.deque()  # (when, offset) per export

    def export(self) -> int:
        """Log the scalars of the events new since the last call; returns how many events were read."""
        records = self._tail.poll()
        for record in records:
            by_step: dict[int, dict[str, float]] = {}
            for tag, value, step in self._scalars.of(record):
                by_step.setdefault(step, {})[tag] = value
            for step, values in by_step.items():
                self.run.log({**values, STEP_METRIC: step})
        if records:
            # W&B writes asynchronously (its own process), with no flush to wait for: the offset kept is
            # the one reached `commit_lag` seconds ago, so a supervisor killed before W&B wrote its last
            # records leaves them to its successor, which logs them again at the same steps
            now = time.monotonic()
            self._exported.append((now, self._tail.offset))
            settled = None
            while self._exported and self._exported[0][0] <= now - self.commit_lag:
                settled = self._exported.popleft()[1]
            if settled is not None:
                self._tail.commit(settled)
        return len(records)

    def close(self) -> None:
        self.export()
        self.run.finish()  # waits for W&B to write everything
        self._tail.commit()
