"""templates_cache/: profiles and templates as readable JSON, keyed by a hash of their inputs.

Layout:

    templates_cache/
      manifest.json              index: every entry with its inputs, content hash, versions, time
      profile/<key>.json         {"manifest": {...}, "data": <profile dict>}
      templates/<key>.json       {"manifest": {...}, "data": {"templates": [...]}}

An entry's key is the sha256 of its inputs (canonical JSON), and each file carries its own manifest:
the kind, the key, the inputs, the sha256 of its data, the producing versions and the time. On load
the entry is used only if all of these match what is asked for; otherwise it is reported (status
'corrupt' or 'stale', and a warning) and regenerated. So a cache made for other inputs (other node
counts, another profile, an older planner) is never used: it simply has another key, or fails the
check.

Writes are atomic (a temp file in the same directory, then os.replace), so readers never see half a
file; concurrent writers of one entry write identical content and the last rename wins. The index
is updated under an exclusive flock, read-modify-write, and also replaced atomically.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import platform
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from oobleck_slurm import __version__
from oobleck_slurm.cluster import durable
from oobleck_slurm.planning.profile import canonical_hash

log = logging.getLogger(__name__)
CACHE_FORMAT = 1


def atomic_write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    durable.write_json(path, data, indent=1, sort_keys=True, newline=True)  # the job's one durable write


class TemplateCache:
    """A directory of cached planner outputs. Statuses: 'hit', 'miss', 'corrupt', 'stale'."""

    def __init__(self, root: str | os.PathLike[str] = "templates_cache") -> None:
        self.root = Path(root)
        self.problems: list[str] = []  # what was found wrong and regenerated, for the caller to show

    @staticmethod
    def key(inputs: dict[str, Any]) -> str:
        return canonical_hash({"cache_format": CACHE_FORMAT, **inputs})

    def path(self, kind: str, key: str) -> Path:
        return self.root / kind / f"{key}.json"

    def load(self, kind: str, inputs: dict[str, Any]) -> tuple[Any, str]:
        """(data, 'hit') or (None, 'miss' | 'corrupt' | 'stale')."""
        key = self.key(inputs)
        path = self.path(kind, key)
        try:
            entry = json.loads(path.read_text())
        except FileNotFoundError:
            return None, "miss"
        except (OSError, ValueError) as err:
            return self._bad(path, "corrupt", f"unreadable ({err})")
        if not isinstance(entry, dict) or not isinstance(entry.get("manifest"), dict) or "data" not in entry:
            return self._bad(path, "corrupt", "not a cache entry (no manifest or data)")
        manifest, data = entry["manifest"], entry["data"]
        if manifest.get("content_sha256") != canonical_hash(data):
            return self._bad(path, "corrupt", "content hash mismatch (file edited or truncated)")
        if manifest.get("cache_format") != CACHE_FORMAT or manifest.get("kind") != kind or manifest.get("key") != key:
            return self._bad(path, "stale", "made by another cache format or for another key")
        if canonical_hash(manifest.get("inputs")) != canonical_hash(inputs):
            return self._bad(path, "stale", "made for other inputs")
        return data, "hit"

    def store(self, kind: str, inputs: dict[str, Any], data: Any) -> Path:
        key = self.key(inputs)
        path = self.path(kind, key)
        manifest = {
            "cache_format": CACHE_FORMAT, "kind": kind, "key": key, "inputs": inputs,
            "content_sha256": canonical_hash(data),
            "versions": {"oobleck_slurm": __version__, "python": platform.python_version()},
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": platform.node(), "pid": os.getpid(),
        }
        atomic_write_json(path, {"manifest": manifest, "data": data})
        with self._locked():
            index = self.index()
            index.setdefault("entries", {})[f"{kind}/{key}"] = {
                k: manifest[k] for k in ("kind", "inputs", "content_sha256", "versions", "created")
            }
            index["cache_format"] = CACHE_FORMAT
            atomic_write_json(self.root / "manifest.json", index)
        return path

    def get_or_create(self, kind: str, inputs: dict[str, Any], create: Callable[[], Any]) -> tuple[Any, str]:
        """The cached data, or `create()` stored and returned; the status says which."""
        data, status = self.load(kind, inputs)
        if status == "hit":
            return data, status
        data = create()
        self.store(kind, inputs, data)
        return data, status

    def index(self) -> dict[str, Any]:
        try:
            index = json.loads((self.root / "manifest.json").read_text())
            return index if isinstance(index, dict) else {}
        except (OSError, ValueError):
            return {}  # missing or damaged index: rebuilt from the entries written from now on

    def _bad(self, path: Path, status: str, why: str) -> tuple[None, str]:
        message = f"templates_cache: {path} is {status}: {why}; regenerating it"
        log.warning(message)
        self.problems.append(message)
        return None, status

    @contextmanager
    def _locked(self) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
