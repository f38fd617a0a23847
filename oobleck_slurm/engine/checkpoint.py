"""Last-resort checkpoints: one file per layer per step, written off the training path.

Layout: `<dir>/step<S>/<layer key>.safetensors` (`layer_file`; the suffix is LAYER_SUFFIX), a
safetensors file of contiguous CPU tensors {"param.<name>": ..., "buffer.<name>": ... (persistent
buffers; a non-persistent one is remade by the seed build the load starts from), "state.<name>": ...
(optimizer state, 0-dim step counters included)} whose string metadata is {"format":
"oobleck-slurm-layer", "version": "1", "step": "<S>"}: no pickles, and readable by any safetensors
reader. A file appears only complete, and stays complete after a crash (cluster/durable.py: temp file,
fsync, rename, fsync of the folder), so a checkpoint is complete when every layer's file exists. Every
`interval` steps, one holder of each layer (pipeline i mod the pipelines for layer i) hands the layer's
live parameters, buffers and optimizer state to a `LayerCopier`, whose thread copies them to CPU memory
while the next step computes (the next update waits for the copy: `LayerCopier.fence`), and a
`CheckpointWriter` thread serialises the copies.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import threading
import time
from collections.abc import Callable, Collection, Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from oobleck_slurm.cluster import durable
from oobleck_slurm.errors import BadInputError
from oobleck_slurm.optim import load_optimizer_state_tensors, optimizer_state_tensors

LAYER_SUFFIX = ".safetensors"
FORMAT = "oobleck-slurm-layer"
VERSION = "1"


class CheckpointError(BadInputError, ValueError):
    """A layer file that is not a readable safetensors file of this format, or does not fit the layer."""


# The data a checkpoint was trained on: `<step dir>/data.json` = {"step", "consumed_samples" (stream
# position of the step's first sample), "global_batch_size", "identity" (engine/batches.data_identity)}.
# Every writer writes it (the same content) before its layer files, so a complete checkpoint has it.
DATA_FILE = "data.json"
# Identity keys a resume may change: the global batch (the consumed-samples cursor bridges it), and
# what only helps people read the record (paths, mtimes; the hashes and sizes say whether data changed).
_MAY_CHANGE = frozenset({"global_batch_size", "path", "mtime_ns"})


class DataChangedError(BadInputError, ValueError):
    """A job resumes from a checkpoint trained on other data (sources, seq_len, holdout, seed, order)."""


def write_data_record(root: str | os.PathLike[str], step: int, record: dict[str, Any]) -> None:
    d = step_dir(root, step)
    d.mkdir(parents=True, exist_ok=True)
    durable.write_json(d / DATA_FILE, record, indent=1, sort_keys=True)


def read_data_record(root: str | os.PathLike[str], step: int) -> dict[str, Any] | None:
    """The data record of the checkpoint of `step`; None for a checkpoint written before they existed.
    Raises CheckpointError naming the file when it is not a record."""
    path = step_dir(root, step) / DATA_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(durable.read_text(path))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not a readable data record ({e})") from None
    if not isinstance(record, dict) or not isinstance(record.get("consumed_samples"), int):
        raise CheckpointError(f"{path}: a data record needs an integer 'consumed_samples'")
    return record


def identity_changes(old: Any, new: Any, where: str = "data") -> list[str]:
    """What differs between two data identities, one sentence per difference (empty: the same data)."""
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for key in sorted(set(old) | set(new), key=str):
            if key in _MAY_CHANGE:
                continue
            if key not in old or key not in new:
                out.append(f"{where}.{key} is {'new' if key not in old else 'gone'}")
            else:
                out += identity_changes(old[key], new[key], f"{where}.{key}")
        return out
    if isinstance(old, list) and isinstance(new, list):
        if len(old) != len(new):
            return [f"{where}: {len(old)} entries in the checkpoint, {len(new)} now"]
        return [c for i, (a, b) in enumerate(zip(old, new)) for c in identity_changes(a, b, f"{where}[{i}]")]
    return [] if old == new else [f"{where} was {old!r}, is {new!r}"]


def step_dir(root: str | os.PathLike[str], step: int) -> Path:
    return Path(root) / f"step{step}"


def layer_file(root: str | os.PathLike[str], step: int, key: str) -> Path:
    """The file that holds layer `key` in the checkpoint of `step`: `<root>/step<S>/<key>.safetensors`."""
    return step_dir(root, step) / f"{key}{LAYER_SUFFIX}"


def live_tensors(layer: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Everything that defines a trained layer, by its name in a layer file, as detached references to
    the live tensors (no copy): what `layer_payload` copies, and what a `LayerCopier` copies later."""
    out = {f"param.{n}": p.detach() for n, p in layer.named_parameters()}
    out.update({f"buffer.{n}": b.detach() for n, b in persistent_buffers(layer).items()})
    out.update({f"state.{n}": t.detach() for n, t in optimizer_state_tensors(opt).items()})
    return out


