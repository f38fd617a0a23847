"""The bytes a worker holds at a step's peak, on a GPU or on the CPU: the figure for the worker's step
report (engine/worker.py `StepResult.peak_memory`), the one the planner's memory model (planning/cost.py
`stage_memory`) is checked against (tests/planning/test_memory_model.py, benchmarks/bench_memory.py),
and how the planner's profiler measures a layer's workspace (planning/measure.py).

    warm_up(device)                # optional: what torch loads on first use, before the baseline
    probe = PeakMemory(device)     # before the worker builds its layers: the baseline
    probe.start()                  # at a step's start: forget earlier peaks
    ...                            # the step
    held = probe.peak()            # bytes above the baseline at the step's highest point

CUDA: `torch.cuda.max_memory_allocated` after `reset_peak_memory_stats`: the bytes of live tensors the
caching allocator handed out (its cached free blocks and the CUDA context are not counted, as in the
planner's model).

CPU: the process's peak anonymous resident memory (heap and mmap'ed memory: tensors, buffers) above
its value at the baseline. Linux (>= 4.0) resets the peak resident set VmHWM to the current RSS when "5"
is written to /proc/self/clear_refs, so each step gets its own peak (`ru_maxrss` only knows the
process's lifetime peak). VmHWM also counts file-backed pages, and those grow the first time a kernel's
code runs (pages of libtorch faulted in: megabytes that are no memory of the worker's); they stay
resident afterwards, so the peak's file-backed part is what is resident when the peak is read
(RssFile + RssShmem then), and the anonymous peak is VmHWM minus that. Where /proc/self/clear_refs
cannot be written (not Linux), a thread samples the RSS every millisecond instead (a peak shorter than
that can be missed, and file-backed pages are counted).

RSS counts live tensors only if freed memory goes back to the OS. glibc's malloc does not do that by
default: a freed chunk stays in the heap for reuse, and after the first large free its mmap threshold
climbs (dynamically, up to 32 MiB), so most tensors end up inside the heap and RSS stays at the
high-water mark of earlier phases (the layers being built, the previous step). Fixing the threshold at
64 KiB (`release_freed_memory()` through mallopt, or `MALLOC_ENV` in a child process's environment,
which also covers what is allocated while it imports) makes every tensor larger than that its own
mapping, returned to the OS by free(): RSS then rises and falls with the live tensors (`trim_heap()`
also hands back what the heap already holds free). The price is a page fault per 4 KiB of each new
tensor (no reuse of freed chunks), so it is for measuring (the benchmark, the test, the profiler's
workspace pass), not a default of training runs; without it the CPU figure is an upper bound of what
the worker holds.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading

import torch

# glibc's mallopt parameter M_MMAP_THRESHOLD (malloc.h) and the value used: chunks of 64 KiB and more
# are mmap'ed and munmap'ed on free (a transformer's smallest tensors worth counting are far larger).
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 64 * 1024
# The same setting for a child process, read by glibc at its start (set it in the child's environment).
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD_BYTES)}

CLEAR_REFS = "/proc/self/clear_refs"
STATUS = "/proc/self/status"
SAMPLE_S = 0.001  # the sampling fallback's period


def release_freed_memory() -> bool:
    """Make glibc return freed chunks of >= 64 KiB to the OS from now on (see the module doc); False
    where that cannot be set (no glibc, or mallopt refused)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    except (OSError, AttributeError):  # not glibc (musl has no mallopt, macOS's libc neither)
        return False


def trim_heap() -> bool:
    """Hand the free memory inside glibc's heap back to the OS now (malloc_trim(0)), so that a later
    allocation served from it counts in RSS again when it is touched; False without glibc."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError):
        return False
    return True


def warm_up(device: torch.device | None = None) -> None:
    """One forward, backward and optimizer step of a throwaway layer on `device`, so that what torch
    loads on first use is in place before a baseline is taken: the modules an optimizer's first use
    imports (torch._dynamo and its dependencies: ~70 MB of Python objects with torch 2.13, anonymous
    memory like a tensor's) and the kernels' one-time buffers. Without it, the first step's figure
    counts them as the model's."""
    layer = torch.nn.Linear(8, 8).to(device or torch.device("cpu"))
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-3)
    with torch.autocast(layer.weight.device.type, dtype=torch.bfloat16):
        layer(torch.ones(2, 8, device=layer.weight.device)).float().sum().backward()
    opt.step()


