"""The metrics sampler and the metrics.csv store: round trip, rotation bound, and clear errors."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oobleck_slurm.detection import (
    HEADER,
    MetricsFileError,
    MetricsSampler,
    MetricsWriter,
    bucket,
    metrics_files,
    read_metrics,
)
from oobleck_slurm.detection.metrics import counter_rates, format_rows

names = st.text(st.characters(codec="utf-8", exclude_characters=',"\r\n\x00'), min_size=1, max_size=8).filter(
    lambda s: s.strip() == s and s.isprintable() and s.strip() != "")
values = st.floats(allow_nan=False, allow_infinity=False, min_value=-1e12, max_value=1e12)
samples = st.dictionaries(names, st.dictionaries(names, values, min_size=1, max_size=4), min_size=1, max_size=4)


@settings(max_examples=60, deadline=None)
@given(trace=st.lists(samples, min_size=1, max_size=5))
def test_csv_round_trip(tmp_path_factory: pytest.TempPathFactory, trace: list) -> None:
    path = tmp_path_factory.mktemp("m") / "metrics.csv"
    with MetricsWriter(path) as writer:
        for t, sample in enumerate(trace):
            writer.write(float(t), sample)
    back = read_metrics(path)
    assert [t for t, _ in back] == [float(t) for t in range(len(trace))]
    for (_, got), want in zip(back, trace):
        assert got.keys() == want.keys()
        for node in want:
            for metric, value in want[node].items():
                assert math.isclose(got[node][metric], value, rel_tol=1e-6, abs_tol=1e-30)


def test_rotation_keeps_the_store_bounded_and_readable(tmp_path: Path) -> None:
    path = tmp_path / "metrics.csv"
    with MetricsWriter(path, max_bytes=16384, keep=2) as writer:
        for t in range(2000):
            writer.write(float(t), {f"n{i}": {"cpu": 50.0 + i, "net": 1e9} for i in range(4)})
    files = metrics_files(tmp_path)
    assert [p.name for p in files] == ["metrics.csv.2", "metrics.csv.1", "metrics.csv"]
    assert sum(p.stat().st_size for p in files) <= 16384
    trace = [s for p in files for s in read_metrics(p)]
    times = [t for t, _ in trace]
    assert times == sorted(times) and times[-1] == 1999.0  # the newest samples survive, in order


def test_rows_in_any_order_and_bucketing(tmp_path: Path) -> None:
    path = tmp_path / "m.csv"
    path.write_text(f"{HEADER}\n2,b,cpu,3\n1,a,cpu,1\n1.02,b,cpu,2\n2.01,a,cpu,4\n")
    trace = read_metrics(path)
    assert [t for t, _ in trace] == [1.0, 1.02, 2.0, 2.01]
    merged = bucket(trace, 1.0)
    assert merged == [(1.0, {"a": {"cpu": 1.0}, "b": {"cpu": 2.0}}), (2.0, {"b": {"cpu": 3.0}, "a": {"cpu": 4.0}})]


BAD_FILES = [
    ("empty", b"", None, "empty file"),
    ("header-only", HEADER.encode() + b"\n", None, "no rows after the header"),
    ("wrong-header", b"t,node,metric,value\n1,a,b,2\n", 1, "expected the header"),
    ("binary", b"\x89PNG\r\n\x1a\n\x00\x00", 3, "binary data"),
    ("latin1", HEADER.encode() + b"\n1,n\xe9,cpu,2\n", 2, "not UTF-8"),
    ("three-fields", HEADER.encode() + b"\n1,a,2\n", 2, "expected 4 fields"),
    ("bad-time", HEADER.encode() + b"\n1,a,cpu,2\nsoon,a,cpu,2\n", 3, "time must be a number, got 'soon'"),
    ("bad-value", HEADER.encode() + b"\n1,a,cpu,high\n", 2, "value must be a number, got 'high'"),
    ("nan-value", HEADER.encode() + b"\n1,a,cpu,nan\n", 2, "value must be finite"),
    ("empty-node", HEADER.encode() + b"\n1,,cpu,2\n", 2, "must not be empty"),
    ("duplicate", HEADER.encode() + b"\n1,a,cpu,2\n1,a,cpu,3\n", 3, "given twice"),
]


@pytest.mark.parametrize(("content", "line", "words"), [c[1:] for c in BAD_FILES], ids=[c[0] for c in BAD_FILES])
def test_bad_files_name_file_and_line(tmp_path: Path, content: bytes, line: int | None, words: str) -> None:
    path = tmp_path / "m.csv"
    path.write_bytes(content)
    with pytest.raises(MetricsFileError) as caught:
        read_metrics(path)
    assert caught.value.line == line and words in caught.value.message
    assert str(caught.value).startswith(f"{path}:{line}: " if line else f"{path}: ")


def test_huge_and_missing_files_and_live_tail(tmp_path: Path) -> None:
    path = tmp_path / "m.csv"
    path.write_text(HEADER + "\n" + "1,a,cpu,2\n" * 100)
    with pytest.raises(MetricsFileError, match="over the 0 MiB limit"):
        read_metrics(path, max_bytes=100)
    with pytest.raises(MetricsFileError, match="file not found"):
        read_metrics(tmp_path / "nope.csv")
    path.write_text(HEADER + "\n1,a,cpu,2\n2,a,cp")  # a writer caught mid-line
    assert read_metrics(path, live=True) == [(1.0, {"a": {"cpu": 2.0}})]
    with pytest.raises(MetricsFileError):
        read_metrics(path)


def test_pure_helpers() -> None:
    assert counter_rates({"a": 10, "b": 5, "c": 1}, {"a": 30, "b": 2, "d": 7}, 2.0) == {"a": 10.0}  # b reset
    assert counter_rates({"a": 1}, {"a": 2}, 0.0) == {}
    rows = format_rows(1.5, {"node,1": {"cpu\n": 2.0, "gone": float("nan")}})
    assert rows == "1.500,node_1,cpu_,2\n"


def test_sampler_gives_cpu_memory_and_rates_without_a_gpu() -> None:
    ticks = iter([0.0, 1.0, 2.0])
    sampler = MetricsSampler(gpus=True, clock=lambda: next(ticks))  # no NVML here: skipped, not an error
    first = sampler.sample()
    assert {"cpu.util", "mem.used_pct", "mem.used_gib", "net.rx_mbps", "net.tx_mbps"} <= first.keys()
    assert all(math.isfinite(v) for v in first.values())
    assert 0 <= first["cpu.util"] <= 100
    sampler.close()
