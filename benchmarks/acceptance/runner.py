"""The command: its arguments, each section in a process of its own (`run_section`), the environment,
the JSON and the tables (`main`); and what a child process runs (`child_main`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import faulthandler
import json
import os
import platform
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

import acceptance
from acceptance.a_abort_rebuild import section_abort_rebuild
from acceptance.b_throughput import child_compiled, section_throughput
from acceptance.c_memory import child_memory, section_memory
from acceptance.d_copy_bandwidth import section_copy_bandwidth
from acceptance.e_two_ranks_one_gpu import child_dup_rank, section_two_ranks_one_gpu
from acceptance.f_two_stage_pipeline import child_pipeline, section_two_stage_pipeline
from acceptance.g_wide_stages import child_stage, section_wide_stages
from acceptance.h_job_kill_drill import section_job_drill
from acceptance.harness import (
    GPU_ONLY,
    RESULTS,
    SCHEMA,
    SECTIONS,
    Record,
    Settings,
    Skipped,
    child_env,
    detected_gpu,
    last_error_line,
    nccl_version,
    peak_flops,
    run_children,
    settings_from_args,
)


def child_main(kind: str, config_path: str) -> int:
    # On SIGUSR1 (sent by run_children before it kills a hung child) every thread's stack goes to
    # stderr: the JSON then says where it hung.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    config = json.loads(Path(config_path).read_text())
    s = Settings(**config["settings"])
    if s.cuda:
        torch.cuda.set_device(int(config.get("cuda_index", 0)))
    else:
        torch.set_num_threads(s.threads)
    result: dict[str, Any]
    if kind == "compiled":
        result = child_compiled(s, config)
    elif kind == "dup_rank":
        result = child_dup_rank(s, config)
    elif kind == "pipeline":
        result = child_pipeline(s, config)
    elif kind == "stage":
        result = child_stage(s, config)
    elif kind == "memory":
        result = child_memory(s, config)
    elif kind == "section":
        result = section_main(config["key"], s).to_json()
    else:
        raise SystemExit(f"unknown child kind {kind!r}")
    Path(config["out"]).write_text(json.dumps(result, default=str))
    sys.stdout.flush()
    sys.stderr.flush()
    # As the worker process does: skip the destructors of groups that may be aborted or stuck.
    os._exit(0)


RUNNERS: dict[str, Callable[[Settings, Record], None]] = {
    "a": section_abort_rebuild,
    "b": section_throughput,
    "c": section_memory,
    "d": section_copy_bandwidth,
    "e": section_two_ranks_one_gpu,
    "f": section_two_stage_pipeline,
    "g": section_wide_stages,
    "h": section_job_drill,
}


def section_main(key: str, s: Settings) -> Record:
    """Run section `key` here (in its own process, see run_section): errors become the record's."""
    rec = Record(key, SECTIONS[key])
    t0 = time.perf_counter()
    try:
        RUNNERS[key](s, rec)
    except Skipped as e:
        rec.status, rec.reason = "skipped", str(e)
    except Exception as e:  # noqa: BLE001 - recorded; the other sections still run
        rec.status = "failed"
        rec.error = f"{type(e).__name__}: {e}"
        rec.traceback = traceback.format_exc()
    rec.seconds = time.perf_counter() - t0
    return rec


def section_env(s: Settings, key: str) -> dict[str, str]:
    """The sections that compare runs bitwise (a, f) get cuBLAS's deterministic workspace from their
    process's start, as `training.deterministic` gives a worker: there the planner may run matrix
    products on the GPU (a measured profile) before the first worker exists, and cuBLAS reads the
    setting once (so section b's timings keep the default)."""
    from oobleck_slurm.engine.worker import CUBLAS_DETERMINISTIC_WORKSPACE

    if s.cuda and key in ("a", "f", "g") and "CUBLAS_WORKSPACE_CONFIG" not in os.environ:
        return {"CUBLAS_WORKSPACE_CONFIG": CUBLAS_DETERMINISTIC_WORKSPACE}
    return {}