def _status_bytes(field: str) -> int | None:
    """A field of /proc/self/status in bytes ('VmRSS', 'VmHWM'); None where there is no such file."""
    try:
        with open(STATUS) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        return None
    return None


def rss_bytes() -> int:
    """This process's resident set size now."""
    rss = _status_bytes("VmRSS")
    if rss is not None:
        return rss
    import psutil

    return int(psutil.Process().memory_info().rss)


def anon_bytes() -> int:
    """This process's anonymous resident memory now (RssAnon: heap, mmap'ed memory, stacks); the whole
    RSS where the kernel does not report it."""
    anon = _status_bytes("RssAnon")
    return anon if anon is not None else rss_bytes()


def _file_bytes() -> int:
    """Resident file-backed and shared pages now (RssFile + RssShmem); 0 where not reported."""
    return (_status_bytes("RssFile") or 0) + (_status_bytes("RssShmem") or 0)


def _reset_hwm() -> bool:
    """Reset the kernel's peak RSS (VmHWM) to the current RSS; False where that is not possible."""
    try:
        with open(CLEAR_REFS, "w") as f:
            f.write("5")
    except OSError:
        return False
    return _status_bytes("VmHWM") is not None


class _Sampler:
    """The CPU fallback: the highest RSS seen by a thread sampling every SAMPLE_S seconds."""

    def __init__(self) -> None:
        self.high = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="peak-memory")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.high = max(self.high, rss_bytes())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.high, rss_bytes())


class PeakMemory:
    """Peak bytes held during a phase (a step), above the baseline taken at construction.

    Build it before the layers exist: the baseline is then the process without the model (the
    interpreter, torch, the dataset, the process groups), and `peak()` what training adds at its
    highest point: parameters, gradients, optimizer state, activations, buffers and temporaries."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device or torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        self.method = "cuda" if self.cuda else ("clear_refs" if _reset_hwm() else "sampling")
        self.baseline = torch.cuda.memory_allocated(self.device) if self.cuda else self._cpu_now()
        self._sampler: _Sampler | None = None

    def start(self) -> None:
        """Forget earlier peaks: `peak()` covers from here."""
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.method == "clear_refs":
            _reset_hwm()  # should it fail now, the peak keeps counting from the last reset: an upper bound
        else:
            if self._sampler is not None:
                self._sampler.stop()
            self._sampler = _Sampler()

    def peak(self) -> int:
        """Bytes above the baseline at the highest point since `start()` (or since construction)."""
        if self.cuda:
            high = torch.cuda.max_memory_allocated(self.device)
        elif self.method == "clear_refs":
            files = _file_bytes()
            high = (_status_bytes("VmHWM") or rss_bytes()) - files
        else:
            high = self._sampler.stop() if self._sampler is not None else rss_bytes()
            self._sampler = None
        return high - self.baseline

    def now(self) -> int:
        """Bytes above the baseline at this moment."""
        if self.cuda:
            return torch.cuda.memory_allocated(self.device) - self.baseline
        return self._cpu_now() - self.baseline

    def _cpu_now(self) -> int:
        return anon_bytes() if self.method == "clear_refs" else rss_bytes()


class StepPeak:
    """The device's peak bytes allocated during one step, for the worker's step report
    (`StepResult.peak_memory`): absolute bytes, as the planner's memory model counts them, but each step's
    own. CUDA only (None elsewhere): `torch.cuda.max_memory_allocated` is the process's peak since the last
    `reset_peak_memory_stats`, so without a reset at each step's start every step reported the highest
    point of any earlier one (a first step's, an evaluation's, a checkpoint's)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def start(self) -> None:
        """A step starts: the peak restarts from what is allocated now."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int | None:
        """The highest bytes allocated since `start()`; None where the device keeps no such count."""
        return int(torch.cuda.max_memory_allocated(self.device)) if self.device.type == "cuda" else None


def malloc_configured() -> bool:
    """True when this process was started with `MALLOC_ENV` (so its RSS tracks live tensors)."""
    return os.environ.get("MALLOC_MMAP_THRESHOLD_") == str(MMAP_THRESHOLD_BYTES)
