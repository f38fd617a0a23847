"""A new job from another job's checkpoint: `submit RECIPE --resume-from PATH` (or the recipe's
`fault_tolerance.resume_from`).

PATH names an old job's folder, its `checkpoints/` folder (the newest checkpoint complete for this
recipe's model), or one `step<S>` folder. Before anything starts, `find_source` picks the step and
`check_model` compares every layer file's header with the recipe's model (built on the meta device: no
memory, no read of the tensors), naming the layer, tensor and shapes that differ. The data is checked
as a requeue checks it (engine/batches.prepare_data against the checkpoint's data record), and the
global batch may change: the record's consumed-samples cursor is where the new job's stream resumes.

The checkpoint is copied into the new job's `checkpoints/step<S>/` (`link_into`), as hard links where
the filesystem allows (no bytes copied, no space taken) and as copies where it does not (another
filesystem). Either way the new job never changes the old job's files: every checkpoint write is a new
file renamed into place (cluster/durable.py), and retention (`prune`) only unlinks its own names. From
then on the new job is an ordinary job that holds a complete checkpoint, and starts from it as a requeue
does (supervisor/main.py): its step, learning-rate position, optimizer state and data cursor go on; the
node count, `f`, the plan and every non-model training key are the new recipe's.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import safe_open

from oobleck_slurm.cluster import durable
from oobleck_slurm.cluster.jobdir import CHECKPOINTS_DIR
from oobleck_slurm.engine.checkpoint import (
    DATA_FILE,
    FORMAT,
    LAYER_SUFFIX,
    VERSION,
    CheckpointError,
    latest_complete,
    layer_file,
    persistent_buffers,
    read_data_record,
    step_dir,
)
from oobleck_slurm.engine.spec import ModelSpec

if TYPE_CHECKING:
    from oobleck_slurm.cluster.jobdir import JobDir

SOURCE_HELP = "a job folder, its checkpoints/ folder, or one of its step<S> folders"


@dataclass(frozen=True)
class ResumeSource:
    root: Path  # the old job's checkpoints folder
    step: int

    @property
    def path(self) -> Path:
        return step_dir(self.root, self.step)


def _step_number(folder: Path) -> int | None:
    return int(folder.name[4:]) if folder.name.startswith("step") and folder.name[4:].isdigit() else None


def find_source(path: str | os.PathLike[str], keys: list[str]) -> ResumeSource:
    """The complete checkpoint `path` names (SOURCE_HELP); CheckpointError saying what is wrong otherwise."""
    try:
        p = Path(path).expanduser()
    except RuntimeError:  # "~nobody/...": no such user, so no such folder
        p = Path(path)
    if not p.is_dir():
        raise CheckpointError(f"{p}: {'not a folder' if p.exists() else 'does not exist'} (a checkpoint to start "
                              f"from is {SOURCE_HELP})")
    if (step := _step_number(p)) is not None:
        source = ResumeSource(p.parent, step)
        _check_complete(source, keys)
        return source
    root = p / CHECKPOINTS_DIR if (p / CHECKPOINTS_DIR).is_dir() else p
    steps = sorted(s for d in root.iterdir() if d.is_dir() and (s := _step_number(d)) is not None)
    if not steps:
        raise CheckpointError(f"{root}: holds no step<S> checkpoint folder (a checkpoint to start from is "
                              f"{SOURCE_HELP})")
    step = latest_complete(root, keys)
    if step is None:  # say what the newest lacks: a write cut short, or another model's checkpoint
        _check_complete(ResumeSource(root, steps[-1]), keys)
        raise CheckpointError(f"{root}: no complete checkpoint for this model")  # unreachable: the check raised
    return ResumeSource(root, step)


def _check_complete(source: ResumeSource, keys: list[str]) -> None:
    d = source.path
    have = {f.name[: -len(LAYER_SUFFIX)] for f in d.glob(f"*{LAYER_SUFFIX}")}
    foreign = sorted(have - set(keys))
    if foreign:
        raise CheckpointError(f"{d}: holds layer(s) {', '.join(foreign[:3])}{' ...' if len(foreign) > 3 else ''} "
                              f"that the recipe's model ({len(keys)} layers: {keys[0]} ... {keys[-1]}) does not "
                              f"have: a checkpoint of another model")
    missing = [k for k in keys if k not in have]
    if missing:
        raise CheckpointError(f"{d}: incomplete checkpoint: {len(missing)} of {len(keys)} layer files missing "
                              f"({', '.join(layer_file(source.root, source.step, k).name for k in missing[:3])}"
                              f"{' ...' if len(missing) > 3 else ''}): a write that failed or was cut short")
    if read_data_record(source.root, source.step) is None:
        raise CheckpointError(f"{d / DATA_FILE}: missing: a checkpoint written before checkpoints recorded their "
                              f"data cannot start another job (its data and sample order cannot be checked)")


def check_model(source: ResumeSource, model: ModelSpec, seed: int) -> None:
    """Every layer file holds, under the same names and shapes, the parameters and persistent buffers of
    the recipe's layer; CheckpointError naming the file, the tensor and both shapes otherwise. Reads the
    files' headers only. The optimizer state is checked when the workers load it (engine/checkpoint.py)."""
    for i, key in enumerate(model.keys()):
        path = layer_file(source.root, source.step, key)
        layer = model.build(seed, i, i + 1, device="meta", initialise=False)[0]
        want = {f"param.{n}": tuple(p.shape) for n, p in layer.named_parameters()}
        want.update({f"buffer.{n}": tuple(b.shape) for n, b in persistent_buffers(layer).items()})
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                have = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys() if not n.startswith("state.")}
        except Exception as e:  # SafetensorError (a bare Exception subclass), OSError, a bad header
            raise CheckpointError(f"{path}: not a valid safetensors file ({type(e).__name__}: {e})") from None
        if meta.get("format") != FORMAT or meta.get("version") != VERSION or meta.get("step") != str(source.step):
            raise CheckpointError(f"{path}: metadata {meta!r} is not that of a layer file of step {source.step} "
                                  f"({FORMAT!r} version {VERSION!r})")
        for name, shape in want.items():
            if name not in have:
                if name.startswith("buffer."):
                    continue  # written before buffers were saved: the seed's buffer stays (checkpoint.load_layer)
                raise CheckpointError(f"{path}: layer {key} of the recipe's model has {name} {shape}, the "
                                      f"checkpoint has no such tensor: a checkpoint of another model")
            if have[name] != shape:
                raise CheckpointError(f"{path}: layer {key}: {name} is {have[name]} in the checkpoint, {shape} in "
                                      f"the recipe's model: a checkpoint of another model")
        extra = sorted(set(have) - set(want))
        if extra:
            raise CheckpointError(f"{path}: layer {key}: the checkpoint has {', '.join(extra[:3])} that the recipe's "
                                  f"model does not: a checkpoint of another model")