def run_section(key: str, s: Settings, console: Console) -> Record:
    """Section `key` in a process of its own, so that nothing one section does to its process (a CUDA
    error that sticks to the context, an NCCL abort that crashes it, a hang) reaches the others;
    bounded by `--section-timeout` (a hung section's stacks are recorded, then it is killed)."""
    console.print(f"[bold]({key}) {SECTIONS[key]}[/] ...")
    t0 = time.perf_counter()
    if key in GPU_ONLY and not s.cuda:
        rec = Record(key, SECTIONS[key], status="skipped", reason="no GPU", seconds=time.perf_counter() - t0)
        console.print(f"    [yellow]skipped[/]: {rec.reason}")
        return rec
    with tempfile.TemporaryDirectory(prefix=f"gpu_acceptance_{key}_") as tmp:
        (run,) = run_children("section", [{"settings": dataclasses.asdict(s), "key": key}],
                              child_env(s, section_env(s, key)), s.section_timeout_s, Path(tmp))
    if run.result is not None and run.returncode == 0:
        rec = Record(**run.result)
        rec.seconds = time.perf_counter() - t0  # with the process's start (imports, CUDA context)
    else:
        rec = Record(key, SECTIONS[key], status="failed", seconds=time.perf_counter() - t0)
        rec.error = (f"the section's process did not finish within --section-timeout {s.section_timeout_s:g} s "
                     "(killed; its stacks are in results.output_tail)" if run.returncode is None
                     else f"the section's process exited {run.returncode} without a result: "
                          f"{last_error_line(run.stderr_tail)}")
        rec.results["output_tail"] = run.stderr_tail
    colour = {"passed": "green", "failed": "red", "skipped": "yellow"}[rec.status]
    bad = [n for n, c in rec.checks.items() if not c["passed"]]
    console.print(f"    [{colour}]{rec.status}[/] in {rec.seconds:.1f} s: "
                  f"{escape(rec.error or rec.reason or rec.summary or '')}"
                  + (f" [red]failed checks: {escape(', '.join(bad))}[/]" if bad else ""))
    return rec


def environment(s: Settings) -> dict[str, Any]:
    env: dict[str, Any] = {
        "torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
        "host": socket.gethostname(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "cuda_available": torch.cuda.is_available(), "cuda_build": torch.version.cuda,
        "nccl": ".".join(map(str, nccl_version() or ())) or None,
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),  # sections a, f: ":4096:8" if unset
    }
    try:
        import psutil

        env["host_memory_bytes"] = int(psutil.virtual_memory().total)
    except ImportError:
        pass
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(device_count=torch.cuda.device_count(), device_name=props.name,
                   device_memory_bytes=int(props.total_memory), compute_capability=f"{props.major}.{props.minor}",
                   multiprocessors=props.multi_processor_count, planner_gpu=detected_gpu())
        try:
            import pynvml

            pynvml.nvmlInit()
            env["driver"] = pynvml.nvmlSystemGetDriverVersion()
        except Exception:  # noqa: BLE001 - the driver version is a nicety
            pass
    name, peak = peak_flops(s)
    env.update(peak_bf16_gpu=name, peak_bf16_flops=peak)
    return env


def print_tables(console: Console, records: list[Record]) -> None:
    table = Table(title="GPU acceptance")
    for col in ("section", "status", "s", "figures / reason"):
        table.add_column(col, overflow="fold")
    colours = {"passed": "green", "failed": "red", "skipped": "yellow"}
    for r in records:
        text = r.summary if r.status != "skipped" else r.reason
        if r.status == "failed":
            bad = [f"{n}: {c.get('message', 'failed')}" for n, c in r.checks.items() if not c["passed"]]
            text = "; ".join(([r.error] if r.error else []) + bad) or text
        table.add_row(f"({r.key}) {r.name}", f"[{colours[r.status]}]{r.status}[/]", f"{r.seconds:.1f}",
                      escape(text or ""))
    console.print(table)
    b = next((r for r in records if r.key == "b" and "runs" in r.results), None)
    if b is not None:
        t = Table(title="(b) throughput (median step after warm-up)")
        for col in ("run", "median step s", "tokens/s", "MFU", "engine / this"):
            t.add_column(col)
        for name, row in b.results["runs"].items():
            ratio = b.results["ratios_tokens_per_s"].get(f"engine_over_{name}")
            t.add_row(name, f"{row['median_step_s']:.4f}", f"{row['tokens_per_s']:.0f}",
                      f"{row['mfu']:.3f}" if row["mfu"] is not None else "unknown",
                      f"{ratio:.3f}" if ratio is not None else "")
        console.print(t)
    c = next((r for r in records if r.key == "c" and "measured" in r.results), None)
    if c is not None:
        t = Table(title=f"(c) peak memory per step, MiB ({c.results['config']['probe']})")
        t.add_column("what")
        t.add_column("MiB")
        for name, m in c.results["measured"].items():
            t.add_row(f"measured {name}", f"{m['peak_bytes'] / 2**20:.1f}")
        for name, v in c.results["predicted_bytes"].items():
            t.add_row(f"planner {name}", f"{v / 2**20:.1f}")
        console.print(t)


