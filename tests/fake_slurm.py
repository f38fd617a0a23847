"""Real Slurm clients that misbehave on purpose: a folder of `squeue`/`scontrol`/`scancel`/... scripts put
first on PATH. Each script counts its calls (a file), logs its arguments, and fails the first N calls,
by a transient error (exit 1, "Socket timed out") or by sleeping past the caller's timeout (`exec sleep`:
the process itself is killed, no grandchild keeps the pipes open); then it prints the answer the test
wrote (`answer`) or fails as the test said (`refuse`)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

SCRIPT = """#!/bin/bash
d={folder}; name={name}
n=$(( $(cat "$d/$name.count" 2>/dev/null || echo 0) + 1 )); echo "$n" > "$d/$name.count"
echo "$*" >> "$d/$name.log"
if [ "$n" -le "$(cat "$d/$name.fail" 2>/dev/null || echo 0)" ]; then
  if [ "$(cat "$d/$name.how")" = sleep ]; then exec sleep 30; fi
  echo "$name: error: Socket timed out on send/recv operation" >&2; exit 1
fi
if [ -f "$d/$name.refuse" ]; then cat "$d/$name.refuse" >&2; exit 1; fi
cat "$d/$name.out" 2>/dev/null; exit 0
"""


class FakeSlurm:
    def __init__(self, folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")

    def client(self, name: str, answer: str = "", fail: int = 0, how: str = "exit") -> FakeSlurm:
        """`name` answers `answer` after failing its first `fail` calls (`how`: exit or sleep)."""
        script = self.folder / name
        script.write_text(SCRIPT.format(folder=self.folder, name=name))
        script.chmod(script.stat().st_mode | stat.S_IXUSR)
        self.answer(name, answer)
        (self.folder / f"{name}.fail").write_text(str(fail))
        (self.folder / f"{name}.how").write_text(how)
        for stale in (f"{name}.count", f"{name}.log", f"{name}.refuse"):  # a fresh client: counts from 0
            (self.folder / stale).unlink(missing_ok=True)
        return self

    def answer(self, name: str, text: str) -> None:
        (self.folder / f"{name}.out").write_text(text)

    def refuse(self, name: str, stderr: str) -> None:
        """From now on `name` exits 1 with `stderr` (after its failing calls)."""
        (self.folder / f"{name}.refuse").write_text(stderr)

    def calls(self, name: str) -> int:
        path = self.folder / f"{name}.count"
        return int(path.read_text()) if path.exists() else 0

    def log(self, name: str) -> list[str]:
        path = self.folder / f"{name}.log"
        return path.read_text().splitlines() if path.exists() else []