def link_into(source: ResumeSource, root: str | os.PathLike[str], keys: list[str]) -> str:
    """Give the checkpoints folder `root` (the new job's) the checkpoint `source` under the same step:
    hard links, or copies across filesystems. Returns "linked" or "copied". The data record goes first:
    the step is complete (latest_complete) once every layer file is in, and its record is then there."""
    dest = step_dir(root, source.step)
    dest.mkdir(parents=True, exist_ok=False)
    how = "linked"
    for name in [DATA_FILE] + [layer_file(source.root, source.step, k).name for k in keys]:
        src, dst = source.path / name, dest / name
        try:
            os.link(src, dst)
        except OSError:  # another filesystem (EXDEV), or one without hard links: a whole copy, atomically
            try:
                durable.write_with(dst, partial(shutil.copyfile, src))
            except OSError as e:  # the old job deleted it meanwhile (its retention), or a full disk
                raise CheckpointError(f"{src}: could not be copied into {dest} ({type(e).__name__}: {e})") from None
            how = "copied"
    durable.fsync_dir(dest)
    durable.fsync_dir(dest.parent)
    return how


def start_from(job: JobDir, recipe: Any, path: str | os.PathLike[str]) -> ResumeSource:
    """Check the checkpoint `path` names against `recipe` (model, data, steps left) and give it to the
    new job `job` (`link_into`); recorded in its meta as `resumed_from`. Raises a BadInputError naming
    the file or key otherwise, having written nothing outside the new job's folder."""
    from oobleck_slurm.engine.batches import prepare_data
    from oobleck_slurm.engine.from_recipe import job_from_recipe, token_file_for, validation_file_for

    spec = job_from_recipe(recipe, token_file_for(recipe, job.data), validation_file_for(recipe, job.data))
    keys = spec.model.keys()
    source = find_source(path, keys)
    check_model(source, spec.model, spec.train.seed)
    if source.step >= spec.train.steps:
        raise CheckpointError(f"{source.path}: the checkpoint is of step {source.step} and training.steps is "
                              f"{spec.train.steps}: nothing is left to train (raise training.steps)")
    prepare_data(spec, str(source.root), source.step)  # DataChangedError naming what changed, as a requeue
    how = link_into(source, job.checkpoints, keys)
    job.update_meta(resumed_from={"path": str(source.path), "step": source.step, "how": how})
    return source
