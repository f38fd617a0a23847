"""The per-job secret that authenticates every control-plane connection.

Kept in `<job_dir>/secret` with mode 0600: anyone who can read it can steer the job, so a file that
others can read is refused rather than used.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

SECRET_FILE = "secret"
SECRET_BYTES = 32


class SecretError(Exception):
    """The job secret is missing, malformed or readable by others."""


def create_secret(job_dir: str | os.PathLike[str]) -> bytes:
    """Write a fresh secret for a new job; refuses to overwrite an existing one."""
    path = Path(job_dir) / SECRET_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    value = secrets.token_bytes(SECRET_BYTES)
    # O_EXCL + mode at creation: the file is never visible with wider permissions.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(value.hex() + "\n")
    return value


def load_secret(job_dir: str | os.PathLike[str]) -> bytes:
    path = Path(job_dir) / SECRET_FILE
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise SecretError(f"{path}: job secret not found (was the job created by `submit`?)") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SecretError(f"{path}: job secret is accessible by other users (mode {stat.S_IMODE(mode):o}); "
                          "expected 600")
    text = path.read_text().strip()
    try:
        value = bytes.fromhex(text)
    except ValueError:
        raise SecretError(f"{path}: job secret is not hex text") from None
    if len(value) != SECRET_BYTES:
        raise SecretError(f"{path}: job secret has {len(value)} bytes, expected {SECRET_BYTES}")
    return value
