"""Durable writes (cluster/durable.py) and the readers of the job folder's records when a file is empty,
truncated or stale on NFS: fsync of the file before the rename and of the folder after it, no temp file
left, a named error or None (never a traceback) for a damaged record, ESTALE retried."""

from __future__ import annotations

import errno
import io
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from oobleck_slurm.cluster import durable
from oobleck_slurm.cluster.jobdir import JobDir, MetaError
from oobleck_slurm.cluster.lease import read_lease, renew
from oobleck_slurm.engine.checkpoint import read_layer_file, save_layer
from oobleck_slurm.protocol.records import SupervisorState, read_state, write_state
from oobleck_slurm.protocol.wire import ProtocolError

STATE = SupervisorState(epoch=1, generation=3, members=("a", "b"), plan={"pipelines": []}, start_step=7,
                        phase="training")


def test_a_write_is_fsynced_then_renamed_then_its_folder_fsynced(tmp_path: Path, monkeypatch) -> None:
    seen: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        seen.append("dir" if os.path.isdir(f"/proc/self/fd/{fd}") else "file")
        real_fsync(fd)

    def replace(src: Any, dst: Any) -> None:
        seen.append("rename")
        real_replace(src, dst)

    monkeypatch.setattr(durable.os, "fsync", fsync)
    monkeypatch.setattr(durable.os, "replace", replace)
    durable.write_json(tmp_path / "x.json", {"a": 1})
    assert seen == ["file", "rename", "dir"]
    assert json.loads((tmp_path / "x.json").read_text()) == {"a": 1}
    assert os.listdir(tmp_path) == ["x.json"]  # no temp file left
    assert (tmp_path / "x.json").stat().st_mode & 0o044  # the usual mode, not mkstemp's 0600


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    durable.write_text(target, "old")

    def broken(path: Path) -> None:
        path.write_text("half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        durable.write_with(target, broken)
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["state.json"]


class StaleOpener:
    """`open` as NFS behaves after a rename over the file: ESTALE the first `stale` times."""

    def __init__(self, stale: int) -> None:
        self.stale, self.calls = stale, 0

    def __call__(self, path: Any, mode: str = "r") -> io.IOBase:
        self.calls += 1
        if self.calls <= self.stale:
            raise OSError(errno.ESTALE, "Stale file handle", str(path))
        return open(path, mode)  # noqa: SIM115 - the caller closes it


def test_estale_is_retried_then_raised(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_text("content")
    opener = StaleOpener(stale=durable.STALE_ATTEMPTS - 1)
    assert durable.read_text(path, opener) == "content" and opener.calls == durable.STALE_ATTEMPTS
    with pytest.raises(OSError) as err:
        durable.read_text(path, StaleOpener(stale=durable.STALE_ATTEMPTS))
    assert err.value.errno == errno.ESTALE
    with pytest.raises(FileNotFoundError):  # any other error at once
        durable.read_text(tmp_path / "missing", StaleOpener(stale=0))


def test_a_stale_lease_is_retried_and_an_empty_or_truncated_one_is_none(tmp_path: Path) -> None:
    job = JobDir.at(tmp_path)
    assert read_lease(job) is None  # none yet
    renew(job, epoch=2)
    assert read_lease(job, StaleOpener(stale=2)).epoch == 2  # type: ignore[union-attr]
    job.supervisor_lease.write_text("")
    assert read_lease(job) is None
    job.supervisor_lease.write_text('{"epoch": 2, "pid": 1')
    assert read_lease(job) is None
    job.supervisor_lease.write_text("[1, 2]")
    assert read_lease(job) is None


@pytest.mark.parametrize(("content", "message"), [
    ("", "empty"), ('{"epoch": 1, "generation": 3, "memb', "truncated or not JSON"), ("\n", "empty"),
])
def test_a_damaged_state_file_is_a_named_error(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "supervisor_state.json"
    write_state(path, STATE)
    assert read_state(path) == STATE
    path.write_text(content)
    with pytest.raises(ProtocolError, match=f"supervisor_state.json: {message}"):
        read_state(path)
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(ProtocolError, match="not UTF-8"):
        read_state(path)


def test_a_truncated_meta_is_a_named_error(tmp_path: Path) -> None:
    job = JobDir.at(tmp_path)
    with pytest.raises(MetaError, match="no meta.json"):
        job.meta()
    durable.write_json(job.meta_path, {"a": 1})
    job.update_meta(backend="slurm")
    assert job.meta() == {"a": 1, "backend": "slurm"}
    job.meta_path.write_text('{"a": 1, "back')
    with pytest.raises(MetaError, match="meta.json: truncated or not JSON"):
        job.meta()
    job.meta_path.write_text("")
    with pytest.raises(MetaError, match="meta.json: empty"):
        job.meta()


def test_a_checkpoint_layer_is_written_durably_and_read_back(tmp_path: Path) -> None:
    payload = {"param.w": torch.arange(6.0).reshape(2, 3)}
    path = save_layer(tmp_path, 5, "layer0", payload)
    assert torch.equal(read_layer_file(path, 5)["param.w"], payload["param.w"])
    assert sorted(p.name for p in path.parent.iterdir()) == [".layer0.seconds", "layer0.safetensors"]
    path.write_bytes(path.read_bytes()[:20])  # a truncated file (what a rename before the data leaves)
    with pytest.raises(Exception, match="not a valid safetensors file"):
        read_layer_file(path, 5)