def layer_payload(layer: nn.Module, opt: torch.optim.Optimizer, step: int | None = None) -> dict[str, torch.Tensor]:
    """Detached CPU copies of everything that defines a trained layer (`live_tensors`), made now. `step`
    is not part of it (the step is the one `CheckpointWriter.submit` / `save_layer` are given, kept in
    the file's metadata); it is accepted for the callers that still pass it."""
    return {name: t.to("cpu", copy=True) for name, t in live_tensors(layer, opt).items()}


def persistent_buffers(layer: nn.Module) -> dict[str, torch.Tensor]:
    """The layer's buffers that belong to its state (`state_dict`), by name."""
    saved = layer.state_dict(keep_vars=True).keys()
    return {n: b for n, b in layer.named_buffers() if n in saved}


def save_layer(root: str | os.PathLike[str], step: int, key: str, payload: dict[str, torch.Tensor]) -> Path:
    """Write `payload` (`layer_payload`) as layer `key` of the checkpoint of `step`; returns its path.

    Atomic and durable (cluster/durable.py): the tensors go to a temporary file that is fsynced and
    renamed into place, so a file under a layer's name is whole even after a crash; a checkpoint whose
    every layer file exists is one a requeued job can load. The seconds it took are written first, to
    `<step dir>/.<key>.seconds` (also durably): the supervisor reads it as soon as the checkpoint is
    complete.
    """
    d = step_dir(root, step)
    d.mkdir(parents=True, exist_ok=True)
    durable.fsync_dir(d.parent)  # the step folder's own entry: its files are lost with it otherwise
    metadata = {"format": FORMAT, "version": VERSION, "step": str(step)}
    t0 = time.perf_counter()
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in payload.items()}
    path = layer_file(root, step, key)

    def write(tmp: Path) -> None:
        save_file(tensors, str(tmp), metadata=metadata)
        # The timing lands (durably) before the layer file: a half-written figure read as '' failed a
        # requeued job.
        durable.write_text(d / f".{key}.seconds", f"{time.perf_counter() - t0:.6f}")

    durable.write_with(path, write)
    return path