def main(argv: list[str] | None = None) -> int:
    doc = acceptance.__doc__ or ""  # the package's docstring is the command's --help
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0], epilog=doc.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=str(RESULTS), help="the JSON file to write")
    ap.add_argument("--only", default=None, help="comma-separated sections, e.g. a,c (default: all)")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default=None,
                    help="default: bf16 on CUDA, fp32 on the CPU")
    ap.add_argument("--family", choices=["gpt", "llama"], default="gpt", help="model family (default gpt)")
    ap.add_argument("--preset", default=None,
                    help="the family's shape (default: gpt 1.3b or llama 3.2-1b on CUDA, tiny on the CPU)")
    ap.add_argument("--layers", type=int, default=None, help="transformer blocks of the slice (default: 4 on CUDA)")
    ap.add_argument("--microbatch-size", type=int, default=None)
    ap.add_argument("--microbatches", type=int, default=None, help="microbatches per step")
    ap.add_argument("--steps", type=int, default=None, help="(a) steps per training run (>= 5)")
    ap.add_argument("--warmup", type=int, default=None, help="(b) steps left out of the medians")
    ap.add_argument("--timed-steps", type=int, default=None, help="(b) timed steps")
    ap.add_argument("--pipe-microbatch-size", type=int, default=None, help="(f) default 3 on CUDA: ~50 MB activations")
    ap.add_argument("--pipe-microbatches", type=int, default=None)
    ap.add_argument("--pipe-steps", type=int, default=None)
    ap.add_argument("--memory-d-model", type=int, default=None,
                    help="(c) d_model of the measured model (default: the preset's on CUDA, 256 on the CPU)")
    ap.add_argument("--copy-mb", type=int, default=None, help="(d) MiB per copy (default 256 on CUDA, 64 on the CPU)")
    ap.add_argument("--compile-budget", type=float, default=None,
                    help="(b) seconds for the torch.compile run, compile included (0: skip it)")
    ap.add_argument("--child-timeout", type=float, default=None,
                    help="(c), (e), (f) seconds before a section's child processes count as hung")
    ap.add_argument("--section-timeout", type=float, default=None,
                    help="seconds before a section's process counts as hung (default 900 on CUDA, 300 on the CPU)")
    ap.add_argument("--threads", type=int, default=None, help="CPU: torch threads (default 1, as a CPU worker)")
    ap.add_argument("--gpu", default=None, help="GPU name in planning/gpus.py for the peak FLOP/s (default: detected)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device cuda: CUDA is not available (torch {torch.__version__}, CUDA build {torch.version.cuda}); "
                 "use --device cpu")
    only = list(SECTIONS) if args.only is None else [x.strip() for x in args.only.split(",") if x.strip()]
    if unknown := [x for x in only if x not in SECTIONS]:
        ap.error(f"--only: unknown section(s) {unknown}; sections: "
                 + ", ".join(f"{k}={v}" for k, v in SECTIONS.items()))
    s = settings_from_args(args)
    if not s.cuda:
        torch.set_num_threads(s.threads)
    # This process only starts the sections (each in a process of its own, with the environment a node
    # agent gives its workers: child_env) and writes what they report.
    console = Console(width=None if sys.stdout.isatty() else 160)
    started = time.perf_counter()
    out: dict[str, Any] = {"schema": SCHEMA, "command": [sys.executable, *sys.argv],
                           "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                           "settings": dataclasses.asdict(s), "environment": environment(s)}
    e = out["environment"]
    console.print(f"[bold]GPU acceptance[/] on {escape(str(e.get('device_name', 'CPU')))}: torch {e['torch']}, "
                  f"CUDA {e['cuda_build']}, NCCL {e['nccl']}; {s.family} {s.preset} x {s.n_layer} blocks, {s.precision}")
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    records: list[Record] = []
    out["sections"] = {}
    for key in only:  # the file is rewritten after each section: an interrupted run keeps what it did
        out["running"] = key
        path.write_text(json.dumps(out, indent=2, default=str))
        records.append(run_section(key, s, console))
        out["sections"][key] = records[-1].to_json()
    del out["running"]
    out["wall_s"] = time.perf_counter() - started
    out["passed"] = all(r.status != "failed" for r in records)
    path.write_text(json.dumps(out, indent=2, default=str))
    print_tables(console, records)
    verdict = "[green]passed[/]" if out["passed"] else "[red]FAILED[/]"
    console.print(f"{verdict} in {out['wall_s']:.1f} s; wrote {escape(str(path))}")
    return 0 if out["passed"] else 1
