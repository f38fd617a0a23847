"""Per-node monitoring metrics: the samplers the node agent calls every second, and the on-disk store.

The sampler turns psutil's (and, when present, NVML's) counters into gauges and per-second rates,
one flat `{metric: value}` per call. Absent sources (no GPU, no NVML library, a counter the kernel
does not expose) are skipped, never an error: the detector compares whatever metrics the nodes share.

`ProcessMetrics` adds the CPU and memory of given processes (the node agent passes itself and its
workers): on the local backend's virtual nodes, which share one machine, the only metrics that tell
them apart.

The store is one CSV file in the job folder, `metrics.csv`, header `time,node,metric,value`, one
row per value: the very format `python -m oobleck_slurm detect --metrics FILE` reads. It is bounded:
when the file reaches its share of `max_bytes` it is renamed `metrics.csv.1` (older ones shift up to
`keep`) and a new file starts, so a week-long job never fills the disk. One writer per file (the
supervisor, which receives every agent's samples); readers may read while it writes.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from oobleck_slurm.cluster.jobdir import METRICS_FILE
from oobleck_slurm.errors import BadInputError

HEADER = "time,node,metric,value"
DEFAULT_MAX_BYTES = 64 * 2**20  # all rotated files together
DEFAULT_READ_LIMIT = 512 * 2**20  # a larger file is refused with a message, not parsed for minutes

# A sample from the job: time -> {node: {metric: value}}.
Sample = dict[str, dict[str, float]]
Trace = list[tuple[float, Sample]]

_MB = 1e6
_GIB = 2.0**30


# ---- pure helpers ---------------------------------------------------------------------------------

def counter_rates(prev: Mapping[str, float], cur: Mapping[str, float], dt: float) -> dict[str, float]:
    """Per-second rates of monotonically increasing counters between two readings.

    A counter missing from either reading, or one that went down (a reset: a NIC replugged, a driver
    reloaded), gives no rate rather than a huge negative one.
    """
    if dt <= 0:
        return {}
    return {k: (cur[k] - prev[k]) / dt for k in cur if k in prev and cur[k] >= prev[k]}


def clean_name(name: str) -> str:
    """A node or metric name safe in the CSV store: no separators, quotes or line breaks."""
    cleaned = "".join("_" if ch in ',"\r\n' or not ch.isprintable() else ch for ch in str(name)).strip()
    return cleaned or "_"


def format_rows(t: float, sample: Mapping[str, Mapping[str, float]]) -> str:
    """The CSV rows of one sample (no header). Non-finite values mean 'not measured' and are left out."""
    lines = []
    for node, metrics in sample.items():
        n = clean_name(node)
        for metric, value in metrics.items():
            v = float(value)
            if math.isfinite(v):
                lines.append(f"{t:.3f},{n},{clean_name(metric)},{v:.7g}\n")
    return "".join(lines)


# ---- the sampler ----------------------------------------------------------------------------------

def _psutil_counters(psutil: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    net = psutil.net_io_counters()
    if net is not None:
        out.update({"net.rx_mbps": net.bytes_recv / _MB, "net.tx_mbps": net.bytes_sent / _MB,
                    "net.errors_ps": float(net.errin + net.errout + net.dropin + net.dropout)})
    try:
        disk = psutil.disk_io_counters()
    except (OSError, RuntimeError):  # no disks visible (some containers)
        disk = None
    if disk is not None:
        out.update({"disk.read_mbps": disk.read_bytes / _MB, "disk.write_mbps": disk.write_bytes / _MB})
        if hasattr(disk, "busy_time"):  # Linux: ms spent doing I/O -> busy % once divided by dt
            out["disk.busy_pct"] = disk.busy_time / 10.0
    return out


def _psutil_gauges(psutil: Any) -> dict[str, float]:
    mem = psutil.virtual_memory()
    out = {"cpu.util": float(psutil.cpu_percent(interval=None)), "mem.used_pct": float(mem.percent),
           "mem.used_gib": (mem.total - mem.available) / _GIB}
    times = psutil.cpu_times_percent(interval=None)
    if hasattr(times, "iowait"):
        out["cpu.iowait"] = float(times.iowait)
    return out


class _Nvml:
    """NVML through nvidia-ml-py (`pynvml`), opened lazily; every query that fails is skipped."""

    def __init__(self) -> None:
        import pynvml  # noqa: PLC0415 - optional dependency, absent on CPU machines

        self.nv = pynvml
        pynvml.nvmlInit()
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        self.events = None
        try:  # Xid errors arrive as events, not as a gauge: register once, drain at every sample
            self.events = pynvml.nvmlEventSetCreate()
            for h in self.handles:
                pynvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, self.events)
        except Exception:  # noqa: BLE001 - not supported on this GPU/driver: no Xid metric
            self.events = None

    def gauges(self) -> dict[str, float]:
        nv, out = self.nv, {}
        queries: dict[str, Callable[[Any], float]] = {
            "util": lambda h: nv.nvmlDeviceGetUtilizationRates(h).gpu,
            "mem_util": lambda h: nv.nvmlDeviceGetUtilizationRates(h).memory,
            "power_w": lambda h: nv.nvmlDeviceGetPowerUsage(h) / 1000.0,
            "temp_c": lambda h: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU),
            "sm_mhz": lambda h: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
            "mem_used_gib": lambda h: nv.nvmlDeviceGetMemoryInfo(h).used / _GIB,
        }
        for i, h in enumerate(self.handles):
            for name, query in queries.items():
                try:
                    out[f"gpu{i}.{name}"] = float(query(h))
                except Exception:  # noqa: BLE001 - NVMLError_NotSupported and friends: skip the metric
                    pass
        return out

    def counters(self) -> dict[str, float]:
        nv, out = self.nv, {}
        for i, h in enumerate(self.handles):
            try:
                out[f"gpu{i}.ecc_ps"] = float(nv.nvmlDeviceGetTotalEccErrors(
                    h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC))
            except Exception:  # noqa: BLE001 - ECC off or not supported
                pass
        return out

    def xid_events(self) -> dict[str, float]:
        if self.events is None:
            return {}
        counts = {f"gpu{i}.xid": 0.0 for i in range(len(self.handles))}
        for _ in range(64):  # bounded: never spin on a storm of events
            try:
                data = self.nv.nvmlEventSetWait(self.events, 0)
            except Exception:  # noqa: BLE001 - NVML_ERROR_TIMEOUT: no more pending events
                break
            for i, h in enumerate(self.handles):
                if data.device == h:
                    counts[f"gpu{i}.xid"] += 1
        return counts

    def close(self) -> None:
        try:
            if self.events is not None:
                self.nv.nvmlEventSetFree(self.events)
            self.nv.nvmlShutdown()
        except Exception:  # noqa: BLE001 - closing is best effort
            pass


class MetricsSampler:
    """One node's metrics, `{metric: value}` per `sample()` call (the agent calls it every second).

    Gauges: cpu.util, cpu.iowait (%), mem.used_pct, mem.used_gib; rates since the previous call:
    net.rx_mbps / net.tx_mbps (MB/s), net.errors_ps, disk.read_mbps / disk.write_mbps (MB/s),
    disk.busy_pct; per GPU i when NVML is usable: gpu{i}.util, mem_util (%), power_w, temp_c,
    sm_mhz, mem_used_gib, ecc_ps (uncorrected ECC errors per second), xid (critical Xid events since
    the previous call). Rates appear from the second call on.
    """

    def __init__(self, gpus: bool = True, clock: Callable[[], float] = time.monotonic) -> None:
        import psutil  # noqa: PLC0415 - keeps `import oobleck_slurm.detection` light for pure users

        self._psutil, self._clock = psutil, clock
        self._nvml: _Nvml | None = None
        if gpus:
            try:
                self._nvml = _Nvml()
            except Exception:  # noqa: BLE001 - no library, no driver, no GPU: CPU metrics only
                self._nvml = None
        _psutil_gauges(psutil)  # prime cpu_percent: its first reading is meaningless
        self._prev_t = clock()
        self._prev = self._counters()

    @property
    def has_gpus(self) -> bool:
        return self._nvml is not None and bool(self._nvml.handles)

    def _counters(self) -> dict[str, float]:
        out = _psutil_counters(self._psutil)
        if self._nvml is not None:
            out.update(self._nvml.counters())
        return out

    def sample(self) -> dict[str, float]:
        now, counters = self._clock(), self._counters()
        out = _psutil_gauges(self._psutil)
        out.update(counter_rates(self._prev, counters, now - self._prev_t))
        if "disk.busy_pct" in out:
            out["disk.busy_pct"] = min(out["disk.busy_pct"], 100.0)  # several disks can sum past 100
        if self._nvml is not None:
            out.update(self._nvml.gauges())
            out.update(self._nvml.xid_events())
        self._prev, self._prev_t = counters, now
        return out

    def close(self) -> None:
        if self._nvml is not None:
            self._nvml.close()
            self._nvml = None


class ProcessMetrics:
    """A set of processes' CPU and resident memory, summed: `procs.cpu_pct` (100 = one core busy) and
    `procs.rss_gib` (the node agent passes itself and its workers: the job's footprint on the node).

    psutil measures a process's CPU between two calls on the same `Process` object, so processes are
    kept by pid; one seen for the first time counts from then on (0 at its first sample).
    """

    def __init__(self) -> None:
        import psutil  # noqa: PLC0415 - see MetricsSampler

        self._psutil = psutil
        self._procs: dict[int, Any] = {}

    def sample(self, pids: Iterable[int]) -> dict[str, float]:
        cpu = rss = 0.0
        alive = {}
        for pid in pids:
            proc = self._procs.get(pid)
            try:
                if proc is None:
                    proc = self._psutil.Process(pid)
                    proc.cpu_percent(interval=None)  # primes the counter: its first reading is meaningless
                else:
                    cpu += proc.cpu_percent(interval=None)
                rss += proc.memory_info().rss / _GIB
            except self._psutil.Error:  # gone between the listing and now
                continue
            alive[pid] = proc
        self._procs = alive
        return {"procs.cpu_pct": cpu, "procs.rss_gib": rss}


# ---- the on-disk store ----------------------------------------------------------------------------

class MetricsWriter:
    """Appends samples to `path` (header `time,node,metric,value`), rotating to stay under `max_bytes`.

    At most `keep` older files (`path.1` newest .. `path.{keep}`) are kept beside the current one; each
    file is cut at max_bytes / (keep + 1), so all of them together stay within `max_bytes`.
    """

    def __init__(self, path: str | os.PathLike[str], max_bytes: int = DEFAULT_MAX_BYTES, keep: int = 1) -> None:
        if keep < 0 or max_bytes < 4096:
            raise ValueError("need keep >= 0 and max_bytes >= 4096")
        self.path, self.keep = Path(path), keep
        self.file_limit = max_bytes // (keep + 1)
        self._file = self._open()

    def _open(self) -> Any:
        fresh = not self.path.exists() or self.path.stat().st_size == 0
        file = open(self.path, "a", encoding="utf-8", newline="")  # noqa: SIM115 - held open on purpose
        if fresh:
            file.write(HEADER + "\n")
            file.flush()
        return file

    def write(self, t: float, sample: Mapping[str, Mapping[str, float]]) -> None:
        rows = format_rows(t, sample)
        if not rows:
            return
        if self._file.tell() + len(rows) > self.file_limit:
            self._rotate()
        # One write per sample, flushed: a reader never sees a sample torn across lines it cannot parse
        # except possibly the very last line, which readers of a live file skip.
        self._file.write(rows)
        self._file.flush()

    def _rotate(self) -> None:
        self._file.close()
        if self.keep == 0:
            self.path.unlink(missing_ok=True)
        else:
            for k in range(self.keep - 1, 0, -1):
                older = self.path.with_name(f"{self.path.name}.{k}")
                if older.exists():
                    os.replace(older, self.path.with_name(f"{self.path.name}.{k + 1}"))
            os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        self._file = self._open()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class MetricsFileError(BadInputError, ValueError):
    """A metrics file that cannot be read; str() is `FILE:LINE: what is wrong`."""

    def __init__(self, path: str | os.PathLike[str], line: int | None, message: str) -> None:
        self.path, self.line, self.message = str(path), line, message
        super().__init__(f"{self.path}:{line}: {message}" if line else f"{self.path}: {message}")


def _number(text: str, what: str, path: Path, lineno: int) -> float:
    try:
        value = float(text)
    except ValueError:
        raise MetricsFileError(path, lineno, f"{what} must be a number, got {text.strip()!r}") from None
    if not math.isfinite(value):
        raise MetricsFileError(path, lineno, f"{what} must be finite, got {text.strip()!r}")
    return value


def read_metrics(path: str | os.PathLike[str], max_bytes: int = DEFAULT_READ_LIMIT,
                 live: bool = False) -> Trace:
    """Samples of a metrics CSV, sorted by time: `[(t, {node: {metric: value}})]`.

    Rows may come in any order. Raises MetricsFileError naming the file and line for: a missing,
    empty, binary, over-`max_bytes` file; a wrong header; a row without exactly 4 fields; a time or
    value that is not a finite number; an empty node or metric; a value given twice. `live`: the file
    may be being written, so a last line without its newline is skipped, not an error.
    """
    path = Path(path)
    if not path.is_file():
        raise MetricsFileError(path, None, "file not found" if not path.exists() else "not a regular file")
    size = path.stat().st_size
    if size == 0:
        raise MetricsFileError(path, None, f"empty file; expected the header {HEADER!r} and rows")
    if size > max_bytes:
        raise MetricsFileError(path, None, f"file is {size / 2**20:.0f} MiB, over the {max_bytes / 2**20:.0f} MiB "
                                           "limit; cut it (e.g. head -n) or raise the limit")
    samples: dict[float, Sample] = {}
    with open(path, "rb") as file:
        head = file.read(4096)  # a binary file is named as such at once, not as a bad first row
        if b"\0" in head:
            at = head[:head.index(b"\0")].count(b"\n") + 1
            raise MetricsFileError(path, at, "binary data (NUL byte); expected a CSV text file")
        file.seek(0)
        for lineno, raw in enumerate(file, start=1):
            if live and not raw.endswith(b"\n"):
                break
            if b"\0" in raw:
                raise MetricsFileError(path, lineno, "binary data (NUL byte); expected a CSV text file")
            try:
                line = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError:
                raise MetricsFileError(path, lineno, "not UTF-8 text; expected a CSV text file") from None
            if lineno == 1:
                if line.lstrip("\ufeff").replace(" ", "") != HEADER:
                    shown = line if len(line) <= 60 else line[:60] + "..."
                    raise MetricsFileError(path, 1, f"expected the header {HEADER!r}, got {shown!r}")
                continue
            if not line.strip():
                continue
            fields = line.split(",")
            if len(fields) != 4:
                raise MetricsFileError(path, lineno, f"expected 4 fields (time,node,metric,value), got {len(fields)}")
            t = _number(fields[0], "time", path, lineno)
            node, metric = fields[1].strip(), fields[2].strip()
            if not node or not metric:
                raise MetricsFileError(path, lineno, "node and metric must not be empty")
            value = _number(fields[3], "value", path, lineno)
            by_node = samples.setdefault(t, {}).setdefault(node, {})
            if metric in by_node:
                raise MetricsFileError(path, lineno, f"{node} {metric} at time {fields[0].strip()} is given twice")
            by_node[metric] = value
    if not samples:
        raise MetricsFileError(path, None, "no rows after the header")
    return sorted(samples.items())


def metrics_files(job_dir: str | os.PathLike[str]) -> list[Path]:
    """A job folder's metrics files, oldest first (rotated `metrics.csv.N` .. `metrics.csv`)."""
    base = Path(job_dir) / METRICS_FILE
    rotated = sorted(base.parent.glob(METRICS_FILE + ".*"), key=lambda p: -int(p.suffix[1:]) if p.suffix[1:].isdigit() else 0)
    return [p for p in rotated if p.suffix[1:].isdigit()] + ([base] if base.exists() else [])


def bucket(trace: Iterable[tuple[float, Sample]], interval: float) -> Trace:
    """Merge samples whose times fall in the same `interval`-wide slot (agents sample at slightly
    different instants); a later value replaces an earlier one of the same node and metric."""
    if interval <= 0:
        raise ValueError("interval must be > 0")
    slots: dict[int, Sample] = {}
    for t, sample in trace:
        slot = slots.setdefault(math.floor(t / interval + 1e-9), {})
        for node, metrics in sample.items():
            slot.setdefault(node, {}).update(metrics)
    return [(k * interval, s) for k, s in sorted(slots.items())]