def read_layer_file(path: str | os.PathLike[str], step: int | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a layer file, after checking that it is one (format, version) and, if `step` is
    given, that its metadata holds that step. Raises CheckpointError naming the file otherwise."""
    def read() -> tuple[dict[str, str], dict[str, torch.Tensor]]:
        with safe_open(str(path), framework="pt") as f:
            return f.metadata() or {}, {name: f.get_tensor(name) for name in f.keys()}

    try:
        meta, tensors = durable.retry_stale(read)  # NFS: a file renamed over while it was opened
    except FileNotFoundError:
        raise CheckpointError(f"{path}: layer file does not exist") from None
    except Exception as e:  # SafetensorError (a bare Exception subclass), OSError, a bad header
        raise CheckpointError(f"{path}: not a valid safetensors file ({type(e).__name__}: {e})") from None
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise CheckpointError(
            f"{path}: metadata format {meta.get('format')!r} version {meta.get('version')!r}, "
            f"expected {FORMAT!r} version {VERSION!r}"
        )
    saved = meta.get("step", "")
    if not saved.isdigit():
        raise CheckpointError(f"{path}: metadata step {saved!r} is not a step number")
    if step is not None and int(saved) != step:
        raise CheckpointError(f"{path}: holds step {int(saved)}, expected {step}")
    return tensors


def load_layer(root: str | os.PathLike[str], step: int, key: str, layer: nn.Module,
               opt: torch.optim.Optimizer) -> int:
    """Overwrite `layer` and `opt` with the checkpointed state; returns the bytes read. Raises
    CheckpointError naming the file when it is missing, not a layer file of `step`, or lacks (or has
    the wrong shape of) a tensor the layer or its optimizer needs."""
    path = layer_file(root, step, key)
    data = read_layer_file(path, step)

    def tensor(name: str, like: torch.Tensor) -> torch.Tensor:
        t = data.get(name)
        if t is None:
            raise CheckpointError(f"{path}: has no tensor {name!r}")
        if t.shape != like.shape:
            raise CheckpointError(f"{path}: tensor {name!r} is {tuple(t.shape)}, the layer's is {tuple(like.shape)}")
        return t

    with torch.no_grad():
        for n, p in layer.named_parameters():
            p.copy_(tensor(f"param.{n}", p))
        for n, b in persistent_buffers(layer).items():
            if f"buffer.{n}" in data:  # checkpoints written before buffers were saved have none
                b.copy_(tensor(f"buffer.{n}", b))
    try:
        load_optimizer_state_tensors(opt, {k[6:]: v for k, v in data.items() if k.startswith("state.")})
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None
    return sum(t.numel() * t.element_size() for t in data.values())


def complete_steps(root: str | os.PathLike[str], keys: list[str]) -> list[int]:
    """The steps whose every layer file exists, in order."""
    root = Path(root)
    if not root.is_dir():
        return []
    steps = sorted(int(d.name[4:]) for d in root.glob("step*") if d.name[4:].isdigit())
    return [s for s in steps if all(layer_file(root, s, k).exists() for k in keys)]


def latest_complete(root: str | os.PathLike[str], keys: list[str]) -> int | None:
    """The highest step whose every layer file exists, or None."""
    root = Path(root)
    if not root.is_dir():
        return None
    steps = sorted((int(d.name[4:]) for d in root.glob("step*") if d.name[4:].isdigit()), reverse=True)
    for s in steps:
        if all(layer_file(root, s, k).exists() for k in keys):
            return s
    return None


def prune(root: str | os.PathLike[str], keys: list[str], keep: int, protect: Collection[int] = ()) -> list[int]:
    """Retention (fault_tolerance.keep_checkpoints): delete the complete checkpoints older than the `keep`
    newest, and the incomplete step folders older than the newest complete one (a write that failed or
    was cut short: nothing completes them later); returns the deleted steps. `keep` 0 deletes nothing,
    and the newest complete checkpoint is never deleted, nor a step in `protect` (one workers are loading).
    Folders newer than the newest complete one are being written: they stay."""
    root = Path(root)
    if keep <= 0 or not root.is_dir():
        return []
    steps = sorted((int(d.name[4:]) for d in root.glob("step*") if d.is_dir() and d.name[4:].isdigit()), reverse=True)
    complete = [s for s in steps if all(layer_file(root, s, k).exists() for k in keys)]
    if not complete:
        return []
    kept = set(complete[:keep]) | set(protect)
    doomed = [s for s in steps if s < complete[0] and s not in kept]
    for s in doomed:
        shutil.rmtree(step_dir(root, s), ignore_errors=True)  # unlinks: a hard-linked source job keeps its files
    if doomed:
        durable.fsync_dir(root)
    return doomed


class Snapshot:
    """CPU copies of one layer's tensors (`live_tensors`), taken off the training path by a
    `LayerCopier`, or already taken (`Snapshot.taken`). `tensors()` waits for them; the writer calls
    `release()` once it has serialised them (the copier may then reuse their pinned buffers)."""

    def __init__(self, key: str) -> None:
        self.key = key
        # Set once the copies are made (CUDA: issued on the copier's stream, `_copied_on_device`
        # completes them) or failed: from then on the live tensors are no longer read on the CPU side.
        self.copied = threading.Event()
        self.released = threading.Event()
        self._tensors: dict[str, torch.Tensor] = {}
        self._error: Exception | None = None
        self._copied_on_device: torch.cuda.Event | None = None

    @classmethod
    def taken(cls, key: str, tensors: dict[str, torch.Tensor]) -> Snapshot:
        """A snapshot of copies made already (a wide stage's gathered layer)."""
        snapshot = cls(key)
        snapshot._tensors = tensors
        snapshot.copied.set()
        return snapshot

    def tensors(self) -> dict[str, torch.Tensor]:
        """The CPU copies, once complete; raises the error that stopped the copy."""
        self.copied.wait()
        if self._error is not None:
            raise self._error
        if self._copied_on_device is not None:
            self._copied_on_device.synchronize()
        return self._tensors

    def release(self) -> None:
        self.released.set()


class LayerCopier:
    """Copies layers' live tensors to the CPU in a background thread, so that a periodic checkpoint
    costs the training path only the hand-over (`copy`). Whatever writes or frees a layer's tensors in
    place (the optimizer update, a plan change, a rollback) calls `fence` first: it waits until the
    pending copies of those layers no longer read them.

    On the CPU a copy is a plain clone in the thread. On CUDA the thread issues `non_blocking` copies
    on a side stream, after an event recorded on the training stream at `copy` (they read the values
    of the update before it), into pinned staging buffers reused per layer key once the writer has
    released them; `fence` makes the training stream wait for the copies (no CPU wait for the DMA).
    The CUDA path has not been run on a GPU."""

    def __init__(self, device: torch.device, before_copy: Callable[[str], None] | None = None) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.before_copy = before_copy  # called in the copier's thread before each layer's copy (tests delay it)
        self._queue: queue.Queue = queue.Queue()
        self._pending: dict[str, Snapshot] = {}  # key -> its newest copy not fenced yet
        self._staging: dict[str, Snapshot] = {}  # CUDA: key -> the snapshot whose pinned buffers may be reused
        self._stream = torch.cuda.Stream(device) if self.cuda else None
        self._waiting = threading.Event()  # a fence waits for a copy (tests wait for it)
        self.waited_s = 0.0  # the fences' waits, over the copier's life
        self._thread = threading.Thread(target=self._run, daemon=True, name="checkpoint-copier")
        self._thread.start()

    def copy(self, key: str, live: dict[str, torch.Tensor]) -> Snapshot:
        """Queue a copy of `live` (`live_tensors`); returns its snapshot at once."""
        snapshot = Snapshot(key)
        ready = torch.cuda.current_stream(self.device).record_event() if self.cuda else None
        self._pending[key] = snapshot  # replaces an older one: copies complete in order, so this one fences both
        self._queue.put((snapshot, live, ready))
        return snapshot

    def fence(self, keys: Iterable[str] | None = None) -> float:
        """Wait until the pending copies of `keys` (every pending copy by default) are made, so that
        their tensors may be written or freed; returns the seconds waited."""
        chosen = list(self._pending) if keys is None else [k for k in keys if k in self._pending]
        if not chosen:
            return 0.0
        t0 = time.perf_counter()
        for key in chosen:
            snapshot = self._pending.pop(key)
            if not snapshot.copied.is_set():
                self._waiting.set()
                snapshot.copied.wait()
            if snapshot._copied_on_device is not None:
                torch.cuda.current_stream(self.device).wait_event(snapshot._copied_on_device)
        self._waiting.clear()
        waited = time.perf_counter() - t0
        self.waited_s += waited
        return waited

    def fence_waiting(self) -> bool:
        """Whether a fence is waiting for a copy now."""
        return self._waiting.is_set()

    def _run(self) -> None:
        if self.cuda:
            torch.cuda.set_device(self.device)  # no context on another GPU
        while True:
            self._take(*self._queue.get())  # a call of its own: its locals do not keep a dropped layer alive
            self._queue.task_done()

    def _take(self, snapshot: Snapshot, live: dict[str, torch.Tensor], ready: torch.cuda.Event | None) -> None:
        try:
            if self.before_copy is not None:
                self.before_copy(snapshot.key)
            if ready is not None:
                self._copy_on_device(snapshot, live, ready)
            else:
                snapshot._tensors = {name: t.to("cpu", copy=True) for name, t in live.items()}
        except Exception as err:  # noqa: BLE001 - the writer reports it (CheckpointWriter's on_error)
            snapshot._error = err
        finally:
            snapshot.copied.set()

    def _copy_on_device(self, snapshot: Snapshot, live: dict[str, torch.Tensor], ready: torch.cuda.Event) -> None:
        assert self._stream is not None
        old = self._staging.get(snapshot.key)
        reuse = old is not None and old.released.is_set() and old._error is None and all(
            name in old._tensors and old._tensors[name].shape == t.shape and old._tensors[name].dtype == t.dtype
            for name, t in live.items() if t.is_cuda)
        out: dict[str, torch.Tensor] = {}
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)
            for name, t in live.items():
                if not t.is_cuda:  # a CPU tensor (AdamW's step counter): a plain copy, now
                    out[name] = t.to("cpu", copy=True)
                    continue
                t.record_stream(self._stream)  # freed before the copy ran, its memory is not reused too early
                buf = old._tensors[name] if reuse and old is not None else torch.empty(
                    t.shape, dtype=t.dtype, pin_memory=True)
                buf.copy_(t, non_blocking=True)
                out[name] = buf
            snapshot._copied_on_device = self._stream.record_event()
        snapshot._tensors = out
        self._staging[snapshot.key] = snapshot


class CheckpointWriter:
    """Serialises layer payloads in a background thread (one at a time, in order).

    A write that fails (a full disk, a folder it may not write, a file where its folder should be) is a
    failed checkpoint, not a failed run: `on_error(step, error)` is told once per step (the worker logs
    it), the step's other layers queued here are skipped (its folder can no longer be complete, and
    `latest_complete` never takes it), and the next step's payloads are written as usual. `flush(steps)`
    raises for the steps its caller waits on (the final and on-demand checkpoints, which are the point
    of the call); a periodic checkpoint is last-resort and only reported."""

    def __init__(self, root: str | os.PathLike[str],
                 data_record: Callable[[int], dict[str, Any]] | None = None,
                 on_error: Callable[[int, Exception], None] | None = None) -> None:
        self.root = Path(root)
        self.data_record = data_record  # step -> its DATA_FILE record (StepBatches.record)
        self.on_error = on_error
        self._recorded: set[int] = set()
        self.submitted: set[tuple[int, str]] = set()  # (step, layer key): written or queued
        self._queue: queue.Queue = queue.Queue()
        self._failed: dict[int, Exception] = {}  # step -> its first failed write, until a flush takes it
        self.failures = 0  # steps whose write failed, over the writer's life
        self._thread = threading.Thread(target=self._run, daemon=True, name="checkpoint-writer")
        self._thread.start()

    def submit(self, step: int, key: str, payload: dict[str, torch.Tensor] | Snapshot) -> None:
        """Queue layer `key` of the checkpoint of `step`: its CPU copies, or a snapshot being taken of
        them (`LayerCopier.copy`: the writer waits for it; a failed copy is a failed write)."""
        self.submitted.add((step, key))
        self._queue.put((step, key, payload))

    def _run(self) -> None:
        while True:
            step, key, payload = self._queue.get()
            try:
                if step in self._failed:  # this step's checkpoint is incomplete already
                    self.submitted.discard((step, key))
                    continue
                if self.data_record is not None and step not in self._recorded:
                    write_data_record(self.root, step, self.data_record(step))
                    self._recorded.add(step)
                save_layer(self.root, step, key, payload.tensors() if isinstance(payload, Snapshot) else payload)
            except Exception as err:  # noqa: BLE001 - reported, and raised by flush() for the steps waited on
                self._failed[step] = err
                self.failures += 1
                self.submitted.discard((step, key))  # not written: a recovery at this step may write it again
                if self.on_error is not None:
                    try:
                        self.on_error(step, err)
                    except Exception:  # noqa: BLE001, S110 - a report that fails must not stop the writer
                        pass
            finally:
                if isinstance(payload, Snapshot):
                    payload.release()
                self._queue.task_done()

    def flush(self, steps: Iterable[int] | None = None) -> None:
        """Wait until everything submitted is on disk (or failed); raises CheckpointError for the first
        failed write of `steps` (every step by default)."""
        self._queue.join()
        for step in sorted(self._failed) if steps is None else steps:
            if (error := self._failed.pop(step, None)) is not None:
                raise CheckpointError(f"writing the checkpoint of step {step} under {self.root} failed: "
                                      f"{type(error).__name__}: {error}") from error
