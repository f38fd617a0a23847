"""Section (e) two_ranks_one_gpu: two processes build an NCCL group of 2 on cuda:0, without and with
NCCL_MULTI_RANK_GPU_ENABLE=1: a clear error or a group, never a hang (GPU only).

In full: the package's docstring (the command's --help).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from acceptance.harness import (
    MULTI_RANK_ENV,
    Record,
    Settings,
    Skipped,
    child_env,
    master_store,
    nccl_version,
    run_children,
)

if TYPE_CHECKING:
    pass


def child_dup_rank(s: Settings, config: dict[str, Any]) -> dict[str, Any]:
    """One of two ranks that build an NCCL group of 2 on cuda:0 and all-reduce once."""
    from oobleck_slurm.engine.comm import make_group

    rank = int(config["rank"])
    device = torch.device("cuda", 0)
    store = dist.TCPStore("127.0.0.1", int(config["port"]), is_master=False, timeout=dt.timedelta(seconds=60))
    t0 = time.perf_counter()
    out: dict[str, Any] = {"rank": rank}
    try:
        pg = make_group(store, "dup-rank", rank, 2, dt.timedelta(seconds=30), "nccl", dt.timedelta(seconds=60), device)
        out["group_s"] = time.perf_counter() - t0
        x = torch.ones(1, device=device) * (rank + 1)
        work = pg.allreduce([x])
        deadline = time.monotonic() + 30
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise TimeoutError("the all-reduce did not complete within 30 s")
            time.sleep(0.001)
        work.wait()
        out["allreduce"] = float(x.item())
        out["outcome"] = "success"
    except Exception as e:  # noqa: BLE001 - the error is the measurement
        out["outcome"] = "error"
        out["error"] = f"{type(e).__name__}: {e}"[:2000]
    out["seconds"] = time.perf_counter() - t0
    return out


def dup_rank_probe(s: Settings, extra_env: dict[str, str], folder: Path) -> dict[str, Any]:
    store = master_store()
    env = child_env(s, {"NCCL_DEBUG": "WARN", **extra_env})
    configs = [{"settings": dataclasses.asdict(s), "rank": r, "port": store.port} for r in range(2)]
    runs = run_children("dup_rank", configs, env, s.child_timeout_s, folder)
    hung = [i for i, r in enumerate(runs) if r.returncode is None]
    outcomes = [r.result.get("outcome") if r.result else "no result" for r in runs]
    nccl_lines = sorted({ln.strip()[:300] for r in runs for ln in r.stderr_tail.splitlines()
                         if "Duplicate GPU" in ln or "Multiple Ranks" in ln or "NCCL WARN" in ln
                         or "ncclInvalidUsage" in ln})
    if hung:
        outcome = "hang"
    elif all(o == "success" for o in outcomes):
        outcome = "success"
    else:
        outcome = "error"
    return {
        "env": extra_env, "outcome": outcome, "hung_ranks": hung,
        "exit_codes": [r.returncode for r in runs], "seconds": max(r.seconds for r in runs),
        "ranks": [r.result for r in runs], "nccl_messages": nccl_lines,
        "duplicate_gpu_refused": any("Duplicate GPU" in ln or "Multiple Ranks" in ln for ln in nccl_lines)
        or any("Duplicate GPU" in (r.result or {}).get("error", "") for r in runs),
        "stderr_tails": [r.stderr_tail[-1500:] for r in runs] if outcome != "success" else [],
    }


def section_two_ranks_one_gpu(s: Settings, rec: Record) -> None:
    if not s.cuda:
        raise Skipped("no GPU")
    rec.results["nccl_version"] = nccl_version()
    probes: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="gpu_acceptance_dup_") as tmp:
        for name, extra in (("default", {}), ("multi_rank_env", MULTI_RANK_ENV)):
            folder = Path(tmp) / name
            folder.mkdir()
            probes[name] = dup_rank_probe(s, extra, folder)
    rec.results["probes"] = probes
    for name, p in probes.items():
        rec.check(f"{name}_no_hang", p["outcome"] != "hang",
                  f"{p['hung_ranks']} still running after {s.child_timeout_s:g} s: a hang, not a clear error")
    d = probes["default"]
    version = ".".join(map(str, rec.results["nccl_version"] or ()))
    rec.summary = (f"NCCL {version}: {d['outcome']} in {d['seconds']:.1f} s"
                   + (" (Duplicate GPU refused)" if d["duplicate_gpu_refused"] else "")
                   + f"; with NCCL_MULTI_RANK_GPU_ENABLE=1: {probes['multi_rank_env']['outcome']}")
