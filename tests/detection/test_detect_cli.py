"""`python -m oobleck_slurm detect`: flags from a metrics file or a job folder; clear errors, exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from detection_traces import make_trace

from oobleck_slurm.cli import main
from oobleck_slurm.detection import HEADER, MetricsWriter


def write_trace(path: Path, kind: str, nodes: int, seed: int) -> dict[str, float]:
    trace = make_trace(kind, nodes, seed)
    with MetricsWriter(path, max_bytes=2**30) as writer:
        for t, sample in trace.samples():
            writer.write(t, sample)
    return trace.faulty


def test_detect_metrics_file_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    faulty = write_trace(tmp_path / "m.csv", "cpu_hog", 8, 5)
    assert main(["detect", "--metrics", str(tmp_path / "m.csv"), "--json"]) == 0
    flags = json.loads(capsys.readouterr().out)
    assert {f["node"] for f in flags} == set(faulty)
    for f in flags:
        assert f["time"] >= faulty[f["node"]] and "cpu.util" in f["metrics"]


def test_detect_job_folder_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job = tmp_path / "job1"
    job.mkdir()
    (faulty_node,) = write_trace(job / "metrics.csv", "thermal", 8, 7)
    assert main(["detect", str(job)]) == 0
    out = capsys.readouterr().out
    assert "1 machine(s) flagged" in out and faulty_node in out and "gpu." in out


def test_detect_healthy_file_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_trace(tmp_path / "m.csv", "healthy", 6, 9)
    assert main(["detect", "--metrics", str(tmp_path / "m.csv")]) == 0
    assert "no faulty machine found" in capsys.readouterr().out
    assert main(["detect", "--metrics", str(tmp_path / "m.csv"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []


@pytest.mark.parametrize(("content", "words"), [
    (b"", "empty file"),
    (b"\x00\x01\x02binary", ":1: binary data"),
    (HEADER.encode() + b"\n1,a,cpu,2\n1,b,cpu\n", ":3: expected 4 fields"),
])
def test_detect_bad_file_exit_2_no_traceback(tmp_path: Path, content: bytes, words: str) -> None:
    path = tmp_path / "m.csv"
    path.write_bytes(content)
    done = subprocess.run([sys.executable, "-m", "oobleck_slurm", "detect", "--metrics", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert str(path) in done.stderr and words in done.stderr
    assert "Traceback" not in done.stderr + done.stdout


def test_detect_argument_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["detect"]) == 2
    assert main(["detect", "--metrics", str(tmp_path / "none.csv")]) == 2
    assert "file not found" in capsys.readouterr().err
    assert main(["detect", str(tmp_path / "nojob")]) == 2
    (tmp_path / "m.csv").write_text(f"{HEADER}\n1,a,cpu,1\n")
    assert main(["detect", "--metrics", str(tmp_path / "m.csv"), "--window", "0.1"]) == 2
