"""Durable, atomic file writes and stale-tolerant reads: the one way a job's records reach the disk.

A record that another process (a standby supervisor, a requeued job, a worker on another node) reads
after this one died must be the old content or the new, whole, and still there after a crash. A rename
alone is not enough: on ext4, XFS and NFS the rename can reach the disk before the data it points to,
and a machine that dies in between leaves an empty or truncated file under the final name. So every
write here is:

    write a temp file in the same folder (a rename across folders is not atomic), flush, fsync it,
    rename it over the target, fsync the folder (the rename itself is then on disk).

Readers meet NFS's ESTALE when the file they looked up was renamed over before they opened it (a
writer replaced it): the new file is there, so the open is simply retried (`STALE_ATTEMPTS`, pausing
`JobTimeouts.stale_file_retry`). Any other error is the caller's to name.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, TypeVar

from oobleck_slurm.timeouts import DEFAULT_TIMEOUTS

T = TypeVar("T")

STALE_ATTEMPTS = 5  # an open that NFS reports stale is tried this often before the error is raised
# fsync of a folder is refused by some filesystems (EINVAL) or descriptors (EBADF): the rename is then as
# durable as that filesystem makes it.
_DIR_FSYNC_UNSUPPORTED = frozenset({errno.EINVAL, errno.EBADF, errno.ENOTSUP, errno.EACCES})

Opener = Callable[..., IO[Any]]


def temp_path(path: Path) -> Path:
    """A fresh temp name beside `path` (hidden, `.tmp`): unique per writer, so two processes replacing
    one file never write into the same temp file."""
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


def fsync_dir(folder: str | os.PathLike[str]) -> None:
    """Make the renames in `folder` durable (its directory entry is written to disk)."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError as err:
        if err.errno in _DIR_FSYNC_UNSUPPORTED:
            return
        raise
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in _DIR_FSYNC_UNSUPPORTED:
            raise
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_with(path: str | os.PathLike[str], write: Callable[[Path], object]) -> None:
    """Replace `path` with what `write(temp)` writes to a temp path beside it (for writers that take a
    path, such as safetensors' `save_file`), durably: fsync, rename, fsync the folder. A failed write
    leaves the old file untouched and no temp file behind."""
    target = Path(path)
    tmp = temp_path(target)
    try:
        write(tmp)
        _fsync_file(tmp)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(target.parent)


def write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace `path` with `data`, durably and atomically (see the module docstring). The file gets the
    usual mode (0666 less the umask), as a plain open would give it."""
    write_with(path, lambda tmp: tmp.write_bytes(data))


def write_text(path: str | os.PathLike[str], text: str) -> None:
    write_bytes(path, text.encode())


def write_json(path: str | os.PathLike[str], value: Any, *, indent: int | None = None, sort_keys: bool = False,
               newline: bool = False) -> None:
    """`value` as JSON, durably and atomically; `newline` ends the file with one."""
    write_text(path, json.dumps(value, indent=indent, sort_keys=sort_keys) + ("\n" if newline else ""))


def retry_stale(action: Callable[[], T], pause: float = DEFAULT_TIMEOUTS.stale_file_retry) -> T:
    """`action()` (an open and read), retried while it fails with ESTALE (see the module docstring);
    the last ESTALE, or any other error, is raised."""
    for attempt in range(STALE_ATTEMPTS):
        try:
            return action()
        except OSError as err:
            if err.errno != errno.ESTALE or attempt == STALE_ATTEMPTS - 1:
                raise
            time.sleep(pause * (attempt + 1))
    raise AssertionError("unreachable")  # the loop returns or raises


def read_bytes(path: str | os.PathLike[str], opener: Opener = open) -> bytes:
    """The whole file, retrying an open or read that NFS reports stale; `opener` is `open` (a test gives
    one that fails as NFS does)."""
    def read() -> bytes:
        with opener(path, "rb") as f:
            return f.read()

    return retry_stale(read)


def read_text(path: str | os.PathLike[str], opener: Opener = open) -> str:
    return read_bytes(path, opener).decode()
