"""Last-resort checkpoints: one file per layer per step, written off the training path.

Layout: `<dir>/step<S>/<layer key>.pt`, each a dict of tensors {"param.<name>": ..., "buffer.<name>":
... (persistent buffers; a non-persistent one is remade by the seed build the load starts from),
"state.<name>": ..., "step": tensor(S)} saved with torch.save and read back with torch.load(weights_only=True): no
pickled objects. A file appears only complete (temp file + os.replace), so a checkpoint is complete
when every layer's file exists. Every `interval` steps, the holder of each layer in the first
pipeline clones the layer's parameters and optimizer state (a memory copy, the only cost on the
training path) and a background thread serialises them.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from pathlib import Path

import torch
from torch import nn

from oobleck_slurm.optim import load_optimizer_state_tensors, optimizer_state_tensors


def step_dir(root: str | os.PathLike[str], step: int) -> Path:
    return Path(root) / f"step{step}"


def layer_payload(layer: nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, torch.Tensor]:
    """Detached CPU copies of everything that defines a trained layer at `step`."""
    out = {f"param.{n}": p.detach().to("cpu", copy=True) for n, p in layer.named_parameters()}
    out.update({f"buffer.{n}": b.detach().to("cpu", copy=True) for n, b in persistent_buffers(layer).items()})
    out.update({f"state.{n}": t.detach().to("cpu", copy=True) for n, t in optimizer_state_tensors(opt).items()})
    out["step"] = torch.tensor(step)
    return out


def persistent_buffers(layer: nn.Module) -> dict[str, torch.Tensor]:
    """The layer's buffers that belong to its state (`state_dict`), by name."""
    saved = layer.state_dict(keep_vars=True).keys()
    return {n: b for n, b in layer.named_buffers() if n in saved}


def load_layer(root: str | os.PathLike[str], step: int, key: str, layer: nn.Module,
               opt: torch.optim.Optimizer) -> int:
    """Overwrite `layer` and `opt` with the checkpointed state; returns the bytes read."""
    path = step_dir(root, step) / f"{key}.pt"
    data = torch.load(path, weights_only=True)
    if int(data["step"]) != step:
        raise ValueError(f"{path}: holds step {int(data['step'])}, expected {step}")
    with torch.no_grad():
        for n, p in layer.named_parameters():
            p.copy_(data[f"param.{n}"])
        for n, b in persistent_buffers(layer).items():
            if f"buffer.{n}" in data:  # checkpoints written before buffers were saved have none
                b.copy_(data[f"buffer.{n}"])
    load_optimizer_state_tensors(opt, {k[6:]: v for k, v in data.items() if k.startswith("state.")})
    return sum(t.numel() * t.element_size() for t in data.values())


def latest_complete(root: str | os.PathLike[str], keys: list[str]) -> int | None:
    """The highest step whose every layer file exists, or None."""
    root = Path(root)
    if not root.is_dir():
        return None
    steps = sorted((int(d.name[4:]) for d in root.glob("step*") if d.name[4:].isdigit()), reverse=True)
    for s in steps:
        if all((step_dir(root, s) / f"{k}.pt").exists() for k in keys):
            return s
    return None


class CheckpointWriter:
    """Serialises layer payloads in a background thread (one at a time, in order)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True, name="checkpoint-writer")
        self._thread.start()

    def submit(self, step: int, key: str, payload: dict[str, torch.Tensor]) -> None:
        self._queue.put((step, key, payload))

    def _run(self) -> None:
        while True:
            step, key, payload = self._queue.get()
            d = step_dir(self.root, step)
            d.mkdir(parents=True, exist_ok=True)
            tmp = d / f".{key}.{os.getpid()}.tmp"
            t0 = time.perf_counter()
            torch.save(payload, tmp)
            # The timing lands (atomically) before the layer file: the supervisor reads it as soon as
            # the checkpoint is complete, and a half-written figure read as '' failed a requeued job.
            seconds = d / f".{key}.{os.getpid()}.seconds.tmp"
            seconds.write_text(f"{time.perf_counter() - t0:.6f}")
            os.replace(seconds, d / f".{key}.seconds")
            os.replace(tmp, d / f"{key}.pt")
            self._queue.task_done()

    def flush(self) -> None:
        """Wait until everything submitted is on disk."""
        self._queue.join()
