"""The job folder: everything about one job in one place, readable after the job and elsewhere.

    <job_root>/<job_id>/
        recipe.yaml     the resolved recipe (every default filled in, data paths absolute)
        meta.json       job id, backend, creation time, the recipe it came from
        secret          per-job control-plane secret, mode 0600
        events.jsonl    the event log (engine, supervisor), read by `dashboard`, `events`, `report`
        profile.json    the profile given to `submit --profile` (the job plans with it, as `plan` does)
        faults.json     optional drill: faults the workers inject (engine/faults.py)
        checkpoints/    step<S>/<layer>.pt: periodic, on-demand and final checkpoints
        logs/           per-process logs
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from oobleck_slurm.protocol.events import EVENTS_FILE
from oobleck_slurm.recipe import Recipe, load_recipe, recipe_to_dict
from oobleck_slurm.supervisor.secret import create_secret

RECIPE_FILE = "recipe.yaml"
META_FILE = "meta.json"
PROFILE_FILE = "profile.json"
FAULTS_FILE = "faults.json"
CHECKPOINTS_DIR = "checkpoints"


class JobNotFound(Exception):
    """No job folder matches what the user named; the message says what was looked for, and where."""


@dataclass(frozen=True)
class JobDir:
    path: Path
    job_id: str

    @property
    def recipe_path(self) -> Path:
        return self.path / RECIPE_FILE

    def recipe(self) -> Recipe:
        return load_recipe(self.recipe_path)

    def meta(self) -> dict[str, Any]:
        return json.loads((self.path / META_FILE).read_text())

    def update_meta(self, **fields: Any) -> None:
        meta = {**self.meta(), **fields}
        tmp = self.path / f".{META_FILE}.tmp"
        tmp.write_text(json.dumps(meta, indent=2))
        os.replace(tmp, self.path / META_FILE)


def create_job_dir(recipe: Recipe, job_root: str | os.PathLike[str] | None = None) -> JobDir:
    """A new, uniquely named job folder holding the resolved recipe and a fresh secret."""
    root = Path(job_root if job_root is not None else recipe.cluster.job_root)
    root.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for attempt in range(1000):  # two submits in the same second get distinct folders
        job_id = f"{recipe.name}-{stamp}" + (f"-{attempt}" if attempt else "")
        path = root / job_id
        try:
            path.mkdir()
            break
        except FileExistsError:
            continue
    else:
        raise RuntimeError(f"could not create a job folder under {root}")
    (path / RECIPE_FILE).write_text(
        f"# resolved from {recipe.source}\n" + yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False)
    )
    (path / META_FILE).write_text(json.dumps({
        "job_id": job_id, "backend": recipe.cluster.backend, "recipe": recipe.name,
        "recipe_source": recipe.source, "created": time.time(),
    }, indent=2))
    create_secret(path)
    (path / "logs").mkdir()
    return JobDir(path.resolve(), job_id)


def find_job(
    name: str | os.PathLike[str], job_root: str | os.PathLike[str] = "jobs", *, needs_meta: bool = True
) -> JobDir:
    """The job folder a user's JOB argument names: a folder (or its events.jsonl), or a job id under
    `job_root` (a unique prefix is enough). Raises JobNotFound saying what was looked for, and where.

    needs_meta=False also takes a folder holding only an event log (a copied job): the log is all
    `dashboard` and `report` read, while `status`, `cancel` and `kill-node` need meta.json.
    """
    markers = (META_FILE,) if needs_meta else (META_FILE, EVENTS_FILE)

    def is_job(folder: Path) -> bool:
        return any((folder / marker).is_file() for marker in markers)

    path = Path(name)
    if path.name == EVENTS_FILE and path.is_file():
        path = path.parent
    if is_job(path):
        return JobDir(path.resolve(), path.resolve().name)
    looked = f"looked for {' or '.join(str(path / marker) for marker in markers)}"
    # Only a bare name can be a job id; a path that is not a job folder has nothing to look up.
    if len(path.parts) != 1 or path.name in (".", ".."):
        raise JobNotFound(f"no job folder {str(name)!r} ({looked})")
    root = Path(job_root)
    if not root.is_dir():
        raise JobNotFound(f"no job folder {str(name)!r} ({looked}; no job root {root} to look up job ids in)")
    candidates = sorted(p for p in root.iterdir() if p.name.startswith(path.name) and is_job(p))
    exact = [p for p in candidates if p.name == path.name]
    if exact or len(candidates) == 1:
        found = (exact or candidates)[0]
        return JobDir(found.resolve(), found.name)
    if candidates:
        raise JobNotFound(f"{str(name)!r} matches several jobs under {root}: {', '.join(p.name for p in candidates)}")
    raise JobNotFound(f"no job folder {str(name)!r} ({looked}, and for jobs named {path.name}* under {root})")
